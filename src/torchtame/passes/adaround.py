"""Adaptive rounding (AdaRound, Nagel et al. 2020) written back into float weights.

Round-to-nearest is not the best rounding of a layer's weights: rounding some weights up and
others down so that their errors cancel on real inputs keeps the layer's *output* closer to
float. AdaRound learns that choice per weight on calibration data: a soft rounding variable
``h(V)`` in [0, 1] replaces the fraction, the layer's output error plus a regulariser that pushes
``h`` to 0 or 1 is minimised, and the hard choice ``floor(w / s) + [V >= 0]`` is kept.

The chosen integers are written back as float weights ``s * q`` on the same per-channel symmetric
grid the back end uses (:func:`weight_grid`: -128..127 with scale = max|w| / 127.5 per output
channel, as torch.ao's, torchao's and onnxruntime's Conv observers compute it; onnxruntime's
Gemm/MatMul weights -127..127, max|w| / 127; 7-bit grids on CPUs without VNNI: PT2E's -64..63,
max|w| / 63.5, onnxruntime's ``reduce_range`` -64..64, max|w| / 64). Each channel's largest weight
is left exactly as it was, so the back end computes the very same scale from the written weights and its
round-to-nearest reproduces the learned integers (:func:`integers` says which ones; the
quantize passes check their converted models against them).

BatchNorms are folded into the convolution before them first: the back ends quantize the folded
weights, so those are the ones to round.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..inputs import call

log = logging.getLogger("torchtame")

WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Linear)
ZETA, GAMMA = 1.1, -0.1  # the rectified sigmoid's stretch (as in the paper and AIMET)
_LR, _REG = 5e-2, 0.1  # Adam on V, and the rounding regulariser (chosen on tf_efficientnet_lite0)


class _Captured(Exception):
    """Stops a forward pass once the layer of interest has seen its input."""


Grid = tuple[int, int]
_GRID: contextvars.ContextVar[tuple[Grid, Grid]] = contextvars.ContextVar(
    "weight_grid", default=((-128, 127), (-128, 127))
)


@contextlib.contextmanager
def weight_grid(conv: Grid, linear: Grid | None = None) -> Iterator[None]:
    """Within this block, weight rounding (AdaRound, bias correction's and the sensitivity
    ranking's simulated int8 weights) uses the symmetric grid ``low..high`` of the back end that
    will quantize the model: ``conv`` for convolutions, ``linear`` (default: the same) for
    Linear layers."""
    token = _GRID.set((conv, linear or conv))
    try:
        yield
    finally:
        _GRID.reset(token)


def grid(w: torch.Tensor) -> Grid:
    """The symmetric int8 grid in force for weight ``w`` (:func:`weight_grid`; a Linear's weight
    is 2-d; default -128..127)."""
    conv, linear = _GRID.get()
    return linear if w.dim() == 2 else conv


def grid_scale(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric scale on :func:`grid`, shaped to broadcast against ``w``."""
    low, high = grid(w)
    scale = w.detach().abs().flatten(1).amax(dim=1).clamp_min(1e-12) / ((high - low) / 2)
    return scale.reshape((-1,) + (1,) * (w.dim() - 1))


def rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` rounded to nearest on :func:`grid` (the integers, as floats)."""
    low, high = grid(w)
    return torch.clamp(torch.round(w / grid_scale(w)), low, high)


def integers(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a back end's round-to-nearest makes of ``w`` on that grid, and where that is decided
    by a tie (on a grid of an odd number of steps each channel's largest weight sits at +-127.5 or
    +-63.5 steps: the back end's own scale, one float rounding apart from ours, may put it either
    side)."""
    low, high = grid(w)
    half = (high - low) / 2
    steps = w.detach() / grid_scale(w)
    tie = (steps.abs() - half).abs() < 1e-3 if half % 1 else torch.zeros_like(steps, dtype=torch.bool)
    return torch.clamp(torch.round(steps), low, high).to(torch.int8), tie


def _h(v: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.sigmoid(v) * (ZETA - GAMMA) + GAMMA, 0, 1)


def _layer_output(layer: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The layer's own forward with ``weight`` (so subclasses that pad in ``forward`` pad)."""
    return torch.func.functional_call(layer, {"weight": weight}, (x,), strict=False)


def _inputs(model: nn.Module, layer: nn.Module, batches: list[Any], limit: int) -> torch.Tensor | None:
    """The inputs ``layer`` receives on ``batches`` (each forward stops at the layer), at most
    ``limit`` rows."""
    seen: list[torch.Tensor] = []

    def grab(module: nn.Module, args: Any) -> None:
        seen.append(args[0].detach())
        raise _Captured

    handle = layer.register_forward_pre_hook(grab)
    try:
        with torch.no_grad():
            for x in batches:
                with contextlib.suppress(_Captured):
                    call(model, x)
                if sum(t.shape[0] for t in seen) >= limit:
                    break
    finally:
        handle.remove()
    if not seen:
        return None
    x = torch.cat(seen)
    if isinstance(layer, nn.Linear) and x.dim() > 2:
        x = x.flatten(0, -2)  # tokens are the samples of a Linear
    return x[:limit] if isinstance(layer, nn.Linear) else x


def round_layer(layer: nn.Module, x: torch.Tensor, iterations: int, seed: int = 0) -> dict[str, float]:
    """Learn ``layer``'s rounding on inputs ``x`` and write it back (see the module docstring)."""
    w = layer.weight.detach().clone()
    s = grid_scale(w)
    low, high = grid(w)
    floor = torch.floor(w / s)
    rest = (w / s - floor).clamp(0.01, 0.99)
    v = (-torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)).requires_grad_(True)
    opt = torch.optim.Adam([v], lr=_LR)
    gen = torch.Generator().manual_seed(seed)
    rows = 256 if isinstance(layer, nn.Linear) else 8
    warm = int(0.2 * iterations)
    with torch.no_grad():
        nearest = rounded(w) * s
        targets = _layer_output(layer, x, w)  # once, not once per iteration: a quarter of the work
    for it in range(iterations):
        idx = torch.randint(0, x.shape[0], (min(rows, x.shape[0]),), generator=gen)
        soft = s * torch.clamp(floor + _h(v), low, high)
        loss = nn.functional.mse_loss(_layer_output(layer, x[idx], soft), targets[idx])
        if it >= warm:
            beta = 20 + (2 - 20) * (it - warm) / max(1, iterations - warm)
            loss = loss + _REG * (1 - (2 * _h(v) - 1).abs().pow(beta)).sum() / v.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        q = torch.clamp(floor + (v >= 0).float(), low, high)
        new = s * q
        # each channel's largest weight stays as it was, so the back end's scale is the same
        flat_w, flat_new = w.flatten(1), new.flatten(1)
        top = flat_w.abs().argmax(dim=1, keepdim=True)
        flat_new.scatter_(1, top, flat_w.gather(1, top))
        new = flat_new.reshape(w.shape)
        xb = x[: min(x.shape[0], 4 * rows)]
        ref = targets[: xb.shape[0]]
        err_nearest = nn.functional.mse_loss(_layer_output(layer, xb, nearest), ref).item()
        err_ada = nn.functional.mse_loss(_layer_output(layer, xb, new), ref).item()
        flipped = (torch.round(w / s) != torch.round(new / s)).float().mean().item()
        if err_ada < err_nearest:
            layer.weight.copy_(new)
        else:  # never worse than round-to-nearest on these inputs
            layer.weight.copy_(nearest)
            flat = layer.weight.flatten(1)
            flat.scatter_(1, top, flat_w.gather(1, top))
    return {"mse_nearest": err_nearest, "mse_adaround": min(err_ada, err_nearest), "flipped": flipped}


def adaround(
    model: nn.Module,
    batches: list[Any],
    fold: Callable[[nn.Module], int],
    iterations: int = 200,
    skip: set[str] | None = None,
    samples: int = 64,
) -> dict[str, Any]:
    """AdaRound every conv/linear of ``model`` in place, layer by layer in module order (each
    layer's inputs come from the model with the earlier layers already rounded, so it learns to
    absorb their error too); ``fold`` folds the model's BatchNorms into their convolutions first."""
    t0 = time.perf_counter()
    folded = fold(model)
    names = [n for n, m in model.named_modules() if isinstance(m, WEIGHTED) and n not in (skip or set())]
    per_layer: dict[str, dict[str, float]] = {}
    for i, name in enumerate(names):
        layer = model.get_submodule(name)
        x = _inputs(model, layer, batches, samples if not isinstance(layer, nn.Linear) else 4096)
        if x is None:  # never called on these inputs
            continue
        per_layer[name] = round_layer(layer, x, iterations, seed=i)
    gains = [r["mse_nearest"] / max(r["mse_adaround"], 1e-20) for r in per_layer.values()]
    record: dict[str, Any] = {
        "algorithm": "adaround",
        "applied": len(per_layer),
        "iterations": iterations,
        "batchnorms_folded": folded,
        "median_output_mse_ratio": round(float(torch.tensor(gains).median()), 3) if gains else None,
        "weights_flipped_from_nearest": round(
            sum(r["flipped"] for r in per_layer.values()) / max(1, len(per_layer)), 4
        ),
        "expected_integers": {n: integers(model.get_submodule(n).weight) for n in per_layer},
        "seconds": round(time.perf_counter() - t0, 2),
    }
    log.info(
        "adaround: %d layers, output error %.2fx lower than round-to-nearest (median)",
        len(per_layer),
        record["median_output_mse_ratio"] or 1.0,
    )
    return record


def int8_weights(model: nn.Module) -> list[torch.Tensor]:
    """The int8 weight tensors a converted torch model stores: torch.ao's quantized modules
    (``weight()``) and PT2E's int8 graph constants."""
    found = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        if callable(w):
            try:
                t = w()
            except Exception:  # not a quantized module's packed-weight accessor
                continue
            if isinstance(t, torch.Tensor) and t.is_quantized:
                found.append(t.int_repr())
    graph = getattr(model, "graph", None)
    if graph is not None:
        for node in graph.nodes:
            if node.op == "get_attr":
                t = model
                for part in str(node.target).split("."):
                    t = getattr(t, part)
                if isinstance(t, torch.Tensor) and t.dtype == torch.int8:
                    found.append(t)
    return found


def check_integers(
    expected: dict[str, tuple[torch.Tensor, torch.Tensor]], found: list[torch.Tensor]
) -> dict[str, Any]:
    """Did the back end store the integers AdaRound chose? ``found``: the int8 weight tensors of the
    converted model; each expected layer counts as verified when one of them equals it exactly
    (ONNX stores a Linear's weight transposed, as MatMul reads it)."""
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for t in found:
        by_shape.setdefault(tuple(t.shape), []).append(t)

    def same(q: torch.Tensor, tie: torch.Tensor, t: torch.Tensor) -> bool:
        diff = (q.int() - t.int()).abs()
        return bool((diff[~tie] == 0).all() and (diff[tie] <= 1).all())

    def stored(q: torch.Tensor, tie: torch.Tensor) -> bool:
        forms = [(q, tie), (q.t(), tie.t())] if q.dim() == 2 else [(q, tie)]
        return any(same(f, m, t) for f, m in forms for t in by_shape.get(tuple(f.shape), []))

    verified = [n for n, (q, tie) in expected.items() if stored(q, tie)]
    missing = [n for n in expected if n not in verified]
    return {"layers_verified": f"{len(verified)}/{len(expected)}", "not_matched": missing[:20]}
