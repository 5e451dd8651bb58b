"""Saving and loading variant artefacts.

Float and pruned variants are saved whole with ``torch.save`` (the pruned structure is part of
the module); torch.ao-quantized variants as TorchScript, since FX-converted quantized graph
modules do not survive pickling; PT2E int8 graphs as exported programs (``.pt2``). ONNX variants
are their ``.onnx`` file.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._warnings import caught
from .inputs import as_args, cast_floating
from .runtime import no_mha_fastpath, quantized_engine
from .variant import Variant

log = logging.getLogger("torchtame")


def _trace(variant: Variant, example: Any, path: Path) -> Path:
    args, kwargs = as_args(cast_floating(example, variant.input_dtype))
    with quantized_engine(variant.backend), torch.inference_mode(), no_mha_fastpath():
        if kwargs:
            traced = torch.jit.trace(
                variant.module, example_kwarg_inputs=kwargs, check_trace=False, strict=False
            )
        else:
            traced = torch.jit.trace(variant.module, args, check_trace=False, strict=False)
    torch.jit.save(traced, str(path))
    return path


def _export(variant: Variant, example: Any, path: Path) -> Path:
    """An exported program (PT2E int8 graphs: what torch.compile and AOTInductor deploy)."""
    from .passes.static.pt2e import export_dynamic

    program = export_dynamic(variant.module, cast_floating(example, variant.input_dtype))
    torch.export.save(program, str(path))
    return path


def save_module(variant: Variant, directory: Path, example: Any) -> Path:
    """Write the variant's module into ``directory``; returns the file written.

    A module that cannot be pickled (a class defined inside a function, a lambda attribute) is
    saved as TorchScript instead, and one that cannot be traced either as its state dict.
    """
    assert variant.module is not None
    directory.mkdir(parents=True, exist_ok=True)
    with caught("save"):
        if isinstance(variant.module, torch.fx.GraphModule) and variant.compiled:
            return _export(variant, example, directory / "model.pt2")
        if variant.compiled:  # torchao tensor subclasses pickle whole, not through TorchScript
            path = directory / "model.pt"
            torch.save(variant.module, path)
            return path
        if variant.quantized:
            return _trace(variant, example, directory / "model.ts")
        path = directory / "model.pt"
        try:
            torch.save(variant.module, path)
            return path
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            path.unlink(missing_ok=True)
            log.info("%s cannot be pickled (%s); saving TorchScript instead", variant.name, exc)
        try:
            return _trace(variant, example, directory / "model.ts")
        except Exception as exc:
            log.info("%s cannot be traced either (%s); saving its state dict", variant.name, exc)
        path = directory / "weights.pt"
        torch.save(variant.module.state_dict(), path)
        return path


def load_module(path: str | Path) -> nn.Module:
    """Load an artefact written by :func:`save_module` (only load files you trust: ``.pt`` files
    are pickles of whole modules)."""
    path = Path(path)
    with caught("load"):
        if path.suffix == ".ts":
            return torch.jit.load(str(path), map_location="cpu")
        if path.suffix == ".pt2":
            return torch.export.load(str(path)).module()
        return torch.load(path, map_location="cpu", weights_only=False)
