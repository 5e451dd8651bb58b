"""The search's candidate families, each a function of the :class:`~torchtame.search.Search`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..passes.export import OnnxOptions
from ..passes.prune import PruneOptions
from .sensitivity import execution_order

if TYPE_CHECKING:
    from . import Search

log = logging.getLogger("torchtame")


def torch_int8(self: Search) -> list[str]:
    """Static int8 keeping the k most sensitive layers float, k = 0, 1, ... until it meets."""
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


def onnx_int8(self: Search) -> None:
    """onnxruntime static int8: each calibration method, then the most sensitive nodes excluded."""
    cfg = self.cfg
    twin, reasons = self.step("search-onnx", "export.onnx", "baseline", OnnxOptions())
    if twin["status"] != "ok":
        self.stop("onnxruntime", f"no ONNX twin: {reasons[0]}")
        return
    base_opts = cfg.onnx_options
    best: tuple[float, str, dict[str, Any]] | None = None
    if self.runner.parallel:  # every calibration at once; the first that meets is kept
        specs = [
            (
                f"search-onnx-int8-{m.lower()}",
                "quantize.onnx",
                "search-onnx",
                base_opts.model_copy(update={"calibration_method": m}),
            )
            for m in cfg.onnx_methods
        ]
        results = self.steps(specs)
        if any(not reasons for _, reasons in results):
            return
        for method, (entry, _) in zip(cfg.onnx_methods, results, strict=True):
            if entry["status"] == "ok" and (best is None or _figure(self, entry) > best[0]):
                best = (_figure(self, entry), method, entry)
    for i, method in enumerate([] if self.runner.parallel else cfg.onnx_methods):
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
            value = _figure(self, entry)
            if best is None or value > best[0]:
                best = (value, method, entry)
    if best is None:
        return
    _, method, entry = best
    nodes = _onnx_nodes(self, entry)
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
        options = base_opts.model_copy(update={"calibration_method": method, "nodes_to_exclude": excluded})
        _, reasons = self.step(name, "quantize.onnx", "search-onnx", options)
        if not reasons:
            return


def _figure(self: Search, entry: dict[str, Any]) -> float:
    acc = entry.get("accuracy") or {}
    if self.metric == "top1":
        return acc.get("top1", 0.0)
    if self.metric == "agreement":
        return acc.get("top1_agreement", 0.0)
    return acc.get("cosine_similarity", -1.0)


def _onnx_nodes(self: Search, entry: dict[str, Any]) -> list[str]:
    """ONNX node names of the most quantization-sensitive torch layers: the k-th weight node of
    the ONNX graph is the k-th weight layer the torch model runs (checked by their count)."""
    graph = (entry.get("info") or {}).get("graph") or {}
    order = execution_order(self.runner.variants["baseline"].module, self.runner.data.example_input(1))
    if not graph.get("weight_nodes") or len(graph["weight_nodes"]) != len(order):
        return []
    mapping = dict(zip(order, graph["weight_nodes"], strict=True))
    return [mapping[layer] for layer in self.ranked("quantize") if layer in mapping]


def pruning(self: Search) -> str | None:
    """Pruning ratios (grid or bisection), retried with the most sensitive layers left whole."""
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
    if cfg.prune_search == "grid" and self.runner.parallel:  # the whole grid at once
        ratios = sorted(cfg.prune_ratios)
        specs: list[tuple[str, str, str, Any]] = []
        for ratio in ratios:
            name = f"search-pruned-{ratio * 100:.3g}"
            specs.append(
                (
                    name,
                    "prune.structured",
                    "baseline",
                    PruneOptions.model_validate({**base_prune, "ratio": ratio}),
                )
            )
            if cfg.finetune is not None:
                specs.append((f"{name}-ft", "finetune", name, cfg.finetune))
        results = self.steps(specs)
        step = 2 if cfg.finetune is not None else 1
        for ratio, (_, reasons) in zip(ratios, results[step - 1 :: step], strict=True):
            name = f"search-pruned-{ratio * 100:.3g}" + ("-ft" if cfg.finetune is not None else "")
            if not reasons:
                best = name
            elif protect:
                name, ok = candidate(ratio, protect)
                best = name if ok else best
        return best
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
