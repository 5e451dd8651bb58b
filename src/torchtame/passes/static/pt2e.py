"""Static int8 through PT2E (torchao): torch.export, a normalised graph, X86InductorQuantizer.

The converted graph holds quantize/dequantize pairs around float ops; it is fast only once
Inductor compiles it (with weight freezing), which fuses those patterns into int8 kernels. So
PT2E variants are measured compiled (see :func:`torchtame.runtime.compiled`).

Two things in graphs exported by torch 2.14 stop the X86 quantizer from annotating layers, and
:func:`normalise` fixes both in the graph's metadata before quantization:

- a module called twice (resnet's ``self.relu``) puts both calls in one source partition, which
  the quantizer rejects ("Input partition has more than one output node"): each call becomes its
  own partition;
- a Conv2d subclass that pads in ``forward`` (TensorFlow ports, timm's ``Conv2dSame``) is not
  recognised as ``nn.Conv2d``, so its convolution stays float: the convolution node is presented
  as the plain layer it is.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from ...errors import PassError, first_line
from ...inputs import as_args, batch_size, repeat_batch, tensors
from ...optional import require
from ...runtime import pt2e_weight_range
from .. import ranges

log = logging.getLogger("torchtame")

_BASES = {
    torch.ops.aten.conv1d.default: (nn.Conv1d, "torch.nn.modules.conv.Conv1d"),
    torch.ops.aten.conv2d.default: (nn.Conv2d, "torch.nn.modules.conv.Conv2d"),
    torch.ops.aten.linear.default: (nn.Linear, "torch.nn.modules.linear.Linear"),
}


def export_dynamic(model: nn.Module, example: Any) -> torch.export.ExportedProgram:
    """torch.export with a dynamic batch (and a dynamic sequence for integer inputs); where the
    model constrains those dims, ``Dim.AUTO`` lets export find the bounds; else shapes are static.
    A batch of one is repeated to two first: export specialises dimensions of size 1."""
    if batch_size(example) == 1:
        example = repeat_batch(example, 2)
    args, kwargs = as_args(example)

    def shapes(auto: bool) -> Any:
        batch = torch.export.Dim.AUTO if auto else torch.export.Dim("batch", min=1)
        seq = torch.export.Dim.AUTO if auto else torch.export.Dim("sequence", min=1)

        def spec(t: torch.Tensor) -> dict[int, Any]:
            axes = {0: batch}
            if t.dim() >= 2 and not t.is_floating_point():
                axes[1] = seq
            return axes

        if kwargs:
            return {k: spec(v) for k, v in kwargs.items()}
        return tuple(spec(t) for t in args)

    errors = []
    for dynamic in (shapes(False), shapes(True), None):
        try:
            return torch.export.export(model, args, kwargs or None, dynamic_shapes=dynamic)
        except Exception as exc:
            errors.append(first_line(exc, 200))
    raise PassError(
        f"torch.export cannot capture the model: {errors[-1]}",
        hint="PT2E needs a model torch.export can trace; use `mode: fx`, quantize.dynamic or quantize.onnx",
    )


def exported(model: nn.Module, example: Any) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """The eval-mode model exported and normalised (:func:`normalise`), and what that changed."""
    gm = export_dynamic(model.eval(), example).module()
    return gm, normalise(gm, model)


def _structure(model: nn.Module) -> tuple[Any, ...]:
    """What makes two float models export to the same graph: their module tree (names and
    types) and their state (names, shapes, dtypes, devices); weights' values do not."""
    modules = tuple((name, type(m)) for name, m in model.named_modules())
    state = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in model.state_dict().items())
    return modules, state


class Exports:
    """Exported, normalised graphs by model structure, for building the int8 models of many float
    models that differ only in their weights (``recovery: auto``'s candidates): torch.export is about
    half of a PT2E build (mobilenet_v2 at 32x32: 2.4 s of 4.5 s). A model with the structure of one
    exported before gets a copy of that graph with its own weights loaded; any other is exported."""

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], tuple[torch.fx.GraphModule, dict[str, Any]]] = {}
        self.exported = 0
        self.reused = 0

    def graph(self, model: nn.Module, example: Any) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
        key = _structure(model)
        cached = self._graphs.get(key)
        if cached is not None:
            gm = copy.deepcopy(cached[0])
            try:
                gm.load_state_dict(model.state_dict(), strict=True)
            except RuntimeError:  # the graph holds the state differently: export this one
                pass
            else:
                self.reused += 1
                return gm, copy.deepcopy(cached[1])
        gm, changes = exported(model, example)
        self.exported += 1
        if cached is None:
            self._graphs[key] = (copy.deepcopy(gm), copy.deepcopy(changes))
        return gm, changes


def normalise(gm: torch.fx.GraphModule, model: nn.Module) -> dict[str, Any]:
    """Rewrite the graph's module metadata so the X86 quantizer sees every layer (see the module
    docstring). Returns what changed and the per-call names (``name@k``) created."""
    split: set[str] = set()
    subclasses: list[str] = []
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or not stack:
            continue
        key, (fqn, cls) = list(stack.items())[-1]
        if "@" in key:
            fqn = f"{fqn}@{key.rsplit('@', 1)[1]}"
            split.add(fqn)
        if node.target in _BASES:
            base, name = _BASES[node.target]
            try:
                owner = model.get_submodule(fqn.split("@")[0].removeprefix("L['self']."))
            except AttributeError:
                owner = None
            if isinstance(owner, base) and type(owner) is not base:
                subclasses.append(f"{fqn} ({type(owner).__name__})")
                cls = name
        stack[key] = (fqn, cls)
    return {"calls_split": sorted(split), "subclass_layers": subclasses}


def x86_config(observer: str, per_channel: bool) -> Any:
    """The X86 Inductor quantization config with the recipe's activation observer and weight
    granularity (activations: uint8 affine per tensor, the only layout its int8 kernels take; weights
    symmetric on :func:`~torchtame.runtime.pt2e_weight_range`'s grid: 7-bit on CPUs without VNNI)."""
    pt2e = require("torchao.quantization.pt2e", "PT2E quantization", PassError)
    from torchao.quantization.pt2e.quantizer import QuantizationConfig, QuantizationSpec

    act_cls = {
        "histogram": pt2e.HistogramObserver,
        "minmax": pt2e.MinMaxObserver,
        "moving_average": pt2e.MovingAverageMinMaxObserver,
        "range_search": ranges.observer_class(pt2e.HistogramObserver),
    }[observer]
    act = QuantizationSpec(
        dtype=torch.uint8,
        quant_min=0,
        quant_max=255,
        qscheme=torch.per_tensor_affine,
        is_dynamic=False,
        observer_or_fake_quant_ctr=act_cls.with_args(eps=2**-12),
    )
    if per_channel:
        weight_obs = pt2e.PerChannelMinMaxObserver.with_args(eps=2**-12)
        scheme = torch.per_channel_symmetric
    else:
        weight_obs = pt2e.MinMaxObserver.with_args(eps=2**-12)
        scheme = torch.per_tensor_symmetric
    low, high = pt2e_weight_range()
    weight = QuantizationSpec(
        dtype=torch.int8,
        quant_min=low,
        quant_max=high,
        qscheme=scheme,
        ch_axis=0,
        is_dynamic=False,
        observer_or_fake_quant_ctr=weight_obs,
    )
    return QuantizationConfig(act, act, weight, None, False)


def quantize_pt2e(
    model: nn.Module,
    example: Any,
    calibrate: Any,
    *,
    observer: str,
    per_channel: bool,
    keep: list[str],
    keep_types: tuple[type[nn.Module], ...],
    exports: Exports | None = None,
) -> tuple[torch.fx.GraphModule, dict[str, Any]]:
    """Export (or take the graph from ``exports``), normalise, annotate, calibrate
    (``calibrate(prepared)``) and convert; returns the converted graph and what the normalisation
    changed."""
    require("torchao", "PT2E quantization", PassError)
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import X86InductorQuantizer

    gm, changes = exports.graph(model, example) if exports is not None else exported(model, example)
    quantizer = X86InductorQuantizer().set_global(x86_config(observer, per_channel))
    for name in keep:
        quantizer.set_module_name_qconfig(name, None)
        for split in changes["calls_split"]:
            if split.split("@")[0] == name:
                quantizer.set_module_name_qconfig(split, None)
    for tp in keep_types:
        quantizer.set_module_type_qconfig(tp, None)
    try:
        prepared = prepare_pt2e(gm, quantizer)
    except Exception as exc:
        where, module = failing_node(exc)
        raise PassError(
            f"the X86 quantizer cannot annotate this graph{where}: {first_line(exc, 200)}",
            hint=f"`keep_float: [{module}]` quantizes the rest" if module else "keep that layer float",
        ) from exc
    calibrate(prepared)
    chosen = ranges.observed_choices(prepared) if observer == "range_search" else None
    converted = convert_pt2e(prepared)
    if chosen is not None:
        converted.meta["torchtame_ranges"] = chosen
    changes["unused_float_bytes_dropped"] = drop_unused_attributes(converted)
    return converted, changes


def failing_node(exc: BaseException) -> tuple[str, str | None]:
    """Where in the graph an exception was raised: the innermost frame of its traceback that was
    looking at a graph node names it, and the node's module stack names the layer to keep float."""
    node = None
    tb = exc.__traceback__
    while tb is not None:
        found = tb.tb_frame.f_locals.get("node")
        if isinstance(found, torch.fx.Node):
            node = found
        tb = tb.tb_next
    if node is None:
        return "", None
    stack = node.meta.get("nn_module_stack") or {}
    module = next(reversed(stack.values()))[0] if stack else None
    return f" at node {node.name} ({node.target}{f', in {module}' if module else ''})", module


def drop_unused_attributes(gm: torch.fx.GraphModule) -> int:
    """Delete parameters and buffers no node reads: after ``convert_pt2e`` folds each weight's
    quantize into an int8 constant, the float weights stay registered (and would be saved: a
    mobilenet_v3_small ``.pt2`` was 1.45x the fp32 file). Returns the bytes dropped."""
    used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    modules = [str(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    dropped = 0
    for name, tensor in [*gm.named_parameters(), *gm.named_buffers()]:
        if name in used or any(name.startswith(m + ".") for m in modules):
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        dropped += tensor.numel() * tensor.element_size()
        delattr(owner, attr)
    gm.delete_all_unused_submodules()
    return dropped


def example_signature(example: Any) -> str:
    return ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in tensors(example))
