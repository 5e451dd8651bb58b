"""Health checks: every built variant is checked before it is reported.

A variant that is slower than the variant it was made from, whose fidelity collapsed, whose int8
graph left layers in float or BatchNorms unfolded, whose ONNX graph kept nodes in float, is a
finding: a code, a level (``error`` | ``warning`` | ``info``), a message with the figures, and the
next step to try. Findings are written to results.json (``health``), flagged in the terminal
table, the report and compare, and summarised once in the log; ``--strict`` fails a run with an
error-level finding.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field

from ..options import Strict
from ..registry import PASSES
from ..results import (
    Finding,
    VariantEntry,
    accuracy_of,
    findings_of,
    info_of,
    latencies,
    setting,
    size_bytes,
    size_of,
)
from .stats import Ratio, paired_ratio

LEVELS = ("error", "warning", "info")
FLAG = {
    "fidelity_collapsed": "fidelity",
    "fidelity_degraded": "fidelity",
    "slower_than_parent": "slower",
    "float_layers": "float layers",
    "unfused_batchnorm": "unfused BN",
    "onnx_float_nodes": "float nodes",
    "degenerate_outputs": "degenerate",
    "larger_than_parent": "larger",
    "float_islands": "islands",
    "fixed_axes": "fixed axes",
    "exceeds_device_memory": "memory",
    "no_measurable_speedup": "no speed-up",
    "non_finite_outputs": "NaN/inf",
    "sparse_dense_kernels": "dense kernels",
    "int8_not_as_trained": "not as trained",
}


AS_TRAINED = 0.999  # int8 against the fake-quantized model QAT trained: below, it ships another model

# Every finding, its level and when it is raised: README's health table is rendered from this
# (``findings_table()``; tests/test_docs.py checks the README holds exactly that table).
FINDINGS: tuple[tuple[str, str, str], ...] = (
    (
        "fidelity_collapsed",
        "error",
        "cosine to the baseline < `min_cosine` (0.9) or not a number, top-1 agreement < `min_agreement` "
        "(50%, class scores), or with labels a top-1 drop > `max_accuracy_drop_error` (10 points), "
        "whatever `evaluate.metrics` lists",
    ),
    (
        "fidelity_degraded",
        "warning",
        "cosine < `warn_cosine` (0.99), agreement < `warn_agreement` (95%), or with labels a top-1 drop "
        "> `warn_accuracy_drop` (1 point); info only when the variant meets the recipe's explicit fidelity "
        "constraints",
    ),
    ("non_finite_outputs", "error", "NaN or infinite values in the measured outputs"),
    (
        "slower_than_parent",
        "warning; error at every measured setting with >= 3 rounds",
        "the 95% interval of its speed-up over its parent (paired rounds, same node, device, batch and "
        "threads) lies wholly below 1 - `slower_tolerance` (0.05); with one round: beyond the tolerance "
        "and the parent's p90, flagged unconfirmed (`slower?`); never for `same_architecture` passes "
        "(fine-tuning)",
    ),
    ("no_measurable_speedup", "info", "the speed-up's 95% interval over its parent spans 1"),
    ("float_layers", "warning", "convolutions/linears an int8 graph left in float (not kept on purpose)"),
    ("unfused_batchnorm", "warning", "BatchNorms running standalone in an int8 graph"),
    ("onnx_float_nodes", "warning", "Conv/MatMul/Gemm nodes an onnxruntime-quantized model left in float"),
    ("larger_than_parent", "warning", "a quantized artefact larger than its float parent"),
    (
        "degenerate_outputs",
        "warning",
        "the outputs' spread between samples is < 1e-6 of their mean magnitude (at least 2 samples; "
        "NaN never counts): random or untrained weights",
    ),
    (
        "exceeds_device_memory",
        "error",
        "peak inference memory above the device's (CUDA total, the CPU's available memory)",
    ),
    ("float_islands", "info", "dequantize -> float ops -> quantize round trips in an int8 graph"),
    (
        "int8_not_as_trained",
        "warning",
        "quantize.qat: cosine between the int8 model and the fake-quantized model it was trained as < "
        f"{AS_TRAINED} on held calibration batches (its kernels round otherwise than training did)",
    ),
    ("fixed_axes", "info", "ONNX axes that came out fixed although the export asked for them dynamic"),
    (
        "sparse_dense_kernels",
        "info",
        "at least 30% of the weights are zeros, and the devices measured run dense kernels that "
        "multiply them: smaller in a sparse format, not faster",
    ),
)


def findings_table() -> str:
    """The Markdown table of every finding (README's health table)."""
    lines = ["| code | level | when |", "|---|---|---|"]
    lines += [f"| `{code}` | {level} | {when} |" for code, level, when in FINDINGS]
    return "\n".join(lines)


class HealthConfig(Strict):
    """When a variant gets a health finding (``evaluate.health`` in the recipe)."""

    enabled: bool = True
    min_cosine: float = Field(0.9, ge=-1, le=1, description="Fidelity collapsed below this cosine.")
    min_agreement: float = Field(50.0, ge=0, le=100, description="...or below this top-1 agreement (%).")
    slower_tolerance: float = Field(
        0.05, ge=0, description="Slower than its parent by more than this fraction is a finding."
    )
    warn_cosine: float = Field(0.99, ge=-1, le=1, description="Fidelity degraded (a warning) below this.")
    warn_agreement: float = Field(95.0, ge=0, le=100, description="...or below this top-1 agreement (%).")
    warn_accuracy_drop: float = Field(
        1.0, ge=0, description="With labels: a top-1 drop above this (points) is the degradation warning."
    )
    max_accuracy_drop_error: float = Field(
        10.0, ge=0, description="With labels: a top-1 drop above this (points) is an error."
    )


def finding(code: str, level: str, message: str, suggestion: str, **figures: Any) -> Finding:
    return {"code": code, "level": level, "message": message, "suggestion": suggestion, **figures}


def _slower_hint(entry: VariantEntry) -> str:
    found = PASSES.find(entry.get("pass"))
    hint = found.hint("slower", entry) if found is not None else None
    return hint or "keep the parent variant for this setting"


def _fidelity_hint(entry: VariantEntry, parent: VariantEntry | None) -> str:
    found = PASSES.find(entry.get("pass"))
    if found is not None and found.has("exports") and parent is not None:
        # an export keeps its parent's arithmetic: the parent's pass is what to change
        found, entry = PASSES.find(parent.get("pass")), parent
    hint = found.hint("fidelity", entry) if found is not None else None
    return hint or "compare the variant's outputs with its parent's to find the layer that diverges"


def _speedups(entry: VariantEntry, parent: VariantEntry) -> dict[tuple[Any, ...], Ratio]:
    """The entry's speed-up over its parent at every setting both were timed at: paired by round
    where both were retimed in the same rounds, else one reading (no interval)."""
    theirs = {setting(m): m for m in latencies(parent)}
    out = {}
    for m in latencies(entry):
        p = theirs.get(setting(m))
        if p is None or not p.get("p50_ms") or not m.get("p50_ms"):
            continue
        a, b = p.get("round_p50_ms") or [], m.get("round_p50_ms") or []
        if len(a) == len(b) >= 2:
            out[setting(m)] = paired_ratio(a, b)
        else:
            out[setting(m)] = Ratio(p["p50_ms"] / m["p50_ms"], None, None, 1)
    return out


def check_speed(entry: VariantEntry, parent: VariantEntry, t: HealthConfig) -> list[Finding]:
    """Slower than the parent only where the speed-up's interval lies wholly below
    1 - ``slower_tolerance``: a warning, or an error when that holds at every measured setting
    with at least 3 rounds. One round has no interval: beyond the tolerance and the parent's own
    p90 it is an unconfirmed warning. An interval that spans 1 is an info finding."""
    if PASSES.has_trait(entry.get("pass"), "same_architecture"):
        return []
    ratios = _speedups(entry, parent)
    band = {setting(m): m.get("p90_ms", 0.0) for m in latencies(parent)}
    mine = {setting(m): m["p50_ms"] for m in latencies(entry)}
    bound = 1 - t.slower_tolerance
    confirmed = [k for k, r in ratios.items() if r.below(bound)]
    unconfirmed = [
        k
        for k, r in ratios.items()
        if not r.has_interval and r.value < 1 / (1 + t.slower_tolerance) and mine[k] > band.get(k, 0.0)
    ]
    out = []
    slower = confirmed or unconfirmed
    if slower:
        every = len(confirmed) == len(ratios) and all(r.rounds >= 3 for r in ratios.values())
        shown = ", ".join(f"{k[1]} b{k[2]} ({_ratio_text(ratios[k])})" for k in slower)
        note = " (every measured setting)" if every else ""
        note += "" if confirmed else " (unconfirmed, 1 round)"
        out.append(
            finding(
                "slower_than_parent",
                "error" if confirmed and every else "warning",
                f"slower than {parent['name']} at {shown}{note}",
                _slower_hint(entry),
                confirmed=bool(confirmed),
                settings=[
                    {"device": k[1], "batch_size": k[2], "node": k[0], **ratios[k].as_fields()}
                    for k in slower
                ],
            )
        )
    spanning = [k for k, r in ratios.items() if r.spans(1.0)]
    if spanning:
        shown = ", ".join(f"{k[1]} b{k[2]} ({_ratio_text(ratios[k])})" for k in spanning)
        out.append(
            finding(
                "no_measurable_speedup",
                "info",
                f"no measurable speed difference from {parent['name']} at {shown}: the 95% interval spans 1",
                "more `latency.rounds` narrow the interval; a larger batch may show a difference",
            )
        )
    return out


def _ratio_text(r: Ratio) -> str:
    if not r.has_interval:
        return f"{r.value:.2f}x"
    return f"{r.value:.2f}x, 95% {r.low:.2f}-{r.high:.2f}"


def check_fidelity(
    entry: VariantEntry, parent: VariantEntry | None, task: str, t: HealthConfig
) -> list[Finding]:
    """Class scores are judged by what they decide (top-1 agreement with the baseline; with
    labels, the accuracy drop), features by their cosine similarity: the logits of a distilled
    or quantized classifier may be rescaled while every decision stays the same. With labels the
    top-1 drop is judged whatever ``evaluate.metrics`` lists; a cosine that is not a number is an
    error (the outputs are not finite, or constant)."""
    acc = accuracy_of(entry)
    hint = _fidelity_hint(entry, parent)
    cosine = acc.get("cosine_similarity")
    if cosine is not None and not math.isfinite(cosine):
        message = f"cosine to the baseline is {cosine}: the outputs are not finite, or constant"
        return [finding("fidelity_collapsed", "error", message, hint)]
    agreement = acc.get("top1_agreement")
    classes = task == "classification" and agreement is not None
    value, unit, low, warn = (
        (agreement, "top-1 agreement", t.min_agreement, t.warn_agreement)
        if classes
        else (cosine, "cosine", t.min_cosine, t.warn_cosine)
    )
    shown = (f"{value:.1f}%" if classes else f"{value:.4f}") if value is not None else ""
    bound = (lambda b: f"{b:g}%") if classes else (lambda b: f"{b:g}")
    if value is not None and value < low:
        message = f"fidelity to the baseline collapsed: {unit} {shown} < {bound(low)}"
        return [finding("fidelity_collapsed", "error", message, hint)]
    drop = acc.get("top1_drop")
    if drop is not None:  # with labels, accuracy is what degrades: a fine-tuned variant may
        # disagree with the baseline exactly where the baseline was wrong
        if drop > t.max_accuracy_drop_error:
            message = f"top-1 accuracy dropped {drop:.2f} points (> {t.max_accuracy_drop_error:g})"
            return [finding("fidelity_collapsed", "error", message, hint)]
        if drop > t.warn_accuracy_drop:
            message = f"top-1 accuracy dropped {drop:.2f} points (> {t.warn_accuracy_drop:g})"
            return [finding("fidelity_degraded", "warning", message, hint)]
        return []
    if value is not None and value < warn:
        message = f"fidelity to the baseline degraded: {unit} {shown} < {bound(warn)}"
        return [finding("fidelity_degraded", "warning", message, hint)]
    return []


def within_constraints(findings: list[Finding]) -> list[Finding]:
    """Fidelity findings of a variant that meets the recipe's explicit fidelity constraints: the
    default thresholds then only inform."""
    out = []
    for f in findings:
        if f["code"] in ("fidelity_collapsed", "fidelity_degraded") and f["level"] != "info":
            f = {
                **f,
                "level": "info",
                "message": f"{f['message']}; it meets the recipe's fidelity constraints, so this is the "
                "default threshold's note only",
            }
        out.append(f)
    return out


def check_graph(entry: VariantEntry) -> list[Finding]:
    info = info_of(entry)
    graph = info.get("graph")
    if not graph:
        return []
    out = []
    kept = set(info.get("kept_float") or [])
    float_layers = [n for n in graph.get("float_layers", []) if n not in kept]
    total = graph.get("weight_layers", 0)
    if graph.get("graph") == "onnx" and float_layers:
        ops = ", ".join(f"{k} x{v}" for k, v in (graph.get("float_ops") or {}).items())
        out.append(
            finding(
                "onnx_float_nodes",
                "warning",
                f"{len(float_layers)} of {total} weight nodes stayed float ({ops}): "
                + ", ".join(float_layers[:4]),
                "check `op_types_to_quantize` and `per_channel`; quant_pre_process helps shaped graphs",
                count=len(float_layers),
            )
        )
    elif float_layers:
        mode = info.get("mode")
        out.append(
            finding(
                "float_layers",
                "warning",
                f"{len(float_layers)} of {total} weight layers stayed float: {', '.join(float_layers[:4])}"
                + (", ..." if len(float_layers) > 4 else ""),
                "try `mode: pt2e`"
                if mode == "fx"
                else "list them in `keep_float` if that is intended, or try `mode: fx`",
                count=len(float_layers),
            )
        )
    if graph.get("standalone_batchnorms"):
        n = graph["standalone_batchnorms"]
        out.append(
            finding(
                "unfused_batchnorm",
                "warning",
                f"{n} BatchNorms run standalone in int8 (not folded into their convolutions): FX traced "
                "through Conv2d subclasses into functional convolutions",
                "use `mode: pt2e` (or `mode: auto`, which checks for this)",
                count=n,
            )
        )
    islands = graph.get("float_islands", 0)
    if islands:
        out.append(
            finding(
                "float_islands",
                "info",
                f"{islands} float islands (dequantize -> float ops -> quantize) in the int8 graph",
                "each island costs a round trip to float; `mode: pt2e` fuses more patterns",
                count=islands,
            )
        )
    return out


def check_as_trained(entry: VariantEntry) -> list[Finding]:
    """A QAT variant whose int8 model is not the fake-quantized model it trained."""
    info = info_of(entry)
    cosine = info.get("int8_vs_trained_cosine")
    if cosine is None or cosine >= AS_TRAINED:
        return []
    hint = "compare with quantize.static, which has no training to lose"
    if info.get("mode") == "fx":
        hint = f"`mode: pt2e` converts to what it trained (cosine 0.99999 in torchtame's tests); or {hint}"
    return [
        finding(
            "int8_not_as_trained",
            "warning",
            f"the int8 model computes cosine {cosine:.4f} to the fake-quantized model QAT trained "
            f"(< {AS_TRAINED}): the int8 kernels ({info.get('backend')}) round otherwise than training "
            "simulated, so part of what QAT learned does not ship",
            hint,
            cosine=cosine,
        )
    ]


def check_size(entry: VariantEntry, parent: VariantEntry) -> list[Finding]:
    mine = size_bytes(entry)
    theirs = size_bytes(parent)
    if not (entry.get("quantized") and mine and theirs and mine > theirs):
        return []
    return [
        finding(
            "larger_than_parent",
            "warning",
            f"the artefact is {mine / theirs:.2f}x the size of {parent['name']}'s ({mine} vs {theirs} B): "
            "in a small model the format's overhead (graph, scales) outweighs the 4x smaller weights",
            "for a small file, export to ONNX and quantize there (quantize.onnx)",
        )
    ]


def check_outputs(entry: VariantEntry) -> list[Finding]:
    """Outputs that are not finite (an error), or that barely vary between samples relative to
    their own scale (random or untrained weights, a dead network: fidelity then says little)."""
    stats = entry.get("outputs") or {}
    bad = stats.get("non_finite")
    if bad:
        return [
            finding(
                "non_finite_outputs",
                "error",
                f"{bad} output values are NaN or infinite",
                "float16 overflows: use bfloat16 or float32; for int8, check the calibration data; "
                "for pruned or fine-tuned variants, lower the learning rate",
                count=bad,
            )
        ]
    spread, scale = stats.get("spread"), stats.get("mean_abs", stats.get("max_abs"))
    if spread is None or stats.get("samples", 2) < 2 or not math.isfinite(spread):
        return []
    relative = spread / scale if scale else 0.0
    if relative > 1e-6:
        return []
    return [
        finding(
            "degenerate_outputs",
            "warning",
            f"the outputs barely vary between samples (spread {spread:.2g}, {relative:.2g} of their mean "
            f"magnitude {scale or 0:.2g}): random or untrained weights? Fidelity figures then say little",
            "load trained weights; for random models recalibrate BatchNorm statistics on real inputs",
        )
    ]


def check_memory(entry: VariantEntry, capacity: dict[str, float] | None) -> list[Finding]:
    """A variant that needs more memory than its device has (CUDA total, CPU available)."""
    over = []
    for m in latencies(entry):
        need, device = m.get("peak_memory_mb"), m["device"]
        have = (capacity or {}).get("cuda" if device.startswith("cuda") else "cpu")
        if need is not None and have and need > have:
            over.append(f"{need:.0f} MiB at {device} b{m['batch_size']} (the device has {have:.0f} MiB)")
    if not over:
        return []
    return [
        finding(
            "exceeds_device_memory",
            "error",
            "needs more memory than the device has: " + "; ".join(over),
            "use a smaller batch size, an int8 or pruned variant, or a device with more memory",
        )
    ]


def check_export(entry: VariantEntry) -> list[Finding]:
    fixed = info_of(entry).get("fixed_axes")
    if not fixed:
        return []
    return [
        finding(
            "fixed_axes",
            "info",
            "the ONNX model has fixed axes the export asked to keep dynamic: " + "; ".join(fixed),
            "feed inputs of exactly that size, or change the model so torch.export keeps the axis dynamic",
        )
    ]


def check_sparse(entry: VariantEntry) -> list[Finding]:
    """Sparse weights on dense kernels: a saving on disk in a sparse format, never a speed-up."""
    size = size_of(entry)
    sparse = size.get("sparse_format_bytes")
    if sparse is None or info_of(entry).get("semi_structured_layers"):
        return []
    zeros = 1 - size.get("nonzero_params", 0) / max(1, size.get("params", 1))
    return [
        finding(
            "sparse_dense_kernels",
            "info",
            f"sparse weights, dense kernels on this device: {zeros:.0%} of the parameters are zeros, "
            f"{sparse / 1e6:.3f} MB in a sparse format against {size.get('bytes', 0) / 1e6:.3f} MB saved "
            "dense, and the kernels still multiply every zero, so expect no speed-up",
            "for speed remove whole channels (prune.structured) or quantize (sparse then int8 keeps the "
            "zeros); 2:4 sparsity runs faster only on GPUs with sparse tensor cores (compute capability "
            "8.0+)",
            zeros=round(zeros, 4),
        )
    ]


def check(
    entry: VariantEntry,
    parent: VariantEntry | None,
    task: str = "classification",
    thresholds: HealthConfig | None = None,
    capacity: dict[str, float] | None = None,
    meets_constraints: bool = False,
) -> list[Finding]:
    """Every finding about one measured variant (``parent``: the entry it was built from;
    ``capacity``: MiB of memory per device kind, ``cpu`` and ``cuda``; ``meets_constraints``: it
    meets the recipe's explicit fidelity constraints, so default fidelity thresholds only inform)."""
    t = thresholds or HealthConfig()
    out: list[Finding] = []
    if entry.get("status") != "ok":
        return out
    out += check_outputs(entry)
    if parent is not None and parent.get("status") == "ok":
        out += check_speed(entry, parent, t)
        out += check_size(entry, parent)
    fidelity = check_fidelity(entry, parent, task, t)
    out += within_constraints(fidelity) if meets_constraints else fidelity
    out += check_graph(entry)
    out += check_as_trained(entry)
    out += check_export(entry)
    out += check_sparse(entry)
    out += check_memory(entry, capacity)
    return sorted(out, key=lambda f: LEVELS.index(f["level"]))


def flags(findings: list[Finding]) -> str:
    """The table's flag cell: errors and warnings, shortest first (info findings stay in the report)."""
    marks = {"error": "✖", "warning": "⚠"}
    return " ".join(
        f"{marks[f['level']]} {FLAG.get(f['code'], f['code'])}{'?' if f.get('confirmed') is False else ''}"
        for f in findings
        if f["level"] in marks
    )


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Counts of findings per level over a run, and one line naming the worst."""
    counts = {level: 0 for level in LEVELS}
    worst = []
    for v in results.get("variants", []):
        for f in findings_of(v):
            counts[f["level"]] += 1
            if f["level"] != "info":
                worst.append(f"{v['name']}: {FLAG.get(f['code'], f['code'])}")
    return {**counts, "line": "; ".join(worst[:6]) + (f"; +{len(worst) - 6} more" if len(worst) > 6 else "")}
