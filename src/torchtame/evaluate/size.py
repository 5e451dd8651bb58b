"""Size of a variant: parameters, non-zero parameters, bytes on disk, MACs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in _tensors(item)]
    return []


def _count(tensors: list[torch.Tensor]) -> tuple[int, int]:
    total = nonzero = 0
    for t in tensors:
        if t.is_quantized:
            t = t.int_repr()
        total += t.numel()
        try:
            nonzero += int(torch.count_nonzero(t).item()) if t.numel() else 0
        except (NotImplementedError, RuntimeError):  # tensor subclasses (torchao) without the op
            nonzero += t.numel()
    return total, nonzero


def module_params(module: nn.Module) -> tuple[int, int]:
    """(parameters, non-zero parameters), counting quantized packed weights as parameters.

    Observer state, scales and zero points are not parameters and are skipped.
    """
    tensors = []
    for key, value in module.state_dict().items():
        leaf = key.rsplit(".", 1)[-1]
        if leaf in ("scale", "zero_point") or "activation_post_process" in key:
            continue
        if "_packed_params" in key or leaf in ("weight", "bias") or isinstance(value, torch.Tensor):
            for t in _tensors(value):
                if t.dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64) or t.is_quantized:
                    tensors.append(t)
    if not tensors:
        tensors = list(module.parameters())
    return _count(tensors)


def onnx_params(path: Path) -> tuple[int, int]:
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    total = nonzero = 0
    for init in model.graph.initializer:
        arr = numpy_helper.to_array(init)
        if arr.ndim == 0 or arr.size <= 1:  # scales, zero points, shapes
            continue
        if arr.dtype.kind in "if":
            total += arr.size
            nonzero += int(np.count_nonzero(arr))
    return total, nonzero


def artifact_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def size_report(params: tuple[int, int], files: list[Path], macs: int | None) -> dict[str, Any]:
    return {
        "params": params[0],
        "nonzero_params": params[1],
        "bytes": artifact_bytes(files),
        "macs": macs,
    }
