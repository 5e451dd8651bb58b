"""Activation range search (``recovery: [range_search]``): per activation tensor, the clipping
range whose int8 rounding and clipping error on calibration data is smallest, instead of one
calibration method for the whole model.

Each tensor's values are collected as a histogram (2048 bins over its observed range). Candidate
ranges are min/max, two-sided percentiles (99.9999 ... 97) and a grid of clipping points (a
fraction of the lowest and of the highest value); each is scored by the expected squared error of
quantizing the tensor to ``levels`` steps on that range: a value inside the range costs the
rounding error scale^2 / 12, a value outside costs its distance to the range's edge. The lowest
error wins (ties go to the simpler method: min/max, then percentile). The squared error of the
tensor is what the next layer's output error grows with (for a Linear or convolution y = W x,
E|W e|^2 = tr(W^T W E[e e^T]), proportional to E|e|^2 for independent rounding errors), which is
how AIMET's TF-enhanced and NNCF's MSE range estimators choose ranges too.

The same search serves every back end: torch.ao FX / eager and PT2E through an observer class
(:func:`observer_class`, a HistogramObserver whose qparams come from the search), onnxruntime
through its histogram calibrator's per-tensor histograms and ``TensorQuantOverrides`` (rmin/rmax per
tensor, :mod:`.onnx_quant`).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch

QUANTILES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2)  # two-sided tails for the percentile candidates
FRACTIONS = torch.linspace(0.25, 1.0, 16).tolist()  # clipping points as fractions of the extremes


def _errors(
    counts: torch.Tensor, centers: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int
) -> torch.Tensor:
    """Expected squared quantization error of the histogram for each candidate range (lo[k], hi[k])."""
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)  # int8 ranges always hold zero exactly
    scale = ((hi - lo) / (levels - 1)).clamp(min=1e-12)
    clamped = torch.minimum(torch.maximum(centers[None, :], lo[:, None]), hi[:, None])
    clip = (centers[None, :] - clamped) ** 2
    rounding = (clip == 0).double() * (scale[:, None] ** 2 / 12)
    return ((clip + rounding) * counts[None, :]).sum(-1) / counts.sum().clamp(min=1)


def _tail(cdf: torch.Tensor, edges: torch.Tensor, q: float, upper: bool) -> float:
    """The value below which (upper=False) or above which (upper=True) a share q of the data lies."""
    i = int(torch.searchsorted(cdf, torch.tensor(1.0 - q if upper else q, dtype=cdf.dtype)))
    i = min(max(i, 0), len(edges) - 2)
    return float(edges[i + 1] if upper else edges[i])


def search_range(
    counts: torch.Tensor, edges: torch.Tensor, levels: int, data_min: float, data_max: float
) -> dict[str, Any]:
    """The range with the smallest expected squared error for a tensor whose values fell into
    ``counts`` over bins ``edges`` (observed extremes ``data_min``/``data_max``). Returns the range,
    the method that found it and its error relative to min/max's (1.0: no better)."""
    counts, edges = counts.double().flatten(), edges.double().flatten()
    centers = (edges[:-1] + edges[1:]) / 2
    if counts.sum() <= 0 or data_max <= data_min:
        return {"min": data_min, "max": data_max, "method": "minmax", "error_ratio": 1.0}
    cdf = counts.cumsum(0) / counts.sum()
    named: list[tuple[str, float, float]] = [("minmax", data_min, data_max)]
    for q in QUANTILES:
        lo = max(data_min, _tail(cdf, edges, q, upper=False)) if data_min < 0 else data_min
        hi = min(data_max, _tail(cdf, edges, q, upper=True))
        named.append((f"percentile {100 * (1 - q):g}", lo, hi))
    lows = sorted({data_min * f for f in FRACTIONS} if data_min < 0 else {data_min})
    highs = sorted({data_max * f for f in FRACTIONS} if data_max > 0 else {data_max})
    grid = [("mse", lo, hi) for lo in lows for hi in highs]
    cands = named + grid
    err = _errors(
        counts,
        centers,
        torch.tensor([c[1] for c in cands], dtype=torch.float64),
        torch.tensor([c[2] for c in cands], dtype=torch.float64),
        levels,
    )
    best = int(torch.argmin(err))  # first minimum: min/max, then percentiles, then the grid
    method, lo, hi = cands[best]
    ratio = float(err[best] / err[0]) if err[0] > 0 else 1.0
    return {"min": lo, "max": hi, "method": method.split(" ")[0], "error_ratio": round(ratio, 4)}


class RangeSearch:
    """Mixin over a HistogramObserver (torch.ao's or torchao's): qparams from :func:`search_range`,
    the choice kept on the observer (``range_choice``) for the run's record."""

    def calculate_qparams(self: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.min_val == float("inf") and self.max_val == float("-inf"):
            return super().calculate_qparams()  # not calibrated: the observer's own warning
        lo, hi = float(self.min_val), float(self.max_val)
        edges = torch.linspace(lo, hi, self.bins + 1, dtype=torch.float64)
        levels = self.quant_max - self.quant_min + 1
        self.range_choice = choice = search_range(self.histogram, edges, levels, lo, hi)
        like = self.min_val
        return self._calculate_qparams(
            torch.tensor(choice["min"], dtype=like.dtype, device=like.device),
            torch.tensor(choice["max"], dtype=like.dtype, device=like.device),
        )


@functools.cache
def observer_class(base: type) -> type:
    """``base`` (torch.ao's or torchao's HistogramObserver) with the :class:`RangeSearch` qparams."""
    return type(f"RangeSearch{base.__name__}", (RangeSearch, base), {})


def summarise(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """What the search chose over a model's activation tensors, for ``info.recovery``."""
    if not choices:
        return {"tensors": 0}
    ratios = sorted(c["error_ratio"] for c in choices)
    return {
        "tensors": len(choices),
        "methods": dict(Counter(c["method"] for c in choices).most_common()),
        "median_error_vs_minmax": ratios[len(ratios) // 2],
        "narrowed": sum(1 for c in choices if c["method"] != "minmax"),
    }


def observed_choices(prepared: torch.nn.Module) -> dict[str, Any]:
    """Run the search on every range-search observer of a calibrated torch model and summarise."""
    found = []
    for m in prepared.modules():
        if isinstance(m, RangeSearch):
            m.calculate_qparams()
            if hasattr(m, "range_choice"):
                found.append(m.range_choice)
    return summarise(found)
