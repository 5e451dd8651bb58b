"""Optimization passes, registered by name; each owns a pydantic model of its options."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from ..registry import Registry
from ..variant import PassFn

PASSES: Registry[PassFn] = Registry("pass")


def register_pass(name: str, options: type[BaseModel]) -> Callable[[PassFn], PassFn]:
    """Register ``fn(model, ctx, options) -> Variant`` as the pass ``name``."""
    return PASSES.register(name, options)


from . import export, finetune, prune, quantize  # noqa: E402,F401  (registers the built-ins)

__all__ = ["PASSES", "register_pass"]
