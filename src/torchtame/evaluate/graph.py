"""What an int8 graph really runs in int8, read from the converted graph itself.

A quantization call that returns without error proves nothing: FX may trace through a Conv2d
subclass into functional convolutions with standalone quantized BatchNorms, PT2E's quantizer may
skip layers it does not recognise, onnxruntime may leave nodes in float. These functions count,
for torch.ao FX graphs, PT2E graphs and ONNX models, the weight layers (convolutions, linears)
that run in int8 and those left in float, standalone quantized BatchNorms, and float islands
(dequantize -> float ops -> quantize again).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHT_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)
_ATEN_WEIGHT_OPS = {
    torch.ops.aten.conv1d.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
    torch.ops.aten.linear.default,
}
_FLOAT_FUNCTIONAL = {nn.functional.conv1d, nn.functional.conv2d, nn.functional.conv3d, nn.functional.linear}


def _summary(int8: list[str], float_: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    total = len(int8) + len(float_)
    return {
        "weight_layers": total,
        "int8_layers": len(int8),
        "float_layers": float_,
        "int8_fraction": round(len(int8) / total, 4) if total else None,
        **extra,
    }


def _is_quantized_module(m: nn.Module) -> bool:
    return type(m).__module__.startswith(("torch.ao.nn.quantized", "torch.ao.nn.intrinsic.quantized"))


def inspect_fx(module: nn.Module) -> dict[str, Any]:
    """An FX-converted (torch.ao) GraphModule, or an eager-converted module."""
    int8: list[str] = []
    float_: list[str] = []
    batchnorms = 0
    for name, m in module.named_modules():
        kind = type(m).__name__
        if kind.endswith("PackedParams"):  # the weights of a quantized Linear, not a layer
            continue
        if _is_quantized_module(m) and ("Conv" in kind or "Linear" in kind):
            int8.append(name)
        elif _is_quantized_module(m) and "BatchNorm" in kind:
            batchnorms += 1
        elif isinstance(m, WEIGHT_MODULES) and not _is_quantized_module(m):
            float_.append(name)
    islands = 0
    functional_int8 = 0
    graph = getattr(module, "graph", None)
    if isinstance(graph, torch.fx.Graph):
        for node in graph.nodes:
            target = str(node.target)
            is_call = node.op == "call_function"
            if is_call and target.startswith("quantized.") and ("conv" in target or "linear" in target):
                functional_int8 += 1
                int8.append(node.name)
            elif is_call and "quantized.batch_norm" in target:
                batchnorms += 1
            elif is_call and node.target in _FLOAT_FUNCTIONAL:
                float_.append(node.name)
            elif node.op == "call_method" and node.target == "dequantize":
                islands += not any(u.op == "output" for u in node.users)
    return _summary(
        int8,
        float_,
        {
            "graph": "torch.ao fx",
            "functional_int8_layers": functional_int8,
            "standalone_batchnorms": batchnorms,
            "float_islands": islands,
        },
    )


def _is_dq(node: Any) -> bool:
    return isinstance(node, torch.fx.Node) and "dequantize" in str(node.target)


def _module_name(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return node.name
    return str(list(stack.values())[-1][0]).split("@")[0]


def inspect_pt2e(module: torch.fx.GraphModule) -> dict[str, Any]:
    """A PT2E-converted graph (Q/DQ representation): a conv/linear runs in int8 when both its
    input and its weight come from dequantize nodes (Inductor fuses those into int8 kernels)."""
    int8: list[str] = []
    float_: list[str] = []
    islands = 0
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _ATEN_WEIGHT_OPS:
            quantized = _is_dq(node.args[0]) and _is_dq(node.args[1])
            (int8 if quantized else float_).append(_module_name(node))
        elif "quantize_per_tensor" in str(node.target) and "dequantize" not in str(node.target):
            source = node.args[0]
            float_op = isinstance(source, torch.fx.Node) and source.op == "call_function"
            if float_op and source.target not in _ATEN_WEIGHT_OPS and any(_is_dq(a) for a in source.args):
                islands += 1
    return _summary(int8, float_, {"graph": "pt2e", "float_islands": islands, "standalone_batchnorms": 0})


_ONNX_WEIGHT_OPS = {"Conv", "Gemm", "MatMul", "ConvTranspose"}
_ONNX_INT8_OPS = {
    "QLinearConv",
    "QLinearMatMul",
    "ConvInteger",
    "MatMulInteger",
    "QGemm",
    "MatMulIntegerToFloat",
}


def inspect_onnx(path: str | Path) -> dict[str, Any]:
    """An onnxruntime-quantized model: QDQ (weight ops fed by DequantizeLinear), QOperator
    (QLinearConv, ...) or dynamic (MatMulInteger, ...). Float weight ops are listed by name."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {out: node for node in graph.node for out in node.output}
    int8: list[str] = []
    float_: list[str] = []
    order: list[str] = []
    float_ops: Counter[str] = Counter()
    for node in graph.node:
        name = node.name or node.op_type
        if node.op_type in _ONNX_INT8_OPS:
            int8.append(name)
            order.append(name)
        elif node.op_type in _ONNX_WEIGHT_OPS:
            order.append(name)
            weight = producer.get(node.input[1]) if len(node.input) > 1 else None
            if weight is not None and weight.op_type == "DequantizeLinear":  # its weights are int8
                int8.append(name)
            else:
                float_.append(name)
                float_ops[node.op_type] += 1
    feeders = {n: _feeders(graph, producer, n) for n in order}
    return _summary(
        int8,
        float_,
        {"graph": "onnx", "float_ops": dict(float_ops), "weight_nodes": order, "feeders": feeders},
    )


_QDQ = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


def quantized_ranges(path: str | Path) -> dict[str, tuple[float, float]]:
    """The activation tensors a QDQ model quantizes, with the float range each QuantizeLinear
    represents ((qmin - zero_point) * scale, (qmax - zero_point) * scale); weights (constant
    inputs) are left out."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name: i for i in graph.initializer}
    out: dict[str, tuple[float, float]] = {}
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in inits or node.input[1] not in inits:
            continue
        scale = float(numpy_helper.to_array(inits[node.input[1]]).reshape(-1)[0])
        zp = inits.get(node.input[2]) if len(node.input) > 2 else None
        zero = numpy_helper.to_array(zp) if zp is not None else None
        signed = zero is not None and zero.dtype.kind == "i"
        qmin, qmax = (-128, 127) if signed else (0, 255)
        z = float(zero.reshape(-1)[0]) if zero is not None else 0.0
        out[node.input[0]] = (round((qmin - z) * scale, 6), round((qmax - z) * scale, 6))
    return out


def qdq_changes(parent: str | Path, child: str | Path, tolerance: float = 0.01) -> dict[str, Any]:
    """Where two QDQ models of one float model quantize activations differently: tensors only the
    parent quantizes (now float), tensors only the child quantizes, and tensors whose range moved
    by more than ``tolerance`` of its width."""
    a, b = quantized_ranges(parent), quantized_ranges(child)
    moved = {}
    for t in a.keys() & b.keys():
        width = max(a[t][1] - a[t][0], 1e-12)
        if max(abs(a[t][0] - b[t][0]), abs(a[t][1] - b[t][1])) > tolerance * width:
            moved[t] = {"parent": list(a[t]), "child": list(b[t])}
    return {
        "now_float": sorted(a.keys() - b.keys()),
        "newly_quantized": {t: list(b[t]) for t in sorted(b.keys() - a.keys())},
        "range_moved": dict(sorted(moved.items())),
    }


def _feeders(graph: Any, producer: dict[str, Any], name: str) -> list[str]:
    """The non-weight ops between a weight node and the weight ops (or graph inputs) before it
    (concatenations, reshapes, ...): excluding a node from quantization keeps its input in float
    only if these are excluded too."""
    node = next(n for n in graph.node if (n.name or n.op_type) == name)
    out: list[str] = []
    stack = [node.input[0]] if node.input else []
    seen: set[str] = set()
    while stack:
        source = producer.get(stack.pop())
        if source is None or source.name in seen:
            continue
        seen.add(source.name)
        if source.op_type in _ONNX_WEIGHT_OPS | _ONNX_INT8_OPS:
            continue
        if source.op_type not in _QDQ:
            out.append(source.name)
        stack += list(source.input[:1]) if source.op_type in _QDQ else list(source.input)
    return out
