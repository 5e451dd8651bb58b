"""`strategy: search`: sensitivity analysis, candidate variants, then the fastest that fits.

(a) Quantize and prune one layer at a time and rank the layers by the accuracy drop they cause.
(b) Build candidates: static int8 keeping the k most quantization-sensitive layers in float
    (k = 0, 1, ... until the accuracy constraint holds), pruning ratios on a grid or by bisection
    (optionally fine-tuned), and the best pruning candidate quantized as well.
(c) :mod:`torchtame.selection` picks the fastest variant that meets every constraint.
Every candidate is an ordinary variant: built, saved and measured like any step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .passes.finetune import FinetuneOptions
from .passes.prune import PruneOptions
from .passes.quantize import StaticOptions
from .selection import accuracy_drop
from .sensitivity import pruning_sensitivity, quantization_sensitivity, score

if TYPE_CHECKING:
    from .pipeline import Pipeline

log = logging.getLogger("torchtame")


def _fits_accuracy(pipe: Pipeline, name: str) -> bool:
    entry = pipe.entry(name)
    if entry is None or entry["status"] != "ok":
        return False
    limit = pipe.recipe.constraints.max_accuracy_drop
    drop, _ = accuracy_drop(entry)
    return limit is None or (drop is not None and drop <= limit)


def _step(pipe: Pipeline, name: str, pass_name: str, parent: str, options: Any) -> str:
    pipe._run_step(name, pass_name, parent, options, len(pipe.results["variants"]))
    return name


def run_search(pipe: Pipeline) -> dict[str, Any]:
    """Run the search on the pipeline's baseline; returns what results.json keeps under `search`."""
    cfg = pipe.recipe.search
    base = pipe.variants["baseline"]
    assert base.module is not None
    data = pipe.data
    reference = pipe.baseline_logits
    info: dict[str, Any] = {"sensitivity": {}, "candidates": []}
    qopts = StaticOptions.model_validate(cfg.quantize_options)
    if cfg.sensitivity:
        pipe.progress.status("sensitivity analysis")
        base_score = score(base.module, data, reference)
        if cfg.quantize:
            info["sensitivity"]["quantize"] = quantization_sensitivity(
                base.module, data, base_score, reference, qopts, pipe.progress
            )
        if cfg.prune:
            info["sensitivity"]["prune"] = pruning_sensitivity(
                base.module,
                data,
                base_score,
                reference,
                cfg.sensitivity_prune_ratio,
                str(cfg.prune_options.get("importance", "l2")),
                pipe.progress,
            )
        info["sensitivity"]["basis"] = "top-1" if data.has_labels else "agreement with the baseline"

    keep: list[str] = []
    if cfg.quantize:
        ranked = [s["layer"] for s in info["sensitivity"].get("quantize", []) if s["drop"] is not None]
        for k in range(0, min(cfg.max_float_layers, len(ranked)) + 1):
            keep = ranked[:k]
            name = "search-int8" if k == 0 else f"search-int8-float{k}"
            opts = qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]})
            info["candidates"].append(_step(pipe, name, "quantize.static", "baseline", opts))
            if _fits_accuracy(pipe, name):
                break
            log.info("%s misses the accuracy constraint; keeping one more sensitive layer in float", name)

    best_pruned = None
    if cfg.prune:
        ft = FinetuneOptions.model_validate(cfg.finetune) if cfg.finetune is not None else None

        def candidate(ratio: float) -> tuple[str, bool]:
            name = f"search-pruned-{ratio * 100:.3g}"
            opts = PruneOptions.model_validate({**cfg.prune_options, "ratio": ratio})
            _step(pipe, name, "prune.structured", "baseline", opts)
            if ft is not None:
                name = _step(pipe, f"{name}-ft", "finetune", name, ft)
            info["candidates"].append(name)
            return name, _fits_accuracy(pipe, name)

        if cfg.prune_search == "grid":
            for ratio in sorted(cfg.prune_ratios):
                name, ok = candidate(ratio)
                if ok:
                    best_pruned = name
        else:  # bisect for the largest ratio that still meets the accuracy constraint
            lo, hi = 0.0, max(cfg.prune_ratios)
            for _ in range(cfg.bisect_steps):
                mid = round((lo + hi) / 2, 4)
                name, ok = candidate(mid)
                if ok:
                    best_pruned, lo = name, mid
                else:
                    hi = mid
        info["best_pruned"] = best_pruned

    if cfg.combine and cfg.quantize and best_pruned is not None:
        opts = qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]})
        info["candidates"].append(_step(pipe, f"{best_pruned}-int8", "quantize.static", best_pruned, opts))
    info["kept_float"] = keep
    return info
