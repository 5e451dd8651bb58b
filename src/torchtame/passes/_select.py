"""Helpers shared by the passes: selecting submodules by name or regex, checking the parent."""

from __future__ import annotations

import re

from torch import nn

from ..errors import PassError
from ..variant import PassContext


def require_float(ctx: PassContext, pass_name: str, hint: str) -> None:
    """Refuse a parent that is quantized or an ONNX file: this pass needs a float torch module."""
    if not ctx.parent.is_float:
        raise PassError(
            f"{pass_name} needs a float torch variant; {ctx.parent.name!r} is {ctx.parent.dtype}", hint=hint
        )


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
