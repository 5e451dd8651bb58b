"""int8 quantization of ONNX models with onnxruntime.quantization (static QDQ/QOperator, dynamic)."""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from .._warnings import caught, quiet_root_logger
from ..errors import PassError, first_line
from ..evaluate.graph import inspect_onnx
from ..inputs import batch_size, call, concat, repeat_batch, select_output, take
from ..onnx_runtime import feed, run_session, session
from ..registry import register_pass
from ..runtime import has_vnni
from ..variant import PassContext, Variant
from . import ranges, recovery
from ._select import require_float
from .export import OnnxOptions, export_onnx
from .recovery import RecoveryOptions

log = logging.getLogger("torchtame")


WEIGHTED_OPS = ["Conv", "ConvTranspose", "MatMul", "Gemm"]


class OnnxQuantOptions(RecoveryOptions):
    mode: Literal["static", "dynamic"] = "static"
    format: Literal["QDQ", "QOperator"] = "QDQ"
    per_channel: bool = True
    calibration_method: Literal["MinMax", "Entropy", "Percentile", "RangeSearch"] = Field(
        "MinMax",
        description="onnxruntime's calibration for every tensor, or RangeSearch: per tensor, the range "
        "with the smallest int8 error among min/max, percentiles and clipping points (what `recovery: "
        "[range_search]` sets).",
    )
    calibration_batches: int | None = Field(None, ge=1)
    weight_type: Literal["int8", "uint8"] = "int8"
    activation_type: Literal["int8", "uint8"] = "uint8"
    preprocess: bool = Field(True, description="Run quant_pre_process (shape inference) first.")
    reduce_range: bool | None = Field(
        None,
        description="7-bit weights: onnxruntime's u8 x s8 kernels saturate on CPUs without VNNI (AVX2 "
        "only; a digits MobileNetV2 on an AMD EPYC: cosine to float 0.9825 with 8-bit weights, 0.9987 "
        "with 7-bit). Default: on where the CPU building the variant has no VNNI; set it for the CPU "
        "that will run the model.",
    )
    nodes_to_exclude: list[str] = Field(
        default_factory=list, description="ONNX node names kept in float (see the variant's graph info)."
    )
    op_types_to_quantize: list[str] | None = Field(
        None, description="Only these op types (e.g. [Conv, MatMul]); default: every supported one."
    )
    quantize_outputs: bool = Field(
        True,
        description="false: the outputs of quantized ops stay float unless a quantized op reads them "
        "(onnxruntime's OpTypesToExcludeOutputQuantization; what `weighted_ops_only` sets).",
    )
    export: OnnxOptions = Field(
        default_factory=OnnxOptions, description="Used when the source is a torch variant."
    )

    def seven_bit_weights(self) -> bool:
        """``reduce_range`` as given, or on where this CPU has no VNNI."""
        return self.reduce_range if self.reduce_range is not None else not has_vnni()

    def per_channel_weights(self) -> bool:
        return self.per_channel and self.weight_type == "int8"

    def weight_grid(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """onnxruntime's symmetric int8 weight grids, Conv's and Gemm/MatMul's (read from the
        integers it stores): -64..64 both with ``reduce_range``, else -128..127 and -127..127."""
        return ((-64, 64), (-64, 64)) if self.seven_bit_weights() else ((-128, 127), (-127, 127))

    def quantizes_onnx(self) -> bool:
        return True

    def keeps_layers_float(self) -> bool:
        return False  # torch layer names do not reach onnxruntime (`nodes_to_exclude` names nodes)

    def quantize_with(self, algorithms: list[str]) -> OnnxQuantOptions:
        """``range_search``: per-tensor ranges; ``weighted_ops_only``: convolutions and matrix
        products only, their outputs float."""
        update: dict[str, Any] = {}
        if "range_search" in algorithms:
            update["calibration_method"] = "RangeSearch"
        if "weighted_ops_only" in algorithms:
            update["op_types_to_quantize"] = [
                t for t in self.op_types_to_quantize or WEIGHTED_OPS if t in WEIGHTED_OPS
            ]
            update["quantize_outputs"] = False
        return self.model_copy(update=update) if update else self


class _Reader:
    """onnxruntime CalibrationDataReader over the recipe's calibration loader (inputs by name).

    onnxruntime's Percentile and Entropy calibrators stack the outputs of every batch, so every
    batch must have the same shape: a ragged last batch is topped up with samples from the start
    of the split (a handful of samples counted twice, rather than a crash or dropped data)."""

    def __init__(self, loader: Any, sess: Any, batches: int | None) -> None:
        self.loader = loader
        self._it = iter(loader)
        self.sess = sess
        self.left = batches if batches is not None else len(loader)
        self.size: int | None = None
        self.topped_up = 0

    def get_next(self) -> dict[str, Any] | None:
        if self.left <= 0:
            return None
        batch = next(self._it, None)
        if batch is None:
            return None
        self.left -= 1
        x = batch[0]
        n = batch_size(x)
        if self.size is None:
            self.size = n
        elif n < self.size:
            first = next(iter(self.loader))[0]
            extra = take(repeat_batch(first, self.size - n), self.size - n)
            x = concat(x, extra)
            self.topped_up += self.size - n
        return feed(self.sess, x)


def preprocess(source: Path, out: Path) -> Path:
    """quant_pre_process (shape inference, optimisation); symbolic shape inference cannot always
    follow dynamic axes (sequence dims of Transformers), so it is retried without it."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    # resolved here, before the change of directory below: a relative path (the default
    # `output_dir: runs`) would otherwise point inside the scratch directory
    source, out = source.resolve(), out.resolve()
    scratch = out.parent / "shape-inference"
    scratch.mkdir(parents=True, exist_ok=True)
    with caught("quant_pre_process"), quiet_root_logger():
        try:
            # onnxruntime's symbolic shape inference dumps `sym_shape_infer_temp.onnx` and a
            # uuid-named `.data` file into the working directory when it gives up: keep them in
            # the variant's work directory instead of the user's.
            with contextlib.chdir(scratch):
                quant_pre_process(str(source), str(out), skip_symbolic_shape=False)
        except Exception as exc:
            log.info("symbolic shape inference failed (%s); preprocessing without it", first_line(exc, 120))
            quant_pre_process(str(source), str(out), skip_symbolic_shape=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out


NAME = "quantize.onnx"


@register_pass(
    NAME,
    OnnxQuantOptions,
    traits={"quantizes"},
    hints={
        "fidelity": "try `calibration_method: Percentile` or `Entropy`, `per_channel: true`, or "
        "`nodes_to_exclude`",
    },
)
def quantize_onnx(model: nn.Module | None, ctx: PassContext, opts: OnnxQuantOptions) -> Variant:
    """int8 quantization of an ONNX model with onnxruntime.quantization (static or dynamic)."""
    parent = ctx.parent
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    require_float(
        ctx, "quantize.onnx", "start from a float32 variant or its ONNX twin", float32=True, allow_onnx=True
    )
    recovered = None
    used = opts  # the options quantized with: the recovery auto settled on may change them
    if parent.kind == "onnx":
        assert parent.onnx_path is not None
        if opts.recovery != "none":
            raise PassError(
                f"recovery works on the float torch model, and {parent.name!r} is an ONNX file",
                hint=f"start this step `from: {parent.parent}` (its torch parent); it exports it itself",
            )
        out, repeated, searched = _quantize(parent.onnx_path, ctx, opts, "model.onnx")
    else:
        assert model is not None
        chosen = None
        if opts.recovery != "none":
            model, recovered, chosen = _recover(model, ctx, opts)
            used = opts.quantize_with(recovered["chosen"])
        if chosen is not None:  # the chosen candidate's file: built and calibrated already, alike
            out, repeated, searched = chosen[0].replace(ctx.work_dir / "model.onnx"), *chosen[1:]
        else:
            out, repeated, searched = _quantize(
                _export(model, ctx, opts, "float.onnx"), ctx, used, "model.onnx"
            )
    for tmp in ctx.work_dir.glob("*.onnx"):
        if tmp != out:
            tmp.unlink()
    for tmp in ctx.work_dir.glob("*.onnx.data"):
        tmp.unlink()
    info = {
        "mode": opts.mode,
        "format": opts.format,
        "per_channel": opts.per_channel,
        "reduce_range": opts.seven_bit_weights(),
        "calibration_method": used.calibration_method if opts.mode == "static" else None,  # as used
        "op_types_quantized": used.op_types_to_quantize or "all",
        **({"ranges": searched} if searched else {}),
        "calibration_samples_repeated": repeated if opts.mode == "static" else None,
        "nodes_excluded": opts.nodes_to_exclude,
        "graph": inspect_onnx(out),
    }
    if used.calibration_method != opts.calibration_method and opts.mode == "static":
        info["calibration_method_asked"] = opts.calibration_method
    if recovered is not None:
        recovery.verify_rounding(recovered, onnx_int8_weights(out))
        recovery.record_ranges(recovered, searched)
        info["recovery"] = recovered
    return ctx.variant(None, onnx_path=out, dtype=f"onnx-{opts.mode}-int8", quantized=True, info=info)


def onnx_int8_weights(path: Path) -> list[torch.Tensor]:
    """The int8 initializers of a quantized ONNX model (its weights, as onnxruntime rounded them)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    return [
        torch.from_numpy(numpy_helper.to_array(t).copy())
        for t in graph.initializer
        if t.data_type == onnx.TensorProto.INT8
    ]


def _export(model: nn.Module, ctx: PassContext, opts: OnnxQuantOptions, name: str) -> Path:
    path = ctx.work_dir / name
    export_onnx(model, repeat_batch(ctx.example_input, 2), path, opts.export, quantized=False)
    return path


def search_ranges(
    source: Path, reader: _Reader, opts: OnnxQuantOptions
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-tensor ranges (:mod:`.ranges`) from onnxruntime's value histograms of every tensor it
    calibrates: ``TensorQuantOverrides`` (rmin/rmax per tensor) and what was chosen."""
    import numpy as np
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    scratch = source.parent / f"{source.stem}-ranges"
    scratch.mkdir(exist_ok=True)
    try:
        cal = create_calibrator(
            source,
            opts.op_types_to_quantize or None,
            augmented_model_path=str(scratch / "augmented.onnx"),
            calibrate_method=CalibrationMethod.Entropy,  # its collector keeps signed value histograms
            extra_options={"num_bins": 2048},
        )
        cal.collect_data(reader)
        histograms = cal.collector.histogram_dict
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    overrides, choices = {}, []
    for tensor, (hist, edges, lo, hi, *_) in histograms.items():
        c = ranges.search_range(torch.from_numpy(hist), torch.from_numpy(edges), 256, float(lo), float(hi))
        choices.append(c)
        overrides[tensor] = [
            {"rmin": np.array(c["min"], dtype=np.float32), "rmax": np.array(c["max"], dtype=np.float32)}
        ]
    return overrides, ranges.summarise(choices)


def _quantize(
    source: Path, ctx: PassContext, opts: OnnxQuantOptions, name: str
) -> tuple[Path, int, dict[str, Any] | None]:
    """onnxruntime's static or dynamic quantization of ``source`` into ``work_dir/name``; also how
    many calibration samples were counted twice (a ragged last batch topped up) and, with
    ``RangeSearch``, what the range search chose."""
    from onnxruntime import quantization as oq

    reader_session = session(source, "cpu")
    if opts.preprocess:
        source = preprocess(source, ctx.work_dir / f"preprocessed-{name}")
    out = ctx.work_dir / name
    qtype = {"int8": oq.QuantType.QInt8, "uint8": oq.QuantType.QUInt8}
    reader = _Reader(ctx.data.calibration, reader_session, opts.calibration_batches)
    method, searched = opts.calibration_method, None
    extra: dict[str, Any] = {}
    if not opts.quantize_outputs:
        extra["OpTypesToExcludeOutputQuantization"] = list(opts.op_types_to_quantize or WEIGHTED_OPS)
    if opts.mode == "static" and method == "RangeSearch":
        with (
            caught("onnxruntime.quantization"),
            quiet_root_logger(),
            open(os.devnull, "w") as devnull,
            contextlib.redirect_stdout(devnull),
        ):
            overrides, searched = search_ranges(source, reader, opts)
        reader = _Reader(ctx.data.calibration, reader_session, opts.calibration_batches)
        method, extra["TensorQuantOverrides"] = "MinMax", overrides
    with (
        caught("onnxruntime.quantization"),
        quiet_root_logger(),
        open(os.devnull, "w") as devnull,
        contextlib.redirect_stdout(devnull),
    ):
        if opts.mode == "dynamic":
            oq.quantize_dynamic(
                str(source),
                str(out),
                weight_type=qtype[opts.weight_type],
                per_channel=opts.per_channel,
                reduce_range=opts.seven_bit_weights(),
                nodes_to_exclude=opts.nodes_to_exclude,
                op_types_to_quantize=opts.op_types_to_quantize,
            )
        else:
            oq.quantize_static(
                str(source),
                str(out),
                reader,
                quant_format=oq.QuantFormat.QDQ if opts.format == "QDQ" else oq.QuantFormat.QOperator,
                per_channel=opts.per_channel,
                reduce_range=opts.seven_bit_weights(),
                weight_type=qtype[opts.weight_type],
                activation_type=qtype[opts.activation_type],
                calibrate_method=getattr(oq.CalibrationMethod, method),
                nodes_to_exclude=opts.nodes_to_exclude,
                op_types_to_quantize=opts.op_types_to_quantize,
                extra_options=extra,
            )
    return out, reader.topped_up, searched


class _Template:
    """One ONNX export for float models that differ from ``base`` only in their weights
    (``recovery``'s candidates): the dynamo exporter takes most of a candidate's time (15 s of 16 s
    on a mobilenet_v2), and each candidate instead gets the exported file with the tensors it
    changed written into the initializers of the same name and shape. A model that changed a
    tensor the file does not hold that way, or whose written file does not reproduce it on a held
    batch, is exported instead."""

    def __init__(
        self, base: nn.Module, export: Callable[[nn.Module, str], Path], check: Any, output: Any = None
    ) -> None:
        """``export(model, name)`` exports to a file of that name; ``check``: a held batch."""
        self.export, self.check, self.output = export, check, output
        self.path = export(base, "template.onnx")
        self.base = {k: v.detach().clone() for k, v in base.state_dict().items()}
        self.exported, self.reused = 1, 0

    def _written(self, candidate: nn.Module, path: Path) -> bool:
        import onnx
        from onnx import numpy_helper

        from .export import TWO_GB

        state = candidate.state_dict()
        if state.keys() != self.base.keys() or self.path.stat().st_size >= TWO_GB:
            return False
        if any(v.shape != self.base[k].shape for k, v in state.items()):
            return False
        changed = {k: v for k, v in state.items() if not torch.equal(v, self.base[k])}
        model = onnx.load(str(self.path))
        inits = {t.name: t for t in model.graph.initializer}
        for k, v in changed.items():
            init = inits.get(k)
            if init is None or tuple(init.dims) != tuple(v.shape) or init.data_type != onnx.TensorProto.FLOAT:
                return False
            init.CopyFrom(numpy_helper.from_array(v.detach().float().cpu().numpy(), k))
        onnx.save_model(model, str(path))
        x = self.check
        with torch.inference_mode():
            want = select_output(call(candidate, x), self.output).float()
        got = select_output(run_session(session(path, "cpu"), x), self.output).float()
        return bool(torch.allclose(got, want, rtol=1e-3, atol=1e-4 * float(want.abs().max()) + 1e-6))

    def file(self, candidate: nn.Module, name: str) -> Path:
        path = self.path.with_name(name)
        if self._written(candidate, path):
            self.reused += 1
            return path
        self.exported += 1
        return self.export(candidate, name)


def _recover(
    model: nn.Module, ctx: PassContext, opts: OnnxQuantOptions
) -> tuple[nn.Module, dict[str, Any], tuple[Path, int, dict[str, Any] | None] | None]:
    """Accuracy recovery on the float model before export (:mod:`.recovery`); ``auto`` judges each
    candidate by its quantized ONNX model's fidelity on calibration batches held apart from the
    evaluation data. Also returns the quantized file of the float model chosen (as
    :func:`_quantize` returns it) where a candidate's build is that file."""
    t0 = time.perf_counter()
    held = recovery.held_outputs(model, ctx.data.calibration, opts, ctx.output)
    # BatchNorms folded first (the exported graph folds them anyway), so that every candidate has
    # the same structure and one export serves them all
    model = copy.deepcopy(model)
    folded = recovery.fold_batchnorms(model, ctx.example_input)
    template = _Template(model, lambda m, name: _export(m, ctx, opts, name), held.fit[0], ctx.output)
    trial = [0]
    built: dict[str, tuple[Path, int, dict[str, Any] | None]] = {}

    def score(candidate: nn.Module, algorithms: list[str]) -> torch.Tensor:
        trial[0] += 1
        source = template.file(candidate, f"trial{trial[0]}.onnx")
        built["last"] = _quantize(source, ctx, opts.quantize_with(algorithms), f"q{trial[0]}.onnx")
        sess = session(built["last"][0], "cpu")
        return torch.cat([select_output(run_session(sess, x), ctx.output).float() for x in held.judge])

    def on_best() -> None:
        built["best"] = built["last"]

    ctx.progress.status(f"quantize.onnx: recovery {opts.recovery}")
    fixed, info = recovery.recover(
        model, ctx.example_input, held, opts, score, on_best=on_best, grid=opts.weight_grid()
    )
    assert info is not None
    info["exports"] = {"exported": template.exported, "reused": template.reused, "batchnorms_folded": folded}
    info["seconds"] = round(time.perf_counter() - t0, 2)  # the template's export included
    return fixed, info, built.get("best")
