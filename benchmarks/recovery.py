"""Accuracy recovery for post-training int8: each algorithm alone and combined, `recovery: auto`.

    .venv/bin/python benchmarks/recovery.py [--quick] [--iterations 200] [--results-dir D]

Models (random init: no weights can be downloaded here; BatchNorm statistics recalibrated on the
inputs, as benchmarks/int8_modes.py does): torchvision mobilenet_v2, timm tf_efficientnet_lite0
(Conv2dSame subclasses that pad in forward) and timm mobilenetv3_large_100, synthetic 3x224x224
images; timm vit_tiny_patch16_224 (64x64 inputs) through onnxruntime. With real weights: the
same three CNN architectures (10 classes) trained here on the digits upsampled to 3x64x64 (10
epochs; quantized, judged and timed at 64x64), and a mobilenet_v2
(width 0.5) trained on the 8x8 digits (benchmarks/compression.py's), evaluated on the digits'
evaluation split. Calibration and evaluation data are drawn apart.

Per CNN (quantize.static, mode pt2e, compiled with freezing):
- the weights-only floor: per-channel int8 weights (BatchNorms folded), float activations;
- plain static int8 (histogram calibration), and `recovery: auto`, whose trials (every
  combination it tried, scored on calibration batches held apart from the evaluation data) give
  each algorithm's gain alone and combined; auto's own time;
- onnxruntime static int8 with MinMax, Percentile and per-tensor range search;
- cosine and top-1 agreement with float on the evaluation images, and, for plain and recovered
  PT2E int8, speed at batch 8 against fp32 eager and fp32 compiled the same way (5 interleaved
  rounds, medians; the lowest and highest single-round speed-up in brackets).
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from common import (
    QUICK_ROUNDS,
    agreement,
    cosine,
    interleaved_rounds,
    medians,
    out_dir,
    parser,
    publish,
    ratio_ranges,
    synthetic,
    with_spread,
)
from torch import nn

from torchtame import apply_pass, load_data
from torchtame.inputs import select_output
from torchtame.onnx_runtime import run_session, session
from torchtame.passes import recovery
from torchtame.passes.adaround import weight_grid
from torchtame.runtime import compiled, pt2e_weight_range
from torchtame.training import recalibrate_batchnorm


def trained_digits_mobilenet() -> tuple[nn.Module, Any]:
    """Real weights and real inputs: mobilenet_v2 (width 0.5) trained here on the digits."""
    from torchtame.data import DigitsData
    from torchtame.training import train
    from torchtame.zoo import DigitsMobileNet

    data = load_data(DigitsData(source="digits", batch_size=64), 0)
    torch.manual_seed(0)
    model = DigitsMobileNet()
    train(model, data.train, epochs=10, lr=3e-3, seed=0)
    return model.eval(), data


def digits_at(size: int) -> Any:
    """scikit-learn's digits as 3-channel ``size`` x ``size`` images (bilinear upsampling, the
    gray channel repeated): real inputs the target architectures can be trained on here. Training
    batches of 64; calibration and evaluation batches of 16, so that ``recovery: auto`` fits on
    4 calibration batches and judges on the others."""
    from torch.utils.data import DataLoader, Subset, TensorDataset

    from torchtame.data import DataBundle
    from torchtame.data.bundle import Split, split_indices
    from torchtame.data.sources import digits_tensors

    x, y = digits_tensors()
    x = nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.repeat(1, 3, 1, 1)
    ds = TensorDataset(x, y)
    tr, ca, ev = split_indices(len(ds), Split(), 0)
    shuffle = torch.Generator().manual_seed(0)
    train = DataLoader(Subset(ds, tr), batch_size=64, shuffle=True, generator=shuffle)
    cal, held = (DataLoader(Subset(ds, i), batch_size=16) for i in (ca, ev))
    return DataBundle(train, cal, held, True, 10, (3, size, size), f"digits at {size}x{size}")


def trained_target(name: str, epochs: int = 10, size: int = 64) -> tuple[nn.Module, Any]:
    """A target architecture (10 classes) trained here on the digits at ``size`` x ``size``: real
    weights and real inputs, which random-weight models cannot give. (One more epoch at 224x224
    after 64x64 left mobilenetv3_large_100 at 30% top-1 at 224: these rows stay at 64x64.)"""
    import timm
    import torchvision

    from torchtame.training import train

    torch.manual_seed(0)
    if name == "mobilenet_v2":
        model = torchvision.models.mobilenet_v2(num_classes=10)
    else:
        model = timm.create_model(name, num_classes=10)
    data = digits_at(size)
    t0 = time.perf_counter()
    train(model, data.train, epochs=epochs, lr=3e-3, seed=0)
    print(f"{name}: trained on digits at {size}x{size} in {time.perf_counter() - t0:.0f} s", flush=True)
    return model.eval(), data


TARGETS = ("mobilenet_v2", "tf_efficientnet_lite0", "mobilenetv3_large_100")


def cnns(quick: bool) -> list[tuple[str, nn.Module, Any, bool]]:
    """(name, model, data, trained) per CNN; random-weight models get their BatchNorm statistics
    from the inputs."""
    import timm
    import torchvision

    if quick:  # a small ported EfficientNet-style net (Conv2d subclasses that pad in forward)
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.samepad import ported_net

        return [("ported-samepad-net (32x32)", ported_net(), synthetic([3, 32, 32], 48, 8), False)]
    out = []
    torch.manual_seed(0)
    out.append(
        ("mobilenet_v2", torchvision.models.mobilenet_v2().eval(), synthetic([3, 224, 224], 96, 8), False)
    )
    for name in TARGETS[1:]:
        torch.manual_seed(0)
        out.append((name, timm.create_model(name).eval(), synthetic([3, 224, 224], 96, 8), False))
    for name in TARGETS:
        out.append((f"{name}{TRAINED_AT}", *trained_target(name), True))
    out.append((TRAINED, *trained_digits_mobilenet(), True))
    return out


TRAINED = "mobilenet_v2 x0.5, trained here on digits"
TRAINED_AT = ", trained here on digits (3x64x64)"


def weights_only(model: nn.Module, example: Any) -> nn.Module:
    """Per-channel int8 weights on PT2E's grid (7-bit on CPUs without VNNI; BatchNorms folded
    first, as the back ends fold them), float activations: what weight rounding alone costs."""
    m = copy.deepcopy(model)
    recovery.fold_batchnorms(m, example)
    with torch.no_grad(), weight_grid(*[pt2e_weight_range()] * 2):
        for layer in m.modules():
            if isinstance(layer, recovery.WEIGHTED):
                layer.weight.copy_(recovery.fake_quant_weight(layer.weight))
    return m


def input_8bit(model: nn.Module, data: Any, held: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Float model, its input alone on the 8-bit grid of the calibration inputs' min/max (as
    static int8 quantizes the first layer's input): a bound on int8 wherever that layer is int8."""
    cal = torch.cat([x for x, _ in data.calibration])
    grid = recovery._fake_quant_input(cal.min().item(), cal.max().item())
    with torch.inference_mode():
        return _figures(ref, model(grid(model, (held,))[0]))


def _figures(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    return {"cosine": round(cosine(ref, out), 5), "agreement": round(agreement(ref, out), 2)}


def _onnx_rows(
    model: nn.Module,
    data: Any,
    variants: list[tuple[str, dict[str, Any]]],
    ref: torch.Tensor,
    held: torch.Tensor,
) -> dict[str, dict[str, Any]]:
    """quantize.onnx with each options: fidelity on ``held``, build time, what recovery chose."""
    rows = {}
    for label, options in variants:
        t0 = time.perf_counter()
        v = apply_pass("quantize.onnx", copy.deepcopy(model), data, options)
        sess = session(v.onnx_path, "cpu")
        out = torch.cat([select_output(run_session(sess, xb)).float() for xb in held.split(16)])
        rows[label] = {**_figures(ref, out), "build_s": round(time.perf_counter() - t0, 1)}
        rows[label]["reduce_range"] = v.info.get("reduce_range")
        if "recovery" in v.info:
            rows[label]["chosen"] = v.info["recovery"]["chosen"]
            rows[label]["trials"] = v.info["recovery"]["trials"]
        print(f"  {label}: {rows[label]['cosine']} / {rows[label]['agreement']}%", flush=True)
    return rows


def bench_cnn(
    name: str,
    model: nn.Module,
    data: Any,
    trained: bool,
    iterations: int,
    min_time: float,
    quick: bool = False,
) -> dict[str, Any]:
    if not trained:
        recalibrate_batchnorm(model, [x for x, _ in data.calibration])
    held = torch.cat([x for x, _ in data.evaluation])
    with torch.inference_mode():
        ref = model(held)
        floor = weights_only(model, data.example_input(8))(held)
    row: dict[str, Any] = {"model": name, "eval_images": len(held), "weights_only": _figures(ref, floor)}
    row["weights_only"]["grid"] = list(pt2e_weight_range())
    row["input_8bit"] = input_8bit(model, data, held, ref)
    print(f"{name}: weights-only int8 {row['weights_only']}", flush=True)
    built: dict[str, Any] = {}
    for label, options in (
        ("pt2e", {"mode": "pt2e"}),
        ("pt2e recovery auto", {"mode": "pt2e", "recovery": "auto", "adaround_iterations": iterations}),
    ):
        t0 = time.perf_counter()
        v = apply_pass("quantize.static", copy.deepcopy(model), data, options)
        seconds = round(time.perf_counter() - t0, 1)
        fn = compiled(v.module)
        with torch.inference_mode():
            fn(data.example_input(8))  # compile for the timed shape first
            out = torch.cat([fn(xb) for xb in held.split(8)])
        row[label] = {**_figures(ref, out), "build_s": seconds}
        if "recovery" in v.info:
            rec = v.info["recovery"]
            row[label]["chosen"] = rec["chosen"]
            row[label]["trials"] = rec["trials"]
            row[label]["float_stage"] = rec.get("float_stage")
            row[label]["kept_float"] = v.info.get("kept_float", [])
            row[label]["applied"] = [
                {k: r[k] for k in r if k in ("algorithm", "applied", "note", "methods", "backend_check")}
                for r in rec["applied"]
            ]
        built[label] = fn
        print(f"  {label}: {row[label]['cosine']} / {row[label]['agreement']}% ({seconds} s)", flush=True)
    onnx = [("onnx MinMax", {}), ("onnx range search", {"calibration_method": "RangeSearch"})]
    if not quick:  # (quick: onnxruntime's own calibration once, besides torchtame's range search)
        onnx.insert(1, ("onnx Percentile", {"calibration_method": "Percentile"}))
    rounds = QUICK_ROUNDS if quick else 5
    row.update(_onnx_rows(model, data, onnx, ref, held))
    fns = {"fp32 eager": model, "fp32 compiled": compiled(model), **built}
    with torch.inference_mode():
        fns["fp32 compiled"](data.example_input(8))
    per_round = interleaved_rounds(fns, data.example_input(8), rounds=rounds, min_time_s=min_time)
    row["rounds"] = rounds
    row["p50_ms"] = {k: round(v, 3) for k, v in medians(per_round).items()}
    row["ratio_ranges"] = ratio_ranges(per_round, ["fp32 eager", "fp32 compiled"])
    if name.endswith(TRAINED_AT) or name.startswith("ported"):  # (quick: so that this cannot rot)
        row["recipe_speed"] = recipe_speed(
            model, row, 48 if quick else 224, min_time, rounds=QUICK_ROUNDS if quick else 7
        )
    return row


RECIPE = "pt2e, same layers float"  # recipe_speed's row for what auto kept float


def recipe_speed(
    model: nn.Module, row: dict[str, Any], size: int, min_time: float, rounds: int = 7
) -> dict[str, Any]:
    """Speed at ``size`` x ``size`` (batch 8) of what ``recovery: auto`` chose on ``model`` (trained
    and judged at a smaller size; its convolutions and global pooling run at any size): plain PT2E
    int8 and PT2E with the same layers float, against fp32 eager and compiled, interleaved. The
    other recovery changes (equalization, bias correction, AdaRound) change weights, not the graph,
    so they cost no speed; the float layers do. Calibrated on synthetic images of that size (what
    the images show does not change the kernels' speed)."""
    kept = row["pt2e recovery auto"].get("kept_float", [])
    data = synthetic([3, size, size], 32, 8)
    x = data.example_input(8)
    fns: dict[str, Any] = {"fp32 eager": model, "fp32 compiled": compiled(model)}
    builds = [("pt2e", {"mode": "pt2e"})]
    if kept:
        builds.append((RECIPE, {"mode": "pt2e", "keep_float": kept}))
    graph = {}
    for label, options in builds:
        v = apply_pass("quantize.static", copy.deepcopy(model), data, options)
        graph[label] = f"{v.info['graph']['int8_layers']}/{v.info['graph']['weight_layers']}"
        fns[label] = compiled(v.module)
    with torch.inference_mode():
        for fn in fns.values():
            fn(x)  # compile for the timed shape first
    per_round = interleaved_rounds(fns, x, rounds=rounds, min_time_s=min_time)
    p50 = medians(per_round)
    print(f"  at {size}x{size}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in p50.items()), flush=True)
    label = builds[-1][0]
    # the speed-up in each round (paired): its spread is the machine's drift
    ranges = {ref: r[label] for ref, r in ratio_ranges(per_round, ["fp32 eager", "fp32 compiled"]).items()}
    out = {"size": size, "kept_float": kept, "int8_layers": graph, "rounds": rounds, "ratio_ranges": ranges}
    return {**out, "p50_ms": {k: round(v, 3) for k, v in p50.items()}}


def bench_vit(quick: bool) -> dict[str, Any]:
    import timm

    torch.manual_seed(0)
    size = 32 if quick else 64
    depth = {"depth": 1} if quick else {}
    model = timm.create_model("vit_tiny_patch16_224", img_size=size, **depth).eval()
    data = synthetic([3, size, size], 48 if quick else 96, 8)
    held = torch.cat([x for x, _ in data.evaluation])
    with torch.inference_mode():
        ref = model(held)
    name = f"vit_tiny_patch16_224 ({size}x{size}{', 1 block' if quick else ''})"
    row: dict[str, Any] = {"model": name, "eval_images": len(held)}
    variants = [("onnx MinMax", {}), ("onnx recovery auto", {"recovery": "auto"})]
    if not quick:
        variants.insert(1, ("onnx range search", {"calibration_method": "RangeSearch"}))
    row.update(_onnx_rows(model, data, variants, ref, held))
    return row


def _trial_text(trials: list[dict[str, Any]]) -> str:
    parts = []
    for t in trials:
        name = " + ".join(t["algorithms"]) or "none"
        if t.get("float_layers"):
            name += f" ({len(t['float_layers'])} float)"
        parts.append(
            f"{name} {t['cosine']:.4f}"
            if "cosine" in t
            else f"{name} {'not needed' if 'skipped' in t else 'failed'}"
        )
    return "; ".join(parts)


def _input_text(row: dict[str, Any]) -> str:
    if "input_8bit" not in row:  # runs before it was measured
        return ""
    return f", float with only its input on the 8-bit grid {row['input_8bit']['cosine']}"


def _recipe_ratios(row: dict[str, Any]) -> tuple[str, float, float]:
    """The recipe's int8 variant at the larger size and its speed-ups over fp32 eager / compiled."""
    p50 = row["recipe_speed"]["p50_ms"]
    label = RECIPE if RECIPE in p50 else "pt2e"
    return label, p50["fp32 eager"] / p50[label], p50["fp32 compiled"] / p50[label]


def _recipe_text(row: dict[str, Any], best: dict[str, Any]) -> str:
    if "recipe_speed" not in row:  # runs before it was measured
        return " (the speed target is for 224x224: the rows above)"
    size = row["recipe_speed"]["size"]
    _, eager, vs_compiled = _recipe_ratios(row)
    fast = eager >= 5 and vs_compiled > 1
    faithful = best["cosine"] >= 0.995 and best["agreement"] >= 95
    verdict = "met" if fast else "NOT met"
    spread = row["recipe_speed"].get("ratio_ranges")  # runs before it was recorded have none
    straddles = spread and (
        spread["fp32 eager"][0] < 5 <= spread["fp32 eager"][1]
        or spread["fp32 compiled"][0] <= 1 < spread["fp32 compiled"][1]
    )
    if straddles:
        verdict += ", within the rounds' spread of the line"
    return (
        f"; the same model at {size}x{size} with the same layers float: {eager:.2f}x fp32 eager, "
        f"{vs_compiled:.2f}x fp32 compiled -> speed {verdict} (>= 5x eager, faster than compiled); "
        f"both: {'met' if fast and faithful else 'NOT met'}"
    )


def _recipe_table(rows: list[dict[str, Any]]) -> list[str]:
    timed = [row for row in rows if "recipe_speed" in row]
    if not timed:
        return []
    out = [
        "",
        "Speed of what `recovery: auto` chose, at the target's size: the models trained here (above) "
        "run at 224x224 (their convolutions and global pooling take any size), batch 8, as plain PT2E "
        "int8 and with the layers auto kept float; its other changes (equalization, bias correction, "
        "AdaRound) move weights, not the graph, so they cost no speed. Calibrated on synthetic images "
        "of that size; medians of interleaved rounds"
        + (
            " (in brackets: the lowest and highest speed-up of a single round, paired):"
            if any("ratio_ranges" in row["recipe_speed"] for row in timed)
            else ":"
        ),
        "",
        "| model | size | float layers | int8 layers | fp32 eager ms | fp32 compiled ms | pt2e ms "
        "| recipe ms | recipe vs fp32 eager | recipe vs fp32 compiled |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in timed:
        r = row["recipe_speed"]
        p50 = r["p50_ms"]
        label, eager, vs_compiled = _recipe_ratios(row)
        cells = [
            row["model"],
            f"{r['size']}x{r['size']}",
            ", ".join(r["kept_float"]) or "none",
            r["int8_layers"][label],
            f"{p50['fp32 eager']:.2f}",
            f"{p50['fp32 compiled']:.2f}",
            f"{p50['pt2e']:.2f}",
            f"{p50[label]:.2f}",
            with_spread(eager, r.get("ratio_ranges", {}).get("fp32 eager")),
            with_spread(vs_compiled, r.get("ratio_ranges", {}).get("fp32 compiled")),
        ]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def render(data: dict[str, Any]) -> list[str]:
    trained = any(row["model"].endswith(TRAINED_AT) for row in data["rows"])
    floors = [
        row["weights_only"]["cosine"]
        for row in data["rows"]
        if "weights_only" in row and not row["model"].endswith(TRAINED_AT) and row["model"] != TRAINED
    ]
    floor = f"{min(floors)}-{max(floors)}" if floors else "-"
    lines = [
        "Post-training int8 with and without accuracy recovery. Cosine and top-1 agreement with "
        "float are on evaluation images drawn apart from calibration; `recovery: auto` scores each "
        "combination it tries on calibration batches held apart from the evaluation data and, where "
        "the calibration split has more than the algorithms read, apart from those too (those "
        "trial figures are listed per model: each algorithm's gain alone and combined). The "
        "weights-only row (per-channel int8 weights, float activations) is the floor of what weight "
        "rounding alone costs. Random-weight models: BatchNorm statistics recalibrated on the inputs; "
        f"their weights-only floor (cosine {floor}) is below the 0.995 target"
        + (
            ", so the same architectures are also trained here on the digits (upsampled to 3x64x64, "
            "10 epochs) and quantized, judged and timed at 64x64 on the digits' evaluation split "
            "(their speed-ups at 64x64 are not the 224x224 target's"
            + (
                "; the table after the trials times the same models at 224x224)."
                if any("recipe_speed" in row for row in data["rows"])
                else ")."
            )
            if trained
            else " (this run predates the rows of the same architectures trained here)."
        )
        + " `(k float)`: the best of the first two stages with its k most quantization-sensitive "
        "layers kept float (auto's third stage, tried only while its cosine falls short of "
        "float_target). onnx rows not marked `(7-bit weights)` quantized weights to 8 bits, which "
        "onnxruntime's u8 x s8 kernels saturate on a CPU without VNNI (quantize.onnx's "
        "`reduce_range` now defaults to 7 bits there). "
        + (
            "This machine has no VNNI: PT2E quantized weights to 7 bits (-64..63) with 8-bit "
            "activations, and the floor is on that grid."
            if "no VNNI" in str(data.get("meta", {}).get("machine", ""))
            else "PT2E: 8-bit weights and activations."
        )
        + (
            f" Speed-ups: median p50s of {data['rows'][0].get('rounds', 5)} interleaved rounds; in "
            "brackets the lowest and highest single-round speed-up (paired by round: the machine's drift)."
            if any("ratio_ranges" in row for row in data["rows"])
            else ""
        ),
        *(
            [
                "",
                "The `float, input on the 8-bit grid` rows are the float model with only its input "
                "image on the 8-bit grid of the calibration images' range, as static int8 quantizes "
                "the first layer's input: where that alone falls short of 0.995, no int8 model with "
                "an int8 first layer meets the target (the digits are 8x8 images upsampled, so their "
                "pixels are not on an 8-bit grid as a camera's are).",
            ]
            if any("input_8bit" in row for row in data["rows"])
            else []
        ),
        "",
        "| model | variant | cosine | agreement % | build s | b8 p50 ms | vs fp32 eager | vs fp32 compiled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for row in data["rows"]:
        p50 = row.get("p50_ms", {})
        spread = row.get("ratio_ranges", {})  # runs before it was recorded have none
        vs_eager, vs_comp = spread.get("fp32 eager", {}), spread.get("fp32 compiled", {})
        for key in ("fp32 eager", "fp32 compiled"):
            if key in p50:
                eager = with_spread(p50["fp32 eager"] / p50[key], vs_eager.get(key))
                lines.append(f"| {row['model']} | {key} | 1 | 100 | - | {p50[key]:.2f} | {eager} | - |")
        if "weights_only" in row:
            w = row["weights_only"]
            bits = " (7-bit weights)" if w.get("grid", [-128])[0] == -64 else ""
            floor = f"| {row['model']} | int8 weights only (floor){bits} | {w['cosine']} | {w['agreement']}"
            lines.append(floor + " | - | - | - | - |")
        if "input_8bit" in row:
            i = row["input_8bit"]
            lines.append(
                f"| {row['model']} | float, input on the 8-bit grid | {i['cosine']} | {i['agreement']}"
                + " | - | - | - | - |"
            )
        for label, r in row.items():
            if not isinstance(r, dict) or "cosine" not in r or label in ("weights_only", "input_8bit"):
                continue
            speed = ["-", "-", "-"]
            if label in p50:
                speed = [
                    f"{p50[label]:.2f}",
                    with_spread(p50["fp32 eager"] / p50[label], vs_eager.get(label)),
                    with_spread(p50["fp32 compiled"] / p50[label], vs_comp.get(label)),
                ]
            shown = label + (f" (chose {' + '.join(r['chosen']) or 'none'})" if "chosen" in r else "")
            if label.startswith("onnx") and r.get("reduce_range"):
                shown += " (7-bit weights)"
            if r.get("kept_float"):
                shown += f"; float: {', '.join(r['kept_float'])}"
            cells = [row["model"], shown, r["cosine"], r["agreement"], r["build_s"], *speed]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
            if "trials" in r:
                notes.append(f"- {row['model']}, {label}: {_trial_text(r['trials'])}")
    lines += ["", "What `recovery: auto` tried (cosine on held-apart calibration batches):", "", *notes]
    lines += _recipe_table(data["rows"])
    lines += ["", "Targets:", ""]
    for row in data["rows"]:
        best = row.get("pt2e recovery auto")
        if best is None:
            auto = row.get("onnx recovery auto") or {}
            ok = auto.get("cosine", 0) >= 0.99
            lines.append(
                f"- {row['model']}: onnxruntime int8 with recovery auto, cosine {auto.get('cosine')} "
                f"-> {'met' if ok else 'NOT met'} (cosine >= 0.99)"
            )
            continue
        p50 = row["p50_ms"]
        eager = p50["fp32 eager"] / p50["pt2e recovery auto"]
        vs_compiled = p50["fp32 compiled"] / p50["pt2e recovery auto"]
        ok = best["cosine"] >= 0.995 and best["agreement"] >= 95 and eager >= 5 and vs_compiled > 1
        if row["model"].endswith(TRAINED_AT):  # a target architecture with real weights (digits)
            lines.append(
                f"- {row['model']}: recovered static int8 cosine {best['cosine']}, agreement "
                f"{best['agreement']}% (plain int8 {row['pt2e']['cosine']} / {row['pt2e']['agreement']}%, "
                f"weights-only floor {row['weights_only']['cosine']}{_input_text(row)}) -> fidelity "
                f"{'met' if best['cosine'] >= 0.995 and best['agreement'] >= 95 else 'NOT met'} "
                f"(cosine >= 0.995, agreement >= 95%); at 64x64 b8 {eager:.2f}x fp32 eager, "
                f"{vs_compiled:.2f}x fp32 compiled{_recipe_text(row, best)}"
            )
            continue
        if row["model"] == TRAINED:  # not one of the target models: real weights, for comparison
            lines.append(
                f"- {row['model']} (real weights, not a target model): recovered static int8 cosine "
                f"{best['cosine']}, agreement {best['agreement']}% (plain int8 "
                f"{row['pt2e']['cosine']} / {row['pt2e']['agreement']}%), {eager:.2f}x fp32 eager"
            )
            continue
        lines.append(
            f"- {row['model']}: recovered static int8 cosine {best['cosine']}, agreement "
            f"{best['agreement']}%, {eager:.2f}x fp32 eager, {vs_compiled:.2f}x fp32 compiled -> "
            f"{'met' if ok else 'NOT met'} (cosine >= 0.995, agreement >= 95%, >= 5x eager, "
            "faster than compiled)"
        )
    return lines


def main() -> None:
    ap = parser(__doc__, "mobilenet_v2 at 32x32 and a 32x32 ViT, 10 AdaRound steps, short timings")
    ap.add_argument("--iterations", type=int, default=100, help="AdaRound steps per layer")
    ap.add_argument("--min-time", type=float, default=0.5)
    args = ap.parse_args()
    if args.quick:
        args.iterations, args.min_time = 10, 0.05
    out = out_dir(args)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    rows = [
        bench_cnn(name, m, d, t, args.iterations, args.min_time, args.quick)
        for name, m, d, t in cnns(args.quick)
    ]
    rows.append(bench_vit(args.quick))
    command = "python benchmarks/recovery.py" + (" --quick" if args.quick else "")
    if not args.quick and args.iterations != 100:
        command += f" --iterations {args.iterations}"
    figures = {"rows": rows, "adaround_iterations": args.iterations}
    publish(out, "recovery", "Int8 accuracy recovery", command, time.perf_counter() - t0, figures, render)


if __name__ == "__main__":
    main()
