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

A layer's output error is linear in its weight change, so for plain Conv2d and Linear layers it is
a matrix product of the change with the layer's input patches (:func:`_objective`): exactly, over
every calibration input, through the patches' second moments where that is cheaper (early
convolutions with many output positions, depthwise ones), else on patches drawn per step; only
subclasses (whose ``forward`` may pad) run their forward each step. The rounding variables'
gradient is written out rather than traced (:func:`_learn`). On resnet18 at 224x224 (100 steps,
2 cores) that took AdaRound from 113 to 65 s at the same fidelity.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections import Counter
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


def _patches(layer: nn.Module, x: torch.Tensor) -> Iterator[torch.Tensor]:
    """The input patches a plain Conv2d (per group) or Linear multiplies by its weights, in chunks
    shaped (groups, K, patches)."""
    if isinstance(layer, nn.Linear):
        yield x.reshape(-1, layer.in_features).T.unsqueeze(0)
        return
    k = layer.weight[0].numel()
    for chunk in x.split(8):
        p = nn.functional.unfold(chunk, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
        p = p.reshape(p.shape[0], layer.groups, k, -1)  # unfold orders channels outermost: groups split them
        yield p.permute(1, 2, 0, 3).reshape(layer.groups, k, -1)


class _Quadratic(torch.autograd.Function):
    """``sum(d M * d)`` for symmetric ``M`` with its gradient ``2 d M`` kept from the forward: one
    matrix product per step where autograd would do two."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
        dm = torch.bmm(flat, moments)
        ctx.save_for_backward(dm)
        return (dm * flat).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (dm,) = ctx.saved_tensors
        return 2 * grad * dm, None


Objective = Callable[[torch.Tensor], torch.Tensor]
_PATCH_FLOATS = 64 * 2**20  # patches kept for sampling at most (256 MB); beyond: the layer's forward


def _through_forward(
    layer: nn.Module, x: torch.Tensor, out: torch.Tensor, rows: int, gen: torch.Generator
) -> tuple[str, Objective]:
    """The output error of ``rows`` inputs drawn per step, through the layer's own forward (so
    subclasses that pad in ``forward`` pad)."""
    w = layer.weight.detach()

    def forward(d: torch.Tensor) -> torch.Tensor:
        idx = torch.randint(0, x.shape[0], (min(rows, x.shape[0]),), generator=gen)
        return nn.functional.mse_loss(_layer_output(layer, x[idx], w + d), out[idx])

    return "forward", forward


def _objective(
    layer: nn.Module, x: torch.Tensor, out: torch.Tensor, rows: int, iterations: int, gen: torch.Generator
) -> tuple[str, Objective]:
    """The mean squared output error of a plain Conv2d or Linear (``mse_loss`` of its outputs on
    ``x``) as a function of a weight change ``d``: the layer is linear in its weight, so the error
    is ``d E[p p^T] d^T`` per output channel over its input patches ``p``. ``exact``: those moments,
    over every input, where building them and one product per step cost less than sampling;
    otherwise ``sampled``: ``rows`` inputs' worth of patches drawn per step, one matrix product
    each way. A subclass (its ``forward`` may pad or reshape) is sampled through its forward."""
    plain = type(layer) is nn.Linear or (
        type(layer) is nn.Conv2d and not isinstance(layer.padding, str) and layer.padding_mode == "zeros"
    )
    if not plain:
        return _through_forward(layer, x, out, rows, gen)
    cout, k, groups = layer.weight.shape[0], layer.weight[0].numel(), getattr(layer, "groups", 1)
    positions = 1 if isinstance(layer, nn.Linear) else out.shape[-1] * out.shape[-2]
    total = x.shape[0] * positions  # patches in all
    exact = total * groups * k * k + iterations * cout * k * k  # multiply-adds: moments, then each step
    if exact < iterations * 2 * rows * positions * cout * k:  # sampling: forward and gradient per step
        moments = sum(torch.bmm(p, p.transpose(1, 2)) for p in _patches(layer, x)) / total
        return "exact", lambda d: _Quadratic.apply(d.reshape(groups, cout // groups, k), moments) / cout
    if total * groups * k > _PATCH_FLOATS:
        return _through_forward(layer, x, out, rows, gen)
    patches = torch.cat(list(_patches(layer, x)), dim=2)
    draw = min(total, rows * positions)

    def sampled(d: torch.Tensor) -> torch.Tensor:
        idx = torch.randint(0, total, (draw,), generator=gen)
        err = torch.bmm(d.reshape(groups, cout // groups, k), patches[:, :, idx])
        return err.pow(2).sum() / (cout * draw)

    return "sampled", sampled


def _learn(objective: Objective, w: torch.Tensor, iterations: int) -> torch.Tensor:
    """AdaRound's optimisation of the rounding variables ``V`` of weight ``w`` (returned), with the
    gradient of the rectified sigmoid and the regulariser written out: autograd runs through the
    layer's error only, and the elementwise work per step is a few passes over the weight."""
    s, (low, high) = grid_scale(w), grid(w)
    floor = torch.floor(w / s)
    rest = (w / s - floor).clamp(0.01, 0.99)
    v = -torch.log((ZETA - GAMMA) / (rest - GAMMA) - 1)
    opt = torch.optim.Adam([v], lr=_LR, fused=True)
    warm = int(0.2 * iterations)
    for it in range(iterations):
        with torch.no_grad():
            sig = torch.sigmoid(v)
            raw = sig * (ZETA - GAMMA) + GAMMA
            h = raw.clamp(0, 1)
            q = floor + h
            d = (s * q.clamp(low, high) - w).requires_grad_(True)
        (grad,) = torch.autograd.grad(objective(d), d)
        with torch.no_grad():
            grad.mul_(s).mul_((q >= low) & (q <= high))
            if it >= warm:  # d/dh of _REG * mean(1 - |2h - 1| ** beta)
                beta = 20 + (2 - 20) * (it - warm) / max(1, iterations - warm)
                u = h.mul_(2).sub_(1)
                grad.add_(u.abs().pow_(beta - 1).mul_(u.sign()).mul_(-2 * beta * _REG / v.numel()))
            v.grad = grad.mul_(sig.mul_(1 - sig).mul_((ZETA - GAMMA) * ((raw >= 0) & (raw <= 1))))
        opt.step()
    return v


def round_layer(layer: nn.Module, x: torch.Tensor, iterations: int, seed: int = 0) -> dict[str, Any]:
    """Learn ``layer``'s rounding on inputs ``x`` and write it back (see the module docstring)."""
    w = layer.weight.detach().clone()
    s = grid_scale(w)
    low, high = grid(w)
    floor = torch.floor(w / s)
    gen = torch.Generator().manual_seed(seed)
    rows = 256 if isinstance(layer, nn.Linear) else 8
    with torch.no_grad():
        nearest = rounded(w) * s
        targets = _layer_output(layer, x, w)  # once, not once per iteration: a quarter of the work
        objective = _objective(layer, x, targets, rows, iterations, gen)
    v = _learn(objective[1], w, iterations)
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
    return {
        "mse_nearest": err_nearest,
        "mse_adaround": min(err_ada, err_nearest),
        "flipped": flipped,
        "objective": objective[0],
    }


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
        "objective_layers": dict(Counter(str(r["objective"]) for r in per_layer.values())),
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
