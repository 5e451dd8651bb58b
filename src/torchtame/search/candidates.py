"""The search's candidate families. Each family is a small object with a ``run(search)`` that
builds its candidates through the :class:`~torchtame.search.Search` it is given (``step``,
``steps``, ``stop``, ``ranked``); the search only orders the families and combines their
results, as Torch-Pruning keeps its pruners apart from the importance they use."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..evaluate.graph import qdq_changes
from ..passes.export import NAME as ONNX_EXPORT
from ..passes.export import OnnxOptions
from ..passes.finetune import NAME as FINETUNE
from ..passes.onnx_quant import NAME as ONNX_QUANTIZE
from ..passes.prune import NAME as PRUNE
from ..passes.prune import PruneOptions
from ..passes.qat import NAME as QAT
from ..passes.static import NAME as STATIC
from ..results import accuracy_of, info_of
from .sensitivity import execution_order

if TYPE_CHECKING:
    from . import Search

log = logging.getLogger("torchtame")

Spec = tuple[str, str, str, Any]  # name, pass, parent, options
# a candidate with more layers float that scores lower than this below its parent is a finding
COSINE_NOISE = 1e-3
POINTS_NOISE = 1.0  # top-1 or agreement, in points


def figure(search: Search, entry: dict[str, Any]) -> float:
    """The entry's value of the metric the search ranks by (higher is better)."""
    acc = accuracy_of(entry)
    if search.metric == "top1":
        return acc.get("top1", 0.0)
    if search.metric == "agreement":
        return acc.get("top1_agreement", 0.0)
    return acc.get("cosine_similarity", -1.0)


class TorchInt8:
    """Static int8 keeping the k most sensitive layers float, k = 0, 1, ... until it meets."""

    family = "torch int8"

    def run(self, s: Search, parent: str = "baseline", prefix: str = "search-int8") -> list[str]:
        """The layers kept float by the first candidate that meets (or by the last tried)."""
        qopts = s.cfg.quantize_options
        ranked = s.ranked("quantize")
        most = min(s.cfg.max_float_layers, len(ranked))
        keep: list[str] = []
        for k in range(0, most + 1):
            keep = ranked[:k]
            name = prefix if k == 0 else f"{prefix}-float{k}"
            options = qopts.model_copy(update={"keep_float": [*qopts.keep_float, *keep]})
            _, reasons = s.step(name, STATIC, parent, options)
            if not reasons or (k == 0 and self.recovered(s, parent, prefix)):
                if k < most:
                    s.stop(
                        self.family,
                        f"{name if not reasons else f'{prefix}-recovered'} meets the fidelity "
                        "constraints; more float layers cannot be faster",
                    )
                return keep
            log.info(
                "%s misses the constraints (%s); keeping one more sensitive layer in float",
                name,
                "; ".join(reasons),
            )
        if s.cfg.qat:
            self.qat(s, parent, prefix)
        return keep

    def recovered(self, s: Search, parent: str, prefix: str) -> bool:
        """Plain int8 missed: the same with accuracy recovery (``recovery: auto``); whether it meets."""
        qopts = s.cfg.quantize_options
        if not s.cfg.recovery or qopts.recovery != "none":
            return False
        log.info("plain int8 misses the constraints; trying it with accuracy recovery (recovery: auto)")
        options = qopts.model_copy(update={"recovery": "auto"})
        entry, reasons = s.step(f"{prefix}-recovered", STATIC, parent, options)
        chosen = ((info_of(entry) or {}).get("recovery") or {}).get("chosen")
        s.info.setdefault("recovery", {})[parent] = {
            "meets": not reasons,
            "chosen": chosen,
            "reasons": reasons,
        }
        return not reasons

    def qat(self, s: Search, parent: str, prefix: str) -> None:
        """Post-training int8 missed even with sensitive layers float: quantization-aware training."""
        log.info("post-training int8 misses the constraints; trying quantization-aware training")
        _, reasons = s.step(f"{prefix}-qat", QAT, parent, s.cfg.qat_options)
        s.info.setdefault("qat", {})[parent] = {"meets": not reasons, "reasons": reasons}


class OnnxInt8:
    """onnxruntime static int8: each calibration method, then the most sensitive nodes excluded."""

    family = "onnxruntime"
    twin = "search-onnx"

    def run(self, s: Search) -> None:
        twin, reasons = s.step(self.twin, ONNX_EXPORT, "baseline", OnnxOptions())
        if twin["status"] != "ok":
            s.stop(self.family, f"no ONNX twin: {reasons[0]}")
            return
        best = self.calibrations(s)
        if best is not None:
            self.exclusions(s, *best)

    def name(self, method: str) -> str:
        return f"search-onnx-int8-{method.lower()}"

    def options(self, s: Search, method: str, excluded: list[str] | None = None) -> Any:
        update: dict[str, Any] = {"calibration_method": method}
        if excluded is not None:
            update["nodes_to_exclude"] = excluded
        return s.cfg.onnx_options.model_copy(update=update)

    def calibrations(self, s: Search) -> tuple[str, dict[str, Any]] | None:
        """Each calibration method; None when one meets the constraints (nothing left to do),
        else the best method and its entry."""
        methods = s.cfg.onnx_methods
        if s.runner.parallel:  # every calibration at once
            results = s.steps([(self.name(m), ONNX_QUANTIZE, self.twin, self.options(s, m)) for m in methods])
        else:
            results = []
            for i, method in enumerate(methods):
                entry, reasons = s.step(self.name(method), ONNX_QUANTIZE, self.twin, self.options(s, method))
                results.append((entry, reasons))
                if not reasons:
                    if i + 1 < len(methods):
                        s.stop(
                            self.family,
                            f"{self.name(method)} meets the fidelity constraints; other calibrations run "
                            "as fast",
                        )
                    break
        if any(not reasons for _, reasons in results):
            return None
        built = [
            (figure(s, e), m, e) for m, (e, _) in zip(methods, results, strict=False) if e["status"] == "ok"
        ]
        if not built:
            return None
        _, method, entry = max(built, key=lambda b: b[0])
        return method, entry

    def exclusions(self, s: Search, method: str, entry: dict[str, Any]) -> None:
        """The best calibration again, with the k most sensitive nodes (and their feeders) float."""
        nodes = self.sensitive_nodes(s, entry)
        if not nodes:
            s.stop(
                self.family,
                "the ONNX weight nodes do not map one to one onto the torch layers; no nodes excluded",
            )
            return
        feeders = (info_of(entry).get("graph") or {}).get("feeders") or {}
        parent = self.name(method), entry
        for k in range(1, min(s.cfg.max_float_layers, len(nodes)) + 1):
            # the node's input stays float only if its feeders (concat, reshape, ...) are excluded too
            excluded = list(dict.fromkeys(n for node in nodes[:k] for n in [node, *feeders.get(node, [])]))
            name = f"{self.name(method)}-float{k}"
            child, reasons = s.step(name, ONNX_QUANTIZE, self.twin, self.options(s, method, excluded))
            if child["status"] == "ok":
                self.explain_loss(s, parent, (name, child), excluded)
                parent = name, child
            if not reasons:
                return

    def explain_loss(
        self,
        s: Search,
        parent: tuple[str, dict[str, Any]],
        child: tuple[str, dict[str, Any]],
        excluded: list[str],
    ) -> None:
        """Where keeping more nodes float lowered the ranking figure by more than noise, record it
        (``search.float_lowered``, one warning line) with what changed in the activations' Q/DQ
        between the two models, so the surprise says where it comes from."""
        before, after = figure(s, parent[1]), figure(s, child[1])
        if after >= before - (COSINE_NOISE if s.metric == "cosine" else POINTS_NOISE):
            return
        record: dict[str, Any] = {
            "candidate": child[0],
            "parent": parent[0],
            "metric": s.metric,
            "before": before,
            "after": after,
            "excluded": excluded,
        }
        paths = [getattr(s.runner.variants.get(n), "onnx_path", None) for n in (parent[0], child[0])]
        if all(paths):
            changes = qdq_changes(*paths)
            record["qdq_changes"] = changes
            others = len(changes["newly_quantized"]) + len(changes["range_moved"])
            record["why"] = (
                f"keeping {len(excluded)} node(s) float moved the quantization of {others} other "
                "activation tensor(s) (newly_quantized, range_moved)"
                if others
                else "no activation outside the excluded nodes changed its Q/DQ: the difference is "
                "in the excluded nodes themselves (float weights and outputs) or noise of the "
                "evaluation data"
            )
        s.info.setdefault("float_lowered", []).append(record)
        log.warning(
            "search: %s (%s float) has %s %.4g against %.4g for %s: %s",
            child[0],
            ", ".join(excluded),
            s.metric,
            after,
            before,
            parent[0],
            record.get("why", "no ONNX files to compare"),
        )

    def sensitive_nodes(self, s: Search, entry: dict[str, Any]) -> list[str]:
        """ONNX node names of the most quantization-sensitive torch layers: the k-th weight node of
        the ONNX graph is the k-th weight layer the torch model runs (checked by their count)."""
        graph = info_of(entry).get("graph") or {}
        order = execution_order(s.runner.variants["baseline"].module, s.runner.data.example_input(1))
        if not graph.get("weight_nodes") or len(graph["weight_nodes"]) != len(order):
            return []
        mapping = dict(zip(order, graph["weight_nodes"], strict=True))
        return [mapping[layer] for layer in s.ranked("quantize") if layer in mapping]


@dataclass
class Pruning:
    """Pruning ratios (grid or bisection), retried with the most sensitive layers left whole."""

    family = "pruning"

    def run(self, s: Search) -> str | None:
        """The name of the most pruned candidate that meets the constraints."""
        self.s = s
        self.base = s.cfg.prune_options.model_dump(exclude_unset=True)
        self.protect = s.ranked("prune")[: s.cfg.protect_layers]
        if s.cfg.prune_search == "grid":
            return self.grid_at_once() if s.runner.parallel else self.grid()
        return self.bisect()

    def name(self, ratio: float, protected: list[str] | None = None) -> str:
        return f"search-pruned-{ratio * 100:.3g}" + (f"-protect{len(protected)}" if protected else "")

    def options(self, ratio: float, protected: list[str] | None = None) -> PruneOptions:
        ratios = {**self.base.get("layer_ratios", {}), **dict.fromkeys(protected or [], 0.0)}
        return PruneOptions.model_validate({**self.base, "ratio": ratio, "layer_ratios": ratios})

    def candidate(self, ratio: float, protected: list[str] | None = None) -> tuple[str, bool]:
        """One pruned candidate (fine-tuned, where the search says so); whether it meets."""
        s = self.s
        name = self.name(ratio, protected)
        entry, reasons = s.step(name, PRUNE, "baseline", self.options(ratio, protected))
        if s.cfg.finetune is not None and entry["status"] == "ok":
            s.info["candidates"].pop()  # the fine-tuned one is the candidate
            name = f"{name}-ft"
            entry, reasons = s.step(name, FINETUNE, entry["name"], s.cfg.finetune)
        return name, not reasons

    def grid_at_once(self) -> str | None:
        """The whole grid in parallel (Ray); a missing ratio retried with its layers protected."""
        s, best = self.s, None
        ratios = sorted(s.cfg.prune_ratios)
        tuned = s.cfg.finetune is not None
        specs: list[Spec] = []
        for ratio in ratios:
            specs.append(
                (
                    self.name(ratio),
                    PRUNE,
                    "baseline",
                    PruneOptions.model_validate({**self.base, "ratio": ratio}),
                )
            )
            if tuned:
                specs.append((f"{self.name(ratio)}-ft", FINETUNE, self.name(ratio), s.cfg.finetune))
        results = s.steps(specs)
        step = 2 if tuned else 1
        for ratio, (_, reasons) in zip(ratios, results[step - 1 :: step], strict=True):
            if not reasons:
                best = self.name(ratio) + ("-ft" if tuned else "")
            elif self.protect:
                name, ok = self.candidate(ratio, self.protect)
                best = name if ok else best
        return best

    def grid(self) -> str | None:
        """Ratios in increasing order until one misses (larger ones remove more)."""
        s, best = self.s, None
        for ratio in sorted(s.cfg.prune_ratios):
            name, ok = self.candidate(ratio)
            if not ok and self.protect:
                name, ok = self.candidate(ratio, self.protect)
            if not ok:
                larger = [r for r in s.cfg.prune_ratios if r > ratio]
                if larger:
                    shown = ", ".join(f"{r:g}" for r in larger)
                    s.stop(
                        self.family,
                        f"no candidate at ratio {ratio:g} meets the constraints; larger ratios ({shown}) "
                        "remove more",
                    )
                break
            best = name
        return best

    def bisect(self) -> str | None:
        """The largest ratio that still meets the constraints, by bisection."""
        s, best = self.s, None
        lo, hi = 0.0, max(s.cfg.prune_ratios)
        for _ in range(s.cfg.bisect_steps):
            mid = round((lo + hi) / 2, 4)
            name, ok = self.candidate(mid)
            if ok:
                best, lo = name, mid
            else:
                hi = mid
        return best
