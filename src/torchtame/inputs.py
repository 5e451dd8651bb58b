"""Model inputs and outputs of any structure, as people write models.

An *input* is one tensor, a tuple/list of tensors (positional arguments), or a dict keyed by
``forward()``'s argument names (the Hugging Face convention). Every stage (calibration,
evaluation, latency, tracing, export, parity) calls the model through :func:`call` and moves or
casts inputs through :func:`prepare`, so integer token ids and boolean masks keep their dtype.

An *output* is a tensor, a tuple/list, a dict or a ``transformers`` ``ModelOutput``;
:func:`select_output` picks the one tensor that is measured.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

Inputs = Any  # torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | dict[str, torch.Tensor]


def is_structure(x: Any) -> bool:
    """Whether ``x`` is an input structure torchtame can call a model with."""
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, tuple | list):
        return len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)
    if isinstance(x, Mapping):
        return len(x) > 0 and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in x.items())
    return False


def map_tensors(x: Inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """``x`` with ``fn`` applied to every tensor, structure kept."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        return {k: fn(v) for k, v in x.items()}
    return type(x)(fn(t) for t in x) if isinstance(x, tuple) else [fn(t) for t in x]


def tensors(x: Inputs) -> list[torch.Tensor]:
    """The tensors of ``x`` in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, Mapping):
        return list(x.values())
    return list(x)


def first_tensor(x: Inputs) -> torch.Tensor:
    return tensors(x)[0]


def batch_size(x: Inputs) -> int:
    return int(first_tensor(x).shape[0])


def cast_floating(x: Inputs, dtype: torch.dtype) -> Inputs:
    """Cast floating-point tensors to ``dtype``; integer and boolean tensors keep theirs."""
    return map_tensors(x, lambda t: t.to(dtype) if t.is_floating_point() else t)


def prepare(x: Inputs, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Inputs:
    """Move every tensor to ``device``; cast only the floating ones to ``dtype``."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device)

    return map_tensors(x, move)


def repeat_batch(x: Inputs, n: int) -> Inputs:
    """A batch of exactly ``n`` samples: the samples of ``x`` repeated (or cut) along dim 0."""

    def rep(t: torch.Tensor) -> torch.Tensor:
        reps = math.ceil(n / t.shape[0])
        return t.repeat(reps, *([1] * (t.dim() - 1)))[:n].contiguous()

    return map_tensors(x, rep)


def take(x: Inputs, n: int) -> Inputs:
    """The first ``n`` samples of ``x``."""
    return map_tensors(x, lambda t: t[:n])


def concat(a: Inputs, b: Inputs) -> Inputs:
    """Two batches of the same structure joined along the batch dimension."""
    if isinstance(a, torch.Tensor):
        return torch.cat([a, b])
    if isinstance(a, Mapping):
        return {k: torch.cat([v, b[k]]) for k, v in a.items()}
    joined = [torch.cat([u, v]) for u, v in zip(a, b, strict=True)]
    return tuple(joined) if isinstance(a, tuple) else joined


def call(model: Callable[..., Any], x: Inputs) -> Any:
    """``model(x)``, ``model(*x)`` or ``model(**x)`` for a tensor, a tuple/list or a dict."""
    if isinstance(x, torch.Tensor):
        return model(x)
    if isinstance(x, Mapping):
        return model(**x)
    return model(*x)


def as_args(x: Inputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """(args, kwargs) that :func:`call` would pass, for torch.export and the ONNX exporters."""
    if isinstance(x, torch.Tensor):
        return (x,), {}
    if isinstance(x, Mapping):
        return (), dict(x)
    return tuple(x), {}


def describe(x: Inputs) -> str:
    """A short description such as ``float32[1, 3, 224, 224]`` or ``input_ids: int64[1, 32], ...``."""

    def one(t: torch.Tensor) -> str:
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"

    if isinstance(x, torch.Tensor):
        return one(x)
    if isinstance(x, Mapping):
        return ", ".join(f"{k}: {one(v)}" for k, v in x.items())
    return "(" + ", ".join(one(t) for t in x) + ")"


def forward_parameters(model: Any) -> tuple[list[str], bool]:
    """The names of ``model.forward``'s parameters, and whether it takes ``**kwargs``."""
    fn = getattr(model, "forward", model)
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # TorchScript modules and C functions
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.POSITIONAL_ONLY)]
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def input_names(model: Any, x: Inputs) -> list[str]:
    """Names for each input tensor: dict keys, else ``forward()``'s parameter names in order."""
    if isinstance(x, Mapping):
        return list(x)
    params, _ = forward_parameters(model)
    count = len(tensors(x))
    names = params[:count] if len(params) >= count else []
    if count == 1 and not names:
        names = ["input"]
    return names or [f"input_{i}" for i in range(count)]


def unknown_keys(model: Any, x: Inputs) -> list[str]:
    """Keys of a dict input that ``forward()`` does not accept (empty if it takes ``**kwargs``)."""
    if not isinstance(x, Mapping):
        return []
    params, var_kw = forward_parameters(model)
    if var_kw or not params:
        return []
    return [k for k in x if k not in params]


# --------------------------------------------------------------------------- outputs


def output_items(out: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in an output, in order (``None`` fields are skipped)."""
    if isinstance(out, torch.Tensor):
        return [("output", out)]
    if isinstance(out, Mapping):  # dicts and transformers' ModelOutput
        return [(str(k), v) for k, v in out.items() if isinstance(v, torch.Tensor)]
    if isinstance(out, tuple | list):
        items = []
        for i, v in enumerate(out):
            if isinstance(v, torch.Tensor):
                items.append((f"output_{i}", v))
        return items
    return []


def select_output(out: Any, which: str | int | None = None) -> torch.Tensor:
    """The measured tensor of a model output.

    ``which`` names a dict/ModelOutput key or a tuple index; by default ``logits`` when present,
    else the first tensor.
    """
    if isinstance(out, torch.Tensor) and which in (None, 0, "output"):
        return out
    if isinstance(out, Mapping):
        if isinstance(which, str):
            if which in out and isinstance(out[which], torch.Tensor):
                return out[which]
            raise KeyError(f"the model's output has no tensor {which!r}; it has {output_keys(out)}")
        if which is None and isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        items = output_items(out)
        index = 0 if which is None else int(which)
        if index < len(items):
            return items[index][1]
    elif isinstance(out, tuple | list):
        if isinstance(which, str):
            raise KeyError(f"the model returns a {type(out).__name__}; name its output by index (0, 1, ...)")
        if which is None:
            first = next((v for v in out if isinstance(v, torch.Tensor)), None)
            if first is not None:
                return first
        elif int(which) < len(out) and isinstance(out[int(which)], torch.Tensor):
            return out[int(which)]
    raise KeyError(f"no output {which!r} in the model's {type(out).__name__}; it has {output_keys(out)}")


def output_keys(out: Any) -> list[str]:
    """The names :func:`select_output` accepts for this output."""
    if isinstance(out, Mapping):
        return [k for k, _ in output_items(out)]
    if isinstance(out, tuple | list):
        return [str(i) for i, v in enumerate(out) if isinstance(v, torch.Tensor)]
    return ["output"]


def output_index(out: Any, which: str | int | None) -> int:
    """The position of the measured tensor among :func:`output_items` (for ONNX outputs)."""
    chosen = select_output(out, which)
    for i, (_, t) in enumerate(output_items(out)):
        if t is chosen:
            return i
    return 0


def stack_outputs(outs: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-batch outputs along the batch; outputs whose trailing shapes differ (text
    padded per batch) are flattened per sample and zero-padded to one width, which leaves cosine
    similarity and absolute errors between two such stacks unchanged."""
    if all(o.shape[1:] == outs[0].shape[1:] for o in outs):
        return torch.cat(outs)
    flat = [o.reshape(o.shape[0], -1) for o in outs]
    width = max(f.shape[1] for f in flat)
    return torch.cat([torch.nn.functional.pad(f, (0, width - f.shape[1])) for f in flat])
