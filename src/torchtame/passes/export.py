"""ONNX export of a variant, verified with onnx.checker and by parity in onnxruntime."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from .._warnings import caught
from ..errors import PassError, first_line
from ..onnx_runtime import parity, session
from ..options import Strict
from ..registry import register_pass
from ..runtime import quantized_engine
from ..variant import PassContext, Variant
from ._select import require_float

log = logging.getLogger("torchtame")
TWO_GB = 2 * 1024**3


class OnnxOptions(Strict):
    opset: int | None = Field(None, ge=7, le=25, description="Default: the exporter's own.")
    exporter: Literal["dynamo", "torchscript"] = "dynamo"
    fallback: bool = Field(True, description="Retry with the TorchScript exporter if dynamo fails.")
    dynamic_batch: bool = True
    input_name: str = "input"
    output_name: str = "output"
    verify: bool = True
    atol: float = Field(1e-4, ge=0)
    rtol: float = Field(1e-3, ge=0, description="Relative to the largest reference output.")
    min_top1_agreement: float = Field(0.99, ge=0, le=1)
    parity_batches: int = Field(4, ge=1)


def _export(module: nn.Module, example: torch.Tensor, path: Path, opts: OnnxOptions, exporter: str) -> None:
    kwargs: dict[str, Any] = {
        "input_names": [opts.input_name],
        "output_names": [opts.output_name],
    }
    if opts.opset is not None:
        kwargs["opset_version"] = opts.opset
    if exporter == "dynamo":
        kwargs.update(dynamo=True, external_data=True, verbose=False, report=False)
        if opts.dynamic_batch:
            kwargs["dynamic_shapes"] = ({0: torch.export.Dim("batch", min=1)},)
    else:
        kwargs["dynamo"] = False
        if opts.dynamic_batch:
            kwargs["dynamic_axes"] = {opts.input_name: {0: "batch"}, opts.output_name: {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(module, (example,), str(path), **kwargs)


def merge_external_data(path: Path) -> bool:
    """Fold an ``.onnx.data`` side file into the model when it fits under 2 GB; True if merged."""
    import onnx

    side = [p for p in path.parent.glob(path.name + "*") if p != path]
    if not side:
        return False
    total = path.stat().st_size + sum(p.stat().st_size for p in side)
    if total >= TWO_GB:
        return False
    model = onnx.load(str(path), load_external_data=True)
    onnx.save_model(model, str(path), save_as_external_data=False)
    for p in side:
        p.unlink()
    return True


def export_onnx(
    module: nn.Module, example: torch.Tensor, path: Path, opts: OnnxOptions, quantized: bool
) -> dict[str, Any]:
    """Export ``module`` to ``path`` and run onnx's checker; returns which exporter was used."""
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    exporter = "torchscript" if quantized else opts.exporter
    attempts = [exporter] + (["torchscript"] if exporter == "dynamo" and opts.fallback else [])
    errors = []
    for name in attempts:
        try:
            with (
                caught(f"export.onnx ({name})"),
                open(os.devnull, "w") as devnull,
                contextlib.redirect_stdout(devnull),
            ):
                _export(module, example, path, opts, name)
            break
        except Exception as exc:
            first = first_line(exc, 240)
            errors.append(f"{name}: {first}")
            log.info("ONNX export with the %s exporter failed: %s", name, first)
    else:
        hint = (
            "torch.ao-quantized models export only with the TorchScript exporter, and not every "
            "quantized op has an ONNX form; export the float variant and use quantize.onnx instead"
            if quantized
            else "try `exporter: torchscript`, another `opset`, or simplify the model's forward"
        )
        raise PassError("ONNX export failed: " + " | ".join(errors), hint=hint)
    merged = merge_external_data(path)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        raise PassError(f"the exported ONNX model fails onnx.checker: {str(exc)[:300]}") from exc
    return {"exporter": name, "fallback_errors": errors, "merged_external_data": merged}


def verify(
    variant_fn: Any,
    path: Path,
    loader: Any,
    opts: OnnxOptions,
    input_dtype: torch.dtype,
    quantized: bool,
) -> dict[str, float]:
    """Parity of the ONNX model with its PyTorch source on evaluation batches; raises on failure."""
    sess = session(path, "cpu")
    figures = parity(variant_fn, sess, loader, opts.parity_batches, input_dtype)
    limit = opts.atol + opts.rtol * figures["reference_max_abs"]
    numeric_ok = quantized or figures["max_abs_error"] <= limit
    agree_ok = figures["top1_agreement"] >= opts.min_top1_agreement
    figures["passed"] = float(numeric_ok and agree_ok)
    if not (numeric_ok and agree_ok):
        raise PassError(
            "ONNX parity check failed: "
            f"max abs error {figures['max_abs_error']:.3g} (allowed {limit:.3g}), "
            f"top-1 agreement {figures['top1_agreement']:.3f} (needed {opts.min_top1_agreement})",
            hint="raise `atol`/`rtol` if the difference is acceptable, or try the other exporter",
        )
    return figures


@register_pass("export.onnx", OnnxOptions)
def export_onnx_pass(model: nn.Module | None, ctx: PassContext, opts: OnnxOptions) -> Variant:
    """Export to ONNX, check it with onnx.checker and compare with PyTorch in onnxruntime."""
    parent = ctx.parent
    if model is None:
        raise PassError(f"{parent.name!r} is already an ONNX model", hint="export from a torch variant")
    if parent.dtype in ("float16", "bfloat16"):
        require_float(
            ctx,
            "export.onnx",
            "export the float32 variant; onnxruntime can convert precision afterwards",
            float32=True,
        )
    path = ctx.work_dir / "model.onnx"
    example = ctx.example_input
    if opts.dynamic_batch and example.shape[0] == 1:
        example = example.repeat(2, *([1] * (example.dim() - 1)))
    with quantized_engine(parent.backend):
        info = export_onnx(model, example, path, opts, parent.quantized)
        if opts.verify:
            info["parity"] = verify(
                model, path, ctx.data.evaluation, opts, parent.input_dtype, parent.quantized
            )
    return ctx.variant(
        None,
        onnx_path=path,
        dtype=parent.dtype,
        devices="any",
        info={**info, "opset": opts.opset},
    )
