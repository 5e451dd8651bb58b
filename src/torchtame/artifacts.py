"""Saving and loading variant artefacts.

Float and pruned variants are saved whole with ``torch.save`` (the pruned structure is part of
the module); torch.ao-quantized variants as TorchScript, since FX-converted quantized graph
modules do not survive pickling. ONNX variants are their ``.onnx`` file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ._warnings import caught
from .passes.quantize import engine
from .variant import Variant


def save_module(variant: Variant, directory: Path, example: torch.Tensor) -> Path:
    """Write the variant's module into ``directory``; returns the file written."""
    assert variant.module is not None
    directory.mkdir(parents=True, exist_ok=True)
    with caught("save"):
        if variant.quantized:
            path = directory / "model.ts"
            with engine(variant.backend), torch.inference_mode():
                traced = torch.jit.trace(variant.module, example.to(variant.input_dtype), check_trace=False)
            torch.jit.save(traced, str(path))
        else:
            path = directory / "model.pt"
            torch.save(variant.module, path)
    return path


def load_module(path: str | Path) -> nn.Module:
    """Load an artefact written by :func:`save_module` (only load files you trust: ``.pt`` files
    are pickles of whole modules)."""
    path = Path(path)
    with caught("load"):
        if path.suffix == ".ts":
            return torch.jit.load(str(path), map_location="cpu")
        return torch.load(path, map_location="cpu", weights_only=False)
