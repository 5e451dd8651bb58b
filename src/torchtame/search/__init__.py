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

from ..passes.export import OnnxOptions
from ..passes.prune import PruneOptions
from .selection import fidelity_reasons
from .sensitivity import METRICS, execution_order, pruning_sensitivity, quantization_sensitivity, score

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

    def entry(self, name: str) -> dict[str, Any] | None: ...

    def run_step(self, name: str, pass_name: str, parent: str, options: BaseModel) -> dict[str, Any]: ...


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

    # ------------------------------------------------------------- torch int8

    def torch_int8(self) -> list[str]:
        qopts = self.cfg.quantize_options
        ranked = self.ranked("quantize")
        keep: list[str] = []
        for k in range(0, min(self.cfg.max_float_layers, len(ranked)) + 1):
            keep = ranked[:k]
            name = "search-int8" if k == 0 else f"search-int8-float{k}"
            _, reasons = self.step(
                name,
                "quantize.static",
                "baseline",
                qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]}),
            )
            if not reasons:
                if k < min(self.cfg.max_float_layers, len(ranked)):
                    self.stop(
                        "torch int8",
                        f"{name} meets the fidelity constraints; more float layers cannot be faster",
                    )
                return keep
            log.info(
                "%s misses the constraints (%s); keeping one more sensitive layer in float",
                name,
                "; ".join(reasons),
            )
        return keep

    # ------------------------------------------------------------- onnxruntime

    def onnx_int8(self) -> None:
        cfg = self.cfg
        twin, reasons = self.step("search-onnx", "export.onnx", "baseline", OnnxOptions())
        if twin["status"] != "ok":
            self.stop("onnxruntime", f"no ONNX twin: {reasons[0]}")
            return
        base_opts = cfg.onnx_options
        best: tuple[float, str, dict[str, Any]] | None = None
        for i, method in enumerate(cfg.onnx_methods):
            name = f"search-onnx-int8-{method.lower()}"
            entry, reasons = self.step(
                name,
                "quantize.onnx",
                "search-onnx",
                base_opts.model_copy(update={"calibration_method": method}),
            )
            if not reasons:
                if i + 1 < len(cfg.onnx_methods):
                    self.stop(
                        "onnxruntime",
                        f"{name} meets the fidelity constraints; other calibrations run as fast",
                    )
                return
            if entry["status"] == "ok":
                value = self._figure(entry)
                if best is None or value > best[0]:
                    best = (value, method, entry)
        if best is None:
            return
        _, method, entry = best
        nodes = self._onnx_nodes(entry)
        if not nodes:
            self.stop(
                "onnxruntime",
                "the ONNX weight nodes do not map one to one onto the torch layers; no nodes excluded",
            )
            return
        feeders = ((entry.get("info") or {}).get("graph") or {}).get("feeders") or {}
        for k in range(1, min(cfg.max_float_layers, len(nodes)) + 1):
            name = f"search-onnx-int8-{method.lower()}-float{k}"
            # the node's input stays float only if its feeders (concat, reshape, ...) are excluded too
            excluded = list(dict.fromkeys(n for node in nodes[:k] for n in [node, *feeders.get(node, [])]))
            options = base_opts.model_copy(
                update={"calibration_method": method, "nodes_to_exclude": excluded}
            )
            _, reasons = self.step(name, "quantize.onnx", "search-onnx", options)
            if not reasons:
                return

    def _figure(self, entry: dict[str, Any]) -> float:
        acc = entry.get("accuracy") or {}
        if self.metric == "top1":
            return acc.get("top1", 0.0)
        if self.metric == "agreement":
            return acc.get("top1_agreement", 0.0)
        return acc.get("cosine_similarity", -1.0)

    def _onnx_nodes(self, entry: dict[str, Any]) -> list[str]:
        """ONNX node names of the most quantization-sensitive torch layers: the k-th weight node of
        the ONNX graph is the k-th weight layer the torch model runs (checked by their count)."""
        graph = (entry.get("info") or {}).get("graph") or {}
        order = execution_order(self.runner.variants["baseline"].module, self.runner.data.example_input(1))
        if not graph.get("weight_nodes") or len(graph["weight_nodes"]) != len(order):
            return []
        mapping = dict(zip(order, graph["weight_nodes"], strict=True))
        return [mapping[layer] for layer in self.ranked("quantize") if layer in mapping]

    # ------------------------------------------------------------- pruning

    def pruning(self) -> str | None:
        cfg = self.cfg
        base_prune = cfg.prune_options.model_dump(exclude_unset=True)
        protect = self.ranked("prune")[: cfg.protect_layers]

        def candidate(ratio: float, protected: list[str] | None = None) -> tuple[str, bool]:
            name = f"search-pruned-{ratio * 100:.3g}" + (f"-protect{len(protected)}" if protected else "")
            ratios = {**base_prune.get("layer_ratios", {}), **dict.fromkeys(protected or [], 0.0)}
            opts = PruneOptions.model_validate({**base_prune, "ratio": ratio, "layer_ratios": ratios})
            entry, reasons = self.step(name, "prune.structured", "baseline", opts)
            if cfg.finetune is not None and entry["status"] == "ok":
                self.info["candidates"].pop()  # the fine-tuned one is the candidate
                name = f"{name}-ft"
                entry, reasons = self.step(name, "finetune", entry["name"], cfg.finetune)
            return name, not reasons

        best = None
        if cfg.prune_search == "grid":
            for ratio in sorted(cfg.prune_ratios):
                name, ok = candidate(ratio)
                if not ok and protect:
                    name, ok = candidate(ratio, protect)
                if not ok:
                    larger = [r for r in cfg.prune_ratios if r > ratio]
                    if larger:
                        shown = ", ".join(f"{r:g}" for r in larger)
                        self.stop(
                            "pruning",
                            f"no candidate at ratio {ratio:g} meets the constraints; larger ratios ({shown}) "
                            "remove more",
                        )
                    break
                best = name
        else:  # bisect for the largest ratio that still meets the accuracy constraint
            lo, hi = 0.0, max(cfg.prune_ratios)
            for _ in range(cfg.bisect_steps):
                mid = round((lo + hi) / 2, 4)
                name, ok = candidate(mid)
                if ok:
                    best, lo = name, mid
                else:
                    hi = mid
        return best

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
            keep = self.torch_int8()
        if cfg.onnx:
            self.onnx_int8()
        best_pruned = None
        if cfg.prune:
            best_pruned = self.pruning()
            self.info["best_pruned"] = best_pruned
        if cfg.combine and cfg.quantize and best_pruned is not None:
            qopts = cfg.quantize_options
            self.step(
                f"{best_pruned}-int8",
                "quantize.static",
                best_pruned,
                qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]}),
            )
        self.info["kept_float"] = keep
        return self.info


def run_search(runner: StepRunner) -> dict[str, Any]:
    """Run the search on the baseline; returns what results.json keeps under ``search``."""
    return Search(runner).run()


__all__ = ["Search", "StepRunner", "objective", "run_search"]
