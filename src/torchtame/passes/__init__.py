"""Optimization passes, registered by name; each owns a pydantic model of its options.

Importing this package registers the built-in passes (one module per family).
"""

from __future__ import annotations

from ..registry import PASSES, register_pass
from . import export, finetune, onnx_quant, prune, qat, quantize, sparse, static, torchao  # noqa: F401  (registers the built-ins)

__all__ = ["PASSES", "register_pass"]
