"""Model sources on small files the tests create: torchvision, python, checkpoint, TorchScript."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision

from torchtame import ModelLoadError, load_model, load_recipe
from torchtame.models import CheckpointModel, PythonModel, TorchScriptModel, TorchvisionModel
from torchtame.zoo import digits_cnn

X = torch.randn(2, 3, 64, 64)


def test_torchvision_with_local_weights(tmp_path: Path) -> None:
    ref = torchvision.models.squeezenet1_1(num_classes=10).eval()
    weights = tmp_path / "sq.pth"
    torch.save(ref.state_dict(), weights)
    model = load_model(
        TorchvisionModel(source="torchvision", name="squeezenet1_1", weights=weights, num_classes=10)
    )
    with torch.no_grad():
        assert torch.allclose(model(X), ref(X))
    assert not model.training


def test_torchvision_unknown_name_suggests() -> None:
    with pytest.raises(ModelLoadError, match="resnet18"):
        load_model(TorchvisionModel(source="torchvision", name="resnet_18"))


def test_torchvision_weights_for_wrong_head(tmp_path: Path) -> None:
    weights = tmp_path / "sq.pth"
    torch.save(torchvision.models.squeezenet1_1(num_classes=10).state_dict(), weights)
    with pytest.raises(ModelLoadError, match="does not fit"):
        load_model(TorchvisionModel(source="torchvision", name="squeezenet1_1", weights=weights))


def test_python_callable_and_file(tmp_path: Path) -> None:
    m = load_model(PythonModel(source="python", target="torchtame.zoo:digits_cnn", kwargs={"width": 4}))
    assert m.features[0].out_channels == 4
    f = tmp_path / "mymodels.py"
    f.write_text("import torch\ndef build(n=3):\n    return torch.nn.Linear(n, 2)\n")
    m2 = load_model(PythonModel(source="python", target=f"{f}:build", kwargs={"n": 5}))
    assert m2.in_features == 5


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("torchtame.zoo", "form"),
        ("no_such_module_x:build", "cannot import"),
        ("torchtame.zoo:digits_cnm", "digits_cnn"),
        ("torchtame.zoo:__doc__", "not callable"),
    ],
)
def test_python_bad_target(target: str, needle: str) -> None:
    with pytest.raises(ModelLoadError, match=needle):
        load_model(PythonModel(source="python", target=target))


def test_python_bad_kwargs() -> None:
    with pytest.raises(ModelLoadError, match="kwargs"):
        load_model(PythonModel(source="python", target="torchtame.zoo:digits_cnn", kwargs={"depth": 3}))


def test_checkpoint_state_dict_for_architecture(tmp_path: Path) -> None:
    ref = digits_cnn(width=8).eval()
    path = tmp_path / "ckpt.pt"
    torch.save({"epoch": 3, "state_dict": ref.state_dict()}, path)
    m = load_model(
        CheckpointModel(
            source="checkpoint", path=path, architecture="torchtame.zoo:digits_cnn", kwargs={"width": 8}
        )
    )
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


def test_checkpoint_wrong_architecture(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save(digits_cnn(width=8).state_dict(), path)
    with pytest.raises(ModelLoadError, match="does not fit"):
        load_model(
            CheckpointModel(
                source="checkpoint", path=path, architecture="torchtame.zoo:digits_cnn", kwargs={"width": 16}
            )
        )
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(CheckpointModel(source="checkpoint", path=path, architecture="torchtame.zoo:digits_mlp"))


def test_full_module_checkpoint_needs_trust(tmp_path: Path) -> None:
    path = tmp_path / "full.pt"
    torch.save(digits_cnn(width=4), path)
    with pytest.raises(ModelLoadError, match="trust_checkpoint: true"):
        load_model(CheckpointModel(source="checkpoint", path=path))
    m = load_model(CheckpointModel(source="checkpoint", path=path, trust_checkpoint=True))
    assert m.features[0].out_channels == 4


def test_state_dict_without_architecture(tmp_path: Path) -> None:
    path = tmp_path / "sd.pt"
    torch.save(digits_cnn(width=4).state_dict(), path)
    with pytest.raises(ModelLoadError, match="architecture"):
        load_model(CheckpointModel(source="checkpoint", path=path))


def test_checkpoint_missing_and_garbage(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(CheckpointModel(source="checkpoint", path=tmp_path / "none.pt"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file at all")
    with pytest.raises(ModelLoadError, match="not a readable torch file"):
        load_model(CheckpointModel(source="checkpoint", path=junk, architecture="torchtame.zoo:digits_cnn"))


def test_torchscript(tmp_path: Path) -> None:
    ref = digits_cnn(width=4).eval()
    path = tmp_path / "m.ts"
    x = torch.rand(2, 1, 8, 8)
    torch.jit.save(torch.jit.trace(ref, x), str(path))
    m = load_model(TorchScriptModel(source="torchscript", path=path))
    with torch.no_grad():
        assert torch.allclose(m(x), ref(x))
    with pytest.raises(ModelLoadError, match="not a TorchScript"):
        bad = tmp_path / "sd.pt"
        torch.save(ref.state_dict(), bad)
        load_model(TorchScriptModel(source="torchscript", path=bad))


def test_recipe_model_section_parses_each_source() -> None:
    for model in (
        {"source": "torchvision", "name": "resnet18"},
        {"source": "python", "target": "a:b"},
        {"source": "checkpoint", "path": "x.pt", "architecture": "resnet18"},
        {"source": "torchscript", "path": "x.ts"},
    ):
        r = load_recipe({"name": "m", "model": model, "data": {"source": "digits"}})
        assert r.model.source == model["source"]


def test_paths_expand_the_home_directory() -> None:
    spec = CheckpointModel(source="checkpoint", path="~/models/x.pt")
    assert spec.path == Path.home() / "models" / "x.pt"
    r = load_recipe(
        {
            "name": "m",
            "model": {"source": "python", "target": "a:b"},
            "data": {"source": "digits"},
            "output_dir": "~/runs",
        }
    )
    assert r.output_dir == Path.home() / "runs"
