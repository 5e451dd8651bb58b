"""``quantize.static``: int8 weights and activations, calibrated on the calibration split.

``mode: auto`` (the default) chooses by evidence, not by whether a call raised: it builds the FX
variant and reads its converted graph (how many convolutions/linears really run in int8, standalone
BatchNorms), its fidelity to the float model and its speed on a calibration batch. FX is kept when
it is whole, faithful and faster; otherwise PT2E is built (and compiled) and the better of the two
is chosen, with the figures of both and the reason recorded in the variant's info.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

import torch
from torch import nn

from ...errors import PassError, first_line
from ...evaluate.graph import WEIGHT_MODULES, inspect_fx, inspect_pt2e
from ...evaluate.latency import measure_latency
from ...inputs import call, select_output
from ...onnx_runtime import compare_outputs
from ...registry import register_pass
from ...results import info_of
from ...runtime import check_backend, compiled, quantized_engine, weight_bits, weight_range
from ...variant import PassContext, Variant
from .. import recovery
from .._select import match_modules, module_types, require_float
from ..adaround import int8_weights
from .fx import StaticOptions, calibrate, static_eager, static_fx
from .pt2e import Exports, quantize_pt2e

log = logging.getLogger("torchtame")

MIN_COSINE = 0.99  # what auto asks of a mode's outputs on a calibration batch, against float
# Speed decides only when the difference is unmistakable, so that the same recipe gives the same
# choice run after run: FX is too slow below 0.8x float (the pathological cases are 0.1x-0.5x),
# and between modes a speed difference under 10% is a tie.
SPEED_TOLERANCE = 0.2
SPEED_TIE = 0.10


def build(
    mode: str,
    model: nn.Module,
    ctx: PassContext,
    opts: StaticOptions,
    backend: str,
    exports: Exports | None = None,
) -> nn.Module:
    """The int8 model in one graph mode (``exports``: PT2E graphs of models built before, reused
    where only the weights differ)."""
    if mode == "pt2e":
        if opts.activation_symmetric:
            raise PassError(
                "PT2E's x86 int8 kernels take affine (uint8) activations only",
                hint="drop `activation_symmetric` or use `mode: fx`",
            )
        converted, changes = quantize_pt2e(
            model,
            ctx.example_input,
            lambda prepared: calibrate(prepared, ctx, opts.calibration_batches, "calibrate (pt2e)"),
            observer=opts.activation_observer,
            per_channel=opts.weight_granularity == "per_channel",
            keep=match_modules(model, opts.keep_float, "keep_float"),
            keep_types=tuple(module_types(opts.keep_float_types)),
            exports=exports,
        )
        converted.meta["torchtame_normalised"] = changes
        return converted
    with quantized_engine(backend):
        return (static_fx if mode == "fx" else static_eager)(model, ctx, opts, backend)


def inspect(mode: str, q: nn.Module) -> dict[str, Any]:
    return inspect_pt2e(q) if mode == "pt2e" else inspect_fx(q)  # type: ignore[arg-type]


def trial(
    mode: str, model: nn.Module, ctx: PassContext, opts: StaticOptions, backend: str, ref: dict[str, Any]
) -> tuple[nn.Module | None, dict[str, Any]]:
    """Build one mode and judge it: int8 coverage, fidelity and speed against float eager."""
    try:
        q = build(mode, copy.deepcopy(model), ctx, opts, backend)
    except PassError as exc:
        return None, {"error": first_line(exc.message, 240), "hint": exc.hint}
    except Exception as exc:  # a library bug in one mode must not stop the other from being tried
        return None, {"error": f"{type(exc).__name__}: {first_line(exc, 200)}"}
    graph = inspect(mode, q)
    run = compiled(q) if mode == "pt2e" else q
    x = ref["x"]
    with quantized_engine(None if mode == "pt2e" else backend), torch.inference_mode():
        t0 = time.perf_counter()
        out = select_output(call(run, x), ctx.output)
        first_call_s = time.perf_counter() - t0
        ms = measure_latency(lambda v: call(run, v), x, warmup=2, min_runs=5, min_time_s=0.2).p50_ms
    fid = compare_outputs(ref["out"], out)
    figures = {
        "int8_layers": f"{graph['int8_layers']}/{graph['weight_layers']}",
        "standalone_batchnorms": graph.get("standalone_batchnorms", 0),
        "cosine": round(fid["cosine_similarity"], 5),
        "speedup_vs_float": round(ref["ms"] / ms, 3),
        "p50_ms": round(ms, 4),
        "batch_size": int(ref["batch"]),
        **({"compile_s": round(first_call_s, 2)} if mode == "pt2e" else {}),
    }
    if "top1_agreement" in fid:
        figures["agreement"] = round(100 * fid["top1_agreement"], 2)
    return q, figures


def kept_layers(model: nn.Module, opts: StaticOptions) -> int:
    """Weight layers the user keeps float on purpose: by name, inside a kept module, or by type."""
    names = match_modules(model, opts.keep_float, "keep_float") if opts.keep_float else []
    types = tuple(module_types(opts.keep_float_types))
    return sum(
        1
        for n, m in model.named_modules()
        if isinstance(m, WEIGHT_MODULES)
        and ((types and isinstance(m, types)) or any(n == k or n.startswith(k + ".") for k in names))
    )


def _shortfalls(figures: dict[str, Any], kept: int) -> list[str]:
    """Why a mode is not good enough (empty when it is whole, faithful and faster)."""
    if "error" in figures:
        return [f"failed: {figures['error']}"]
    out = []
    done, total = (int(v) for v in figures["int8_layers"].split("/"))
    if done + kept < total:
        out.append(f"{total - done - kept} of {total} weight layers left float")
    if figures["standalone_batchnorms"]:
        out.append(f"{figures['standalone_batchnorms']} BatchNorms not folded")
    if figures["cosine"] < MIN_COSINE:
        out.append(f"cosine {figures['cosine']:.4f} < {MIN_COSINE}")
    if figures["speedup_vs_float"] < 1.0 - SPEED_TOLERANCE:  # not noise: a real slowdown
        out.append(f"{figures['speedup_vs_float']:.2f}x the float model's speed")
    return out


def choose(
    model: nn.Module, ctx: PassContext, opts: StaticOptions, backend: str
) -> tuple[nn.Module, str, dict]:
    """``mode: auto``: FX if it holds up, else the better of FX and PT2E (see the module docstring)."""
    x = next(iter(ctx.data.calibration))[0]
    with torch.inference_mode():
        out = select_output(call(model, x), ctx.output)
        ms = measure_latency(lambda v: call(model, v), x, warmup=2, min_runs=5, min_time_s=0.2).p50_ms
    ref = {"x": x, "out": out, "ms": ms, "batch": out.shape[0]}
    kept = kept_layers(model, opts)
    trials: dict[str, dict[str, Any]] = {}
    built: dict[str, nn.Module] = {}
    for mode in ("fx", "pt2e"):
        ctx.progress.status(f"quantize.static auto: trying {mode}")
        q, trials[mode] = trial(mode, model, ctx, opts, backend, ref)
        if q is not None:
            built[mode] = q
        trials[mode]["shortfalls"] = _shortfalls(trials[mode], kept)
        if mode == "fx" and q is not None and not trials[mode]["shortfalls"]:
            break
    if not built:  # a hint never suggests a mode that has just failed
        hints = [
            h for t in trials.values() if (h := t.get("hint")) and not any(f"mode: {m}" in h for m in trials)
        ]
        raise PassError(
            "static int8 failed in every graph mode: "
            + "; ".join(f"{m}: {t['error']}" for m, t in trials.items() if "error" in t),
            hint="; ".join([*hints[:1], "or use quantize.dynamic (Linear/RNN layers) or quantize.onnx"]),
        )

    fastest = max((trials[m]["speedup_vs_float"] for m in built), default=1.0)

    def rank(mode: str) -> tuple[bool, bool, bool, float, bool, float]:
        """Faithful first, then whole (no shortfall left), then clearly faster (within 10% of the
        fastest is a tie); where no mode is faithful, closer to float (mobilenet_v2: PT2E 0.977
        against FX 0.972, and faster); then FX (no compile step), then closer to float."""
        t = trials[mode]
        faithful = t["cosine"] >= MIN_COSINE
        fast = t["speedup_vs_float"] >= fastest * (1 - SPEED_TIE)
        unfaithful_cosine = 0.0 if faithful else round(t["cosine"], 3)  # 1e-3: not noise
        return (
            faithful,
            not t["shortfalls"],
            faithful and fast,
            unfaithful_cosine,
            mode == "fx",
            t["cosine"],
        )

    chosen = max(built, key=rank)
    t = trials[chosen]
    reason = (
        f"{chosen}: {t['int8_layers']} layers int8, cosine {t['cosine']:.4f}, "
        f"{t['speedup_vs_float']:.2f}x float at batch {t['batch_size']}"
    )
    others = [
        f"{m}: {', '.join(v['shortfalls'])}" for m, v in trials.items() if m != chosen and v["shortfalls"]
    ]
    if others:
        reason += "; " + "; ".join(others)
    if t["shortfalls"]:
        reason += f" (chosen as the best available; it still has: {', '.join(t['shortfalls'])})"
    log.info("quantize.static mode auto chose %s", reason)
    return built[chosen], chosen, {"chosen": chosen, "reason": reason, "trials": trials}


def _quantize_with(opts: StaticOptions, algorithms: list[str], candidate: nn.Module) -> StaticOptions:
    """The options a recovery candidate is quantized with: ``sensitive_float``'s layers float too."""
    out = opts.quantize_with(algorithms)
    kept = [n for n in recovery.kept_float(candidate) if n not in out.keep_float]
    return out.model_copy(update={"keep_float": [*out.keep_float, *kept]}) if kept else out


def _recover(
    model: nn.Module, q: nn.Module | None, mode: str, ctx: PassContext, opts: StaticOptions, backend: str
) -> tuple[nn.Module, dict[str, Any]]:
    """Accuracy recovery on the float model (:mod:`..recovery`), then the int8 model built again in
    the chosen mode; fidelity is judged on calibration batches held apart from the evaluation data."""
    t0 = time.perf_counter()
    held = recovery.held_outputs(model, ctx.data.calibration, opts, ctx.output)
    exports, folded = None, None
    if mode == "pt2e" and opts.recovery != "none":
        # Candidates then share one structure (BatchNorms folded, as PT2E folds them anyway; the
        # convolutions have biases for bias correction), so one export serves them all.
        model, exports = copy.deepcopy(model), Exports()
        folded = recovery.fold_batchnorms(model, ctx.example_input)
    built: dict[str, nn.Module] = {}

    def score(candidate: nn.Module, algorithms: list[str]) -> torch.Tensor:
        built.pop("last", None)
        how = _quantize_with(opts, algorithms, candidate)
        q = build(mode, copy.deepcopy(candidate), ctx, how, backend, exports)
        with quantized_engine(None if mode == "pt2e" else backend), torch.inference_mode():
            out = torch.cat([select_output(call(q, x), ctx.output).float() for x in held.judge])
        built["last"] = q
        return out

    def on_best() -> None:  # the int8 model of the best candidate so far is the one to keep
        built["best"] = built.pop("last")

    kept = set(match_modules(model, opts.keep_float, "keep_float")) if opts.keep_float else set()
    ctx.progress.status(f"quantize.static: recovery {opts.recovery}")
    weights = weight_range(mode, backend)
    grid = (weights, weights)
    fixed, info = recovery.recover(model, ctx.example_input, held, opts, score, kept, on_best, grid)
    if "best" in built and (q is None or info["chosen"]):  # built and calibrated already, alike
        q = built["best"]
    elif q is None or info["chosen"]:  # the int8 model of the float model recovery settled on
        how = _quantize_with(opts, info["chosen"], fixed)
        q = build(mode, copy.deepcopy(fixed), ctx, how, backend, exports)
    if exports is not None:
        info["exports"] = {
            "exported": exports.exported,
            "reused": exports.reused,
            "batchnorms_folded": folded,
        }
    recovery.record_ranges(info, getattr(q, "meta", {}).get("torchtame_ranges"))
    info["seconds"] = round(time.perf_counter() - t0, 2)  # folding and the int8 model kept included
    return q, info


NAME = "quantize.static"


def _slower_hint(entry: dict[str, Any]) -> str:
    if info_of(entry).get("mode") == "fx":
        return (
            "try `mode: pt2e` (compiled by Inductor) or quantize.onnx; at batch 1 int8 overhead can "
            "exceed the gain"
        )
    return "try `mode: fx` or quantize.onnx; compiled int8 pays off at larger batches"


@register_pass(
    NAME,
    StaticOptions,
    traits={"quantizes"},
    hints={
        "slower": _slower_hint,
        "fidelity": "keep the most sensitive layers float (`strategy: search` ranks them; `keep_float: "
        "[...]`), try `mode: pt2e`, or quantize.onnx with `calibration_method: Percentile`",
    },
)
def quantize_static(model: nn.Module | None, ctx: PassContext, opts: StaticOptions) -> Variant:
    """Static int8 post-training quantization calibrated on the calibration split."""
    with weight_bits(opts.weight_bits):
        return _quantize_static(model, ctx, opts)


def _quantize_static(model: nn.Module | None, ctx: PassContext, opts: StaticOptions) -> Variant:
    """The pass itself, inside :func:`~torchtame.runtime.weight_bits`."""
    assert model is not None
    require_float(
        ctx,
        "quantize.static",
        "start this step `from:` a float variant (baseline, pruned, fine-tuned)",
        float32=True,
    )
    backend = check_backend(opts.backend, static=True)
    choice: dict[str, Any] | None = None
    if opts.mode == "auto":
        q, mode, choice = choose(model, ctx, opts, backend)
    else:
        mode = opts.mode
        q = build(mode, model, ctx, opts, backend) if opts.recovery == "none" else None
    recovered = None
    if opts.recovery != "none":
        q, recovered = _recover(model, q, mode, ctx, opts, backend)
    batches = (
        len(ctx.data.calibration)
        if opts.calibration_batches is None
        else min(opts.calibration_batches, len(ctx.data.calibration))
    )
    info: dict[str, Any] = {
        "mode": mode,
        "backend": backend if mode != "pt2e" else "x86 inductor",
        "calibration_batches": batches,
        "observer": opts.activation_observer,
        "weight_granularity": opts.weight_granularity,
        "weight_grid": list(weight_range(mode, backend)),  # 7-bit where the kernels need it
        "kept_float": [*opts.keep_float, *opts.keep_float_types],
        "graph": inspect(mode, q),
    }
    if mode == "pt2e":
        info["normalised"] = q.meta.get("torchtame_normalised")  # type: ignore[union-attr]
        info["cpu_only"] = "x86 Inductor int8 kernels; no PT2E static int8 quantizer targets CUDA"
    if choice is not None:
        info["mode_choice"] = choice
    if recovered is not None:
        recovery.verify_rounding(recovered, int8_weights(q))
        info["recovery"] = recovered
        for rec in recovered.get("applied", []):
            if rec.get("algorithm") == "sensitive_float":
                info["kept_float"] += [n for n in rec.get("layers", []) if n not in info["kept_float"]]
    return ctx.variant(
        q,
        quantized=True,
        devices="cpu_only",
        backend=backend if mode != "pt2e" else None,
        dtype="int8",
        compiled=mode == "pt2e",
        info=info,
    )
