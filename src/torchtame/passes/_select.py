"""Helpers shared by the passes: selecting submodules by name or regex, checking the parent."""

from __future__ import annotations

import re
from typing import Literal

from torch import nn

from ..errors import PassError
from ..variant import PassContext


def require_float(
    ctx: PassContext, pass_name: str, hint: str, *, float32: bool = False, allow_onnx: bool = False
) -> None:
    """Refuse a parent this pass cannot start from: quantized, ONNX (unless ``allow_onnx``), or
    (with ``float32``) half precision. One wording for every pass."""
    parent = ctx.parent
    if allow_onnx and parent.kind == "onnx" and not parent.quantized:
        return
    ok = parent.is_float and (not float32 or parent.dtype == "float32")
    if not ok:
        what = "a float32" if float32 else "a float"
        also = " or a float ONNX model" if allow_onnx else ""
        got = "a quantized ONNX model" if parent.kind == "onnx" and parent.quantized else parent.dtype
        got = "an ONNX model" if parent.kind == "onnx" and not parent.quantized else got
        raise PassError(f"{pass_name} needs {what} torch variant{also}; {parent.name!r} is {got}", hint=hint)


def match_modules(model: nn.Module, patterns: list[str], field: str = "pattern") -> list[str]:
    """Names of submodules that equal a pattern or fully match it as a regex (each must hit)."""
    if not patterns:
        return []
    names = [n for n, _ in model.named_modules() if n]
    out: list[str] = []
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error:
            regex = None
        hits = [n for n in names if n == pattern or (regex is not None and regex.fullmatch(n))]
        if not hits:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise PassError(
                f"{field}: no module is named {pattern!r} (nor matches it as a regex)",
                hint=f"module names look like: {shown}",
            )
        out += [h for h in hits if h not in out]
    return out


Backend = Literal["x86", "fbgemm", "onednn", "qnnpack"]


def module_types(names: list[str]) -> list[type[nn.Module]]:
    out = []
    for name in names:
        tp = getattr(nn, name, None)
        if not (isinstance(tp, type) and issubclass(tp, nn.Module)):
            raise PassError(f"{name!r} is not a torch.nn module type", hint="e.g. Linear, Conv2d, LSTM")
        out.append(tp)
    return out
