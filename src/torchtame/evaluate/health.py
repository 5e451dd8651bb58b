"""Health checks: every built variant is checked before it is reported.

A variant that is slower than the variant it was made from, whose fidelity collapsed, whose int8
graph left layers in float or BatchNorms unfolded, whose ONNX graph kept nodes in float, is a
finding: a code, a level (``error`` | ``warning`` | ``info``), a message with the figures, and the
next step to try. Findings are written to results.json (``health``), flagged in the terminal
table, the report and compare, and summarised once in the log; ``--strict`` fails a run with an
error-level finding.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..options import Strict
from ..registry import PASSES

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
}


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


def finding(code: str, level: str, message: str, suggestion: str, **figures: Any) -> dict[str, Any]:
    return {"code": code, "level": level, "message": message, "suggestion": suggestion, **figures}


def _slower_hint(entry: dict[str, Any]) -> str:
    found = PASSES.find(entry.get("pass"))
    hint = found.hint("slower", entry) if found is not None else None
    return hint or "keep the parent variant for this setting"


def _fidelity_hint(entry: dict[str, Any], parent: dict[str, Any] | None) -> str:
    found = PASSES.find(entry.get("pass"))
    if found is not None and found.has("exports") and parent is not None:
        # an export keeps its parent's arithmetic: the parent's pass is what to change
        found, entry = PASSES.find(parent.get("pass")), parent
    hint = found.hint("fidelity", entry) if found is not None else None
    return hint or "compare the variant's outputs with its parent's to find the layer that diverges"


def _latency(entry: dict[str, Any], key: str = "p50_ms") -> dict[tuple[Any, ...], float]:
    """Latency per setting; a setting is one node, device, batch size and thread count."""
    return {
        (m["device"], m["batch_size"], m["threads"], m.get("node")): m.get(key, 0.0)
        for m in entry.get("latency") or []
    }


def check_speed(entry: dict[str, Any], parent: dict[str, Any], t: HealthConfig) -> list[dict[str, Any]]:
    """Slower than the parent: beyond the tolerance and beyond the parent's own p90 (noise)."""
    if PASSES.has_trait(entry.get("pass"), "same_architecture"):
        return []
    mine, theirs, band = _latency(entry), _latency(parent), _latency(parent, "p90_ms")
    shared = [k for k in mine if k in theirs and theirs[k] > 0]
    slower = [k for k in shared if mine[k] > max(theirs[k] * (1 + t.slower_tolerance), band.get(k, 0.0))]
    if not slower:
        return []
    settings = ", ".join(f"{k[0]} b{k[1]} ({theirs[k] / mine[k]:.2f}x)" for k in slower)
    everywhere = len(slower) == len(shared)
    return [
        finding(
            "slower_than_parent",
            "error" if everywhere else "warning",
            f"slower than {parent['name']} at {settings}"
            + (" (every measured setting)" if everywhere else ""),
            _slower_hint(entry),
            settings=[
                {"device": k[0], "batch_size": k[1], "node": k[3], "speedup": round(theirs[k] / mine[k], 3)}
                for k in slower
            ],
        )
    ]


def check_fidelity(
    entry: dict[str, Any], parent: dict[str, Any] | None, task: str, t: HealthConfig
) -> list[dict[str, Any]]:
    """Class scores are judged by what they decide (top-1 agreement with the baseline; with
    labels, the accuracy drop warns), features by their cosine similarity: the logits of a
    distilled or quantized classifier may be rescaled while every decision stays the same."""
    acc = entry.get("accuracy") or {}
    agreement = acc.get("top1_agreement")
    classes = task == "classification" and agreement is not None
    value, unit, low, warn = (
        (agreement, "top-1 agreement", t.min_agreement, t.warn_agreement)
        if classes
        else (acc.get("cosine_similarity"), "cosine", t.min_cosine, t.warn_cosine)
    )
    if value is None:
        return []
    shown = f"{value:.1f}%" if classes else f"{value:.4f}"
    bound = (lambda b: f"{b:g}%") if classes else (lambda b: f"{b:g}")
    if value < low:
        message = f"fidelity to the baseline collapsed: {unit} {shown} < {bound(low)}"
        return [finding("fidelity_collapsed", "error", message, _fidelity_hint(entry, parent))]
    drop = acc.get("top1_drop")
    if drop is not None:  # with labels, accuracy is what degrades: a fine-tuned variant may
        # disagree with the baseline exactly where the baseline was wrong
        if drop > t.warn_accuracy_drop:
            message = f"top-1 accuracy dropped {drop:.2f} points (> {t.warn_accuracy_drop:g})"
            return [finding("fidelity_degraded", "warning", message, _fidelity_hint(entry, parent))]
        return []
    if value < warn:
        message = f"fidelity to the baseline degraded: {unit} {shown} < {bound(warn)}"
        return [finding("fidelity_degraded", "warning", message, _fidelity_hint(entry, parent))]
    return []


def check_graph(entry: dict[str, Any]) -> list[dict[str, Any]]:
    info = entry.get("info") or {}
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


def check_size(entry: dict[str, Any], parent: dict[str, Any]) -> list[dict[str, Any]]:
    mine = (entry.get("size") or {}).get("bytes")
    theirs = (parent.get("size") or {}).get("bytes")
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


def check_outputs(entry: dict[str, Any]) -> list[dict[str, Any]]:
    stats = entry.get("outputs") or {}
    spread = stats.get("spread")
    if spread is None or spread > 1e-6:
        return []
    return [
        finding(
            "degenerate_outputs",
            "warning",
            f"the outputs barely vary between samples (spread {spread:.2g}, "
            f"max |x| {stats.get('max_abs', 0):.2g}): "
            "random or untrained weights? Fidelity figures then say little",
            "load trained weights; for random models recalibrate BatchNorm statistics on real inputs",
        )
    ]


def check_memory(entry: dict[str, Any], capacity: dict[str, float] | None) -> list[dict[str, Any]]:
    """A variant that needs more memory than its device has (CUDA total, CPU available)."""
    over = []
    for m in entry.get("latency") or []:
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


def check_export(entry: dict[str, Any]) -> list[dict[str, Any]]:
    fixed = (entry.get("info") or {}).get("fixed_axes")
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


def check(
    entry: dict[str, Any],
    parent: dict[str, Any] | None,
    task: str = "classification",
    thresholds: HealthConfig | None = None,
    capacity: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Every finding about one measured variant (``parent``: the entry it was built from;
    ``capacity``: MiB of memory per device kind, ``cpu`` and ``cuda``)."""
    t = thresholds or HealthConfig()
    out: list[dict[str, Any]] = []
    if entry.get("status") != "ok":
        return out
    out += check_outputs(entry)
    if parent is not None and parent.get("status") == "ok":
        out += check_speed(entry, parent, t)
        out += check_size(entry, parent)
    out += check_fidelity(entry, parent, task, t)
    out += check_graph(entry)
    out += check_export(entry)
    out += check_memory(entry, capacity)
    return sorted(out, key=lambda f: LEVELS.index(f["level"]))


def flags(findings: list[dict[str, Any]]) -> str:
    """The table's flag cell: errors and warnings, shortest first (info findings stay in the report)."""
    marks = {"error": "✖", "warning": "⚠"}
    return " ".join(
        f"{marks[f['level']]} {FLAG.get(f['code'], f['code'])}" for f in findings if f["level"] in marks
    )


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Counts of findings per level over a run, and one line naming the worst."""
    counts = {level: 0 for level in LEVELS}
    worst = []
    for v in results.get("variants", []):
        for f in v.get("health") or []:
            counts[f["level"]] += 1
            if f["level"] != "info":
                worst.append(f"{v['name']}: {FLAG.get(f['code'], f['code'])}")
    return {**counts, "line": "; ".join(worst[:6]) + (f"; +{len(worst) - 6} more" if len(worst) > 6 else "")}
