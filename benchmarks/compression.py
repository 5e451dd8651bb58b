"""Training-time compression: weight sparsity, quantization-aware training, attention-head pruning.

    .venv/bin/python benchmarks/compression.py [--steps 240] [--quick] [--results-dir D]

1. Sparsity, digits CNN (`recipes/digits-sparse.yaml`): 50% unstructured and 2:4, each fine-tuned
   with its zeros kept, and sparse then int8: top-1, sizes (dense file, sparse format, xz) and the
   CPU speed-up with its interval (dense kernels: none is expected).
   Sparsity, torchvision resnet18 (random init, synthetic 3x64x64 inputs, no labels): 50%
   unstructured and 2:4, distilled from the dense model; cosine on held-apart inputs.
2. QAT, torchvision mobilenet_v2 (random init, BatchNorm statistics recalibrated, synthetic 3x32x32
   inputs): post-training int8 (FX, the static engine) against QAT (FX, distillation from float, no
   labels); the
   share of the cosine gap QAT closes, and its training time. And a mobilenet_v2 (width 0.5)
   trained on the digits, whose post-training int8 loses top-1 agreement: PTQ against QAT, FX
   (the static engine: onednn with VNNI, x86 without; and torch.ao's x86 engine, 7-bit weights) and
   PT2E, and FX with
   per-tensor weights, with learned and with calibrated activation scales,
   3 and 20 epochs, and how close each int8 model is to the fake-quantized one QAT trained.
3. Heads, timm vit_tiny_patch16_224 and torchvision vit_b_16 (random init, 64x64 inputs: 16
   patches), 25% of heads pruned (the target), and 25% of heads and FFN channels, the Linears after
   them refitted by least squares, distilled on a train split of fresh draws; MACs, speed at batch 8
   (interleaved rounds), cosine on held-apart inputs without and with the refit and after
   distillation, ONNX export parity.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml
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

import torchtame
from torchtame import apply_pass, load_data
from torchtame.training import recalibrate_batchnorm
from torchtame.zoo import DigitsMobileNet

ROOT = Path(__file__).resolve().parents[1]
# Random-weight models (resnet18, mobilenet_v2, the ViTs) give nearly flat class scores, which the
# softened KL barely moves: they are distilled on the scores themselves (what cosine measures).
LOGITS_LOSS = "cosine"
# Distillation's lr for a ViT of width 192 (vit_tiny), scaled down with width (Adam moves every
# weight by about lr a step whatever its scale): on vit_b_16 (width 768), heads pruned and refitted
# (cosine 0.889), 240 steps at 1e-4 reached 0.893, 120 at 1e-5 0.902 and 3e-5 0.901; on vit_tiny
# (0.948), 240 steps at 1e-5 0.975, 3e-5 0.986, 1e-4 0.988
VIT_LR = 1e-4
VIT_LR_WIDTH = 192
# ... and on the attention outputs too (finetune's `intermediate`): on vit_b_16, 120 steps at
# 2.5e-5, logits alone 0.899, + every block's output 0.900, + every attention's output 0.905
VIT_INTERMEDIATE = "attention"


def digits_sparse(quick: bool) -> dict[str, Any]:
    raw = yaml.safe_load((ROOT / "recipes" / "digits-sparse.yaml").read_text())
    raw["output_dir"] = tempfile.mkdtemp(prefix="torchtame-bench-")
    if quick:  # the recipe's path on a narrower model, one epoch each, two rounds at batch 64
        raw["model"].update(kwargs={"width": 8, "hidden": 64}, train={"epochs": 2, "lr": 0.003})
        for step in raw["steps"]:
            for key in ("finetune", "finetune_between"):
                if key in step["options"]:
                    step["options"][key]["epochs"] = 1
        raw["evaluate"]["latency"].update(
            batch_sizes=[64], warmup=2, min_time_s=0.02, min_runs=5, rounds=QUICK_ROUNDS
        )
    res = torchtame.run(torchtame.load_recipe(raw)).results
    rows = []
    for v in res["variants"]:
        b64 = next((m for m in v["latency"] if m["batch_size"] == 64), {})
        rows.append(
            {
                "variant": v["name"],
                "top1": v["accuracy"]["top1"],
                "bytes": v["size"]["bytes"],
                "sparse_format_bytes": v["size"].get("sparse_format_bytes"),
                "compressed_bytes": v["size"].get("compressed_bytes"),
                "sparsity": (v.get("info") or {}).get("sparsity"),
                "speedup_b64": b64.get("speedup"),
                "speedup_b64_low": b64.get("speedup_low"),
                "speedup_b64_high": b64.get("speedup_high"),
                "findings": [f["code"] for f in v.get("health", [])],
            }
        )
    return {"rows": rows}


def resnet18_sparse(steps: int, quick: bool) -> dict[str, Any]:
    import torchvision

    data = synthetic([3, 32, 32] if quick else [3, 64, 64], 48 if quick else 512, 16 if quick else 32)
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    held = torch.cat([x for x, _ in data.evaluation])
    out = {}
    for name, options in (("unstructured 50%", {"sparsity": 0.5}), ("2:4", {"pattern": "2:4"})):
        train = {"loss": "distill", "steps": steps, "lr": 1e-3, "logits_loss": LOGITS_LOSS}
        t0 = time.perf_counter()
        plain = apply_pass("prune.sparse", model, data, options, task="classification")
        tuned = apply_pass("prune.sparse", model, data, {**options, "finetune": train}, task="classification")
        with torch.inference_mode():
            ref = model(held)
            out[name] = {
                "cosine_before": round(cosine(ref, plain.module(held)), 4),
                "cosine_after": round(cosine(ref, tuned.module(held)), 4),
                "sparsity": tuned.info["sparsity"],
                "steps": steps,
                "seconds": round(time.perf_counter() - t0, 1),
            }
    return out


def mobilenet_qat(steps: int, quick: bool) -> dict[str, Any]:
    import torchvision

    # a train split of fresh draws, one pass: QAT never trains on the batches that calibrate or
    # score its curve (without one, distillation trains on the calibration split)
    data = synthetic([3, 32, 32], 128 if quick else 512, 32, train=32 * steps)
    torch.manual_seed(0)
    model = torchvision.models.mobilenet_v2(num_classes=10).eval()
    recalibrate_batchnorm(model, [x for x, _ in data.calibration])
    held = torch.cat([x for x, _ in data.evaluation])
    ptq = apply_pass("quantize.static", model, data, {"mode": "fx"})
    t0 = time.perf_counter()
    qat = apply_pass("quantize.qat", model, data, {"mode": "fx", "steps": steps, "logits_loss": LOGITS_LOSS})
    seconds = time.perf_counter() - t0
    with torch.inference_mode():
        ref = model(held)
        before, after = cosine(ref, ptq.module(held)), cosine(ref, qat.module(held))
    return {
        "ptq_cosine": round(before, 4),
        "qat_cosine": round(after, 4),
        "gap_closed": round((after - before) / max(1e-9, 1 - before), 3),
        "steps": steps,
        "seconds": round(seconds, 1),
        "int8_vs_trained_cosine": qat.info["int8_vs_trained_cosine"],
        "backend": qat.info["backend"],
        "weight_bits": _bits(qat.info["weight_grid"]),
        "curve": qat.info["curve"],
    }


def _bits(grid: list[int]) -> int:
    """7 or 8: the weight grid a QAT variant's int8 kernels took (``info.weight_grid``)."""
    return 7 if grid[1] - grid[0] < 200 else 8


def digits_mobilenet_qat(quick: bool) -> dict[str, Any]:
    """A trained depthwise CNN whose post-training int8 loses top-1 agreement: PTQ against QAT
    (defaults: 3 epochs, distilled from float without labels), each mode (FX: eager int8 kernels
    of the static engine, onednn with VNNI, x86 without; PT2E: what `mode: auto`
    builds), on the evaluation split."""
    from torchtame.data import DigitsData
    from torchtame.training import train

    data = load_data(DigitsData(source="digits", batch_size=64), 0)
    torch.manual_seed(0)
    model = DigitsMobileNet()
    train(model, data.train, epochs=1 if quick else 10, lr=3e-3, seed=0)
    model.eval()
    x = torch.cat([b for b, _ in data.evaluation])
    out: dict[str, Any] = {}
    # per-tensor weights (one scale per layer, as many NPUs and older int8 kernels want): the
    # depthwise layers' ranges differ most between channels, so post-training int8 loses most
    per_tensor = {"weight_granularity": "per_tensor"}
    # each row: (post-training int8 options, what QAT changes from its defaults: 3 epochs,
    # activation scales learned from the calibrated ones). FX runs on the static engine (onednn,
    # 8-bit weights, on CPUs with VNNI; x86 without); the x86 rows use torch.ao's x86 engine, whose
    # kernels need 7-bit weights on every CPU. "calibrated ranges" rows keep the
    # calibrated scales (`learn_ranges: false`), to show what learning them gives; the 20-epoch
    # rows use more of the 2 minutes of training the target allows, on mixed pairs of digits that
    # teacher and student both see (`mixup: 1.0`)
    longer = {"epochs": 20, "lr": 3e-5, "mixup": 1.0}
    fixed = {"learn_ranges": False}
    x86 = {"mode": "fx", "backend": "x86"}
    modes = {
        "fx": ({"mode": "fx"}, {}),
        "fx, calibrated ranges": ({"mode": "fx"}, fixed),
        "fx per-tensor": ({"mode": "fx", **per_tensor}, {}),
        "pt2e": ({"mode": "pt2e"}, {}),
        "fx x86": (x86, {}),
        "fx x86, calibrated ranges": (x86, fixed),
        "fx x86, 20 epochs, mixup": (x86, longer),
        "fx x86 per-tensor": ({**x86, **per_tensor}, {}),
        "fx x86 per-tensor, 20 epochs, mixup": ({**x86, **per_tensor}, longer),
        "fx x86 per-tensor, 20 epochs, mixup, calibrated ranges": (
            {**x86, **per_tensor},
            {**longer, **fixed},
        ),
    }
    ptqs: dict[str, Any] = {}
    for mode, (backend, extra) in modes.items():
        if quick and mode != "fx x86, 20 epochs, mixup":  # quick: one row; the modes are in tests/test_qat.py
            continue
        key = str(sorted(backend.items()))  # rows of one mode share its post-training int8
        if key not in ptqs:
            ptqs[key] = apply_pass("quantize.static", model, data, backend)
        ptq = ptqs[key]
        options = {**backend, "epochs": 3, **extra} | ({"epochs": 1} if quick else {})
        t0 = time.perf_counter()
        qat = apply_pass("quantize.qat", model, data, options)
        seconds = time.perf_counter() - t0
        with torch.inference_mode():
            ref, a, b = model(x), ptq.module(x), qat.module(x)
        pc, qc, pa, qa = cosine(ref, a), cosine(ref, b), agreement(ref, a), agreement(ref, b)
        out[mode] = {
            "ptq_cosine": round(pc, 5),
            "qat_cosine": round(qc, 5),
            "ptq_agreement": round(pa, 2),
            "qat_agreement": round(qa, 2),
            "gap_closed": round((qa - pa) / max(1e-9, 100 - pa), 3),
            "cosine_gap_closed": round((qc - pc) / max(1e-9, 1 - pc), 3),
            "int8_vs_trained_cosine": qat.info["int8_vs_trained_cosine"],
            "backend": qat.info["backend"],
            "weight_bits": _bits(qat.info["weight_grid"]),
            "epochs": options["epochs"],
            "learned_ranges": qat.info.get("learned_ranges"),
            "samples": len(x),
            "seconds": round(seconds, 1),
            "curve": qat.info["curve"],
        }
    return out


def _vit(which: str, quick: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if which == "timm vit_tiny_patch16_224":
        import timm

        # quick: 2 of its 12 blocks (the same layout; its ONNX export alone took 12 s of 21)
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=64, **({"depth": 2} if quick else {})
        ).eval()
    import torchvision

    model = torchvision.models.vit_b_16(image_size=64).eval()
    nn.init.normal_(model.heads.head.weight, std=0.02)  # torchvision starts the head at zero
    return model


# what is pruned: 25% of the heads of every attention layer (the target), and 25% of the heads and
# FFN channels alike
PRUNINGS = {"heads": {"ratio": 0, "head_ratio": 0.25}, "heads + FFN": {"ratio": 0.25}}


def vit_heads(steps: int, quick: bool) -> dict[str, Any]:
    # a train split of fresh draws, one pass: distillation never trains on the batches the refit
    # was fitted on and finetune's keep_best judges by (the calibration split)
    data = synthetic([3, 64, 64], 32 if quick else 256, 16, train=16 * steps)
    held = torch.cat([x for x, _ in data.evaluation])
    out = {}
    models = (
        ("timm vit_tiny_patch16_224",) if quick else ("timm vit_tiny_patch16_224", "torchvision vit_b_16")
    )
    for which in models:
        model = _vit(which, quick)
        with torch.inference_mode():
            ref = model(held)
        for what, options in PRUNINGS.items():
            if quick and what != "heads":
                continue
            name = f"{which} (2 blocks)" if quick else which  # quick: the shortened model
            out[f"{name}, {what}"] = _vit_row(model, ref, data, options, steps, quick)
    return out


def _vit_row(
    model: nn.Module, ref: torch.Tensor, data: Any, options: dict[str, Any], steps: int, quick: bool
) -> dict[str, Any]:
    """One pruning of one ViT: without and with the refit, then distilled; MACs, speed, ONNX."""
    held = torch.cat([x for x, _ in data.evaluation])
    raw = apply_pass(
        "prune.structured", model, data, {**options, "reconstruct": False}, task="classification"
    )
    pruned = apply_pass("prune.structured", model, data, options, task="classification")
    width = getattr(model, "embed_dim", None) or model.hidden_dim  # timm, torchvision
    lr = VIT_LR * VIT_LR_WIDTH / width
    train = {
        "loss": "distill",
        "steps": steps,
        "lr": lr,
        "logits_loss": LOGITS_LOSS,
        "intermediate": VIT_INTERMEDIATE,
    }
    t0 = time.perf_counter()
    tuned = apply_pass("finetune", pruned, data, train, baseline=model, task="classification")
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        onnx = apply_pass("export.onnx", tuned.module, data, work_dir=Path(tmp))
    per_round = interleaved_rounds(
        {"fp32": model, "pruned": tuned.module},
        held[:8],
        rounds=QUICK_ROUNDS if quick else 5,
        min_time_s=0.1 if quick else 1.0,
    )
    p50 = medians(per_round)
    with torch.inference_mode():
        return {
            "pruning": options,
            "heads": next(iter(pruned.info["attention_heads"].values())),
            "macs_fraction": pruned.info["macs_fraction"],
            "cosine_no_refit": round(cosine(ref, raw.module(held)), 4),
            "cosine_pruned": round(cosine(ref, pruned.module(held)), 4),
            "refit_seconds": pruned.info["reconstruction"]["seconds"],
            "cosine_distilled": round(cosine(ref, tuned.module(held)), 4),
            "steps": steps,
            "lr": lr,
            "intermediate": VIT_INTERMEDIATE,
            "distill_seconds": round(seconds, 1),
            "kept_epoch": tuned.info.get("kept_epoch"),
            "speedup_b8": round(p50["fp32"] / p50["pruned"], 2),
            "speedup_b8_range": ratio_ranges(per_round, ["fp32"])["fp32"]["pruned"],
            "rounds": len(per_round["fp32"]),
            "onnx_max_abs_error": onnx.info["parity"]["max_abs_error"],
        }


def _grid(row: dict[str, Any]) -> str:
    return f", {row['weight_bits']}-bit weights" if "weight_bits" in row else ""


def _engines(rows: dict[str, Any]) -> str:
    """What the digits QAT rows' engines were on the machine that ran them (from the JSON)."""
    fx, x86 = rows.get("fx", {}), rows.get("fx x86", {})
    if "backend" not in fx:  # a run before rows recorded their engine (a CPU with VNNI)
        return (
            "fx: the onednn engine (the default on x86 CPUs, 8-bit activations); fx x86: torch.ao's x86 "
            "engine (`backend: x86`, 7-bit activations), where post-training int8 loses more"
        )
    out = f"fx: the default static engine, {fx['backend']} on this machine{_grid(fx)}"
    if x86:
        out += f"; fx x86: torch.ao's x86 engine (`backend: x86`{_grid(x86)})"
    return out + "; activations 8-bit"


def _vit_name(key: str) -> str:
    return key.split(", ")[0]


def _pruned(key: str) -> str:
    """What a heads row pruned (results before the heads-only rows: heads and FFN channels)."""
    return key.split(", ", 1)[1] if ", " in key else "heads + FFN"


def _heads_intro(h: dict[str, Any]) -> list[str]:
    first = next(iter(h.values()))
    if "lr" not in first:  # results before the heads-only rows and the train split
        return [
            "Heads (25% of heads and FFN channels pruned; the Linears after them refitted by least "
            "squares on calibration batches (`reconstruct`); then distilled at lr 1e-4 on the "
            "calibration inputs; 64x64 inputs, batch 8):"
        ]
    return [
        "Heads (random init, 64x64 inputs, batch 8"
        + (
            f"; speed-up: median of {first.get('rounds', 5)} interleaved rounds, lowest and highest round "
            "in brackets"
            if any("speedup_b8_range" in v for v in h.values())
            else ""
        )
        + "): 25% of the heads of every attention layer pruned "
        "(heads; the target), or 25% of heads and FFN channels alike (heads + FFN); the Linears after "
        "them refitted by least squares on calibration batches (`reconstruct`); then distilled from "
        f"the unpruned model for {first['steps']} steps on a train split of fresh draws at lr "
        + ", ".join(sorted({f"{v['lr']:g} ({_vit_name(k)})" for k, v in h.items()}))
        + " (1e-4 at width 192, scaled down with the width: Adam moves every weight by about lr a "
        "step), one pass"
        + (
            ", on the class scores and every attention module's output "
            f"(`intermediate: {first['intermediate']}`)"
            if first.get("intermediate", "none") != "none"
            else ""
        )
        + "; cosine on held-apart inputs:"
    ]


def _mb(v: int | None) -> str:
    return "-" if v is None else f"{v / 1e6:.3f}"


def _int8_vs_trained(row: dict[str, Any]) -> str:
    value = row.get("int8_vs_trained_cosine")
    return "." if value is None else f"; int8 against the model QAT trained: {value:.4f}."


def _scales(moved: dict[str, Any] | None) -> str:
    """Learned over calibrated activation scales, median [min, max] ("-": not learned)."""
    if not moved or not moved.get("tensors"):
        return "-"
    return (
        f"{moved['scale_ratio_median']:.2f} [{moved['scale_ratio_min']:.2f}, {moved['scale_ratio_max']:.2f}]"
    )


MIN_SAMPLES_MOVED = 10  # fewer samples between PTQ's and QAT's agreement is too few to judge by


def _differing(v: dict[str, Any]) -> tuple[int, int] | None:
    """How many samples' top-1 differs from float before and after QAT (None: not recorded)."""
    if "samples" not in v:
        return None
    n = v["samples"]
    before, after = (round(n * (100 - v[k]) / 100) for k in ("ptq_agreement", "qat_agreement"))
    return before, after


def _closed(v: dict[str, Any]) -> float:
    """The share of the gap QAT closed: cosine's, or agreement's where enough samples moved."""
    counts = _differing(v)
    enough = counts is None or abs(counts[0] - counts[1]) >= MIN_SAMPLES_MOVED
    return max(v["gap_closed"] if enough else 0.0, v.get("cosine_gap_closed", 0))


def _disagreeing(v: dict[str, Any]) -> str:
    """The counts behind the agreement gap (small counts: read the gap with them)."""
    counts = _differing(v)
    return (
        "" if counts is None else f": {counts[0]} -> {counts[1]} of {v['samples']} samples differ from float"
    )


def render(data: dict[str, Any]) -> list[str]:
    d, r, q, h = data["digits"], data["resnet18"], data["qat"], data["heads"]
    g = data["qat_digits"]
    g = {"fx": g} if "ptq_cosine" in g else g  # results before the PT2E row: one unnamed row
    lines = [
        "Digits CNN (`recipes/digits-sparse.yaml`; speed-up at batch 64 against fp32 on the CPU, with "
        "its 95% interval over paired rounds):",
        "",
        "| variant | top-1 % | MB saved | MB sparse format | MB xz | x fp32 (sparse format) | speed-up b64 "
        "| findings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = d["rows"][0]["bytes"]
    for row in d["rows"]:
        small = row["sparse_format_bytes"] or row["bytes"]
        speed = (
            f"{row['speedup_b64']:.2f}x [{row['speedup_b64_low']:.2f}, {row['speedup_b64_high']:.2f}]"
            if row["speedup_b64_low"] is not None
            else "1.00x"
        )
        lines.append(
            f"| {row['variant']} | {row['top1']:.2f} | {_mb(row['bytes'])} "
            f"| {_mb(row['sparse_format_bytes'])} | {_mb(row['compressed_bytes'])} | {base / small:.1f} "
            f"| {speed} | {', '.join(row['findings']) or '-'} |"
        )
    lines += [
        "",
        "resnet18 (random init, synthetic inputs, no labels), distilled from the dense model "
        f"(`logits_loss: {data.get('logits_loss', 'kl')}`, as the random-weight QAT and ViT rows below: "
        "their class scores are nearly flat):",
        "",
    ]
    lines += ["| sparsity | cosine before | cosine after distillation | steps | s |", "|---|---|---|---|---|"]
    lines += [
        f"| {k} ({v['sparsity']:.0%}) | {v['cosine_before']:.4f} | {v['cosine_after']:.4f} | {v['steps']} "
        f"| {v['seconds']:.0f} |"
        for k, v in r.items()
    ]
    lines += [
        "",
        "QAT, mobilenet_v2 (random init, synthetic 3x32x32): post-training int8 "
        f"(FX, {q.get('backend', 'onednn')}{_grid(q)}) cosine {q['ptq_cosine']:.4f}; "
        f"QAT (FX, {q['steps']} steps distilled from float on a train split of fresh draws, no labels, "
        f"{q['seconds']:.0f} s) {q['qat_cosine']:.4f}: {q['gap_closed']:.0%} of the gap to 1 closed"
        + _int8_vs_trained(q),
        "",
        "QAT, mobilenet_v2 (width 0.5) trained on the digits (upsampled to 32x32), evaluation split; "
        "QAT with its defaults (3 epochs at lr 1e-5 distilled from float, no labels, activation scales "
        "learned from the calibrated ones at range_lr 1e-2) unless the row says otherwise; calibrated "
        "ranges: `learn_ranges: false`; the 20-epoch rows train at lr 3e-5 on mixed pairs of digits that "
        "teacher and student both see (`mixup: 1.0`); s: the whole QAT pass, calibration and conversion "
        "included; scales: learned over calibrated activation scale, median [min, max]; " + _engines(g) + ":",
        "",
        "| mode | epochs | PTQ agreement % | QAT agreement % | PTQ cosine | QAT cosine "
        "| agreement gap closed | cosine gap closed | int8 vs trained | scales | s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {mode} | {v.get('epochs', 3)} | {v['ptq_agreement']:.2f} | {v['qat_agreement']:.2f} "
        f"| {v['ptq_cosine']:.4f} "
        f"| {v['qat_cosine']:.4f} | {v['gap_closed']:.0%} | {v.get('cosine_gap_closed', 0):.0%} "
        f"| {v.get('int8_vs_trained_cosine', 0):.5f} | {_scales(v.get('learned_ranges'))} "
        f"| {v['seconds']:.0f} |"
        for mode, v in g.items()
    ]
    lines += [
        "",
        *_heads_intro(h),
        "",
    ]
    both = any("pruning" in v for v in h.values())  # runs before the heads-only rows had no column
    lines += [
        "| model |" + (" pruned |" if both else "") + " heads per block | MACs left | speed-up b8 "
        "| cosine pruned, no refit | cosine pruned + refit | refit s | cosine distilled | ONNX max abs err |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if both else ""),
    ]
    lines += [
        f"| {_vit_name(k)} |" + (f" {_pruned(k)} |" if both else "") + f" {v['heads'][0]} -> {v['heads'][1]} "
        f"| {v['macs_fraction']:.0%} | {with_spread(v['speedup_b8'], v.get('speedup_b8_range'))} "
        f"| {v.get('cosine_no_refit', float('nan')):.4f} "
        f"| {v['cosine_pruned']:.4f} | {v.get('refit_seconds', float('nan')):.0f} "
        f"| {v['cosine_distilled']:.4f} | {v['onnx_max_abs_error']:.1e} |"
        for k, v in h.items()
    ]
    # the target's rows: heads only (results before that row pruned heads and FFN channels alike)
    target = {k: v for k, v in h.items() if _pruned(k) == "heads"} or h
    rows = {row["variant"]: row for row in d["rows"]}
    top = rows["baseline"]["top1"]
    int8 = rows.get("sparse50-int8", {})
    lines += [
        "",
        "Targets (issue #26):",
        "",
        "- digits: 50% and 2:4 keep top-1 within 1 point: "
        + ", ".join(f"{n} {rows[n]['top1']:.2f}" for n in ("sparse50", "sparse-2of4") if n in rows)
        + f" vs {top:.2f} -> "
        + (
            "met"
            if all(top - rows[n]["top1"] <= 1 for n in ("sparse50", "sparse-2of4") if n in rows)
            else "NOT met"
        ),
        "- sparse + int8 >= 6x smaller than fp32 in a compressed format: xz "
        f"{base / int8['compressed_bytes']:.1f}x, "
        f"sparse format {base / int8['sparse_format_bytes']:.1f}x -> "
        + ("met (xz)" if base / int8["compressed_bytes"] >= 6 else "NOT met"),
        "- resnet18 cosine >= 0.99 after distillation: "
        + ", ".join(f"{k} {v['cosine_after']:.4f}" for k, v in r.items())
        + " -> "
        + ("met" if all(v["cosine_after"] >= 0.99 for v in r.values()) else "NOT met"),
        "- QAT closes at least half of the post-training gap within 2 minutes (rows whose QAT pass took "
        f"at most 120 s count): random mobilenet_v2 {q['gap_closed']:.0%} "
        "(cosine), trained digits mobilenet_v2 "
        + ", ".join(
            f"{m} {v['gap_closed']:.0%} (agreement{_disagreeing(v)}) / "
            f"{v.get('cosine_gap_closed', 0):.0%} (cosine)"
            for m, v in g.items()
        )
        + " -> "
        + (
            "met"
            if max([q["gap_closed"]] + [_closed(v) for v in g.values() if v["seconds"] <= 120]) >= 0.5
            else f"NOT met (agreement counts where at least {MIN_SAMPLES_MOVED} samples separate PTQ and QAT)"
        ),
        "- ViTs, head-pruned 25%: cosine >= 0.95 after distillation: "
        + ", ".join(f"{_vit_name(k)} {v['cosine_distilled']:.4f}" for k, v in target.items())
        + " -> "
        + (
            "met"
            if all(v["cosine_distilled"] >= 0.95 for v in target.values())
            else "NOT met (random weights)"
        ),
    ]
    return lines


def main() -> None:
    ap = parser(__doc__, "2-epoch digits model, 3 training steps, timm's ViT only, tiny timings")
    ap.add_argument("--steps", type=int, default=240)
    args = ap.parse_args()
    steps = 3 if args.quick else args.steps
    out = out_dir(args)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    data: dict[str, Any] = {"digits": digits_sparse(args.quick), "logits_loss": LOGITS_LOSS}
    print(data["digits"], flush=True)
    data["resnet18"] = resnet18_sparse(steps, args.quick)
    print(data["resnet18"], flush=True)
    data["qat"] = mobilenet_qat(max(steps, 3) if args.quick else steps, args.quick)
    print({k: v for k, v in data["qat"].items() if k != "curve"}, flush=True)
    data["qat_digits"] = digits_mobilenet_qat(args.quick)
    print(
        {m: {k: x for k, x in v.items() if k != "curve"} for m, v in data["qat_digits"].items()}, flush=True
    )
    data["heads"] = vit_heads(steps, args.quick)
    print(data["heads"], flush=True)
    command = "python benchmarks/compression.py" + (
        " --quick" if args.quick else (f" --steps {args.steps}" if args.steps != 240 else "")
    )
    title = "Training-time compression: sparsity, QAT, attention heads"
    publish(out, "compression", title, command, time.perf_counter() - t0, data, render)


if __name__ == "__main__":
    main()
