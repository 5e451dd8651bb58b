"""quantize.qat: quantization-aware training (PT2E and FX), distilling from the baseline without
labels; it recovers fidelity post-training int8 lost, on torchvision code; bad input stops before
training; the curve reaches the report."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchtame import PassError, apply_pass, load_data, load_recipe, run
from torchtame.data import SyntheticData
from torchtame.training import recalibrate_batchnorm

from .conftest import tiny_recipe


def _fidelity(model: nn.Module, q: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return nn.functional.cosine_similarity(model(x), q(x)).mean().item()


def _calibrated(model: nn.Module, digits, mode: str) -> nn.Module:
    """``model`` fake-quantized for QAT (``mode``, x86 for FX) and calibrated as quantize.qat does
    (activations: range search), in eval mode; call it inside the engine the test measures with."""
    from types import SimpleNamespace

    from torchtame.passes.qat import QatOptions, calibrate_ranges, prepare

    ctx = SimpleNamespace(example_input=digits.example_input(8), data=digits, progress=None)
    opts = QatOptions(mode=mode)
    prepared, _, _ = prepare(model, ctx, opts, "x86")  # type: ignore[arg-type]
    prepared.eval()
    calibrate_ranges(prepared, ctx, opts)  # type: ignore[arg-type]
    return prepared


def test_qat_recovers_what_post_training_int8_lost() -> None:
    import torchvision

    data = load_data(SyntheticData(source="synthetic", shape=[3, 32, 32], num_samples=512, batch_size=32), 0)
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10).eval()
    recalibrate_batchnorm(model, [x for x, _ in data.calibration])
    assert {m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm2d)} == {0.1}  # as it was
    held_apart = torch.cat([x for x, _ in data.evaluation])
    ptq = apply_pass("quantize.static", model, data, {"mode": "fx"})
    qat = apply_pass("quantize.qat", model, data, {"mode": "fx", "steps": 60})
    before, after = _fidelity(model, ptq.module, held_apart), _fidelity(model, qat.module, held_apart)
    # without a single label: distilled from float (onednn, 8-bit activations: 0.782 -> 0.802)
    assert after > before + 0.01, (before, after)
    curve = qat.info["curve"]
    assert curve[0]["epoch"] == 0 and curve[0]["loss"] is None and curve[-1]["cosine"] > curve[0]["cosine"]
    assert qat.info["observers_frozen_at"] == 40  # 2/3 of 60 steps
    assert qat.info["batchnorm_frozen_at"] == 0  # the model is trained: its statistics stay
    assert (
        qat.info["activation_ranges"]["method"] == "range_search" and qat.info["activation_ranges"]["tensors"]
    )
    assert qat.info["graph"]["int8_layers"] == qat.info["graph"]["weight_layers"]


def test_qat_pt2e_converts_to_the_static_int8_artefact(trained_cnn, digits) -> None:
    v = apply_pass("quantize.qat", trained_cnn, digits, {"steps": 12, "freeze_bn_after": 4})
    assert v.info["mode"] == "pt2e" and v.info["mode_reason"] == "torch.export captured the model"
    assert v.info["batchnorm_frozen_at"] == 4 and v.info["teacher"] == "input"  # apply_pass: "input"
    assert v.info["graph"]["int8_layers"] == v.info["graph"]["weight_layers"] == 5
    assert v.compiled and v.quantized and v.dtype == "int8"
    x = digits.example_input(32)
    assert _fidelity(trained_cnn, v.module, x) > 0.99
    from torchtame.runtime import pt2e_weight_range

    assert v.info["weight_grid"] == list(pt2e_weight_range())  # 7-bit without VNNI
    seven = apply_pass("quantize.qat", trained_cnn, digits, {"steps": 2, "weight_bits": 7})
    from torchtame.passes.adaround import int8_weights

    stored = int8_weights(seven.module)
    assert seven.info["weight_grid"] == [-64, 63] and len(stored) == 5
    assert all(int(t.min()) >= -64 and int(t.max()) <= 63 for t in stored)


def test_qat_refuses_what_it_cannot_capture_before_training(digits) -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(64, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.flatten(1)
            if x.sum() > 0:  # data-dependent control flow: torch.export cannot capture it
                return self.fc(x)
            return -self.fc(x)

    with pytest.raises(PassError, match=r"torch\.export cannot capture the model"):
        apply_pass("quantize.qat", Branchy().eval(), digits, {"mode": "pt2e", "epochs": 50})


def test_qat_curve_is_in_the_report(tmp_path: Path) -> None:
    steps = [{"name": "qat", "pass": "quantize.qat", "options": {"mode": "fx", "epochs": 2}}]
    result = run(load_recipe(tiny_recipe(tmp_path, steps=steps)))
    entry = next(v for v in result.results["variants"] if v["name"] == "qat")
    assert entry["status"] == "ok" and len(entry["info"]["curve"]) == 3
    report = (Path(result.run_dir) / "report.md").read_text()
    assert "## Quantization-aware training" in report and "qat cosine" in report


@pytest.mark.parametrize("mode", ["fx", "pt2e"])
def test_the_int8_model_is_the_one_qat_trained(trained_cnn, digits, mode: str) -> None:
    """Every fake-quantizer trains with the scale conversion will use. torch.ao's and torchao's
    default QAT configs fake-quantize weights with a fused kernel whose per-channel scale
    (range/128 or /127) is not the converted model's (range/127.5): a tenth of the outputs one
    step apart, so QAT trained a model that did not ship (cosine 0.988 between the two on a trained
    MobileNetV2)."""
    from torchtame.passes.qat import _convert
    from torchtame.runtime import quantized_engine

    x = digits.example_input(64)
    with quantized_engine("x86" if mode == "fx" else None):
        prepared = _calibrated(trained_cnn, digits, mode)  # activations: range search
        quantizers = [
            m for m in prepared.modules() if hasattr(m, "calculate_qparams") and hasattr(m, "scale")
        ]
        assert len(quantizers) >= 10  # weights and activations
        for fq in quantizers:
            scale, zero_point = fq.calculate_qparams()
            assert torch.allclose(fq.scale, scale, rtol=1e-5, atol=0), type(fq).__name__  # 4e-3 unfixed
            assert torch.equal(fq.zero_point, zero_point.to(fq.zero_point))
        with torch.no_grad():
            trained = prepared(x)
            converted = _convert(prepared, mode)(x)
    c = nn.functional.cosine_similarity(trained, converted).mean().item()
    assert c > 0.9999


def test_fx_qat_clips_activations_where_the_int8_kernels_clip(trained_cnn, digits) -> None:
    """x86 FX QAT trains 8-bit activations and 7-bit weights: the fake-quantizers clip at 0..255
    where the int8 kernels' quint8 tensors do, and the kernels do not saturate their 16-bit pair
    sums, so even on inputs three times the calibrated range the int8 model computes what QAT
    trained, on every CPU. (torch.ao's default, 7-bit activations, clipped at 0..127 while training:
    cosine 0.9499 between the two here; 8-bit weights with 8-bit activations saturated the kernels.)"""
    from torchtame.passes.qat import _convert
    from torchtame.runtime import quantized_engine

    x = 3 * digits.example_input(64)  # three times the calibrated range: outliers everywhere
    with quantized_engine("x86"), torch.no_grad():
        prepared = _calibrated(trained_cnn, digits, "fx")
        weights = [m for n, m in prepared.named_modules() if n.endswith("weight_fake_quant")]
        assert weights and all((m.quant_min, m.quant_max) == (-64, 63) for m in weights)
        acts = [
            m
            for n, m in prepared.named_modules()
            if "activation_post_process" in n and hasattr(m, "quant_max")
        ]
        assert acts and all(m.quant_max == 255 for m in acts if m.dtype == torch.quint8)
        trained = prepared(x)
        int8 = _convert(prepared, "fx")
        converted = int8(x)
    assert nn.functional.cosine_similarity(trained, converted).mean().item() > 0.9999
    # the stored integers are on the grid QAT trained on: conversion alone stores each channel's
    # positive extreme (63.5 steps) as 64, where the fake-quantizers clamped it to 63
    stored = [m.weight().int_repr() for m in int8.modules() if callable(getattr(m, "weight", None))]
    assert stored and all(w.min() >= -64 and w.max() <= 63 for w in stored)


@pytest.mark.parametrize("mode", ["fx", "pt2e"])
def test_qat_learns_activation_scales_and_the_int8_model_uses_them(trained_cnn, digits, mode: str) -> None:
    """learn_ranges (LSQ): the loss reaches every calibrated activation scale, which trains in its
    own optimizer group at ``range_lr``, and conversion takes the learned scales, so the int8 model
    is the one trained, not the calibrated one."""
    import math

    from torchtame.passes.qat import _convert, _range_changes, learn_ranges
    from torchtame.runtime import quantized_engine
    from torchtame.training import make_optimizer

    x = digits.example_input(64)
    with quantized_engine("x86" if mode == "fx" else None):
        prepared = _calibrated(trained_cnn, digits, mode)
        with torch.no_grad():
            calibrated = prepared(x)
        learned = learn_ranges(prepared, 1000.0)
        assert len(learned) >= 5
        prepared(x).square().sum().backward()
        assert sum(bool(fq.log_scale.grad.abs().sum() > 0) for fq in learned) >= len(learned) - 1

        opt = make_optimizer(prepared, "adam", 1e-5, 0.0)
        by_lr = {g["lr"]: {id(p) for p in g["params"]} for g in opt.param_groups}
        assert sorted(by_lr) == [1e-5, pytest.approx(1e-2)]
        assert {id(fq.log_scale) for fq in learned} == by_lr[max(by_lr)]

        with torch.no_grad():
            for fq in learned:
                fq.log_scale += math.log(0.8)  # what training might have learned
            trained = prepared(x)
        moved = _range_changes(learned)
        assert moved["tensors"] == len(learned) and moved["scale_ratio_median"] == pytest.approx(
            0.8, abs=1e-3
        )
        with torch.no_grad():
            converted = _convert(prepared, mode)(x)

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return nn.functional.cosine_similarity(a, b).mean().item()

    assert cos(trained, converted) > 0.9999
    assert cos(calibrated, converted) < cos(trained, converted) - 1e-5  # not the calibrated scales


def test_an_int8_model_that_is_not_the_one_qat_trained_is_a_warning() -> None:
    """int8_vs_trained_cosine below 0.999: the int8 kernels round otherwise than the fake-quantizers
    QAT trained with (a random-weight MobileNetV2 on onednn: 0.973), a warning with the next step."""
    from torchtame.evaluate.health import check, flags

    def entry(cosine: float | None, mode: str = "fx") -> dict:
        info = {
            "mode": mode,
            "backend": "onednn",
            **({} if cosine is None else {"int8_vs_trained_cosine": cosine}),
        }
        return {"name": "qat", "status": "ok", "pass": "quantize.qat", "info": info}

    assert [f["code"] for f in check(entry(0.9995), None)] == []
    assert [f["code"] for f in check(entry(None), None)] == []  # other passes: no such figure
    found = check(entry(0.9728), None)
    assert [(f["code"], f["level"]) for f in found] == [("int8_not_as_trained", "warning")]
    assert "0.9728" in found[0]["message"] and "onednn" in found[0]["message"]
    assert "mode: pt2e" in found[0]["suggestion"] and flags(found) == "⚠ not as trained"
    assert "mode: pt2e" not in check(entry(0.99, mode="pt2e"), None)[0]["suggestion"]


def test_conv_batchnorm_patterns_are_matched_only_for_convolutions_the_graph_has() -> None:
    """torchao exports 96 pattern graphs per QAT convert (four convolution kinds): the kinds the
    graph lacks are skipped, 2d always runs, and torchao's helpers are restored after."""
    import torch.nn.functional as F
    import torchao.quantization.pt2e.qat_utils as qat_utils

    from torchtame.passes.qat import present_convolutions_only

    class ConvBn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.conv(x))

    graph = torch.export.export(ConvBn().train(), (torch.rand(2, 1, 5, 5),)).module().graph
    originals = (qat_utils._fuse_conv_bn_qat_helper, qat_utils._fold_conv_bn_qat_helper)
    calls: list[object] = []
    qat_utils._fold_conv_bn_qat_helper = lambda m, conv_fn, *a, **k: calls.append(conv_fn) or m
    try:
        with present_convolutions_only(graph):
            for fn in (F.conv1d, F.conv2d, F.conv_transpose1d, F.conv_transpose2d):
                assert qat_utils._fold_conv_bn_qat_helper("gm", fn, (), is_cuda=False) == "gm"
        assert calls == [F.conv2d]
        decomposed = torch.fx.Graph()
        decomposed.call_function(torch.ops.aten.convolution.default, ())
        with present_convolutions_only(decomposed):  # aten.convolution: every kind runs
            qat_utils._fold_conv_bn_qat_helper("gm", F.conv1d, (), is_cuda=False)
        assert calls == [F.conv2d, F.conv1d]
    finally:
        qat_utils._fold_conv_bn_qat_helper = originals[1]
    assert (qat_utils._fuse_conv_bn_qat_helper, qat_utils._fold_conv_bn_qat_helper) == originals
