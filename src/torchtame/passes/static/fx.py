"""The torch.ao halves of ``quantize.static``: FX graph mode and eager mode with automatic fusion,
their qconfig and calibration."""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ...errors import PassError, first_line
from ...inputs import as_args, call
from ...progress import NullProgress
from ...runtime import weight_range
from ...variant import PassContext
from .. import ranges
from .._select import Backend, match_modules, module_types
from ..recovery import RecoveryOptions


class StaticOptions(RecoveryOptions):
    mode: Literal["auto", "fx", "pt2e", "eager"] = Field(
        "auto",
        description="auto (default): build FX, check its converted graph, fidelity and speed, and go on "
        "to PT2E when FX falls short; fx: torch.ao FX graph mode; pt2e: torch.export + torchao's "
        "X86 Inductor quantizer, measured compiled; eager: torch.ao eager mode (QuantStub models).",
    )
    backend: Backend | None = Field(
        None,
        description="Quantized engine for FX/eager int8 (default: onednn on x86 CPUs with VNNI, 8-bit "
        "weights; else x86; x86/fbgemm quantize weights to 7 bits, which their kernels need).",
    )
    calibration_batches: int | None = Field(None, ge=1, description="Default: the whole split.")
    activation_observer: Literal["minmax", "moving_average", "histogram", "range_search"] = Field(
        "histogram",
        description="How activation ranges are calibrated; range_search: per tensor, the range with the "
        "smallest int8 error among min/max, percentiles and clipping points (what `recovery: "
        "[range_search]` sets).",
    )
    weight_granularity: Literal["per_channel", "per_tensor"] = "per_channel"
    activation_symmetric: bool = False
    weight_bits: Literal[7, 8] | None = Field(
        None,
        description="Weight grid: 7 (-64..63) or 8 (-128..127) bits; activations are 8-bit. Default: "
        "what this CPU's int8 kernels take without saturating their 16-bit pair sums (7 on the "
        "x86/fbgemm engines, and on PT2E/onednn without VNNI; else 8). Set 8 for a model built here "
        "for a CPU with VNNI (onednn/PT2E).",
    )
    keep_float: list[str] = Field(default_factory=list, description="Module names/regexes kept float.")
    keep_float_types: list[str] = Field(default_factory=list, description="e.g. [Linear].")
    fuse: bool = Field(True, description="Eager mode: fuse Conv-BN(-ReLU) and Linear-ReLU first.")

    def per_channel_weights(self) -> bool:
        return self.weight_granularity == "per_channel"

    def quantize_with(self, algorithms: list[str]) -> StaticOptions:
        """``range_search`` calibrates activations with the per-tensor range search."""
        if "range_search" not in algorithms:
            return self
        return self.model_copy(update={"activation_observer": "range_search"})


def build_qconfig(opts: StaticOptions, backend: str) -> Any:
    from torch.ao.quantization import QConfig, observer

    # 8-bit activations on every engine; x86/fbgemm kernels take 7-bit weights (runtime.weight_range)
    low, high = weight_range("fx", backend)
    qscheme = torch.per_tensor_symmetric if opts.activation_symmetric else torch.per_tensor_affine
    act_cls = {
        "minmax": observer.MinMaxObserver,
        "moving_average": observer.MovingAverageMinMaxObserver,
        "histogram": observer.HistogramObserver,
        "range_search": ranges.observer_class(observer.HistogramObserver),
    }[opts.activation_observer]
    activation = act_cls.with_args(dtype=torch.quint8, qscheme=qscheme, reduce_range=False)
    grid = {"dtype": torch.qint8, "quant_min": low, "quant_max": high}
    if opts.weight_granularity == "per_channel":
        weight = observer.PerChannelMinMaxObserver.with_args(**grid, qscheme=torch.per_channel_symmetric)
    else:
        weight = observer.MinMaxObserver.with_args(**grid, qscheme=torch.per_tensor_symmetric)
    return QConfig(activation=activation, weight=weight)


def calibrate_loader(
    model: nn.Module, loader: Any, batches: int | None, progress: Any = None, description: str = "calibrate"
) -> int:
    """Run up to ``batches`` calibration batches through an observed model; returns how many."""
    total = len(loader) if batches is None else min(batches, len(loader))
    used = 0
    with torch.inference_mode(), (progress or NullProgress()).task(description, total=total) as task:
        for x, *_ in loader:
            if used >= total:
                break
            call(model, x)
            used += 1
            task.advance(1)
    return used


def calibrate(model: nn.Module, ctx: PassContext, batches: int | None, description: str) -> int:
    """Calibrate on the context's calibration split, with a progress bar."""
    return calibrate_loader(model, ctx.data.calibration, batches, ctx.progress, description)


class _ProbeTracer(torch.fx.Tracer):
    """An FX tracer that remembers which module it was inside when tracing failed."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.failed_at: list[str] | None = None
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        self.stack.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = list(self.stack)
            raise
        finally:
            self.stack.pop()


def untraceable_module(model: nn.Module, leaves: set[str]) -> tuple[str, str] | None:
    """(module path, error) of the innermost module FX cannot trace, or None if it traces."""
    tracer = _ProbeTracer(leaves)
    try:
        tracer.trace(model)
    except Exception as exc:
        where = tracer.failed_at[-1] if tracer.failed_at else ""
        return where, first_line(exc, 300)
    return None


def static_fx(model: nn.Module, ctx: PassContext, opts: StaticOptions, backend: str) -> nn.Module:
    from torch.ao.quantization import QConfigMapping, get_default_qconfig_mapping
    from torch.ao.quantization.fx.custom_config import PrepareCustomConfig
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    args, kwargs = as_args(ctx.example_input)
    if kwargs:
        raise PassError(
            "FX graph mode cannot quantize a model called with keyword inputs "
            f"({', '.join(kwargs)}): torch.ao's FX tracer takes positional inputs only",
            hint="use `mode: pt2e` (torch.export), quantize.dynamic (int8 Linear layers), or quantize.onnx",
        )
    mapping: QConfigMapping = get_default_qconfig_mapping(backend)
    mapping.set_global(build_qconfig(opts, backend))
    keep = match_modules(model, opts.keep_float, "keep_float")
    for name in keep:
        mapping.set_module_name(name, None)
    keep_types = tuple(module_types(opts.keep_float_types))
    for tp in keep_types:
        mapping.set_object_type(tp, None)
    # by name too: a kept Linear fused with its ReLU would otherwise follow the fused pattern
    for name, m in model.named_modules():
        if keep_types and name and isinstance(m, keep_types):
            mapping.set_module_name(name, None)
    custom = PrepareCustomConfig().set_non_traceable_module_names(keep)
    problem = untraceable_module(model, set(keep))
    if problem is not None:
        where, error = problem
        kind = type(model.get_submodule(where)).__name__ if where else type(model).__name__
        target = f"module {where!r} ({kind})" if where else f"the model's own forward ({kind})"
        raise PassError(
            f"FX cannot trace {target}: {error}",
            hint=(f"add `keep_float: [{where}]` to keep it in float, or " if where else "")
            + "use `mode: eager` (needs QuantStub-style models)",
        )
    prepared = prepare_fx(model.eval(), mapping, args, prepare_custom_config=custom)
    calibrate(prepared, ctx, opts.calibration_batches, "calibrate (fx)")
    chosen = ranges.observed_choices(prepared) if opts.activation_observer == "range_search" else None
    converted = convert_fx(prepared)
    if chosen is not None:
        converted.meta["torchtame_ranges"] = chosen
    return converted


def fusion_groups(model: nn.Module) -> list[list[str]]:
    """Conv-BN(-ReLU), Conv-ReLU and Linear-ReLU runs of consecutive children, safe to fuse.

    ReLU is fused only inside ``nn.Sequential`` (where child order is execution order); in other
    parents only Conv-BN pairs, since a ReLU module there may be shared by several calls.
    """
    groups: list[list[str]] = []
    for parent_name, parent in model.named_modules():
        names = list(parent._modules)
        mods = [parent._modules[n] for n in names]
        seq = isinstance(parent, nn.Sequential)
        prefix = f"{parent_name}." if parent_name else ""
        i = 0
        while i < len(mods):
            m = mods[i]
            nxt = mods[i + 1] if i + 1 < len(mods) else None
            nxt2 = mods[i + 2] if i + 2 < len(mods) else None
            conv = isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d)
            bn = isinstance(nxt, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d)
            if conv and bn and seq and isinstance(nxt2, nn.ReLU):
                groups.append([prefix + names[i], prefix + names[i + 1], prefix + names[i + 2]])
                i += 3
            elif (conv and bn) or (seq and (conv or isinstance(m, nn.Linear)) and isinstance(nxt, nn.ReLU)):
                groups.append([prefix + names[i], prefix + names[i + 1]])
                i += 2
            else:
                i += 1
    return groups


def static_eager(model: nn.Module, ctx: PassContext, opts: StaticOptions, backend: str) -> nn.Module:
    from torch.ao.quantization import QuantWrapper, convert, fuse_modules, prepare

    model = model.eval()
    groups = fusion_groups(model) if opts.fuse else []
    if groups:
        model = fuse_modules(model, groups)
    wrapped = QuantWrapper(model)
    wrapped.qconfig = build_qconfig(opts, backend)
    keep_types = tuple(module_types(opts.keep_float_types))
    for name in match_modules(model, opts.keep_float, "keep_float"):
        model.get_submodule(name).qconfig = None
    for _, m in model.named_modules():
        if keep_types and isinstance(m, keep_types):
            m.qconfig = None
    prepared = prepare(wrapped)
    calibrate(prepared, ctx, opts.calibration_batches, "calibrate (eager)")
    q = convert(prepared)
    try:
        with torch.inference_mode():
            call(q, ctx.example_input)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        raise PassError(
            f"eager-mode quantized model fails to run: {first_line(exc)}",
            hint="eager mode needs functional ops (+, cat) as nn.quantized.FloatFunctional; "
            "use `mode: fx` or keep_float for the failing block",
        ) from exc
    return q


# --------------------------------------------------------------------------- half
