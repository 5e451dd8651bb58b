"""`strategy: search`: sensitivity analysis, candidate variants, then the fastest that fits.

(a) Quantize and prune one layer at a time and rank the layers by what that costs in the metric
    the constraints are on: top-1 (where the optimizer may use labels), agreement with the
    baseline, or cosine similarity to it (no labels needed).
(b) Build candidates that move fidelity, for both back ends:
    - torch int8 keeping the k most quantization-sensitive layers in float (k = 0, 1, ...; FX or
      PT2E, as `quantize_options.mode` says);
    - onnxruntime static int8 with each calibration method, then with the most sensitive nodes
      excluded (`nodes_to_exclude`);
    - pruning ratios on a grid or by bisection (optionally fine-tuned or distilled), and where a
      ratio misses, the same ratio with the most prune-sensitive layers left whole;
    - the best pruning candidate quantized as well.
    Each family stops early: at its first candidate that meets every fidelity constraint when the
    next ones cannot beat it (more float layers, another calibration of the same speed), or at
    the first pruning ratio that no candidate meets (larger ratios remove more).
(c) :mod:`torchtame.search.selection` picks the fastest variant that meets every constraint.
Every candidate is an ordinary variant, built, saved and measured through the pipeline's public
step interface (:class:`StepRunner`), like any recipe step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from ..passes.static import NAME as STATIC
from ..pipeline.executor import Job
from .candidates import OnnxInt8, Pruning, Spec, TorchInt8
from .selection import fidelity_reasons
from .sensitivity import METRICS, pruning_sensitivity, quantization_sensitivity, score

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from ..data import DataBundle
    from ..progress import Progress
    from ..recipe import Constraints, Recipe
    from ..variant import Variant

log = logging.getLogger("torchtame")


class StepRunner(Protocol):
    """What the search needs from a pipeline: its inputs and a way to build and measure a step."""

    recipe: Recipe
    data: DataBundle
    progress: Progress
    variants: dict[str, Variant]
    baseline_outputs: torch.Tensor | None
    output: str | int | None
    task: str

    parallel: bool  # steps given together to run_steps build at once (Ray)

    def entry(self, name: str) -> dict[str, Any] | None: ...

    def run_step(self, name: str, pass_name: str, parent: str, options: BaseModel) -> dict[str, Any]: ...

    def run_steps(self, jobs: list[Job]) -> list[dict[str, Any]]: ...


def objective(c: Constraints, use_labels: bool, task: str) -> str:
    """The metric the search ranks layers by: the one the constraints are on."""
    if c.max_accuracy_drop is not None and use_labels:
        return "top1"
    if c.min_agreement is not None:
        return "agreement"
    if c.min_cosine is not None:
        return "cosine"
    if c.max_accuracy_drop is not None or task == "classification":
        return "top1" if use_labels else "agreement"
    return "cosine"


class Search:
    """One search over a pipeline's baseline; ``info`` is what results.json keeps."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        self.cfg = runner.recipe.search
        self.c = runner.recipe.constraints
        self.use_labels = bool(runner.data.use_labels)
        self.metric = objective(self.c, self.use_labels, runner.task)
        self.info: dict[str, Any] = {
            "sensitivity": {},
            "candidates": [],
            "stopped": [],
            "objective": self.metric,
        }

    def step(self, name: str, pass_name: str, parent: str, options: Any) -> tuple[dict[str, Any], list[str]]:
        """Build and measure one candidate; returns its entry and why it misses the fidelity
        constraints (empty: it meets them)."""
        entry = self.runner.run_step(name, pass_name, parent, options)
        self.info["candidates"].append(name)
        if entry["status"] != "ok":
            return entry, [f"failed: {entry.get('error', '')[:120]}"]
        return entry, fidelity_reasons(entry, self.c, self.use_labels)

    def steps(self, specs: list[Spec]) -> list[tuple[dict[str, Any], list[str]]]:
        """Several candidates at once (in parallel on Ray); their entries and shortfalls in order."""
        base = 1000 + len(self.info["candidates"])  # one seed per candidate, in submission order
        jobs = [Job(n, p, parent, o, base + i) for i, (n, p, parent, o) in enumerate(specs)]
        out = []
        for (name, *_), entry in zip(specs, self.runner.run_steps(jobs), strict=True):
            self.info["candidates"].append(name)
            ok = entry["status"] == "ok"
            out.append(
                (
                    entry,
                    fidelity_reasons(entry, self.c, self.use_labels)
                    if ok
                    else [f"failed: {entry.get('error', '')[:120]}"],
                )
            )
        return out

    def stop(self, family: str, reason: str) -> None:
        self.info["stopped"].append({"family": family, "reason": reason})
        log.info("search: %s: %s", family, reason)

    # ------------------------------------------------------------- sensitivity

    def sensitivity(self) -> None:
        r, cfg = self.runner, self.cfg
        base = r.variants["baseline"].module
        assert base is not None
        r.progress.status("sensitivity analysis")
        base_score = score(base, r.data, r.baseline_outputs, None, self.metric, r.output)
        sens = self.info["sensitivity"]
        if cfg.quantize or cfg.onnx:
            sens["quantize"] = quantization_sensitivity(
                base,
                r.data,
                base_score,
                r.baseline_outputs,
                cfg.quantize_options,
                r.progress,
                self.metric,
                r.output,
            )
        if cfg.prune:
            sens["prune"] = pruning_sensitivity(
                base,
                r.data,
                base_score,
                r.baseline_outputs,
                cfg.sensitivity_prune_ratio,
                cfg.prune_options.importance,
                r.progress,
                self.metric,
                r.output,
            )
        sens["basis"] = METRICS[self.metric]
        sens["prune_ratio"] = cfg.sensitivity_prune_ratio

    def ranked(self, kind: str) -> list[str]:
        return [s["layer"] for s in self.info["sensitivity"].get(kind, []) if s.get("drop") is not None]

    # ------------------------------------------------------------- the whole search

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        if self.c.min_agreement is not None and self.runner.task != "classification":
            self.stop(
                "all", "min_agreement needs class-score outputs; this output is features (use min_cosine)"
            )
        if cfg.sensitivity:
            self.sensitivity()
        keep: list[str] = []
        if cfg.quantize:
            keep = TorchInt8().run(self)
        if cfg.onnx:
            OnnxInt8().run(self)
        best_pruned = None
        if cfg.prune:
            best_pruned = Pruning().run(self)
            self.info["best_pruned"] = best_pruned
        if cfg.combine and cfg.quantize and best_pruned is not None:
            qopts = cfg.quantize_options
            self.step(
                f"{best_pruned}-int8",
                STATIC,
                best_pruned,
                qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]}),
            )
        self.info["kept_float"] = keep
        return self.info


def run_search(runner: StepRunner) -> dict[str, Any]:
    """Run the search on the baseline; returns what results.json keeps under ``search``."""
    return Search(runner).run()


__all__ = ["Search", "StepRunner", "objective", "run_search"]
