"""``quantize.torchao``: the quantization schemes the field uses today, through torchao's
``quantize_`` (tensor subclasses on Linear weights), measured compiled.

- ``int8_dynamic``: int8 weights, activations quantized per token at run time (CPU and GPU);
- ``int8_weight_only``: int8 weights, float activations (memory-bound GPU inference);
- ``int4_weight_only``: 4-bit grouped weights (torchao's int4 kernels need a CUDA GPU);
- ``float8_dynamic``: float8 weights and activations (GPUs of compute capability 8.9 and up).

A scheme the run's devices cannot execute is refused before any work, with what to use instead.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import PassError
from ..optional import require
from ..options import Strict
from ..registry import register_pass
from ..variant import PassContext, Variant
from ._select import match_modules, require_float

Scheme = Literal["int8_dynamic", "int8_weight_only", "int4_weight_only", "float8_dynamic"]


class TorchaoOptions(Strict):
    scheme: Scheme = Field("int8_dynamic", description="Which torchao quantization scheme.")
    group_size: int = Field(128, ge=16, description="int4_weight_only: weights per scale.")
    exclude: list[str] = Field(default_factory=list, description="Linear layers (names/regexes) kept float.")
    compile: bool = Field(True, description="Measure through torch.compile (what torchao's kernels need).")


def _cuda_devices(ctx: PassContext) -> list[str]:
    return [d for d in ctx.devices if d.startswith("cuda")]


def check_device(scheme: str, ctx: PassContext) -> str | None:
    """The CUDA device the scheme needs (None: it runs anywhere); refuses what cannot run here."""
    cuda = _cuda_devices(ctx)
    if scheme == "int4_weight_only":
        if not cuda:
            raise PassError(
                "int4_weight_only needs a CUDA GPU: torchao's int4 kernels do not run on this run's CPU",
                hint="use `scheme: int8_weight_only` or `int8_dynamic`, or add `cuda` to `devices`",
            )
        return cuda[0]
    if scheme == "float8_dynamic":
        capable = [d for d in cuda if torch.cuda.get_device_capability(d) >= (8, 9)]
        if not capable:
            raise PassError(
                "float8_dynamic needs a GPU of compute capability 8.9 or more (Ada, Hopper); "
                f"this run has {', '.join(cuda) or 'no GPU'}",
                hint="use `scheme: int8_dynamic`",
            )
        return capable[0]
    return None


def _config(opts: TorchaoOptions) -> Any:
    q = require("torchao.quantization", "quantize.torchao", PassError)
    if opts.scheme == "int8_dynamic":
        return q.Int8DynamicActivationInt8WeightConfig()
    if opts.scheme == "int8_weight_only":
        return q.Int8WeightOnlyConfig()
    if opts.scheme == "int4_weight_only":
        return q.Int4WeightOnlyConfig(group_size=opts.group_size)
    return q.Float8DynamicActivationFloat8WeightConfig()


def make_picklable(model: nn.Module) -> nn.Module:
    """torchao binds a ``functools.partial`` as each quantized layer's ``extra_repr``, which
    ``torch.save`` cannot pickle; the class's own ``extra_repr`` is put back."""
    for m in model.modules():
        m.__dict__.pop("extra_repr", None)
    return model


NAME = "quantize.torchao"


@register_pass(
    NAME,
    TorchaoOptions,
    traits={"quantizes", "trains"},
    hints={
        "slower": "torchao int8 is fast once compiled and at larger batches; try quantize.static or "
        "quantize.onnx",
    },
)
def quantize_torchao(model: nn.Module | None, ctx: PassContext, opts: TorchaoOptions) -> Variant:
    """torchao int8 dynamic / int8 weight-only / int4 weight-only / float8 on Linear layers."""
    assert model is not None
    require_float(ctx, "quantize.torchao", "quantize a float32 variant", float32=True)
    device = check_device(opts.scheme, ctx)
    quant = require("torchao.quantization", "quantize.torchao", PassError)
    excluded = set(match_modules(model, opts.exclude, "exclude"))
    targets = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in excluded]
    if not targets:
        raise PassError(
            "the model has no Linear layer for torchao to quantize",
            hint="torchao's schemes target Linear layers; for convolutions use quantize.static",
        )
    dtype = torch.float32
    if device is not None:  # the GPU kernels take bfloat16 activations
        dtype = torch.bfloat16
        model = model.to(device=device, dtype=dtype)
    quant.quantize_(model.eval(), _config(opts), filter_fn=lambda m, fqn: fqn in targets)
    make_picklable(model.to("cpu") if device is None else model)
    return ctx.variant(
        model,
        quantized=True,
        compiled=opts.compile,
        devices="any" if device is None else "cuda_only",
        dtype=f"torchao-{opts.scheme.replace('_', '-')}",
        input_dtype=dtype,
        info={
            "scheme": opts.scheme,
            "quantized_layers": len(targets),
            "kept_float": sorted(excluded),
            "group_size": opts.group_size if opts.scheme == "int4_weight_only" else None,
            "compiled": opts.compile,
        },
    )
