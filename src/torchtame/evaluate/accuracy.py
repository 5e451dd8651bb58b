"""Accuracy metrics (top-1, top-5) and fidelity against the baseline's outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..errors import TorchtameError
from ..inputs import batch_size, call, repeat_batch, select_output, stack_outputs
from ..onnx_runtime import compare_outputs
from ..registry import METRICS, register_metric, resolve_callable
from ..runtime import quantized_engine

MetricFn = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor | None], dict[str, float] | None]


def _topk(k: int) -> MetricFn:
    def metric(logits: torch.Tensor, labels: torch.Tensor | None, ref: torch.Tensor | None) -> Any:
        if labels is None or logits.dim() != 2 or logits.shape[1] < k:
            return None
        top = logits.topk(k, dim=1).indices
        hit = (top == labels.unsqueeze(1)).any(dim=1).float().mean().item()
        return {f"top{k}": round(100.0 * hit, 3)}

    return metric


def _fidelity(logits: torch.Tensor, labels: torch.Tensor | None, ref: torch.Tensor | None) -> Any:
    if ref is None or ref.shape != logits.shape:
        return None
    f = compare_outputs(ref, logits)
    out = {
        "max_abs_error": f["max_abs_error"],
        "mean_abs_error": f["mean_abs_error"],
        "cosine_similarity": f["cosine_similarity"],
    }
    if "top1_agreement" in f:
        out = {"top1_agreement": round(100.0 * f["top1_agreement"], 3), **out}
    return out


register_metric("top1")(_topk(1))
register_metric("top5")(_topk(5))
register_metric("fidelity")(_fidelity)
_imported: dict[str, MetricFn] = {}


def metric_fn(name: str) -> MetricFn:
    """A registered metric, or a ``module:callable`` imported on first use."""
    if name in METRICS:
        return METRICS.get(name).fn
    if name not in _imported:
        _imported[name] = resolve_callable(name, "evaluate.metrics")
    return _imported[name]


def predict(
    run: Callable[[Any], Any],
    prepare: Callable[[Any], Any],
    loader: DataLoader,
    output: str | int | None = None,
    fill_to: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The measured output (float32, CPU; see :func:`~torchtame.inputs.select_output`) and the
    labels over the whole loader.

    ``fill_to``: for a compiled variant, which compiles a graph per input shape (a minute on a
    real CNN): a last, smaller batch is filled up to this many samples with its own samples
    repeated and their outputs dropped, so it runs on the graph the full batches compiled. Where
    the output's first dimension is not the batch, that batch runs as it is."""
    outs, labels = [], []
    for x, y, *_ in loader:
        n = batch_size(x)
        out = None
        if fill_to is not None and n < fill_to:
            filled = select_output(run(prepare(repeat_batch(x, fill_to))), output)
            out = filled[:n] if filled.dim() and filled.shape[0] == fill_to else None
        if out is None:
            out = select_output(run(prepare(x)), output)
        outs.append(out.detach().float().cpu())
        labels.append(y)
    return stack_outputs(outs), torch.cat(labels)


def top1_accuracy(
    module: Callable[..., Any],
    loader: DataLoader,
    backend: str | None = None,
    output: str | int | None = None,
) -> float:
    """Top-1 accuracy in percent of ``module`` over a labelled loader (no autograd; quantized
    modules run under their ``backend`` engine)."""
    with quantized_engine(backend), torch.inference_mode():
        logits, labels = predict(lambda x: call(module, x), lambda x: x, loader, output)
    return 100.0 * (logits.argmax(1) == labels).float().mean().item()


def evaluate_accuracy(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    baseline_logits: torch.Tensor | None,
    metrics: list[str],
) -> dict[str, Any]:
    """Each requested metric that applies; labels None means accuracy is not measured."""
    result: dict[str, Any] = {}
    for name in metrics:
        value = metric_fn(name)(logits, labels, baseline_logits)
        if value is not None and not isinstance(value, dict):
            raise TorchtameError(
                f"metric {name!r} returned {type(value).__name__}, not a dict of name -> number"
            )
        if value is not None:
            result.update(value)
    if not torch.isfinite(logits).all():
        result["non_finite_outputs"] = int((~torch.isfinite(logits)).sum().item())
    return result
