"""Modern int8 on model code others wrote: PT2E (torchao) with every convolution quantized on
torchvision and timm models, the evidence-based `mode: auto`, torchao schemes, MACs counted at the
aten level, and onnxruntime calibration with ragged batches."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from torchtame import PassError, apply_pass, load_data, run
from torchtame.artifacts import load_module, save_module
from torchtame.data import DigitsData, SyntheticData
from torchtame.evaluate.macs import count_macs
from torchtame.progress import NullProgress
from torchtame.training import recalibrate_batchnorm

from .conftest import tiny_recipe
from .samepad import Conv2dSame, ported_net

pytest.importorskip("torchao")


def images(size: int = 64, n: int = 16, batch: int = 8):
    return load_data(
        SyntheticData(source="synthetic", shape=[3, size, size], num_samples=n, batch_size=batch), 0
    )


def recalibrate_bn(model: nn.Module, data) -> nn.Module:
    """BatchNorm statistics from the inputs, so that random weights give healthy activations."""
    return recalibrate_batchnorm(model, (x for x, _ in data.calibration))


def _torchvision(name: str) -> nn.Module:
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.get_model(name).eval()


def _timm(name: str) -> nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(name).eval()


@pytest.mark.parametrize(
    ("build", "name", "layers"),
    [
        (_torchvision, "resnet18", 21),  # a ReLU module called twice per block
        (_torchvision, "mobilenet_v2", 53),  # in-place hardtanh_
        (_timm, "tf_efficientnet_lite0", 50),  # Conv2dSame: Conv2d subclasses that pad in forward
    ],
)
def test_pt2e_quantizes_every_layer_of_third_party_models(build, name, layers) -> None:
    data = images()
    model = recalibrate_bn(build(name), data)
    v = apply_pass("quantize.static", model, data, {"mode": "pt2e"})
    graph = v.info["graph"]
    assert (graph["int8_layers"], graph["weight_layers"]) == (layers, layers), graph["float_layers"]
    assert v.compiled and v.devices == "cpu_only"
    x = data.example_input(4)
    with torch.inference_mode():
        ref, out = model(x), v.module(x)
    # random weights (with BatchNorm statistics from the inputs) amplify rounding more than trained
    # ones; this is a sanity bar, benchmarks/int8_modes.py measures fidelity properly
    assert torch.nn.functional.cosine_similarity(ref, out).mean() >= 0.8


def test_pt2e_keeps_named_modules_float() -> None:
    data = images()
    model = recalibrate_bn(_torchvision("resnet18"), data)
    v = apply_pass("quantize.static", model, data, {"mode": "pt2e", "keep_float": ["fc", "layer4.1.conv2"]})
    graph = v.info["graph"]
    assert sorted(graph["float_layers"]) == ["fc", "layer4.1.conv2"] and graph["int8_layers"] == 19
    assert (
        not v.runs_on("cuda:0")[0] and "no PT2E static int8 quantizer targets CUDA" in v.runs_on("cuda:0")[1]
    )


def test_auto_rejects_fx_on_a_ported_same_padding_model_and_says_why() -> None:
    data = images(32, n=32, batch=16)
    model = recalibrate_bn(ported_net(), data)
    fx = apply_pass("quantize.static", model, data, {"mode": "fx"})
    assert fx.info["graph"]["standalone_batchnorms"] == 5  # FX traced through the subclass
    assert fx.info["graph"]["functional_int8_layers"] == 5
    auto = apply_pass("quantize.static", model, data)
    assert auto.info["mode"] == "pt2e"
    assert auto.info["graph"]["standalone_batchnorms"] == 0
    assert auto.info["graph"]["int8_layers"] == auto.info["graph"]["weight_layers"] == 6
    choice = auto.info["mode_choice"]
    assert choice["chosen"] == "pt2e" and "5 BatchNorms not folded" in choice["reason"]
    assert {"fx", "pt2e"} <= set(choice["trials"]) and choice["trials"]["pt2e"]["cosine"] >= 0.99
    assert auto.info["normalised"]["subclass_layers"]  # the convolutions were seen as nn.Conv2d


@pytest.mark.parametrize(
    ("fx_cosine", "pt2e_cosine", "chosen"),
    [(0.9721, 0.9771, "pt2e"), (0.9771, 0.9721, "fx"), (0.9741, 0.9744, "fx"), (0.995, 0.999, "fx")],
)
def test_auto_keeps_the_closer_mode_where_neither_is_faithful(
    trained_cnn, digits, monkeypatch, fx_cosine: float, pt2e_cosine: float, chosen: str
) -> None:
    """Where neither mode reaches cosine 0.99, auto keeps the one closer to float (mobilenet_v2's
    int8_modes figures: FX 0.9721, PT2E 0.9771 and faster), FX on a tie within 1e-3 or where both
    are faithful and as fast."""
    import torchtame.passes.static as static

    cosines = {"fx": fx_cosine, "pt2e": pt2e_cosine}

    def trial(mode, *_args):
        figures = {"int8_layers": "5/5", "standalone_batchnorms": 0, "cosine": cosines[mode]}
        return nn.Identity(), {**figures, "speedup_vs_float": 2.0, "p50_ms": 1.0, "batch_size": 8}

    monkeypatch.setattr(static, "trial", trial)
    ctx = SimpleNamespace(data=digits, output=None, progress=NullProgress())
    _, mode, choice = static.choose(trained_cnn, ctx, static.StaticOptions(), "onednn")  # type: ignore[arg-type]
    assert mode == chosen == choice["chosen"], choice["reason"]


def test_auto_keeps_fx_where_it_holds_up(trained_cnn, digits) -> None:
    v = apply_pass("quantize.static", trained_cnn, digits)
    assert v.info["mode"] == "fx" and "pt2e" not in v.info["mode_choice"]["trials"]
    assert not v.info["mode_choice"]["trials"]["fx"]["shortfalls"]


def test_pt2e_artefact_reloads_with_the_same_outputs(tmp_path: Path) -> None:
    data = images(32, n=16)
    model = recalibrate_bn(ported_net(), data)
    v = apply_pass("quantize.static", model, data, {"mode": "pt2e"})
    path = save_module(v, tmp_path, data.example_input(1))
    assert path.suffix == ".pt2"
    again = load_module(path)
    x = data.example_input(5)  # another batch size than the export's example: a dynamic batch
    with torch.inference_mode():
        assert torch.allclose(v.module(x), again(x), atol=1e-5)


def test_pt2e_variant_is_measured_compiled_with_compile_time_recorded(tmp_path: Path) -> None:
    steps = [{"name": "int8", "pass": "quantize.static", "options": {"mode": "pt2e"}}]
    result = run(tiny_recipe(tmp_path, steps=steps))
    v = result.variant("int8")
    assert v["status"] == "ok", v.get("error")
    assert v["compiled"] and v["compile_s"]["cpu"] > 0 and v["artifact"][0].endswith("model.pt2")
    assert v["accuracy"]["top1_drop"] <= 2.0
    assert v["info"]["graph"]["int8_layers"] == v["info"]["graph"]["weight_layers"]
    # the saved program holds int8 weights only (convert_pt2e leaves the float ones registered)
    assert v["info"]["normalised"]["unused_float_bytes_dropped"] > 0
    assert v["size"]["bytes"] < result.variant("baseline")["size"]["bytes"], v["size"]
    program = torch.export.load(str(result.run_dir / v["artifact"][0]))
    tensors = [*program.state_dict.values(), *program.constants.values()]
    by_dtype = {str(t.dtype): 0 for t in tensors}
    for t in tensors:
        by_dtype[str(t.dtype)] += t.numel() * t.element_size()
    assert by_dtype.get("torch.float32", 0) < by_dtype["torch.int8"], by_dtype  # biases and scales only


def test_torchao_int8_dynamic_and_refusals(trained_mlp, digits, tmp_path: Path) -> None:
    v = apply_pass("quantize.torchao", trained_mlp, digits)
    assert v.quantized and v.compiled and v.info["quantized_layers"] == 3
    x = digits.example_input(32)
    with torch.inference_mode():
        ref, out = trained_mlp(x), v.module(x)
    assert torch.nn.functional.cosine_similarity(ref, out).mean() >= 0.99
    path = save_module(v, tmp_path, digits.example_input(1))
    with torch.inference_mode():
        assert torch.equal(load_module(path)(x), out)
    if not torch.cuda.is_available():
        with pytest.raises(PassError, match="int4_weight_only needs a CUDA GPU"):
            apply_pass("quantize.torchao", trained_mlp, digits, {"scheme": "int4_weight_only"})
        with pytest.raises(PassError, match=r"compute capability 8\.9"):
            apply_pass("quantize.torchao", trained_mlp, digits, {"scheme": "float8_dynamic"})


def test_macs_at_the_aten_level() -> None:
    assert count_macs(_torchvision("resnet18"), torch.randn(1, 3, 224, 224)) == pytest.approx(
        1.814e9, rel=0.005
    )
    x = torch.randn(1, 8, 32, 32)
    same = Conv2dSame(8, 16, 3, 2, image_size=32)
    plain = nn.Conv2d(8, 16, 3, 2, padding=1)
    assert same(x).shape == plain(x).shape
    assert count_macs(same, x) == count_macs(plain, x) == 16 * 16 * 16 * 8 * 9


def test_macs_of_the_ported_model_count_its_functional_convolutions(tmp_path: Path) -> None:
    from torchtame.evaluate.macs import count_macs_params

    macs, params = count_macs_params(ported_net(), torch.randn(1, 3, 32, 32))
    assert macs > 300_000 and params == sum(p.numel() for p in ported_net().parameters())


@pytest.mark.parametrize("method", ["MinMax", "Percentile", "Entropy"])
def test_ort_calibration_methods_with_a_ragged_last_batch(trained_cnn, method) -> None:
    data = load_data(DigitsData(source="digits", batch_size=64), 0)
    assert len({len(x) for x, _ in data.calibration}) > 1  # 64, 64, 52
    v = apply_pass("quantize.onnx", trained_cnn, data, {"calibration_method": method})
    assert v.info["calibration_samples_repeated"] == 12
    assert v.info["graph"]["int8_layers"] == v.info["graph"]["weight_layers"] == 5


# ------------------------------------------------------------------ health


class _Slow(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        time.sleep(0.004)
        return self.inner(x)


def _slow_pass(model, ctx, opts):
    """Wraps the model in a 4 ms sleep: a variant slower than its parent at every setting."""
    return ctx.variant(_Slow(model))


def _noisy_pass(model, ctx, opts):
    """Replaces every weight with noise: a variant whose fidelity collapsed."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return ctx.variant(model)


from torchtame import register_pass  # noqa: E402

register_pass("test.slow")(_slow_pass)
register_pass("test.noisy")(_noisy_pass)
ROUNDS = {"batch_sizes": [1], "warmup": 1, "min_runs": 3, "min_time_s": 0, "rounds": 3}


def test_health_flags_slower_and_collapsed_variants(tmp_path: Path) -> None:
    steps = [{"name": "slow", "pass": "test.slow"}, {"name": "noisy", "pass": "test.noisy"}]
    result = run(tiny_recipe(tmp_path, steps=steps, evaluate={"latency": ROUNDS}))
    slow = {f["code"]: f for f in result.variant("slow")["health"]}
    # slower at every measured setting, its interval over 3 paired rounds wholly below 0.95
    assert slow["slower_than_parent"]["level"] == "error"
    timing = result.variant("slow")["latency"][0]
    assert timing["rounds"] == 3 and timing["speedup_high"] < 0.95
    assert timing["speedup_low"] <= timing["speedup"] <= timing["speedup_high"]
    assert "slower than baseline at cpu b1" in slow["slower_than_parent"]["message"]
    noisy = {f["code"]: f for f in result.variant("noisy")["health"]}
    assert noisy["fidelity_collapsed"]["level"] == "error" and noisy["fidelity_collapsed"]["suggestion"]
    assert result.variant("baseline")["health"] == []
    assert result.results["health"]["error"] >= 2
    md = (result.run_dir / "report.md").read_text()
    assert "## Health" in md and "✖ error: slower than baseline" in md and "Next:" in md
    assert "✖ slower" in md  # the flag column


def test_strict_fails_on_an_error_finding(tmp_path: Path) -> None:
    import yaml
    from click.testing import CliRunner

    from torchtame.cli import main

    path = tmp_path / "r.yaml"
    steps = [{"name": "slow", "pass": "test.slow"}]
    recipe = tiny_recipe(tmp_path, steps=steps, evaluate={"latency": ROUNDS})
    path.write_text(yaml.safe_dump(recipe))
    relaxed = CliRunner().invoke(main, [str(path), "--quiet"])
    assert relaxed.exit_code == 0, relaxed.output
    assert "✖" in relaxed.stdout  # the flag column ("✖ slower", shortened to the terminal's width)
    strict = CliRunner().invoke(main, [str(path), "--quiet", "--strict"])
    assert strict.exit_code == 1
    assert "health error" in strict.stderr and "slow: slower than baseline" in strict.stderr


def test_health_units() -> None:
    from torchtame.evaluate.health import check

    def entry(name, p50, **kw):
        timing = {"device": "cpu", "batch_size": 1, "threads": 2, "p50_ms": p50, "p90_ms": p50 * 1.08}
        return {"name": name, "status": "ok", "latency": [timing], **kw}

    parent = entry("baseline", 1.0, size={"bytes": 100})
    codes = lambda e: {f["code"]: f["level"] for f in check(e, parent)}  # noqa: E731
    assert codes(entry("a", 1.02)) == {}  # within the 5% tolerance
    assert codes(entry("a2", 1.07)) == {}  # within the parent's own p90 (noise)
    assert codes(entry("a3", 2.0, **{"pass": "finetune"})) == {}  # same architecture: noise
    # one reading: no interval, so no error, only an unconfirmed warning
    one = check(entry("b", 1.5), parent)
    found = [(f["code"], f["level"], f["confirmed"]) for f in one]
    assert found == [("slower_than_parent", "warning", False)]
    assert "unconfirmed, 1 round" in one[0]["message"]
    fx = entry(
        "c",
        0.5,
        **{"pass": "quantize.static"},
        info={
            "mode": "fx",
            "graph": {"weight_layers": 6, "float_layers": ["head"], "standalone_batchnorms": 5},
        },
    )
    assert codes(fx) == {"float_layers": "warning", "unfused_batchnorm": "warning"}
    big = entry("d", 0.5, quantized=True, size={"bytes": 300})
    assert codes(big) == {"larger_than_parent": "warning"}
    flat = entry("baseline", 1.0, outputs={"spread": 2e-6, "mean_abs": 5.0, "samples": 64})
    assert {f["code"] for f in check(flat, None)} == {"degenerate_outputs"}
    tiny = entry("baseline", 1.0, outputs={"spread": 5e-11, "mean_abs": 3e-9, "samples": 64})
    assert check(tiny, None) == []  # small outputs that vary by 2% of their scale are not degenerate
    one_sample = entry("baseline", 1.0, outputs={"spread": None, "mean_abs": 1.0, "samples": 1})
    assert check(one_sample, None) == []
    nan = entry("x", 1.0, outputs={"spread": float("nan"), "mean_abs": 1.0, "samples": 64, "non_finite": 12})
    assert codes(nan) == {"non_finite_outputs": "error"}  # NaN is an error, never "degenerate"
    nan_cosine = entry("y", 1.0, accuracy={"cosine_similarity": float("nan")})
    assert codes(nan_cosine) == {"fidelity_collapsed": "error"}
    low = entry("e", 0.5, accuracy={"cosine_similarity": 0.5, "top1_agreement": 30.0})
    assert "top-1 agreement 30.0%" in check(low, parent)[0]["message"]
    assert "cosine 0.5000" in check(low, parent, task="features")[0]["message"]
    rescaled = entry("e2", 0.5, accuracy={"cosine_similarity": 0.85, "top1_agreement": 99.5})
    assert codes(rescaled) == {}  # a distilled classifier: logits rescaled, decisions the same
    meh = entry("f", 0.5, accuracy={"cosine_similarity": 0.98, "top1_agreement": 94.0})
    assert codes(meh) == {"fidelity_degraded": "warning"}
    emb = entry("f2", 0.5, accuracy={"cosine_similarity": 0.98})
    assert {f["code"] for f in check(emb, parent, task="features")} == {"fidelity_degraded"}
    assert codes(entry("g", 0.5, accuracy={"cosine_similarity": 0.999, "top1_agreement": 99.0})) == {}
    tuned = entry("h", 0.5, accuracy={"top1_drop": -0.5, "top1_agreement": 93.0, "cosine_similarity": 0.97})
    assert codes(tuned) == {}  # more accurate than the baseline: disagreeing is not a finding
    assert codes(entry("i", 0.5, accuracy={"top1_drop": 4.0, "top1_agreement": 90.0})) == {
        "fidelity_degraded": "warning"
    }
    # with labels, the top-1 rule runs whether or not fidelity was measured; 10+ points is an error
    assert codes(entry("j", 0.5, accuracy={"top1_drop": 88.3})) == {"fidelity_collapsed": "error"}
    assert codes(entry("k", 0.5, accuracy={"top1_drop": 3.0})) == {"fidelity_degraded": "warning"}
    # a variant meeting the recipe's explicit fidelity constraints only gets an info note
    noted = check(entry("l", 0.5, accuracy={"top1_agreement": 91.0}), parent, meets_constraints=True)
    assert [(f["code"], f["level"]) for f in noted] == [("fidelity_degraded", "info")]


def test_health_reads_paired_round_intervals() -> None:
    from torchtame.evaluate.health import check

    def entry(name, rounds, **kw):
        p50 = sorted(rounds)[len(rounds) // 2]
        timing = {"device": "cpu", "batch_size": 8, "threads": 2, "p50_ms": p50}
        timing.update(p90_ms=timing["p50_ms"] * 1.1, round_p50_ms=rounds, rounds=len(rounds))
        return {"name": name, "status": "ok", "latency": [timing], **kw}

    parent = entry("baseline", [1.0, 1.3, 0.9])
    codes = lambda e: {f["code"]: f["level"] for f in check(e, parent)}  # noqa: E731
    # the machine drifts, but every round the variant takes 1.5x its parent: confirmed, an error
    assert codes(entry("slow", [1.5, 1.95, 1.35])) == {"slower_than_parent": "error"}
    # slower in one round, faster in another: the interval spans 1, an info finding, no flag
    assert codes(entry("noise", [1.2, 1.1, 1.0])) == {"no_measurable_speedup": "info"}
    # two rounds only: confirmed slower is a warning, never an error
    short_parent = entry("baseline", [1.0, 1.0])
    assert {f["code"]: f["level"] for f in check(entry("c", [1.6, 1.7]), short_parent)} == {
        "slower_than_parent": "warning"
    }
    assert codes(entry("fast", [0.5, 0.65, 0.45])) == {}


def test_an_annotation_failure_names_the_node_and_the_layer() -> None:
    """When the X86 quantizer breaks on a graph, the error says where and which layer to keep float."""
    from torchtame.passes.static.pt2e import failing_node

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    gm = torch.export.export(model, (torch.randn(2, 4),)).module()

    def annotate(graph: torch.fx.Graph) -> None:  # a quantizer's loop over nodes, failing on one
        for node in graph.nodes:
            if node.name == "linear_1":
                raise IndexError("list index out of range")

    with pytest.raises(IndexError) as caught:
        annotate(gm.graph)
    where, module = failing_node(caught.value)
    assert "at node linear_1" in where and module == "2", (where, module)


def test_a_compiled_variants_last_short_batch_runs_on_the_full_batches_graph() -> None:
    """predict(fill_to=...) fills the last, smaller batch with its own samples, so a compiled
    variant compiles no graph for it; the outputs are those of the unfilled batches. An output
    whose first dimension is not the batch (sequence-first) runs the short batch as it is."""
    from torch.utils.data import DataLoader, TensorDataset

    from torchtame.evaluate.accuracy import predict

    x, y = torch.randn(10, 3), torch.arange(10)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    shapes: list[int] = []

    def run(b: torch.Tensor) -> torch.Tensor:
        shapes.append(b.shape[0])
        return b * 2

    outs, labels = predict(run, lambda b: b, loader, fill_to=4)
    assert shapes == [4, 4, 4] and torch.equal(outs, x * 2) and torch.equal(labels, y)
    shapes.clear()
    predict(lambda b: run(b).T, lambda b: b, loader, fill_to=4)  # (features, batch)
    assert shapes == [4, 4, 4, 2]  # the filled try, then the batch as it is
