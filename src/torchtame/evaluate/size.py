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


SPARSE_ENOUGH = 0.3  # a weight with fewer zeros is cheaper stored dense


def sparse_format_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the tensors in a simple sparse format: a weight (2+ dims) with at least 30% zeros
    as its non-zero values plus a one-bit-per-element mask; everything else dense."""
    total = 0
    for t in tensors:
        if t.is_quantized:
            t = t.int_repr()
        size = t.element_size()
        if t.dim() >= 2 and t.numel():
            nonzero = int(torch.count_nonzero(t).item())
            if 1 - nonzero / t.numel() >= SPARSE_ENOUGH:
                total += nonzero * size + (t.numel() + 7) // 8
                continue
        total += t.numel() * size
    return total


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every tensor a saved module holds (torch.ao's packed weights are in its state as tensors)."""
    out = []
    for value in module.state_dict().values():
        out += [t for t in _tensors(value) if isinstance(t, torch.Tensor)]
    return out


def onnx_tensors(path: Path) -> list[torch.Tensor]:
    import onnx
    from onnx import numpy_helper

    return [torch.from_numpy(numpy_helper.to_array(t).copy()) for t in onnx.load(str(path)).graph.initializer]


def artifact_bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def size_report(
    params: tuple[int, int], files: list[Path], macs: int | None, tensors: list[torch.Tensor] | None = None
) -> dict[str, Any]:
    """Size figures; where at least 30% of the parameters are zeros, also ``sparse_format_bytes``
    (the saved file is dense: this is what a sparse format, non-zeros + bitmask, would take) and
    ``compressed_bytes`` (the saved files compressed with xz, as they would be shipped)."""
    out: dict[str, Any] = {
        "params": params[0],
        "nonzero_params": params[1],
        "bytes": artifact_bytes(files),
        "macs": macs,
    }
    if tensors is not None and params[0] and 1 - params[1] / params[0] >= SPARSE_ENOUGH:
        dense = sum(t.numel() * t.element_size() for t in tensors)
        sparse = sparse_format_bytes(tensors)
        # the same saving applied to the file (which also holds metadata and structure)
        out["sparse_format_bytes"] = int(out["bytes"] - (dense - sparse)) if out["bytes"] else sparse
        if out["bytes"]:
            out["compressed_bytes"] = compressed_bytes(files)
    return out


def compressed_bytes(paths: list[Path]) -> int:
    """Bytes of the files compressed with xz (LZMA, preset 6): zeros and repeated values shrink."""
    import lzma

    return sum(len(lzma.compress(p.read_bytes(), preset=6)) for p in paths if p.exists())
