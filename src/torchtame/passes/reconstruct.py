"""Least-squares reconstruction of the layers whose inputs structured pruning removed.

When pruning removes attention heads or FFN channels, the layer that consumes them (a
Transformer's output projection or second FFN Linear, a CNN's classifier) still holds the weights
it had for the full input, now summed over fewer features. Its weights and bias are refitted by
ridge-regularised least squares so that, on calibration batches, its output on the *pruned*
model's inputs reproduces the *unpruned* layer's output on the unpruned model's inputs:

    W', b' = argmin || [X_pruned, 1] [W'; b']^T - Y_unpruned ||^2 + damp * mean(diag) * ||[W'; b']||^2

Layers are refitted one at a time in the order the forward pass reaches them, each on inputs
that already pass through the refitted layers before it, so later layers also absorb the error of
earlier ones (the layer-wise reconstruction of Kwon et al., "A Fast Post-Training Pruning
Framework for Transformers", NeurIPS 2022; ThiNet's for CNNs). It needs no labels and no
gradient steps; fine-tuning or distillation afterwards starts from a much closer model.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from ..inputs import call
from .recovery import observe


class _Stop(Exception):
    """Raised by a hook to end a forward pass once the layer of interest has run."""


def reconstruct_pruned_linears(
    pruned: nn.Module, unpruned: nn.Module, batches: list[Any], damp: float = 0.01
) -> dict[str, Any]:
    """Refit, in place, every ``nn.Linear`` of ``pruned`` whose same-named layer in ``unpruned``
    takes more input features (see the module docstring). Returns what was done: the layers, and
    the relative error of each layer's output against the unpruned one, before and after."""
    full = dict(unpruned.named_modules())
    targets = [
        (name, m)
        for name, m in pruned.named_modules()
        if isinstance(m, nn.Linear)
        and isinstance(full.get(name), nn.Linear)
        and full[name].in_features > m.in_features
        and full[name].out_features == m.out_features
    ]
    t0 = time.perf_counter()
    errors: dict[str, tuple[float, float]] = {}
    skipped: list[str] = []
    # (no probe forward where nothing is to be refitted: a CNN whose classifier was kept whole)
    ordered, calls = _in_call_order(pruned, targets, batches[0]) if targets and batches else ([], {})
    for name, layer in ordered:
        fit = None if calls.get(name) != 1 else _fit(pruned, unpruned, layer, full[name], batches, damp)
        if fit is None:
            skipped.append(name)
        else:
            errors[name] = fit
    out: dict[str, Any] = {
        "layers": len(errors),
        "batches": len(batches),
        "seconds": round(time.perf_counter() - t0, 1),
        "relative_error": {k: [round(a, 4), round(b, 4)] for k, (a, b) in errors.items()},
    }
    if skipped:
        out["skipped"] = skipped  # not called exactly once per forward in both models: left as pruned
    return out


def _in_call_order(
    model: nn.Module, targets: list[tuple[str, nn.Linear]], probe: Any
) -> tuple[list[tuple[str, nn.Linear]], dict[str, int]]:
    """``targets`` in the order a forward pass on batch ``probe`` calls them (module order where
    none ran), and how often it calls each."""
    order: dict[str, int] = {}
    calls: dict[str, int] = {}

    def seen(name: str) -> Any:
        def hook(*_: Any) -> None:  # (a hook that returns a value would replace the output)
            order.setdefault(name, len(order))
            calls[name] = calls.get(name, 0) + 1

        return hook

    observe(model, {name: seen(name) for name, _ in targets}, [probe])
    ordered = sorted(targets, key=lambda t: order.get(t[0], len(targets) + targets.index(t)))
    return ordered, calls


def _capture(model: nn.Module, layer: nn.Module, x: Any, what: str) -> list[torch.Tensor]:
    """``layer``'s input (``what='input'``) or output on batch ``x``; the forward stops right after
    the layer's first call. Empty where the layer does not run."""
    seen: list[torch.Tensor] = []

    def grab(_m: nn.Module, args: Any, out: Any) -> None:
        seen.append((args[0] if what == "input" else out).detach())
        raise _Stop

    handle = layer.register_forward_hook(grab)
    try:
        with torch.no_grad(), contextlib.suppress(_Stop):
            call(model, x)
    finally:
        handle.remove()
    return seen


def _fit(
    pruned: nn.Module, unpruned: nn.Module, layer: nn.Linear, full: nn.Linear, batches: list[Any], damp: float
) -> tuple[float, float] | None:
    """Accumulate the normal equations over ``batches`` and write the solution into ``layer``."""
    m = layer.in_features
    k = m + (layer.bias is not None)  # a layer without a bias is refitted without one
    xtx = torch.zeros(k, k, dtype=torch.float64)
    xty = torch.zeros(k, layer.out_features, dtype=torch.float64)
    ref_energy = 0.0
    for x in batches:
        xs, ys = _capture(pruned, layer, x, "input"), _capture(unpruned, full, x, "output")
        if len(xs) != 1 or len(ys) != 1 or xs[0].shape[:-1] != ys[0].shape[:-1]:
            return None
        a = xs[0].reshape(-1, m).double()
        if k > m:
            a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
        y = ys[0].reshape(-1, layer.out_features).double()
        xtx += a.T @ a
        xty += a.T @ y
        ref_energy += float((y * y).sum())
    w_old = layer.weight.detach().double().T
    if layer.bias is not None:
        w_old = torch.cat([w_old, layer.bias.detach().double().unsqueeze(0)], 0)
    # The ridge term is relative to the inputs' scale; a bias (last row) is not shrunk.
    reg = damp * xtx.diagonal()[:m].mean().clamp_min(1e-12) * torch.eye(k, dtype=xtx.dtype)
    if k > m:
        reg[m, m] = 0.0
    try:
        w = torch.linalg.solve(xtx + reg, xty)
    except RuntimeError:  # singular even with the ridge (a layer that sees constant inputs)
        return None

    # || A W - Y ||^2 = tr(W' A'A W) - 2 tr(W' A'Y) + ||Y||^2, from the accumulated sums
    def residual(v: torch.Tensor) -> float:
        r = float((v * (xtx @ v)).sum() - 2 * (v * xty).sum()) + ref_energy
        return max(r, 0.0) / max(ref_energy, 1e-30)

    before, after = residual(w_old), residual(w)
    if not after < before:  # never make a layer worse on the data it was fitted to
        return before, before
    with torch.no_grad():
        layer.weight.copy_(w[:m].T.to(layer.weight.dtype))
        if layer.bias is not None:
            layer.bias.copy_(w[m].to(layer.bias.dtype))
    return before**0.5, after**0.5
