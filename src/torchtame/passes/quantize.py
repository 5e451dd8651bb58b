"""Post-training quantization through torch.ao.quantization, and fp16/bf16 casts.

- ``quantize.dynamic``: int8 or float16 weights, activations quantized on the fly (Linear, RNNs).
- ``quantize.half``: the whole model cast to float16 or bfloat16 (floating inputs cast likewise).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import PassError
from ..options import Strict
from ..registry import register_pass
from ..runtime import check_backend, quantized_engine
from ..variant import PassContext, Variant
from ._select import Backend, match_modules, require_float

DYNAMIC_TYPES: dict[str, type[nn.Module]] = {
    "Linear": nn.Linear,
    "LSTM": nn.LSTM,
    "GRU": nn.GRU,
    "LSTMCell": nn.LSTMCell,
    "GRUCell": nn.GRUCell,
    "RNNCell": nn.RNNCell,
}


# --------------------------------------------------------------------------- dynamic


class DynamicOptions(Strict):
    dtype: Literal["qint8", "float16"] = "qint8"
    modules: list[Literal["Linear", "LSTM", "GRU", "LSTMCell", "GRUCell", "RNNCell"]] = Field(
        default_factory=lambda: list(DYNAMIC_TYPES), description="Module types to quantize."
    )
    exclude: list[str] = Field(default_factory=list, description="Module names or regexes kept float.")
    backend: Backend | None = None


DYNAMIC = "quantize.dynamic"
HALF = "quantize.half"


@register_pass(
    DYNAMIC,
    DynamicOptions,
    traits={"quantizes"},
    hints={
        "slower": "dynamic int8 pays off for large Linear/LSTM layers at larger batches; try "
        "quantize.static or quantize.onnx",
        "fidelity": "exclude the sensitive layers (`exclude: [...]`) or use float16 weights "
        "(`dtype: float16`)",
    },
)
def quantize_dynamic(model: nn.Module | None, ctx: PassContext, opts: DynamicOptions) -> Variant:
    """Dynamic quantization: int8 (or float16) weights, activations quantized at run time."""
    assert model is not None
    require_float(ctx, "quantize.dynamic", "quantize a float variant (baseline, pruned, fine-tuned)")
    from torch.ao.quantization import default_dynamic_qconfig, float16_dynamic_qconfig, quantize_dynamic

    backend = check_backend(opts.backend)
    qconfig = default_dynamic_qconfig if opts.dtype == "qint8" else float16_dynamic_qconfig
    spec: dict[Any, Any] = {DYNAMIC_TYPES[m]: qconfig for m in opts.modules}
    excluded = match_modules(model, opts.exclude, "exclude")
    for name in excluded:
        spec[name] = None
    types = tuple(DYNAMIC_TYPES[m] for m in opts.modules)
    targets = [n for n, m in model.named_modules() if isinstance(m, types) and n not in excluded]
    if not targets:
        raise PassError(
            f"the model has no {'/'.join(opts.modules)} layer to quantize dynamically",
            hint="dynamic quantization targets Linear and RNN layers; for conv nets use quantize.static",
        )
    with quantized_engine(backend):
        q = quantize_dynamic(model.eval(), spec, dtype=getattr(torch, opts.dtype))
    return ctx.variant(
        q,
        quantized=True,
        devices="cpu_only",
        backend=backend,
        dtype=f"dynamic-{opts.dtype}",
        info={"quantized_layers": len(targets), "kept_float": excluded, "backend": backend},
    )


class HalfOptions(Strict):
    dtype: Literal["float16", "bfloat16"] = "float16"
    allow_cpu: bool = Field(
        False, description="Also measure float16 on the CPU (bfloat16 always is where it runs)."
    )


def _half_fidelity(entry: dict[str, Any]) -> str:
    if entry.get("dtype") == "bfloat16":
        return (
            "bfloat16 keeps float32's range but only 8 bits of mantissa: keep float32 (or float16 on a "
            "GPU) for this model, or quantize.static where int8 stays faithful"
        )
    return "float16 overflows in this model: use `dtype: bfloat16`"


@register_pass(
    HALF,
    HalfOptions,
    traits={"quantizes"},
    hints={
        "slower": "bfloat16/float16 is fast only on GPUs and CPUs with AMX or AVX512-BF16; keep float32 here",
        "fidelity": _half_fidelity,
    },
)
def quantize_half(model: nn.Module | None, ctx: PassContext, opts: HalfOptions) -> Variant:
    """Cast weights (and inputs) to float16 or bfloat16: GPU inference, bf16 also on CPU."""
    assert model is not None
    require_float(ctx, "quantize.half", "start it `from: baseline`")
    dtype = getattr(torch, opts.dtype)
    half = model.to(dtype)
    policy = "any" if (opts.dtype == "bfloat16" or opts.allow_cpu) else "cuda_only"
    return ctx.variant(half, dtype=opts.dtype, input_dtype=dtype, devices=policy)
