"""ONNX export, verification against PyTorch in onnxruntime, and onnxruntime quantization."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from torchtame import PassError, apply_pass
from torchtame.onnx_runtime import session, session_output
from torchtame.passes.export import OnnxOptions, merge_external_data, verify


class TinyEncoder(nn.Module):
    """Transformer-ish: the 8 rows of a digit as 8 tokens through one encoder layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True, dropout=0.0),
            1,
            enable_nested_tensor=False,
        )
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        t = self.encoder(self.embed(x.reshape(x.shape[0], 8, 8)))
        return self.head(self.norm(t.mean(1)))


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_export_conv_with_parity(trained_cnn, digits, exporter, tmp_path: Path) -> None:
    v = apply_pass("export.onnx", trained_cnn, digits, {"exporter": exporter}, work_dir=tmp_path)
    assert v.kind == "onnx" and v.onnx_path.is_file()
    assert not list(tmp_path.glob("*.data"))  # weights folded into the one file
    onnx.checker.check_model(str(v.onnx_path))
    p = v.info["parity"]
    assert v.info["exporter"] == exporter
    assert p["max_abs_error"] < 1e-3 and p["top1_agreement"] == 1.0 and p["samples"] == 4 * 64
    # dynamic batch axis: any batch size runs
    sess = session(v.onnx_path)
    for bs in (1, 7):
        assert tuple(session_output(sess, digits.example_input(bs)).shape) == (bs, 10)


def test_export_transformer_with_parity(digits, tmp_path: Path) -> None:
    torch.manual_seed(0)
    v = apply_pass("export.onnx", TinyEncoder().eval(), digits, work_dir=tmp_path)
    assert v.info["parity"]["max_abs_error"] < 1e-3


def test_external_data_is_merged(trained_cnn, tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    torch.onnx.export(trained_cnn, (torch.rand(2, 1, 8, 8),), str(path), dynamo=False)
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    assert (tmp_path / "m.onnx.data").is_file()
    assert path.stat().st_size < 100_000
    assert merge_external_data(path)
    assert not (tmp_path / "m.onnx.data").exists()
    assert path.stat().st_size > 200_000
    sess = session(path)
    x = torch.rand(2, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(session_output(sess, x), trained_cnn(x), atol=1e-4)


def test_injected_mismatch_fails_parity(trained_cnn, digits, tmp_path: Path) -> None:
    v = apply_pass("export.onnx", trained_cnn, digits, work_dir=tmp_path)
    broken = trained_cnn
    with torch.no_grad():
        broken.classifier[4].bias += 0.5  # a small, systematic difference
    with pytest.raises(PassError) as info:
        verify(broken, v.onnx_path, digits.evaluation, OnnxOptions(), torch.float32, quantized=False)
    assert "parity check failed" in str(info.value) and "max abs error" in str(info.value)


def test_ort_static_int8_is_small_and_agrees(trained_cnn, digits, tmp_path: Path) -> None:
    fp32 = apply_pass("export.onnx", trained_cnn, digits, work_dir=tmp_path / "fp32")
    q = apply_pass(
        "quantize.onnx", fp32, digits, {"mode": "static", "format": "QDQ"}, work_dir=tmp_path / "q"
    )
    assert q.onnx_path.stat().st_size <= 0.3 * fp32.onnx_path.stat().st_size
    sess_q, sess_f = session(q.onnx_path), session(fp32.onnx_path)
    x = next(iter(digits.evaluation))[0]
    agree = (session_output(sess_q, x).argmax(1) == session_output(sess_f, x).argmax(1)).float().mean()
    assert agree >= 0.95


@pytest.mark.parametrize(
    "options",
    [
        {"mode": "dynamic"},
        {"mode": "static", "format": "QOperator", "per_channel": False},
        {"mode": "static", "calibration_method": "Entropy", "calibration_batches": 1},
        {"mode": "static", "calibration_method": "Percentile", "calibration_batches": 1},
    ],
    ids=["dynamic", "qoperator", "entropy", "percentile"],
)
def test_ort_quantization_options(trained_cnn, digits, options, tmp_path: Path) -> None:
    q = apply_pass("quantize.onnx", trained_cnn, digits, options, work_dir=tmp_path)
    sess = session(q.onnx_path)
    x = next(iter(digits.evaluation))[0]
    with torch.no_grad():
        ref = trained_cnn(x).argmax(1)
    assert (session_output(sess, x).argmax(1) == ref).float().mean() >= 0.9
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_quantized_torch_variant_exports_through_torchscript(trained_mlp, digits, tmp_path: Path) -> None:
    q = apply_pass("quantize.static", trained_mlp, digits)
    v = apply_pass("export.onnx", q, digits, work_dir=tmp_path)
    assert v.info["exporter"] == "torchscript"
    assert v.info["parity"]["top1_agreement"] >= 0.95 and v.info["parity"]["passed"]


def test_quantized_export_failure_explains_the_way_out(
    trained_mlp, digits, tmp_path: Path, monkeypatch
) -> None:
    """A quantized op without an ONNX form: the error names the exporter and the alternative."""
    q = apply_pass("quantize.static", trained_mlp, digits)

    def no_onnx_form(*args, **kwargs):
        raise RuntimeError("Exporting the operator 'quantized::linear_relu' to ONNX is not supported")

    monkeypatch.setattr(torch.onnx, "export", no_onnx_form)
    with pytest.raises(PassError, match="quantized::linear_relu") as info:
        apply_pass("export.onnx", q, digits, work_dir=tmp_path)
    assert "TorchScript exporter" in info.value.hint and "quantize.onnx" in info.value.hint
    assert not (tmp_path / "model.onnx").exists()


@pytest.mark.parametrize("relative", [True, False], ids=["relative", "absolute"])
def test_preprocessing_keeps_symbolic_shape_inference(
    trained_cnn, digits, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog, relative: bool
) -> None:
    """A relative work directory (the default `output_dir: runs`) must not make onnxruntime's
    symbolic shape inference give up on a model it can handle."""
    import logging

    monkeypatch.chdir(tmp_path)
    work = Path("runs/variants/onnx-int8") if relative else tmp_path / "abs"
    with caplog.at_level(logging.INFO, logger="torchtame"):
        q = apply_pass("quantize.onnx", trained_cnn, digits, {"mode": "static"}, work_dir=work)
    assert not [r for r in caplog.records if "symbolic shape inference failed" in r.getMessage()]
    assert q.onnx_path.is_file() and q.info["graph"]["int8_layers"] == q.info["graph"]["weight_layers"]
