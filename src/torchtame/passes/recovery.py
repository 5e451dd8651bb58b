"""Accuracy recovery for post-training int8, applied to the float model before it is quantized, so
FX, PT2E and onnxruntime all keep the gain (``recovery:`` of ``quantize.static`` and
``quantize.onnx``, same names and meaning in both).

- ``equalization`` (cross-layer equalization, Nagel et al. 2019): for each pair of convolutions or
  linears joined by ReLU or nothing (a BatchNorm between them is folded first; depthwise
  convolutions included; Conv2d subclasses that pad in ``forward`` are convolutions too), output
  channel i of the first is divided by s_i and input channel i of the second multiplied by it, with
  s_i = sqrt(r1_i / r2_i) from the channels' weight ranges: both ranges become sqrt(r1_i r2_i), so
  per-channel int8 loses less on the narrow ones. ReLU(x / s) = ReLU(x) / s for s > 0, so the float
  function is kept exactly; ReLU6, Hardswish, SiLU and the like are not scale-equivariant, and
  such pairs are reported, never scaled. Then high-bias absorption: through a ReLU, what the
  first layer's output never goes below on calibration data moves into the second layer's bias,
  where that layer takes a constant exactly (no padding).
- ``bias_correction`` (empirical): each layer's bias absorbs the mean output error that rounding
  its weights to per-channel symmetric int8 causes on calibration data, E[(W - Q(W)) x], so the
  int8 layer's outputs are right on average.
- ``adaround`` (Nagel et al. 2020, :mod:`.adaround`): each layer's rounding up or down is learned
  on calibration data and written back as float weights on the back ends' int8 grid, so their
  round-to-nearest reproduces it (checked on the converted model).
- ``range_search`` (:mod:`.ranges`): per activation tensor, the clipping range with the smallest
  int8 error on calibration data among min/max, percentiles and a grid of clipping points. It does
  not change the float model: the pass calibrates with it (torch observers, onnxruntime per-tensor
  overrides), and its record says what each tensor got.
- ``weighted_ops_only``: only convolutions and matrix products are quantized; the inputs of
  Softmax, LayerNorm, GELU, Add and the like stay float (onnxruntime quantizes them by default,
  and plain ranges on them are what collapses Transformers). torch's X86 quantizer quantizes
  conv/linear (and what fuses into them) only already, so there it changes nothing and says so.
- ``smoothquant`` (Xiao et al. 2022): for Linears fed by a LayerNorm (Transformers), activation
  outliers move into the weights: input channel j is divided by
  s_j = max|X_j|^alpha / max|W_:,j|^(1 - alpha) (folded into the LayerNorm) and the Linears'
  weight columns multiplied by it.
- ``sensitive_float``: the ``float_layers`` conv/linear layers whose int8 (per-channel weights,
  their input on an 8-bit grid) costs most alone stay float (:func:`rank_sensitivity`, on
  calibration data). It does not change the float model: the pass keeps them out of the quantizer
  (``keep_float``), as ``strategy: search`` does with its ranked layers. ``auto`` tries it last,
  one layer more at a time on top of its best, only while that falls short of ``float_target``:
  each float layer costs speed.

Libraries: torch.ao's ``_equalize`` only handles nn.Sequential-adjacent modules and no BatchNorm
or depthwise pairs, torchao's SmoothQuant targets its own int8 tensor subclasses (not PT2E or
onnxruntime graphs), and aimet-torch / brevitas / NNCF replace the model's layers with their own
quantization wrappers; so these few well-defined transforms are written here, on plain float
modules, where every back end sees them (ARCHITECTURE.md says the same).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Self, get_args

import torch
from pydantic import Field, model_validator
from torch import nn

from ..inputs import batch_size, call, select_output
from ..options import Strict
from .adaround import adaround, check_integers, grid_scale, rounded, weight_grid

log = logging.getLogger("torchtame")

# in the order that composes: what the back end applies itself first, then smoothing and
# equalization change the weights, AdaRound rounds them, bias correction corrects what is left
Algorithm = Literal[
    "range_search",
    "weighted_ops_only",
    "smoothquant",
    "equalization",
    "adaround",
    "bias_correction",
    "sensitive_float",
]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
# what the back end applies at calibration or quantization, not a change of the float model
AT_QUANTIZATION = {
    "range_search": "calibration",
    "weighted_ops_only": "quantization",
    "sensitive_float": "quantization",
}
PRESERVING = ("smoothquant", "equalization")  # change float weights, keep the float function
KEEP_FLOAT = "torchtame_keep_float"  # the float model's attribute: layers sensitive_float keeps float
WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Linear)
SCALE_EQUIVARIANT = (nn.ReLU, nn.Identity)  # f(x / s) = f(x) / s for s > 0
NOT_EQUIVARIANT = (
    nn.ReLU6,
    nn.Hardswish,
    nn.Hardtanh,
    nn.SiLU,
    nn.GELU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardsigmoid,
)


@dataclass
class Pair:
    """Two weighted layers joined by at most a BatchNorm and an activation."""

    first: str
    bn: str | None
    act: str | None
    second: str


# --------------------------------------------------------------------------- what feeds what


def _trace_modules(model: nn.Module, example: Any) -> list[tuple[str, int, list[int]]]:
    """One forward pass with hooks: each leaf module's name, the id of its output tensor and the
    ids of its input tensors, in call order (every tensor is kept alive until the end, so no id
    is reused)."""
    calls: list[tuple[str, int, list[int]]] = []
    alive: list[Any] = []
    hooks = []

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                alive.extend([output, *args])
                calls.append((name, id(output), [id(a) for a in args if isinstance(a, torch.Tensor)]))

        return record

    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)
    leaves = (*WEIGHTED, *norms, *SCALE_EQUIVARIANT, *NOT_EQUIVARIANT)
    for name, m in model.named_modules():
        if isinstance(m, leaves):
            hooks.append(m.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            alive.append(call(model, example))
    finally:
        for h in hooks:
            h.remove()
    return calls


def _consumers(calls: list[tuple[str, int, list[int]]], mods: dict[str, nn.Module]) -> dict[str, list[str]]:
    """Node -> the nodes that take its output as their input, in call order (an in-place ReLU
    hands on the tensor it was given: it becomes that tensor's producer). A stateless activation
    called several times (resnet's shared ``relu``) is one node per call, ``name#k``; a weighted
    layer or norm called more than once is left out: its channels cannot be scaled for one
    caller. Uses by plain functions (a residual add) are invisible here; equalization checks the
    output instead."""
    counts: dict[str, int] = {}
    seen: dict[str, int] = {}
    producer: dict[int, str] = {}
    fed: dict[str, list[str]] = {}
    for name, _, _ in calls:
        counts[name] = counts.get(name, 0) + 1
    for name, out, ins in calls:
        seen[name] = seen.get(name, 0) + 1
        stateless = isinstance(mods[name], SCALE_EQUIVARIANT + NOT_EQUIVARIANT)
        node = f"{name}#{seen[name]}" if stateless and counts[name] > 1 else name
        if counts[name] == 1 or stateless:
            for i in ins:
                if i in producer and producer[i] != node:
                    fed.setdefault(producer[i], []).append(node)
            producer[out] = node
    return fed


def _module(mods: dict[str, nn.Module], node: str) -> nn.Module:
    return mods[node.split("#")[0]]


def _plain_bn(m: nn.Module) -> bool:
    """A BatchNorm and nothing more (timm's BatchNormAct2d subclasses add an activation)."""
    return type(m) in (nn.BatchNorm1d, nn.BatchNorm2d)


def find_pairs(
    model: nn.Module, example: Any, fed: dict[str, list[str]] | None = None
) -> tuple[list[Pair], list[str]]:
    """Equalizable pairs, and why other chains were left alone (``fed``: the model's traced
    consumers, where the caller has them already)."""
    mods = dict(model.named_modules())
    fed = fed if fed is not None else _consumers(_trace_modules(model, example), mods)
    pairs, skipped = [], []
    for name, m in mods.items():
        if not isinstance(m, WEIGHTED):
            continue
        node = name
        bn = act = None
        while len(fed.get(node, [])) == 1:
            nxt = fed[node][0]
            nm = _module(mods, nxt)
            if _plain_bn(nm) and bn is None and act is None:
                bn = nxt
            elif isinstance(nm, SCALE_EQUIVARIANT) and act is None:
                act = nxt
            elif isinstance(nm, (*NOT_EQUIVARIANT, nn.BatchNorm1d, nn.BatchNorm2d)):
                equivariant = not isinstance(nm, NOT_EQUIVARIANT)
                why = "a norm with an activation" if equivariant else "not scale-equivariant"
                skipped.append(f"{name} -> {nxt} ({type(nm).__name__}: {why})")
                break
            elif isinstance(nm, WEIGHTED):
                if _channels_match(m, nm):
                    pairs.append(Pair(name, bn, act, nxt))
                break
            else:
                break
            node = nxt
    return pairs, skipped


def _channels_match(a: nn.Module, b: nn.Module) -> bool:
    out = a.out_features if isinstance(a, nn.Linear) else a.out_channels
    if isinstance(b, nn.Linear):
        return isinstance(a, nn.Linear) and b.in_features == out
    if isinstance(a, nn.Linear) or b.in_channels != out:
        return False
    return b.groups == 1 or (b.groups == b.in_channels == b.out_channels)  # dense or depthwise


# --------------------------------------------------------------------------- equalization


def _fold_bn(model: nn.Module, conv_name: str, bn_name: str, keep: bool = False) -> None:
    """Fold an eval-mode BatchNorm into the convolution/linear before it; the BN becomes Identity
    (``keep``: it stays, with statistics that make its normalisation the identity)."""
    conv, bn = model.get_submodule(conv_name), model.get_submodule(bn_name)
    with torch.no_grad():
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(std)
        scale = gamma / std
        shape = (-1,) + (1,) * (conv.weight.dim() - 1)
        conv.weight.mul_(scale.reshape(shape))
        bias = conv.bias if conv.bias is not None else torch.zeros_like(std)
        new_bias = (bias - bn.running_mean) * scale + beta
        if conv.bias is None:
            conv.bias = nn.Parameter(new_bias)
        else:
            conv.bias.copy_(new_bias)
        if keep:
            bn.running_mean.zero_()
            bn.running_var.fill_(1.0 - bn.eps)
            if bn.weight is not None:
                bn.weight.fill_(1.0)
            if bn.bias is not None:
                bn.bias.zero_()
            return
    parent, _, child = bn_name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, nn.Identity())


def fold_batchnorms(model: nn.Module, example: Any) -> int:
    """Fold every BatchNorm that is the only consumer of a convolution/linear into it (as the back
    ends do before they quantize weights); returns how many. A BatchNorm subclass with more in it
    (timm's BatchNormAct2d) stays, its statistics made the identity, so its activation still runs."""
    mods = dict(model.named_modules())
    fed = _consumers(_trace_modules(model, example), mods)
    folded = 0
    for name, m in mods.items():
        nxt = fed.get(name, [])
        if not (isinstance(m, WEIGHTED) and len(nxt) == 1 and "#" not in nxt[0]):
            continue
        bn = mods[nxt[0]]
        if _plain_bn(bn):
            _fold_bn(model, name, nxt[0])
        elif isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.track_running_stats:
            _fold_bn(model, name, nxt[0], keep=True)
        else:
            continue
        folded += 1
    return folded


def _in_ranges(layer: nn.Module) -> torch.Tensor:
    """Per input channel: the range of the weights that read it."""
    w = layer.weight.detach()
    if isinstance(layer, nn.Linear):
        return w.abs().amax(dim=0)
    if layer.groups > 1:  # depthwise: weight[i] reads channel i
        return w.abs().flatten(1).amax(dim=1)
    return w.abs().transpose(0, 1).flatten(1).amax(dim=1)


def _scale_in(layer: nn.Module, s: torch.Tensor) -> None:
    w = layer.weight
    if isinstance(layer, nn.Linear):
        w.mul_(s.reshape(1, -1))
    elif layer.groups > 1:
        w.mul_(s.reshape((-1,) + (1,) * (w.dim() - 1)))
    else:
        w.mul_(s.reshape((1, -1) + (1,) * (w.dim() - 2)))


def _output(model: nn.Module, example: Any) -> torch.Tensor:
    from ..inputs import output_items

    with torch.no_grad():
        return torch.cat([t.float().flatten() for _, t in output_items(call(model, example))])


def observe(model: nn.Module, watched: dict[str, Callable[..., Any]], batches: list[Any]) -> None:
    """Run ``batches`` through ``model`` with a forward hook on each named module (removed after)."""
    hooks = [model.get_submodule(name).register_forward_hook(hook) for name, hook in watched.items()]
    try:
        with torch.no_grad():
            for x in batches:
                call(model, x)
    finally:
        for h in hooks:
            h.remove()


def _snapshot(modules: list[nn.Module]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in modules]


def _restore(modules: list[nn.Module], saved: list[dict[str, torch.Tensor]]) -> None:
    for m, state in zip(modules, saved, strict=True):
        m.load_state_dict(state)


def _scale_pair(model: nn.Module, p: Pair, s: torch.Tensor) -> None:
    a, b = model.get_submodule(p.first), model.get_submodule(p.second)
    a.weight.div_(s.reshape((-1,) + (1,) * (a.weight.dim() - 1)))
    if a.bias is not None:
        a.bias.div_(s)
    _scale_in(b, s)


def _factors(model: nn.Module, p: Pair) -> torch.Tensor:
    a, b = model.get_submodule(p.first), model.get_submodule(p.second)
    r1 = a.weight.detach().abs().flatten(1).amax(dim=1)
    r2 = _in_ranges(b)
    s = torch.sqrt(r1 / r2.clamp_min(1e-12)).clamp(1e-4, 1e4)
    return torch.where((r1 > 0) & (r2 > 0), s, torch.ones_like(s))


def equalize(
    model: nn.Module, example: Any, iterations: int = 4, batches: list[Any] | None = None
) -> dict[str, Any]:
    """Cross-layer equalization in place; returns what was done. Each pair is checked once on the
    example: where the first layer's output also reaches something else (a residual add, which
    hooks cannot see), scaling would change the model, so that pair is put back and left alone."""
    pairs, skipped = find_pairs(model, example)
    reference = _output(model, example)
    folded = 0
    for p in pairs:
        if p.bn is not None and _plain_bn(model.get_submodule(p.bn)):
            _fold_bn(model, p.first, p.bn)
            folded += 1
    spread_before = _range_spread(model, pairs)
    tolerance = 1e-4 * reference.abs().max().clamp_min(1e-12)
    kept = []
    with torch.no_grad():
        for p in pairs:
            touched = [model.get_submodule(p.first), model.get_submodule(p.second)]
            saved = _snapshot(touched)
            _scale_pair(model, p, _factors(model, p))
            if (_output(model, example) - reference).abs().max() > tolerance:
                _restore(touched, saved)  # its output is used elsewhere too
                skipped.append(f"{p.first} -> {p.second} (its output also feeds another path)")
            else:
                kept.append(p)
        for _ in range(iterations - 1):
            for p in kept:
                _scale_pair(model, p, _factors(model, p))
    absorbed = absorb_high_biases(model, kept, batches or [example])
    change = (_output(model, example) - reference).abs().max() / reference.abs().max().clamp_min(1e-12)
    error = change.item()
    return {
        "algorithm": "equalization",
        "applied": len(kept),
        "batchnorms_folded": folded,
        "pairs": [f"{p.first} -> {p.second}" for p in kept][:50],
        "skipped": skipped[:50],
        "channel_range_spread": {"before": spread_before, "after": _range_spread(model, kept)},
        "bias_absorption": absorbed,
        "float_output_change": round(error, 8),
    }


SIGMAS = 5  # high-bias absorption: the floor is the calibration minimum or mean - 5 std, the lower


def _exact_absorber(layer: nn.Module) -> bool:
    """Whether a constant added to this layer's input can move into its bias exactly: a Linear,
    or a plain convolution without padding (a padded one, or a subclass that pads in forward,
    would see the constant inside the image and zeros at its borders)."""
    if type(layer) is nn.Linear:
        return True
    if type(layer) not in (nn.Conv1d, nn.Conv2d) or layer.padding == "same":
        return False
    return layer.padding == "valid" or all(p == 0 for p in layer.padding)


def absorb_high_biases(model: nn.Module, pairs: list[Pair], batches: list[Any]) -> dict[str, Any]:
    """High-bias absorption (Nagel et al. 2019), after equalization: where a ReLU joins a pair,
    output channel i of the first layer is taken never to go below c_i (the lower of its minimum
    on the calibration batches and mean - 5 std, never below 0); c_i leaves the first layer's bias
    and enters the second's (W2 c), since ReLU(y) = ReLU(y - c) + c for y >= c. The ReLU's output
    range then starts nearer 0 instead of wasting [0, c) of the int8 grid. The paper's
    c = beta - 3 gamma clips values that do occur: on a ResNet-50 (32x32 inputs) it moved held-apart
    outputs by 0.6% of their range, the calibration minimum alone by 2.2%, this floor by < 1e-5.
    Only where the second layer takes a constant exactly (no padding); the rest are counted."""
    mods = dict(model.named_modules())
    relu = [p for p in pairs if p.act is not None and isinstance(_module(mods, p.act), nn.ReLU)]
    exact = [p for p in relu if _exact_absorber(model.get_submodule(p.second))]
    if not exact:
        return {"applied": 0, "channels": 0, "skipped_padded": len(relu)}
    firsts = {p.first: model.get_submodule(p.first) for p in exact}
    seen: dict[str, list[torch.Tensor]] = {}

    def watch(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            y = output.detach().float().transpose(0, 1).flatten(1)  # channel, values
            seen.setdefault(name, []).append(torch.stack([y.amin(1), y.mean(1), (y * y).mean(1)]))

        return record

    observe(model, {n: watch(n) for n in firsts}, batches)
    moved = channels = 0
    with torch.no_grad():
        for p in exact:
            stats = torch.stack(seen[p.first])
            mean, square = stats[:, 1].mean(0), stats[:, 2].mean(0)  # over equal batches
            floor = mean - SIGMAS * (square - mean**2).clamp_min(0).sqrt()
            c = torch.minimum(stats[:, 0].amin(0), floor).clamp_min(0)
            a, b = firsts[p.first], model.get_submodule(p.second)
            if a.bias is None or not bool((c > 0).any()):
                continue
            a.bias.sub_(c)
            w = b.weight if isinstance(b, nn.Linear) else b.weight.flatten(2).sum(2)  # (out, in)
            depthwise = not isinstance(b, nn.Linear) and b.groups > 1
            _add_to_bias(b, w[:, 0] * c if depthwise else w @ c)
            moved += 1
            channels += int((c > 0).sum())
    return {"applied": moved, "channels": channels, "skipped_padded": len(relu) - len(exact)}


def _range_spread(model: nn.Module, pairs: list[Pair]) -> float | None:
    """Median over the pairs' first layers of max/min per-channel weight range (1 is even)."""
    ratios = []
    for p in pairs:
        r = model.get_submodule(p.first).weight.detach().abs().flatten(1).amax(dim=1)
        r = r[r > 0]
        if r.numel():
            ratios.append((r.max() / r.min()).item())
    return round(float(torch.tensor(ratios).median()), 3) if ratios else None


# --------------------------------------------------------------------------- bias correction


def fake_quant_weight(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric int8 rounding, as the back end stores it (on the grid
    :func:`.adaround.weight_grid` sets: 8-bit, or 7-bit on CPUs without VNNI)."""
    return rounded(w) * grid_scale(w)


def _channel_mean(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    dims = list(range(y.dim() - 1)) if isinstance(module, nn.Linear) else [0, *range(2, y.dim())]
    return y.float().mean(dim=dims)


def _broadcast(module: nn.Module, c: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return c if isinstance(module, nn.Linear) else c.reshape((1, -1) + (1,) * (y.dim() - 2))


def _add_to_bias(m: nn.Module, correction: torch.Tensor) -> float:
    """``m.bias += correction`` (a bias made where there was none); the mean absolute shift."""
    if m.bias is None:
        m.bias = nn.Parameter(correction.to(m.weight.dtype))
    else:
        m.bias.add_(correction.to(m.bias.dtype))
    return correction.abs().mean().item()


def correct_bias(model: nn.Module, batches: list[Any], skip: set[str] | None = None) -> dict[str, Any]:
    """Empirical bias correction in place: on each calibration batch, the float model's mean output
    of every layer is compared with a copy whose weights are rounded to int8, layer by layer in
    call order (each corrected before the next runs, so the error a layer inherits is corrected
    too); the mean difference per output channel, averaged over ``batches``, goes into the bias."""
    names = {n for n, m in model.named_modules() if isinstance(m, WEIGHTED) and n not in (skip or set())}
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for n, m in rounded.named_modules():
            if n in names:
                m.weight.copy_(fake_quant_weight(m.weight))
    float_means: dict[str, torch.Tensor] = {}
    totals: dict[str, torch.Tensor] = {}

    def watch(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            float_means[name] = _channel_mean(module, output)

        return record

    def correct(name: str) -> Callable[..., Any]:
        def fix(module: nn.Module, args: Any, output: Any) -> Any:
            if name not in float_means or not isinstance(output, torch.Tensor):
                return None
            r = float_means[name] - _channel_mean(module, output)
            totals[name] = totals.get(name, torch.zeros_like(r)) + r / len(batches)
            return output + _broadcast(module, r, output).to(output.dtype)

        return fix

    mods, shadow = dict(model.named_modules()), dict(rounded.named_modules())
    hooks = [mods[n].register_forward_hook(watch(n)) for n in names]
    hooks += [shadow[n].register_forward_hook(correct(n)) for n in names]
    try:
        with torch.no_grad():
            for x in batches:
                float_means.clear()
                call(model, x)
                call(rounded, x)
    finally:
        for h in hooks:
            h.remove()
    shifts = []
    with torch.no_grad():
        for name, correction in totals.items():
            shifts.append(_add_to_bias(mods[name], correction))
    return {
        "algorithm": "bias_correction",
        "applied": len(totals),
        "form": "empirical, sequential",
        "batches": len(batches),
        "mean_abs_shift": round(sum(shifts) / len(shifts), 6) if shifts else None,
    }


def _expected_input(bn: nn.Module, act: nn.Module | None) -> torch.Tensor:
    """E[act(z)] per channel for z ~ N(beta, gamma^2): a BatchNorm's output distribution, through
    the activation after it (timm's BatchNormAct2d carries its own), by quadrature over 257 normal
    quantiles (works for ReLU, ReLU6, Hardswish, SiLU, ... alike)."""
    beta = bn.bias.detach() if bn.bias is not None else torch.zeros_like(bn.running_mean)
    gamma = bn.weight.detach().abs() if bn.weight is not None else torch.ones_like(bn.running_mean)
    p = (torch.arange(257, dtype=torch.float64) + 0.5) / 257
    z = torch.distributions.Normal(0.0, 1.0).icdf(p).to(beta.dtype)
    samples = beta[:, None] + gamma[:, None] * z[None, :]
    fn = act if act is not None else getattr(bn, "act", None)
    with torch.no_grad():
        return (fn(samples) if fn is not None else samples).mean(dim=1)


def _bn_fed_layers(model: nn.Module, example: Any) -> dict[str, torch.Tensor]:
    """Layer -> the expected value of each input channel, for every conv/linear whose input is a
    BatchNorm's output (through at most one elementwise activation)."""
    mods = dict(model.named_modules())
    fed = _consumers(_trace_modules(model, example), mods)
    found = {}
    for name, m in mods.items():
        chain = fed.get(name, [])
        if not isinstance(m, WEIGHTED) or len(chain) != 1:
            continue
        bn = _module(mods, chain[0])
        if not (isinstance(bn, nn.modules.batchnorm._BatchNorm) and bn.track_running_stats):
            continue
        node, act = chain[0], None
        if len(fed.get(node, [])) == 1 and isinstance(
            _module(mods, fed[node][0]), SCALE_EQUIVARIANT + NOT_EQUIVARIANT
        ):
            node = fed[node][0]
            act = _module(mods, node)
        after = fed.get(node, [])
        if len(after) == 1 and isinstance(_module(mods, after[0]), WEIGHTED):
            second = _module(mods, after[0])
            if _channels_match(m, second):
                found[after[0].split("#")[0]] = _expected_input(bn, act)
    return found


def correct_bias_analytic(model: nn.Module, example: Any, skip: set[str] | None = None) -> dict[str, Any]:
    """Analytic (data-free) bias correction in place (Nagel et al. 2019): where a layer's input is
    a BatchNorm's output, its channels' expected values follow from the BatchNorm's beta and gamma
    (and the activation between), so the mean output error of int8 weights is (Q(W) - W) E[x],
    subtracted from the bias. BatchNorms are folded first, as the back ends fold them."""
    means = {k: v for k, v in _bn_fed_layers(model, example).items() if k not in (skip or set())}
    fold_batchnorms(model, example)
    shifts = []
    with torch.no_grad():
        for name, mean in means.items():
            m = model.get_submodule(name)
            delta = fake_quant_weight(m.weight) - m.weight
            delta = delta.flatten(2).sum(-1) if delta.dim() > 2 else delta  # [out, in / groups]
            depthwise = getattr(m, "groups", 1) > 1  # output channel c reads input channel c
            error = delta[:, 0] * mean if depthwise else delta @ mean.to(delta.dtype)
            shifts.append(_add_to_bias(m, -error))
    return {
        "algorithm": "bias_correction",
        "applied": len(means),
        "form": "analytic, from BatchNorm statistics",
        "mean_abs_shift": round(sum(shifts) / len(shifts), 6) if shifts else None,
    }


# --------------------------------------------------------------------------- smoothquant


def smooth_quant(model: nn.Module, batches: list[Any], example: Any, alpha: float = 0.5) -> dict[str, Any]:
    """SmoothQuant in place for every LayerNorm whose output feeds only Linears."""
    mods = dict(model.named_modules())
    fed = _consumers(_trace_modules(model, example), mods)
    groups = {
        ln: fed[ln]
        for ln, m in mods.items()
        if isinstance(m, nn.LayerNorm)
        and m.elementwise_affine
        and fed.get(ln)
        and all(isinstance(mods[c], nn.Linear) for c in fed[ln])
    }
    if not groups:
        return {"algorithm": "smoothquant", "applied": 0, "alpha": alpha}
    act_max: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            m = output.detach().abs().flatten(0, -2).amax(dim=0).float()
            act_max[name] = torch.maximum(act_max[name], m) if name in act_max else m

        return record

    observe(model, {ln: hook(ln) for ln in groups}, batches)
    reference = _output(model, example)
    tolerance = 1e-4 * reference.abs().max().clamp_min(1e-12)
    smoothed, skipped = {}, []
    with torch.no_grad():
        for ln, linears in groups.items():
            if ln not in act_max:
                continue
            w_max = torch.stack([mods[c].weight.detach().abs().amax(dim=0) for c in linears]).amax(dim=0)
            s = act_max[ln].clamp_min(1e-5) ** alpha / w_max.clamp_min(1e-5) ** (1 - alpha)
            s = s.clamp(1e-2, 1e2)
            touched = [mods[ln], *(mods[c] for c in linears)]
            saved = _snapshot(touched)
            _smooth(mods[ln], [mods[c] for c in linears], s)
            # post-LN models (BERT) also add the LayerNorm's output to a residual: folding would
            # change the model there, so such a group is put back exactly as it was
            if (_output(model, example) - reference).abs().max() > tolerance:
                _restore(touched, saved)
                skipped.append(f"{ln} (its output also feeds a residual path)")
            else:
                smoothed[ln] = linears
    return {
        "algorithm": "smoothquant",
        "applied": sum(len(v) for v in smoothed.values()),
        "layernorms": len(smoothed),
        "skipped": skipped[:50],
        "alpha": alpha,
    }


def _smooth(norm: nn.Module, linears: list[nn.Module], s: torch.Tensor) -> None:
    norm.weight.div_(s)
    if norm.bias is not None:
        norm.bias.div_(s)
    for c in linears:
        c.weight.mul_(s.reshape(1, -1))


# --------------------------------------------------------------------------- sensitive layers


def _fake_quant_input(lo: float, hi: float) -> Callable[..., Any]:
    """A forward pre-hook putting a layer's input on the 8-bit affine grid of [lo, hi]."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = max(hi - lo, 1e-8) / 255
    zero = round(-lo / scale)

    def hook(module: nn.Module, args: Any) -> Any:
        return (torch.fake_quantize_per_tensor_affine(args[0], scale, zero, 0, 255), *args[1:])

    return hook


def rank_sensitivity(
    model: nn.Module,
    example: Any,
    batches: list[Any],
    skip: set[str] | None = None,
    samples: int = 64,
) -> list[tuple[str, float]]:
    """Conv/linear layers, most quantization-sensitive first, with what int8 costs each alone: the
    mean per-sample cosine loss of the model's output when only that layer has per-channel int8
    weights (BatchNorms folded, as the back ends fold them) and its input on the 8-bit grid of
    its min/max on the same batches (the first ``samples`` or so of ``batches``). One pass per
    layer; layers in ``skip`` are left out."""
    use, seen = [], 0
    for x in batches:
        use.append(x)
        seen += batch_size(x)
        if seen >= samples:
            break
    m = copy.deepcopy(model).eval()
    fold_batchnorms(m, example)
    layers = {
        n: mod for n, mod in m.named_modules() if isinstance(mod, WEIGHTED) and n not in (skip or set())
    }
    ranges: dict[str, list[float]] = {}

    def watch(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any) -> None:
            lo, hi = args[0].min().item(), args[0].max().item()
            r = ranges.setdefault(name, [lo, hi])
            r[0], r[1] = min(r[0], lo), max(r[1], hi)

        return record

    def outputs() -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([select_output(call(m, x)).float().flatten(1) for x in use])

    hooks = [layer.register_forward_pre_hook(watch(n)) for n, layer in layers.items()]
    try:
        reference = outputs()
    finally:
        for h in hooks:
            h.remove()
    ranked = []
    for name, layer in layers.items():
        if name not in ranges:  # not run on these inputs
            continue
        saved = layer.weight.detach().clone()
        hook = layer.register_forward_pre_hook(_fake_quant_input(*ranges[name]))
        try:
            with torch.no_grad():
                layer.weight.copy_(fake_quant_weight(saved))
            out = outputs()
        finally:
            hook.remove()
            with torch.no_grad():
                layer.weight.copy_(saved)
        loss = 1 - nn.functional.cosine_similarity(out, reference, dim=1).mean().item()
        ranked.append((name, loss))
    return sorted(ranked, key=lambda r: -r[1])


def keep_sensitive(
    model: nn.Module,
    example: Any,
    batches: list[Any],
    count: int,
    skip: set[str] | None,
    ranked: list[tuple[str, float]] | None = None,
) -> dict[str, Any]:
    """``sensitive_float``: mark the ``count`` most sensitive layers (:func:`rank_sensitivity`) for
    the pass to keep float (:data:`KEEP_FLOAT`, read by :func:`kept_float`)."""
    ranked = ranked if ranked is not None else rank_sensitivity(model, example, batches, skip)
    layers = [n for n, loss in ranked[:count] if loss > 0]
    setattr(model, KEEP_FLOAT, layers)
    top = [{"layer": n, "cosine_loss": round(loss, 6)} for n, loss in ranked[: max(count, 5)]]
    return {
        "algorithm": "sensitive_float",
        "applied": bool(layers),
        "at": "quantization",
        "layers": layers,
        "ranked": top,
    }


def kept_float(model: nn.Module) -> list[str]:
    """The layers ``sensitive_float`` marked on this float model to stay float (none: [])."""
    return list(getattr(model, KEEP_FLOAT, None) or [])


# --------------------------------------------------------------------------- one entry point


WHY_NOT = {
    "weighted_ops_only": "torch's quantizers choose op by op (PT2E's X86 quantizer leaves Softmax, "
    "LayerNorm and GELU float already; FX: `keep_float_types`)",
    "smoothquant": "no LayerNorm feeds only Linears (post-LN residuals are left alone)",
    "equalization": "no conv/linear pairs joined by ReLU or nothing",
    "bias_correction": "no conv/linear layers",
    "adaround": "no conv/linear layers",
    "sensitive_float": "no conv/linear layer loses fidelity in int8 alone",
}


def _apply_one(
    name: str,
    model: nn.Module,
    example: Any,
    batches: list[Any],
    opts: RecoveryOptions,
    skip: set[str] | None,
    ranked: list[tuple[str, float]] | None = None,
) -> dict[str, Any]:
    if name == "sensitive_float":
        return keep_sensitive(model, example, batches, opts.float_layers, skip, ranked)
    if name in AT_QUANTIZATION:  # the pass applies these itself, at calibration or quantization
        applies = name != "weighted_ops_only" or opts.quantizes_onnx()
        return {"algorithm": name, "applied": applies, "at": AT_QUANTIZATION[name]}
    if name == "smoothquant":
        return smooth_quant(model, batches, example, opts.smoothquant_alpha)
    if name == "equalization":
        return equalize(model, example, batches=batches)
    if name == "adaround":
        return adaround(model, batches, lambda m: fold_batchnorms(m, example), opts.adaround_iterations, skip)
    if opts.bias_correction_form == "analytic":
        return correct_bias_analytic(model, example, skip)
    return correct_bias(model, batches, skip)


def apply(
    model: nn.Module,
    algorithms: list[str],
    example: Any,
    batches: list[Any],
    opts: RecoveryOptions | None = None,
    skip: set[str] | None = None,
    ranked: list[tuple[str, float]] | None = None,
) -> list[dict[str, Any]]:
    """Apply ``algorithms`` to the float ``model`` in place (``opts``: their settings), in the order
    that composes (:data:`ALGORITHMS`), except that ``sensitive_float`` chooses its layers first: the
    layers it keeps float are neither rounded by AdaRound (which would leave its integers in their
    float weights) nor bias-corrected for a quantization they never get, and AdaRound fits the later
    layers to their float outputs. Returns one record per algorithm, in :data:`ALGORITHMS` order; one
    that found nothing to do says so (and logs it). ``ranked``: :func:`rank_sensitivity` where known
    already (else of ``model`` as given)."""
    opts = opts or RecoveryOptions()
    order = [a for a in ALGORITHMS if a in algorithms]
    if "sensitive_float" in order:
        order = ["sensitive_float", *(a for a in order if a != "sensitive_float")]
    done = []
    for name in order:
        rec = _apply_one(name, model, example, batches, opts, skip, ranked)
        if name == "sensitive_float":
            skip = (skip or set()) | set(rec["layers"])
        if not rec["applied"]:
            why = WHY_NOT[name]
            if name == "bias_correction" and opts.bias_correction_form == "analytic":
                why += " fed by a BatchNorm"
            where = "this back end" if name == "weighted_ops_only" else "this model"
            rec["note"] = f"does not apply to {where}: {why}"
            log.info("recovery %s %s", name, rec["note"])
        done.append(rec)
    return sorted(done, key=lambda rec: ALGORITHMS.index(rec["algorithm"]))


# --------------------------------------------------------------------------- options and `auto`


class RecoveryOptions(Strict):
    """The recovery options ``quantize.static`` and ``quantize.onnx`` share (same names, same meaning)."""

    recovery: list[Algorithm] | Literal["auto", "none"] = Field(
        "none",
        description="Accuracy recovery applied to the float model before quantizing: a list of "
        "range_search, weighted_ops_only, equalization, bias_correction, smoothquant, adaround, "
        "sensitive_float; `auto` tries each that applies alone (adaround, the costliest, only while the "
        "best so far falls short of `float_target`), then combinations of those that helped "
        "alone, and keeps the best on held calibration batches where it beats none by more than noise; "
        "then, only while that best falls short of `float_target`, the most sensitive layers float, one "
        "more at a time up to `float_layers`; `none`.",
    )
    float_layers: int = Field(
        4,
        ge=0,
        le=64,
        description="sensitive_float: how many of the most quantization-sensitive conv/linear layers stay "
        "float (`auto`: at most this many; 0: auto never keeps layers float). Each costs speed.",
    )
    float_target: float = Field(
        0.995,
        gt=0,
        le=1,
        description="`auto` tries AdaRound and keeps sensitive layers float until its best int8 model's "
        "cosine to float on the held calibration batches clears this by more than their noise (the mean "
        "less two standard errors of the per-sample cosines).",
    )
    smoothquant_alpha: float = Field(0.5, ge=0, le=1, description="SmoothQuant's migration strength.")
    bias_correction_form: Literal["empirical", "analytic"] = Field(
        "empirical",
        description="bias_correction's form: empirical (calibration batches, every layer) or analytic "
        "(data-free, from the BatchNorm statistics before each layer; layers not fed by a BatchNorm "
        "are left alone).",
    )
    recovery_batches: int = Field(
        4, ge=1, le=64, description="Calibration batches that bias correction, AdaRound and SmoothQuant read."
    )
    judge_samples: int = Field(
        128,
        ge=1,
        le=100_000,
        description="Calibration samples after those `recovery_batches` that recovery judges candidates "
        "on (up to this many): not the ones the algorithms fitted. Where the calibration split has no "
        "others, they are judged on those (info.recovery.judged_on says which).",
    )
    adaround_iterations: int = Field(
        100,
        ge=10,
        le=20000,
        description="AdaRound: optimisation steps per layer (time grows linearly with it; "
        "benchmarks/recovery_cost.py times 100 and 200 on resnet18 at 224x224).",
    )

    def per_channel_weights(self) -> bool:
        """Whether the pass rounds weights per output channel (AdaRound's grid); passes override."""
        return True

    def quantizes_onnx(self) -> bool:
        """Whether onnxruntime quantizes (``weighted_ops_only`` changes something there only)."""
        return False

    def keeps_layers_float(self) -> bool:
        """Whether the pass can keep layers ``sensitive_float`` ranks out of the quantizer."""
        return True

    def quantize_with(self, algorithms: list[str]) -> Self:
        """These options as the pass quantizes after ``algorithms`` (those the back end applies
        itself, at calibration or quantization, change them); passes override."""
        return self

    @model_validator(mode="after")
    def _adaround_grid(self) -> RecoveryOptions:
        if isinstance(self.recovery, list) and "adaround" in self.recovery and not self.per_channel_weights():
            raise ValueError(
                "`adaround` learns roundings on a per-channel symmetric int8 grid, and these options "
                "quantize weights per tensor or unsigned: use per-channel int8 weights, or drop adaround"
            )
        if (
            isinstance(self.recovery, list)
            and "sensitive_float" in self.recovery
            and not self.keeps_layers_float()
        ):
            raise ValueError(
                "`sensitive_float` keeps torch layers float in quantize.static; onnxruntime keeps nodes "
                "float with `nodes_to_exclude` (`strategy: search` ranks them and excludes them one at a "
                "time): drop sensitive_float here"
            )
        return self


def units(model: nn.Module, example: Any, per_channel: bool = True, onnx: bool = False) -> list[list[str]]:
    """The single changes ``recovery: auto`` tries on this model first, each that applies (AdaRound
    with equalization before it, where there are pairs, counts as one)."""
    out: list[list[str]] = [["range_search"], ["bias_correction"]]
    mods = dict(model.named_modules())
    fed = _consumers(_trace_modules(model, example), mods)  # one trace serves both questions
    pairs, _ = find_pairs(model, example, fed)
    if pairs:
        out.append(["equalization"])
    norms = any(isinstance(m, nn.LayerNorm) and fed.get(n) for n, m in mods.items())
    if norms:
        out.append(["smoothquant"])
    if onnx and norms:  # Transformers: onnxruntime's quantized Softmax/LayerNorm/GELU inputs
        out.append(["weighted_ops_only"])
    weighted = [m for m in mods.values() if isinstance(m, WEIGHTED)]
    convs = [m for m in weighted if isinstance(m, (nn.Conv1d, nn.Conv2d))]
    if per_channel and 2 * len(convs) > len(weighted):  # rounding gains most on convolutional models
        out.append(["equalization", "adaround"] if pairs else ["adaround"])
    return out


def combinations(winners: list[list[str]], tried: list[list[str]]) -> list[list[str]]:
    """Stage two of ``auto``: every pair of the units that beat none alone, and all of them
    together, each in composition order, leaving out what was tried already."""
    merged = [[*a, *b] for i, a in enumerate(winners) for b in winners[i + 1 :]]
    if len(winners) > 2:
        merged.append([a for unit in winners for a in unit])
    out: list[list[str]] = []
    for combo in merged:
        ordered = [a for a in ALGORITHMS if a in combo]
        if ordered not in tried and ordered not in out:
            out.append(ordered)
    return out


@dataclass(frozen=True)
class Judgement:
    """A candidate's fidelity on the held calibration batches: per-sample cosine to float and, for
    outputs shaped (batch, classes), per-sample top-1 agreement; paired with another candidate's on
    the same samples, they say whether a difference is more than noise."""

    per_sample: torch.Tensor
    agrees: torch.Tensor | None
    margin: torch.Tensor | None = None  # float's top-1 lead over its second class, per sample
    error: torch.Tensor | None = None  # distance of the int8 scores from float's, per sample

    @classmethod
    def of(cls, ref: torch.Tensor, out: torch.Tensor) -> Judgement:
        ref, out = ref.float(), out.float()
        per = nn.functional.cosine_similarity(ref.reshape(len(ref), -1), out.reshape(len(out), -1), dim=1)
        if ref.dim() != 2 or ref.shape[-1] < 2:
            return cls(per, None)
        top = ref.topk(2, dim=-1).values
        return cls(per, ref.argmax(-1) == out.argmax(-1), top[:, 0] - top[:, 1], (out - ref).norm(dim=-1))

    def decisive(self, other: Judgement) -> torch.Tensor:
        """Samples whose float top-1 class leads by more than the median int8 error of the two
        candidates: a changed class there is a lost decision, elsewhere (near ties: nearly flat
        scores of random weights) it is rounding noise. On a random-weight MobileNetV3 bias
        correction took cosine 0.963 -> 0.978 on the judged samples while 5 of 64 near-tie classes
        moved; on the evaluation set it raised agreement 62.5 -> 71.9%."""
        assert self.margin is not None and self.error is not None and other.error is not None
        return self.margin > torch.cat([self.error, other.error]).median()

    @property
    def cosine(self) -> float:
        return self.per_sample.mean().item()

    @property
    def agreement(self) -> float | None:
        return None if self.agrees is None else self.agrees.float().mean().item()

    @property
    def lower(self) -> float:
        """The mean cosine less two standard errors of the per-sample cosines: what the evaluation
        data's mean may still come out at. ``auto`` calls ``float_target`` reached only past this."""
        n = len(self.per_sample)
        se = self.per_sample.double().std().item() / n**0.5 if n > 1 else 0.0
        return self.cosine - 2 * se

    def reaches(self, target: float) -> bool:
        """Whether the cosine clears ``target`` by more than the held samples' noise (:attr:`lower`).
        On a digits-trained MobileNetV2, PT2E int8 with none passed 0.998 on the judged batches, so
        auto tried nothing more, and came out at 0.99796 on the evaluation split."""
        return self.lower >= target

    def record(self) -> dict[str, float]:
        out = {"cosine": round(self.cosine, 6), "cosine_lower": round(self.lower, 6)}
        if self.agreement is not None:
            out["agreement"] = round(100 * self.agreement, 2)
        return out

    def beats(self, best: Judgement) -> bool:
        """Whether this candidate replaces ``best`` by more than the held samples' noise: its mean
        per-sample cosine gain exceeds two standard errors of the paired differences and it loses
        no top-1 agreement on balance, or its agreement gain passes a paired sign test (McNemar,
        two sigma) without a significant cosine loss. Agreement counts on :meth:`decisive`
        samples only. Ties keep ``best`` (the simpler, earlier one)."""
        d = (self.per_sample - best.per_sample).double()
        noise = 2 * (d.std().item() / len(d) ** 0.5 if len(d) > 1 else 0.0)
        gain = d.mean().item()
        won = lost = 0
        if self.agrees is not None and best.agrees is not None:
            decisive = self.decisive(best)
            won = int((self.agrees & ~best.agrees & decisive).sum())
            lost = int((best.agrees & ~self.agrees & decisive).sum())
        if gain > max(noise, 1e-6) and won >= lost:
            return True
        return won - lost > 2 * (won + lost) ** 0.5 and gain > -noise


def _float_stage(
    opts: RecoveryOptions,
    best: Callable[[], tuple[Judgement, list[str], nn.Module, Any]],
    trial: Callable[..., None],
    rank: Callable[[list[str]], list[tuple[str, float]]],
) -> str:
    """Stage three of ``auto``: the best so far with its 1, 2, ... most sensitive layers float (one
    ranking, :func:`_rank_for`), while its cosine falls short of ``float_target``; says what it did."""
    if not opts.keeps_layers_float():
        return "not tried: this pass keeps no layers float"
    if not opts.float_layers:
        return "not tried: float_layers is 0"
    judged, combo, _, _ = best()
    if judged.reaches(opts.float_target):
        return "not needed: " + _enough(judged, opts)
    t0 = time.perf_counter()
    ranked = rank(combo)
    note = f"tried on top of {combo or 'none'} (ranking {time.perf_counter() - t0:.1f} s)"
    for k in range(1, min(opts.float_layers, len(ranked)) + 1):
        trial([*combo, "sensitive_float"], 3, opts.model_copy(update={"float_layers": k}), ranked)
        if best()[0].reaches(opts.float_target):
            break
    return note


def _rank_for(
    model: nn.Module,
    combo: list[str],
    example: Any,
    batches: list[Any],
    opts: RecoveryOptions,
    skip: set[str] | None,
) -> list[tuple[str, float]]:
    """:func:`rank_sensitivity` for the float stage on top of ``combo``: of the float model with
    only those changes of ``combo`` that keep its function (:data:`PRESERVING`). Ranked after
    AdaRound, whose weights are on the grid already, a layer's own rounding error would not count
    (the stem of a MobileNetV3 fell out of the top four); after bias correction, its shifted means."""
    m = copy.deepcopy(model)
    apply(m, [a for a in combo if a in PRESERVING], example, batches, opts, skip)
    return rank_sensitivity(m, example, batches, skip)


def _nearer(
    judged: Judgement, best: Judgement, none: Judgement | None, stage: int, opts: RecoveryOptions
) -> bool:
    """Whether a stage-one or -two candidate replaces a best it ties with (neither wins by more
    than noise): only below ``float_target``, where it has the higher mean cosine and itself beats
    none. Ties otherwise keep the earlier, simpler candidate; but the float stage builds on the
    best, and on a digits-trained EfficientNet-Lite0 bias correction (0.9794) kept over AdaRound
    (0.9817) left it at 0.9941 with four layers float, AdaRound's base at 0.9954. Float-stage
    candidates must still win outright: each layer kept float costs speed."""
    if stage > 2 or none is None or best.reaches(opts.float_target):
        return False
    return judged.cosine > best.cosine and judged.beats(none) and not best.beats(judged)


def _enough(judged: Judgement, opts: RecoveryOptions) -> str:
    return (
        f"cosine {judged.cosine:.5f} (less two standard errors {judged.lower:.5f}) >= float_target "
        f"{opts.float_target}"
    )


def choose(
    model: nn.Module,
    example: Any,
    batches: list[Any],
    opts: RecoveryOptions,
    score: Callable[[nn.Module, list[str]], torch.Tensor],
    reference: torch.Tensor,
    skip: set[str] | None = None,
    on_best: Callable[[], None] | None = None,
) -> tuple[nn.Module, dict[str, Any]]:
    """``recovery: auto`` in two stages: none and each single change (:func:`units`), then only
    combinations of the changes that beat none alone (:func:`combinations`), rather than every
    combination. Each candidate's quantized model (``score``: built from a float model, run on
    calibration batches held apart from the evaluation data) is judged against the float
    ``reference``; one replaces the best so far only where it wins by more than noise
    (:meth:`Judgement.beats`), or, below ``float_target``, ties it with a higher mean
    (:func:`_nearer`), so none is kept unless something clearly helps. Every trial is
    recorded with its stage. ``on_best`` is called when the candidate just scored becomes the best
    (the pass keeps that one's quantized model instead of building it again)."""
    t_start = time.perf_counter()
    trials: list[dict[str, Any]] = []
    best: tuple[Judgement, list[str], nn.Module, list[dict[str, Any]]] | None = None
    none: Judgement | None = None
    winners: list[list[str]] = []

    def trial(combo: list[str], stage: int, how: RecoveryOptions = opts, ranked: Any = None) -> None:
        nonlocal best, none
        m = copy.deepcopy(model)
        t0 = time.perf_counter()
        try:
            records = apply(m, combo, example, batches, how, skip, ranked)
            judged = Judgement.of(reference, score(m, combo))
        except Exception as exc:  # one candidate failing to apply or build must not stop the others
            trials.append(
                {"algorithms": combo, "stage": stage, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
            )
            return
        seconds = round(time.perf_counter() - t0, 2)
        trials.append({"algorithms": combo, "stage": stage, **judged.record(), "seconds": seconds})
        if kept_float(m):
            trials[-1]["float_layers"] = kept_float(m)
        if not combo:
            none = judged
        elif stage == 1 and none is not None and judged.beats(none):
            winners.append(combo)
        if best is None or judged.beats(best[0]) or _nearer(judged, best[0], none, stage, opts):
            best = (judged, combo, m, records)
            if on_best is not None:
                on_best()

    single = units(model, example, opts.per_channel_weights(), opts.quantizes_onnx())
    for combo in [[], *single]:
        # the costliest change (minutes where the others take seconds) only where it may matter
        if "adaround" in combo and best is not None and best[0].reaches(opts.float_target):
            why = "not needed: best so far " + _enough(best[0], opts)
            trials.append({"algorithms": combo, "stage": 1, "skipped": why})
        else:
            trial(combo, 1)
    for combo in combinations(winners, [t["algorithms"] for t in trials]):
        trial(combo, 2)
    if best is None:
        raise ValueError("every recovery candidate failed: " + "; ".join(t.get("error", "") for t in trials))
    float_note = _float_stage(
        opts, lambda: best, trial, lambda combo: _rank_for(model, combo, example, batches, opts, skip)
    )
    judged, combo, m, records = best
    log.info("recovery auto chose %s (cosine %.5f on calibration batches)", combo or "none", judged.cosine)
    info = {
        "mode": "auto",
        "chosen": combo,
        **judged.record(),
        "held_samples": len(judged.per_sample),  # the judged ones
        "beat_none_alone": winners,
        "float_stage": float_note,
        "trials": trials,
        "applied": records,
        "seconds": round(time.perf_counter() - t_start, 2),
    }
    return m, info


def recover(
    model: nn.Module,
    example: Any,
    held: Held,
    opts: RecoveryOptions,
    score: Callable[[nn.Module, list[str]], torch.Tensor] | None = None,
    skip: set[str] | None = None,
    on_best: Callable[[], None] | None = None,
    grid: tuple[tuple[int, int], tuple[int, int]] = ((-128, 127), (-128, 127)),
) -> tuple[nn.Module, dict[str, Any] | None]:
    """The float model the quantizer should start from, and ``info.recovery`` (None: none asked).
    The algorithms read ``held.fit`` (:func:`held_outputs`); ``score`` runs the quantized model of
    a float model on ``held.judge``, judged against ``held.reference``. ``grid``: the back end's
    symmetric weight grids, convolutions' and Linears' (:func:`.adaround.weight_grid`)."""
    if opts.recovery == "none":
        return model, None
    with weight_grid(*grid):
        m, info = _recover(model, example, held, opts, score, skip, on_best)
    info["weight_grid"] = {"conv": list(grid[0]), "linear": list(grid[1])}
    return m, info


def _recover(
    model: nn.Module,
    example: Any,
    held: Held,
    opts: RecoveryOptions,
    score: Callable[[nn.Module, list[str]], torch.Tensor] | None,
    skip: set[str] | None,
    on_best: Callable[[], None] | None,
) -> tuple[nn.Module, dict[str, Any]]:
    if opts.recovery == "auto":
        assert score is not None
        m, info = choose(model, example, held.fit, opts, score, held.reference, skip, on_best)
        info["judged_on"] = held.judged_on
        return m, info
    m = copy.deepcopy(model)
    t0 = time.perf_counter()
    records = apply(m, list(opts.recovery), example, held.fit, opts, skip)
    info: dict[str, Any] = {"mode": "listed", "chosen": list(opts.recovery), "applied": records}
    info["seconds"] = round(time.perf_counter() - t0, 2)
    if score is not None:
        info["cosine"] = round(Judgement.of(held.reference, score(m, list(opts.recovery))).cosine, 6)
        if on_best is not None:
            on_best()
        info["cosine_without"] = round(Judgement.of(held.reference, score(model, [])).cosine, 6)
    return m, info


@dataclass(frozen=True)
class Held:
    """Calibration batches for recovery: ``fit`` (what the algorithms read), ``judge`` (what
    candidates are scored on: later batches where the split has them) and the float model's
    outputs on ``judge`` (``reference``)."""

    fit: list[Any]
    judge: list[Any]
    reference: torch.Tensor
    apart: bool

    @property
    def judged_on(self) -> str:
        return (
            "calibration batches the algorithms did not read"
            if self.apart
            else "the calibration batches the algorithms read (the split has no others: choices may "
            "favour what fits them)"
        )


def held_outputs(model: nn.Module, loader: Any, opts: RecoveryOptions, output: Any) -> Held:
    """The calibration batches recovery fits on (``recovery_batches``) and judges candidates on
    (up to ``judge_samples`` samples after them; the same ones where the split has no others), all
    apart from the evaluation data, and the float model's outputs on the judged ones. Judging on
    the batches bias correction fitted favoured it: on a random-weight EfficientNet-Lite auto
    chose it at 81% top-1 agreement on those and 55% on the evaluation set."""
    fit, judge, seen = [], [], 0
    for i, (x, *_) in enumerate(loader):
        if i < opts.recovery_batches:
            fit.append(x)
        elif seen < opts.judge_samples:
            judge.append(x)
            seen += batch_size(x)
        else:
            break
    apart = bool(judge)
    judge = judge or fit
    with torch.inference_mode():
        ref = torch.cat([select_output(call(model, x), output).float() for x in judge])
    return Held(fit, judge, ref, apart)


def record_ranges(info: dict[str, Any], found: dict[str, Any] | None) -> None:
    """Put what the range search chose per tensor (``found``) into its record of ``info.recovery``."""
    for rec in info["applied"]:
        if rec["algorithm"] == "range_search" and found:
            rec.update(found)


def verify_rounding(info: dict[str, Any] | None, found: list[torch.Tensor]) -> None:
    """Replace AdaRound's expected integers in ``info`` (``info.recovery``) by the check that the
    back end stored them (``found``: the converted model's int8 weight tensors); logs a mismatch."""
    for rec in (info or {}).get("applied", []):
        expected = rec.pop("expected_integers", None)
        if expected is None:
            continue
        rec["backend_check"] = check = check_integers(expected, found)
        done, total = check["layers_verified"].split("/")
        if done != total:
            log.warning(
                "adaround: the back end stored different integers than AdaRound chose for %s of %s "
                "layers (%s)",
                int(total) - int(done),
                total,
                ", ".join(check["not_matched"][:3]),
            )
