"""The built-in data sources: scikit-learn digits, synthetic tensors, image folders, torchvision
datasets on disk, and Python callables returning data of any common shape."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

from ..errors import DataError, first_line
from ..inputs import first_tensor
from ..options import DataSourceOptions, UserPath
from ..registry import register_data_source, resolve_callable
from .bundle import DataBundle, Split, make_loaders, split_indices
from .samples import Samples, columns_dataset


class DigitsData(DataSourceOptions):
    source: Literal["digits"]
    split: Split = Field(default_factory=Split)


class ImageFolderData(DataSourceOptions):
    source: Literal["imagefolder"]
    root: UserPath | None = Field(None, description="One folder split by `split` fractions.")
    train_root: UserPath | None = None
    evaluation_root: UserPath | None = Field(None, description="Folder of the evaluation split.")
    calibration_root: UserPath | None = Field(None, description="Default: part of train_root/root.")
    split: Split = Field(default_factory=Split)
    image_size: int = Field(224, ge=1)
    resize: int | None = Field(None, ge=1, description="Resize shorter side before center crop.")
    mean: list[float] = Field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = Field(default_factory=lambda: [0.229, 0.224, 0.225])
    grayscale: bool = False

    @model_validator(mode="after")
    def _roots(self) -> ImageFolderData:
        if self.root is None and self.evaluation_root is None:
            raise ValueError("set `root` (one folder, split by fractions) or `evaluation_root`")
        return self


class SyntheticData(DataSourceOptions):
    source: Literal["synthetic"]
    shape: list[int] = Field(description="Shape of one sample, e.g. [3, 224, 224].")
    num_samples: int = Field(64, ge=1, description="Samples in each of calibration and evaluation.")
    distribution: Literal["normal", "uniform"] = "normal"
    train_samples: int = Field(
        0,
        ge=0,
        description="Samples of a train split drawn apart from calibration and evaluation (default 0: "
        "none, and distillation trains on the calibration split). With one, training never sees "
        "the batches that calibrate, choose the best epoch (finetune's keep_best) or score QAT's curve.",
    )


class TorchvisionData(DataSourceOptions):
    source: Literal["torchvision"]
    name: str = Field(description="A torchvision.datasets class: MNIST, FashionMNIST, CIFAR10, SVHN, ...")
    root: UserPath = Field(description="Where the dataset already lies (torchtame never downloads).")
    calibration_samples: int = Field(512, ge=1, description="Taken from the train set, disjoint from train.")
    image_size: int | None = Field(None, ge=1, description="Resize to this size (default: as stored).")
    mean: list[float] | None = None
    std: list[float] | None = None


class PythonData(DataSourceOptions):
    source: Literal["python"]
    target: str = Field(
        description="'module:callable' returning a Dataset, a DataLoader, a list of samples, a dict of "
        "columns, or a dict of those keyed train/calibration/evaluation. Samples may be tensors, "
        "tuples (TensorDataset rows) or dicts keyed by forward()'s argument names."
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)
    split: Split = Field(default_factory=Split)
    num_classes: int | None = None
    label: int | str = Field(
        "auto",
        description="Where each sample's label is: auto (a dict's labels/label key; a tuple's last "
        "element if it is an integer), none, last, an index, or a dict key.",
    )


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled 8x8 digits as (N, 1, 8, 8) floats in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    return x, y


@register_data_source("digits", DigitsData)
def _digits(spec: DigitsData, seed: int) -> DataBundle:
    """scikit-learn's 1,797 handwritten 8x8 digits (ships with the package, no download)."""
    x, y = digits_tensors()
    ds = TensorDataset(x, y)
    tr, ca, ev = split_indices(len(ds), spec.split, seed)
    loaders = make_loaders(spec, seed, Subset(ds, tr), Subset(ds, ca), Subset(ds, ev))
    return DataBundle(*loaders, True, 10, (1, 8, 8), f"digits ({len(tr)}/{len(ca)}/{len(ev)})")


@register_data_source("synthetic", SyntheticData)
def _synthetic(spec: SyntheticData, seed: int) -> DataBundle:
    """Random tensors of a given shape: latency and fidelity only, no accuracy. Calibration and
    evaluation samples are drawn from different seeds, so fidelity is never measured on the
    inputs int8 was calibrated on."""

    def draw(stream: int, n: int = spec.num_samples) -> TensorDataset:
        g = torch.Generator().manual_seed(seed * 1000 + stream)
        shape = (n, *spec.shape)
        normal = spec.distribution == "normal"
        x = torch.randn(shape, generator=g) if normal else torch.rand(shape, generator=g)
        return TensorDataset(x, torch.full((n,), -1, dtype=torch.int64))

    train = draw(3, spec.train_samples) if spec.train_samples else None
    tr, cal, ev = make_loaders(spec, seed, train, draw(1), draw(2))
    shape = [spec.num_samples, *spec.shape]
    split = f", train {spec.train_samples}" if spec.train_samples else ""
    return DataBundle(tr, cal, ev, False, None, tuple(spec.shape), f"synthetic {shape}{split}")


@register_data_source("imagefolder", ImageFolderData)
def _imagefolder(spec: ImageFolderData, seed: int) -> DataBundle:
    """Local image folders (one subfolder per class), resized, cropped and normalised."""
    from torchvision import datasets, transforms

    steps: list[Any] = []
    if spec.grayscale:
        steps.append(transforms.Grayscale())
    steps += [
        transforms.Resize(spec.resize or spec.image_size),
        transforms.CenterCrop(spec.image_size),
        transforms.ToTensor(),
        transforms.Normalize(spec.mean, spec.std),
    ]
    tf = transforms.Compose(steps)

    def folder(path: Path) -> datasets.ImageFolder:
        if not path.is_dir():
            raise DataError(f"data: image folder {str(path)!r} does not exist")
        try:
            return datasets.ImageFolder(str(path), transform=tf)
        except (FileNotFoundError, RuntimeError) as exc:
            raise DataError(
                f"data: {str(path)!r} is not an image folder: {exc}",
                hint="it needs one subfolder per class holding .jpg/.png files",
            ) from exc

    if spec.evaluation_root is not None:
        ev_ds = folder(spec.evaluation_root)
        tr_root = spec.train_root or spec.root
        tr_ds: Dataset | None = folder(tr_root) if tr_root is not None else None
        if spec.calibration_root is not None:
            ca_ds: Dataset = folder(spec.calibration_root)
        else:
            ca_ds = tr_ds if tr_ds is not None else ev_ds
        classes = ev_ds.classes
    else:
        assert spec.root is not None
        full = folder(spec.root)
        tr, ca, ev = split_indices(len(full), spec.split, seed)
        tr_ds, ca_ds, ev_ds = Subset(full, tr), Subset(full, ca), Subset(full, ev)  # type: ignore[assignment]
        classes = full.classes
    loaders = make_loaders(spec, seed, tr_ds, ca_ds, ev_ds)
    channels = 1 if spec.grayscale else 3
    return DataBundle(
        *loaders,
        True,
        len(classes),
        (channels, spec.image_size, spec.image_size),
        f"imagefolder ({len(classes)} classes, {len(ev_ds)} evaluation images)",  # type: ignore[arg-type]
    )


@register_data_source("torchvision", TorchvisionData)
def _torchvision(spec: TorchvisionData, seed: int) -> DataBundle:
    """A torchvision dataset already on disk: its train set for training and calibration, its
    test set for evaluation."""
    import inspect

    import torchvision
    from torchvision import transforms

    cls = getattr(torchvision.datasets, spec.name, None)
    if not (isinstance(cls, type) and issubclass(cls, Dataset)):
        names = [n for n in dir(torchvision.datasets) if n[0].isupper()]
        import difflib

        close = difflib.get_close_matches(spec.name, names, n=3)
        raise DataError(
            f"data.name: torchvision has no dataset {spec.name!r}",
            hint=f"did you mean {', '.join(close)}?" if close else "see torchvision.datasets",
        )
    steps: list[Any] = [transforms.Resize(spec.image_size)] if spec.image_size else []
    steps.append(transforms.ToTensor())
    if spec.mean is not None and spec.std is not None:
        steps.append(transforms.Normalize(spec.mean, spec.std))
    tf = transforms.Compose(steps)
    params = inspect.signature(cls).parameters

    def load(train: bool) -> Dataset:
        kwargs: dict[str, Any] = {"transform": tf}
        if "download" in params:
            kwargs["download"] = False
        if "train" in params:
            kwargs["train"] = train
        elif "split" in params:
            kwargs["split"] = "train" if train else "test"
        try:
            return cls(str(spec.root), **kwargs)
        except (RuntimeError, FileNotFoundError, OSError) as exc:
            raise DataError(
                f"data: {spec.name} not found under {str(spec.root)!r} ({first_line(exc, 120)})",
                hint=f"torchtame never downloads: fetch it once with torchvision.datasets.{spec.name}"
                "(root, download=True) on a machine with internet and copy the folder here",
            ) from exc

    train_full, evaluation = load(True), load(False)
    n = len(train_full)  # type: ignore[arg-type]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_cal = min(spec.calibration_samples, max(1, n // 2))
    calibration, train = Subset(train_full, perm[:n_cal]), Subset(train_full, perm[n_cal:])
    x = evaluation[0][0]
    classes = getattr(train_full, "classes", None)
    loaders = make_loaders(spec, seed, train, calibration, evaluation)
    return DataBundle(
        *loaders,
        True,
        len(classes) if classes else None,
        tuple(x.shape),
        f"torchvision {spec.name} ({len(train)}/{n_cal}/{len(evaluation)})",  # type: ignore[arg-type]
    )


SPLITS = ("train", "calibration", "evaluation")


def _as_dataset(item: Any, name: str, rule: Any) -> Dataset:
    """A Dataset of ``(inputs, label)`` pairs from whatever the callable returned for ``name``."""
    if isinstance(item, DataLoader):
        item = item.dataset
    if isinstance(item, Mapping):
        item = columns_dataset(item)
    if isinstance(item, str | bytes) or not (hasattr(item, "__len__") and hasattr(item, "__getitem__")):
        raise DataError(
            f"data.target returned {type(item).__name__} for {name}, not a Dataset, DataLoader, list of "
            "samples or dict of columns"
        )
    return Samples(item, rule)


@register_data_source("python", PythonData)
def _python(spec: PythonData, seed: int) -> DataBundle:
    """A callable returning samples of any common shape: a Dataset, a list, a dict of columns, or a
    dict of them per split."""
    fn = resolve_callable(spec.target, "data.target", DataError)
    obj = fn(**spec.kwargs)
    if isinstance(obj, Mapping) and obj and set(obj) <= set(SPLITS):
        if "evaluation" not in obj:
            raise DataError(
                "data.target's dict needs an 'evaluation' key and may have 'train', 'calibration'; "
                f"got {sorted(obj)}"
            )
        ev_ds = _as_dataset(obj["evaluation"], "evaluation", spec.label)
        tr_ds = _as_dataset(obj["train"], "train", spec.label) if "train" in obj else None
        ca_ds = _as_dataset(obj["calibration"], "calibration", spec.label) if "calibration" in obj else None
        ca_ds = ca_ds or tr_ds or ev_ds
    else:
        full = _as_dataset(obj, "the data", spec.label)
        tr, ca, ev = split_indices(len(full), spec.split, seed)  # type: ignore[arg-type]
        tr_ds, ca_ds, ev_ds = Subset(full, tr), Subset(full, ca), Subset(full, ev)
    if len(ev_ds) == 0:  # type: ignore[arg-type]
        raise DataError("data: the evaluation split is empty", hint="the callable returned no samples")
    x, y = ev_ds[0]
    has_labels = int(y) >= 0
    loaders = make_loaders(spec, seed, tr_ds, ca_ds, ev_ds)
    shape = tuple(first_tensor(x).shape)
    return DataBundle(*loaders, has_labels, spec.num_classes, shape, f"python {spec.target}")
