"""`strategy: search`: sensitivity analysis, candidate variants, then the fastest that fits.

(a) Quantize and prune one layer at a time and rank the layers by the accuracy drop they cause.
(b) Build candidates: static int8 keeping the k most quantization-sensitive layers in float
    (k = 0, 1, ... until the accuracy constraint holds), pruning ratios on a grid or by bisection
    (optionally fine-tuned), and the best pruning candidate quantized as well.
(c) :mod:`torchtame.search.selection` picks the fastest variant that meets every constraint.
Every candidate is an ordinary variant: built, saved and measured through the pipeline's public
step interface (:class:`StepRunner`), like any recipe step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..passes.prune import PruneOptions
from .selection import accuracy_drop
from .sensitivity import pruning_sensitivity, quantization_sensitivity, score

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from ..data import DataBundle
    from ..progress import Progress
    from ..recipe import Recipe
    from ..variant import Variant

log = logging.getLogger("torchtame")


class StepRunner(Protocol):
    """What the search needs from a pipeline: its inputs and a way to build and measure a step."""

    recipe: Recipe
    data: DataBundle
    progress: Progress
    variants: dict[str, Variant]
    baseline_outputs: torch.Tensor | None

    def entry(self, name: str) -> dict[str, Any] | None: ...

    def run_step(self, name: str, pass_name: str, parent: str, options: BaseModel) -> dict[str, Any]: ...


def _fits_accuracy(runner: StepRunner, entry: dict[str, Any]) -> bool:
    if entry["status"] != "ok":
        return False
    limit = runner.recipe.constraints.max_accuracy_drop
    drop, _ = accuracy_drop(entry)
    return limit is None or (drop is not None and drop <= limit)


def run_search(runner: StepRunner) -> dict[str, Any]:
    """Run the search on the baseline; returns what results.json keeps under ``search``."""
    cfg = runner.recipe.search
    base = runner.variants["baseline"]
    assert base.module is not None
    data = runner.data
    reference = runner.baseline_outputs
    info: dict[str, Any] = {"sensitivity": {}, "candidates": []}
    qopts = cfg.quantize_options
    if cfg.sensitivity:
        runner.progress.status("sensitivity analysis")
        base_score = score(base.module, data, reference)
        if cfg.quantize:
            info["sensitivity"]["quantize"] = quantization_sensitivity(
                base.module, data, base_score, reference, qopts, runner.progress
            )
        if cfg.prune:
            info["sensitivity"]["prune"] = pruning_sensitivity(
                base.module,
                data,
                base_score,
                reference,
                cfg.sensitivity_prune_ratio,
                cfg.prune_options.importance,
                runner.progress,
            )
        info["sensitivity"]["basis"] = "top-1" if data.has_labels else "agreement with the baseline"

    keep: list[str] = []
    if cfg.quantize:
        ranked = [s["layer"] for s in info["sensitivity"].get("quantize", []) if s["drop"] is not None]
        for k in range(0, min(cfg.max_float_layers, len(ranked)) + 1):
            keep = ranked[:k]
            name = "search-int8" if k == 0 else f"search-int8-float{k}"
            opts = qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]})
            entry = runner.run_step(name, "quantize.static", "baseline", opts)
            info["candidates"].append(name)
            if _fits_accuracy(runner, entry):
                break
            log.info("%s misses the accuracy constraint; keeping one more sensitive layer in float", name)

    best_pruned = None
    if cfg.prune:
        ft = cfg.finetune
        base_prune = cfg.prune_options.model_dump(exclude_unset=True)

        def candidate(ratio: float) -> tuple[str, bool]:
            name = f"search-pruned-{ratio * 100:.3g}"
            opts = PruneOptions.model_validate({**base_prune, "ratio": ratio})
            entry = runner.run_step(name, "prune.structured", "baseline", opts)
            if ft is not None:
                name = f"{name}-ft"
                entry = runner.run_step(name, "finetune", entry["name"], ft)
            info["candidates"].append(name)
            return name, _fits_accuracy(runner, entry)

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
        name = f"{best_pruned}-int8"
        runner.run_step(name, "quantize.static", best_pruned, opts)
        info["candidates"].append(name)
    info["kept_float"] = keep
    return info


__all__ = ["StepRunner", "run_search"]
