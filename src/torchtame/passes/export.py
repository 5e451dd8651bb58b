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
from ..inputs import as_args, batch_size, call, input_names, output_items, repeat_batch, tensors
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
    dynamic_sequence: bool = Field(
        True, description="Integer/boolean inputs (token ids, masks) get a dynamic sequence axis (dim 1)."
    )
    input_name: str | None = Field(
        None, description="Name of a single tensor input (default: forward()'s parameter name)."
    )
    output_name: str = Field("output", description="Name of a single tensor output.")
    verify: bool = True
    atol: float = Field(1e-4, ge=0)
    rtol: float = Field(1e-3, ge=0, description="Relative to the largest reference output.")
    min_top1_agreement: float = Field(0.99, ge=0, le=1, description="For class-score outputs.")
    min_cosine: float = Field(0.99, ge=-1, le=1, description="Cosine similarity to PyTorch's outputs.")
    parity_batches: int = Field(4, ge=1)


def _names(module: nn.Module, example: Any, opts: OnnxOptions) -> tuple[list[str], list[str]]:
    """ONNX input names (dict keys / forward() parameters) and output names (ModelOutput keys)."""
    inputs = input_names(module, example)
    if isinstance(example, torch.Tensor) and opts.input_name is not None:
        inputs = [opts.input_name]
    with torch.no_grad():
        items = output_items(call(module, example))
    outputs = [opts.output_name] if len(items) == 1 else [n for n, _ in items]
    return inputs, outputs


def _axes(t: torch.Tensor, opts: OnnxOptions) -> list[int]:
    axes = [0] if opts.dynamic_batch else []
    if opts.dynamic_sequence and t.dim() >= 2 and not t.is_floating_point():
        axes.append(1)
    return axes


def _dynamic_shapes(example: Any, opts: OnnxOptions, auto: bool) -> Any:
    """torch.export dynamic shapes in the structure of the inputs: named batch/sequence dims (one
    shared sequence dim for all integer inputs), or ``Dim.AUTO`` letting export find the bounds."""
    batch = torch.export.Dim.AUTO if auto else torch.export.Dim("batch", min=1)
    seq = torch.export.Dim.AUTO if auto else torch.export.Dim("sequence", min=1)

    def spec(t: torch.Tensor) -> dict[int, Any]:
        return {a: (batch if a == 0 else seq) for a in _axes(t, opts)}

    args, kwargs = as_args(example)
    if kwargs:
        return {k: spec(v) for k, v in kwargs.items()}
    return tuple(spec(t) for t in args)


def _export(
    module: nn.Module, example: Any, path: Path, opts: OnnxOptions, exporter: str, auto: bool = False
) -> None:
    args, kwargs = as_args(example)
    inputs, outputs = _names(module, example, opts)
    options: dict[str, Any] = {"input_names": inputs, "output_names": outputs}
    if kwargs:
        options["kwargs"] = kwargs
    if opts.opset is not None:
        options["opset_version"] = opts.opset
    if exporter == "dynamo":
        options.update(dynamo=True, external_data=True, verbose=False, report=False)
        if opts.dynamic_batch or opts.dynamic_sequence:
            options["dynamic_shapes"] = _dynamic_shapes(example, opts, auto)
    else:
        options["dynamo"] = False
        names = {n: t for n, t in zip(inputs, tensors(example), strict=False)}
        axes = {n: {a: ("batch" if a == 0 else "sequence") for a in _axes(t, opts)} for n, t in names.items()}
        if opts.dynamic_batch:
            axes.update({n: {0: "batch"} for n in outputs})
        options["dynamic_axes"] = {n: a for n, a in axes.items() if a}
    with torch.no_grad():
        torch.onnx.export(module, args, str(path), **options)


def fixed_axes(path: Path, example: Any, opts: OnnxOptions) -> list[str]:
    """Axes asked to be dynamic that came out fixed (the model specialised them, e.g. nn.LSTM's
    sequence length under torch.export): ``"input_ids: axis 1 fixed at 12"``."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    out = []
    for value, t in zip(graph.input, tensors(example), strict=False):
        dims = value.type.tensor_type.shape.dim
        for axis in _axes(t, opts):
            if axis < len(dims) and dims[axis].HasField("dim_value"):
                out.append(f"{value.name}: axis {axis} fixed at {dims[axis].dim_value}")
    return out


def strip_debug_metadata(path: Path) -> int:
    """Drop the per-node debug metadata the dynamo exporter writes (FX node text, module stacks):
    the runtime never reads it, and in small models it outweighs the weights. Returns bytes saved."""
    import onnx

    before = path.stat().st_size
    if before >= TWO_GB or any(p != path for p in path.parent.glob(path.name + ".*")):
        return 0
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if len(n.metadata_props)]
    if not nodes:
        return 0
    for n in nodes:
        del n.metadata_props[:]
    onnx.save_model(model, str(path))
    return before - path.stat().st_size


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
    module: nn.Module, example: Any, path: Path, opts: OnnxOptions, quantized: bool
) -> dict[str, Any]:
    """Export ``module`` to ``path`` and run onnx's checker; returns which exporter was used.

    The dynamo exporter is tried with named dynamic dims, then with ``Dim.AUTO`` (for models whose
    shapes carry constraints, such as a maximum sequence length), then the TorchScript exporter.
    """
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    exporter = "torchscript" if quantized else opts.exporter
    attempts = [(exporter, False)]
    if exporter == "dynamo":
        attempts.append(("dynamo", True))
        if opts.fallback:
            attempts.append(("torchscript", False))
    errors = []
    for name, auto in attempts:
        try:
            with (
                caught(f"export.onnx ({name})"),
                open(os.devnull, "w") as devnull,
                contextlib.redirect_stdout(devnull),
            ):
                _export(module, example, path, opts, name, auto)
            break
        except Exception as exc:
            first = first_line(exc, 240)
            errors.append(f"{name}{' (automatic dims)' if auto else ''}: {first}")
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
    stripped = strip_debug_metadata(path)
    fixed = fixed_axes(path, example, opts)
    if fixed:
        log.info("the ONNX model has fixed axes the export asked to keep dynamic: %s", "; ".join(fixed))
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:
        raise PassError(f"the exported ONNX model fails onnx.checker: {str(exc)[:300]}") from exc
    return {
        "exporter": name,
        "automatic_dims": auto,
        "fallback_errors": errors,
        "merged_external_data": merged,
        "stripped_debug_bytes": stripped,
        "fixed_axes": fixed,
    }


def verify(
    variant_fn: Any,
    path: Path,
    loader: Any,
    opts: OnnxOptions,
    input_dtype: torch.dtype,
    quantized: bool,
    output: str | int | None = None,
) -> dict[str, float]:
    """Parity of the ONNX model with its PyTorch source on evaluation batches; raises on failure.

    Numbers must match within atol + rtol * max|reference| (not for quantized sources), the
    cosine similarity must reach ``min_cosine``, and class scores must agree on top-1."""
    sess = session(path, "cpu")
    figures = parity(variant_fn, sess, loader, opts.parity_batches, input_dtype, output)
    limit = opts.atol + opts.rtol * figures["reference_max_abs"]
    numeric_ok = quantized or figures["max_abs_error"] <= limit
    cosine_ok = figures["cosine_similarity"] >= opts.min_cosine
    agree_ok = figures.get("top1_agreement", 1.0) >= opts.min_top1_agreement
    figures["passed"] = float(numeric_ok and agree_ok and cosine_ok)
    if not figures["passed"]:
        agreement = figures.get("top1_agreement")
        shown = (
            f", top-1 agreement {agreement:.3f} (needed {opts.min_top1_agreement})"
            if agreement is not None
            else ""
        )
        raise PassError(
            "ONNX parity check failed: "
            f"max abs error {figures['max_abs_error']:.3g} (allowed {limit:.3g}), "
            f"cosine {figures['cosine_similarity']:.4f} (needed {opts.min_cosine}){shown}",
            hint="raise `atol`/`rtol` if the difference is acceptable, or try the other exporter",
        )
    return figures


def export_example(example: Any, opts: OnnxOptions) -> Any:
    """The example to export with: a batch of 2 for a dynamic batch (export specialises size 1)."""
    return repeat_batch(example, 2) if opts.dynamic_batch and batch_size(example) == 1 else example


NAME = "export.onnx"


@register_pass(NAME, OnnxOptions, traits={"exports"})
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
    example = export_example(ctx.example_input, opts)
    with quantized_engine(parent.backend):
        info = export_onnx(model, example, path, opts, parent.quantized)
        if opts.verify:
            info["parity"] = verify(
                model, path, ctx.data.evaluation, opts, parent.input_dtype, parent.quantized, ctx.output
            )
    return ctx.variant(
        None,
        onnx_path=path,
        dtype=parent.dtype,
        devices="any",
        info={**info, "opset": opts.opset},
    )
