"""Data sources: digits, synthetic, imagefolder (PNG files made here), python callables."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchtame import DataError, apply_pass, load_data
from torchtame.data import DigitsData, ImageFolderData, PythonData, Split, SyntheticData


def _indices(loader) -> set[int]:
    return set(loader.dataset.indices)


def test_digits_splits_are_disjoint_and_seeded() -> None:
    a = load_data(DigitsData(source="digits", batch_size=32), seed=1)
    b = load_data(DigitsData(source="digits", batch_size=32), seed=1)
    c = load_data(DigitsData(source="digits", batch_size=32), seed=2)
    tr, ca, ev = _indices(a.train), _indices(a.calibration), _indices(a.evaluation)
    assert not (tr & ca) and not (tr & ev) and not (ca & ev)
    assert len(tr) + len(ca) + len(ev) == 1797
    assert len(ev) == round(0.3 * 1797)
    assert _indices(b.evaluation) == ev
    assert _indices(c.evaluation) != ev
    x, y = next(iter(a.evaluation))
    assert x.shape == (32, 1, 8, 8) and x.min() >= 0 and x.max() <= 1
    assert a.has_labels and a.num_classes == 10 and y.max() <= 9


def test_batch_limits() -> None:
    d = load_data(DigitsData(source="digits", batch_size=16, calibration_batches=2, evaluation_batches=3), 0)
    assert len(d.calibration) == 2 and len(d.evaluation) == 3


def test_example_input_repeats_to_batch() -> None:
    d = load_data(DigitsData(source="digits", batch_size=8), 0)
    assert d.example_input(20).shape == (20, 1, 8, 8)


def test_synthetic_has_no_labels() -> None:
    d = load_data(SyntheticData(source="synthetic", shape=[3, 16, 16], num_samples=10, batch_size=4), 0)
    assert not d.has_labels and d.train is None
    assert d.sample_shape == (3, 16, 16)
    assert next(iter(d.evaluation))[0].shape == (4, 3, 16, 16)


def test_split_must_fit() -> None:
    with pytest.raises(ValueError, match="add up"):
        Split(train=0.8, calibration=0.2, evaluation=0.3)


def _make_images(root: Path, classes: int = 2, per_class: int = 5, size: int = 20) -> None:
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for c in range(classes):
        d = root / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            arr = (torch.rand(size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
            Image.fromarray(arr).save(d / f"{i}.png")


def test_imagefolder_split(tmp_path: Path) -> None:
    _make_images(tmp_path / "imgs", classes=3, per_class=6)
    d = load_data(
        ImageFolderData(source="imagefolder", root=tmp_path / "imgs", image_size=16, batch_size=4), 0
    )
    x, _y = next(iter(d.evaluation))
    assert x.shape[1:] == (3, 16, 16)
    assert d.num_classes == 3 and d.has_labels
    assert len(d.evaluation.dataset) == round(0.3 * 18)


def test_imagefolder_separate_roots(tmp_path: Path) -> None:
    _make_images(tmp_path / "train")
    _make_images(tmp_path / "val")
    d = load_data(
        ImageFolderData(
            source="imagefolder",
            train_root=tmp_path / "train",
            evaluation_root=tmp_path / "val",
            image_size=8,
            batch_size=2,
        ),
        0,
    )
    assert len(d.evaluation.dataset) == 10 and len(d.train.dataset) == 10


def test_imagefolder_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_data(ImageFolderData(source="imagefolder", root=tmp_path / "none"), 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not an image folder"):
        load_data(ImageFolderData(source="imagefolder", root=tmp_path / "empty"), 0)


def make_pairs(n: int = 40, nan: bool = False):
    x = torch.randn(n, 4)
    if nan:
        x[0, 0] = float("nan")
    return TensorDataset(x, torch.randint(0, 3, (n,)))


def make_dict():
    return {"train": make_pairs(20), "evaluation": make_pairs(10)}


def make_empty():
    return TensorDataset(torch.empty(0, 4), torch.empty(0, dtype=torch.int64))


def make_not_data():
    return [1, 2, 3]


def test_python_callable_dataset_and_dict() -> None:
    d = load_data(PythonData(source="python", target="tests.test_data:make_pairs", batch_size=8), 0)
    assert d.has_labels and d.sample_shape == (4,)
    d2 = load_data(PythonData(source="python", target="tests.test_data:make_dict", batch_size=8), 0)
    assert len(d2.evaluation.dataset) == 10 and len(d2.calibration.dataset) == 20


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("tests.test_data:make_empty", "empty"),
        ("tests.test_data:make_not_data", "not tensors"),
        ("tests.test_data:nothing_here", "no attribute"),
    ],
)
def test_python_bad_data(target: str, needle: str) -> None:
    with pytest.raises(DataError, match=needle):
        load_data(PythonData(source="python", target=target), 0)


def test_nan_inputs_are_refused() -> None:
    spec = PythonData(
        source="python",
        target="tests.test_data:make_pairs",
        kwargs={"nan": True},
        split=Split(train=0.0, calibration=0.5, evaluation=0.5),
        batch_size=64,
    )
    with pytest.raises(DataError, match="NaN"):
        load_data(spec, 0)


def _write_idx(path: Path, array, magic: int) -> None:
    import struct

    import numpy as np

    arr = np.asarray(array, dtype=np.uint8)
    with open(path, "wb") as fh:
        fh.write(struct.pack(">I", magic))
        for dim in arr.shape:
            fh.write(struct.pack(">I", dim))
        fh.write(arr.tobytes())


def _fake_mnist(root: Path, n_train: int = 60, n_test: int = 20) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = (torch.rand(n, 28, 28, generator=g) * 255).to(torch.uint8).numpy()
        labels = (torch.arange(n) % 10).numpy()
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", images, 2051)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels, 2049)


def test_torchvision_dataset_on_disk(tmp_path: Path) -> None:
    from torchtame.data import TorchvisionData

    _fake_mnist(tmp_path)
    d = load_data(
        TorchvisionData(
            source="torchvision",
            name="MNIST",
            root=tmp_path,
            calibration_samples=16,
            image_size=14,
            batch_size=8,
        ),
        0,
    )
    x, labels = next(iter(d.evaluation))
    assert labels.max() <= 9
    assert x.shape == (8, 1, 14, 14) and d.num_classes == 10 and d.has_labels
    assert len(d.calibration.dataset) == 16 and len(d.train.dataset) == 44 and len(d.evaluation.dataset) == 20


def test_torchvision_dataset_missing_or_unknown(tmp_path: Path) -> None:
    from torchtame.data import TorchvisionData

    with pytest.raises(DataError, match="never downloads"):
        load_data(TorchvisionData(source="torchvision", name="MNIST", root=tmp_path), 0)
    with pytest.raises(DataError, match="FashionMNIST"):
        load_data(TorchvisionData(source="torchvision", name="FashonMNIST", root=tmp_path), 0)


# ------------------------------------------------------------------ samples of any common shape


def _ids(n: int = 12, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 30, (n, length), generator=torch.Generator().manual_seed(0))


def tensor_rows():
    return TensorDataset(_ids())  # one-element tuples


def plain_tensors():
    return list(_ids())  # a list of tensors, no labels


def id_mask_pairs():
    ids = _ids()
    return TensorDataset(ids, torch.ones_like(ids))  # two inputs, no label


def id_mask_label():
    ids = _ids()
    return TensorDataset(ids, torch.ones_like(ids), torch.arange(12) % 2)


def dict_rows_with_labels():
    return [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "labels": j % 2} for j, i in enumerate(_ids())
    ]


def list_rows():  # Hugging Face datasets without set_format('torch'): lists of ints
    return [{"input_ids": i.tolist(), "label": j % 3} for j, i in enumerate(_ids())]


def columns():
    ids = _ids()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "label": torch.arange(12) % 2}


def float_target():
    return TensorDataset(torch.randn(12, 4), torch.randn(12))


@pytest.mark.parametrize(
    ("target", "label", "structure", "has_labels"),
    [
        ("tensor_rows", "auto", "tensor", False),
        ("plain_tensors", "auto", "tensor", False),
        ("id_mask_pairs", "auto", "tuple", False),
        ("id_mask_label", "auto", "tuple", True),
        ("id_mask_label", "none", "tuple3", False),
        ("dict_rows_with_labels", "auto", "dict", True),
        ("list_rows", "auto", "dict1", True),
        ("columns", "auto", "dict", True),
        ("columns", "none", "dict3", False),
        ("float_target", "last", "tensor", None),
        ("float_target", "none", "tuple", False),
    ],
)
def test_python_data_takes_every_natural_shape(target, label, structure, has_labels) -> None:
    spec = PythonData(source="python", target=f"tests.test_data:{target}", label=label, batch_size=4)
    if has_labels is None:  # a float scalar cannot be a class index
        with pytest.raises(DataError, match="not a class index"):
            load_data(spec, 0)
        return
    d = load_data(spec, 0)
    x, y = next(iter(d.evaluation))
    assert d.has_labels is has_labels and y.dtype == torch.int64
    kinds = {
        "tensor": lambda x: isinstance(x, torch.Tensor),
        "tuple": lambda x: isinstance(x, list | tuple) and len(x) == 2,
        "tuple3": lambda x: isinstance(x, list | tuple) and len(x) == 3,
        "dict": lambda x: isinstance(x, dict) and set(x) == {"input_ids", "attention_mask"},
        "dict1": lambda x: isinstance(x, dict) and set(x) == {"input_ids"},
        "dict3": lambda x: isinstance(x, dict) and len(x) == 3,
    }
    assert kinds[structure](x), x
    ids = x["input_ids"] if isinstance(x, dict) else x[0] if isinstance(x, list | tuple) else x
    if target != "float_target":
        assert ids.dtype == torch.int64  # token ids keep their dtype


def test_ambiguous_float_scalar_names_the_field() -> None:
    with pytest.raises(DataError) as info:
        load_data(PythonData(source="python", target="tests.test_data:float_target"), 0)
    assert "label: none" in str(info.value) and "label: last" in str(info.value)


def test_label_rule_mismatches_are_named() -> None:
    with pytest.raises(DataError, match="no key 'target'"):
        load_data(PythonData(source="python", target="tests.test_data:columns", label="target"), 0)
    with pytest.raises(DataError, match="needs tuple samples"):
        load_data(
            PythonData(source="python", target="tests.test_data:dict_rows_with_labels", label="last"), 0
        )
    with pytest.raises(DataError, match="out of range"):
        load_data(PythonData(source="python", target="tests.test_data:id_mask_label", label=5), 0)


def test_example_input_repeats_structures() -> None:
    d = load_data(
        PythonData(source="python", target="tests.test_data:dict_rows_with_labels", batch_size=4), 0
    )
    x = d.example_input(10)
    assert set(x) == {"input_ids", "attention_mask"} and x["input_ids"].shape == (10, 6)
    assert x["input_ids"].dtype == torch.int64
    assert d.input_description == "input_ids: int64[1, 6], attention_mask: int64[1, 6]"


def ragged():
    return [torch.zeros(3 + i % 2) for i in range(8)]


def test_ragged_samples_say_how_to_pad() -> None:
    with pytest.raises(DataError, match="padding: max_length"):
        load_data(PythonData(source="python", target="tests.test_data:ragged", batch_size=4), 0)


def test_synthetic_calibration_and_evaluation_are_drawn_apart() -> None:
    """Fidelity on synthetic inputs is never measured on the inputs int8 was calibrated on."""
    d = load_data(SyntheticData(source="synthetic", shape=[3, 4, 4], num_samples=8, batch_size=8), 0)
    cal, ev = next(iter(d.calibration))[0], next(iter(d.evaluation))[0]
    assert cal.shape == ev.shape and not torch.allclose(cal, ev)
    again = load_data(SyntheticData(source="synthetic", shape=[3, 4, 4], num_samples=8, batch_size=8), 0)
    assert torch.equal(next(iter(again.evaluation))[0], ev)  # still seeded


def test_synthetic_train_split_is_drawn_apart_and_trains_distillation() -> None:
    """`train_samples` gives synthetic data a train split of its own draws: distillation then
    never trains on the batches that calibrate or pick the best epoch (finetune's keep_best)."""
    spec = {"source": "synthetic", "shape": [8], "num_samples": 16, "batch_size": 8}
    d = load_data(SyntheticData(**spec, train_samples=24), 0)
    assert d.train is not None and len(d.train.dataset) == 24 and "train 24" in d.description
    train = torch.cat([x for x, _ in d.train])
    for split in (d.calibration, d.evaluation):
        other = torch.cat([x for x, _ in split])
        assert not any(torch.equal(t, o) for t in train for o in other)
    assert load_data(SyntheticData(**spec), 0).train is None  # default: as before, no train split
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    opts = {"loss": "distill", "epochs": 2, "lr": 1e-3}
    v = apply_pass("finetune", student, d, opts, baseline=teacher)
    assert v.info["steps"] == 6 and len(v.info["held_out_loss"]) == 3  # 3 train batches a pass; scored
