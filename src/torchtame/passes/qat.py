"""``quantize.qat``: quantization-aware training, then the same int8 artefacts as ``quantize.static``.

The float model is fake-quantized (int8 rounding simulated in float, with straight-through
gradients) with weight fake-quantizers that round as the converted model will (the default
configs' fused kernel does not: :func:`weight_fake_quant`). Calibration sets the activation ranges
by the same histogram search post-training int8 uses (``activation_ranges: range_search``). The
model is then trained with the shared training loop: cross-entropy on labels, or distillation
from the baseline (``loss: distill``, the default: no labels needed; cosine loss on class
scores), at a small learning rate, BatchNorm statistics frozen from the start (the model is
trained). The weights learn to sit where int8 rounds them well; the weights' observers freeze
after 2/3 of the steps. The activation scales are learned too, from the calibrated ones, at their
own learning rate (``learn_ranges``, LSQ). The evidence for learning them is mixed
(benchmarks/compression.py, a trained digits MobileNetV2, share of the post-training cosine gap
closed, learned against calibrated scales): 3 epochs on the static engine 24% against 12%, on
torch.ao's x86 engine 36% against 43%, and with per-tensor weights, 20 epochs, 34% against 48%;
``learn_ranges: false`` keeps the calibrated ones. The result is converted like post-training int8, and
``info.int8_vs_trained_cosine`` says how close the int8 model is to the one trained.

FX QAT runs on the engine ``quantize.static`` picks (onednn on x86 CPUs with VNNI, else x86).
Activations are 8-bit everywhere, weights on :func:`~torchtame.runtime.weight_range`'s grid (7-bit
on x86/fbgemm, and on PT2E/onednn without VNNI), so the fake-quantizers clip where the int8 kernels
clip. (torch.ao's x86 default, 7-bit activations, clipped at 0..127 while training where the
kernels' quint8 holds 0..255: int8 against the trained model 0.996 on a trained digits
MobileNetV2 with ReLU6.) PT2E's int8 model and the trained one agree (0.99999).

- ``pt2e``: torchao's ``prepare_qat_pt2e`` with the X86 Inductor quantizer's QAT config on
  torchtame's normalised export (conv-BN pairs fused for training), converted by
  ``convert_pt2e`` and measured compiled, as ``quantize.static``'s PT2E variants are.
- ``fx``: torch.ao's ``prepare_qat_fx`` for models only FX can trace (eager int8 kernels).
- ``auto``: PT2E where torch.export captures the model and the quantizer annotates it, else FX.
  (Unlike ``quantize.static``, auto does not train both to compare them: training twice costs
  twice; its reason is recorded.)

The training curve (loss, and fidelity to float on calibration batches not used for calibration
or training, per epoch) is in ``info.curve`` and the report.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections.abc import Iterator
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ..errors import PassError, first_line
from ..evaluate.graph import inspect_fx, inspect_pt2e
from ..inputs import as_args, call, select_output
from ..onnx_runtime import compare_outputs
from ..options import TrainOptions
from ..registry import register_pass
from ..runtime import check_backend, pt2e_weight_range, quantized_engine, weight_bits, weight_range
from ..variant import PassContext, Variant
from ._select import Backend, match_modules, require_float
from .finetune import train_with
from .static.fx import calibrate_loader
from .static.pt2e import drop_unused_attributes, export_dynamic, failing_node, normalise

log = logging.getLogger("torchtame")


class QatOptions(TrainOptions):
    mode: Literal["auto", "pt2e", "fx"] = Field(
        "auto", description="auto: PT2E where torch.export captures the model, else FX; pt2e; fx."
    )
    weight_bits: Literal[7, 8] | None = Field(
        None, description="Weight grid, as quantize.static's (default: what this CPU's kernels take)."
    )
    epochs: int | None = Field(3, ge=1, le=1000, description="Passes over the train split.")
    lr: float = Field(
        1e-5,
        gt=0,
        description="Peak learning rate (small: the model is trained already; on a trained digits "
        "MobileNetV2, 1e-4 made int8 worse than post-training int8, 1e-5 better).",
    )
    logits_loss: Literal["kl", "cosine", "mse"] = Field(
        "cosine",
        description="distill: loss for class scores: cosine (default here: QAT recovers fidelity to "
        "float's scores), kl (softened KL divergence) or mse.",
    )
    loss: Literal["ce", "distill"] = Field(
        "distill", description="distill (default): learn the float baseline's outputs, no labels; ce: labels."
    )
    calibration_batches: int = Field(
        4, ge=1, description="Calibration batches that set the observers' ranges before training."
    )
    freeze_bn_after: int = Field(
        0,
        ge=0,
        description="Freeze BatchNorm statistics after this many steps (default 0: from the start; the "
        "model is trained, and statistics of fake-quantized batches only move it away from float).",
    )
    freeze_observers_after: int | None = Field(
        None, ge=1, description="Freeze the quantization ranges after this many steps (default: 2/3)."
    )
    activation_ranges: Literal["range_search", "minmax"] = Field(
        "range_search",
        description="How calibration sets the activation ranges QAT trains with, then keeps: range_search "
        "(the histogram search post-training int8 uses) or minmax (moving-average min/max, updated while "
        "training until the observers freeze).",
    )
    weight_granularity: Literal["per_channel", "per_tensor"] = Field(
        "per_channel", description="Weight scales per output channel (default) or one per tensor."
    )
    curve_batches: int = Field(
        2, ge=1, description="Calibration batches (after those used to calibrate) scored per epoch."
    )
    keep_float: list[str] = Field(default_factory=list, description="Module names/regexes kept float.")
    backend: Backend | None = Field(
        None,
        description="fx: quantized engine, as quantize.static's (default: onednn on x86 CPUs with VNNI, "
        "8-bit activations, else x86; x86/fbgemm: 7-bit activations).",
    )
    learn_ranges: bool = Field(
        True,
        description="Learn each activation's quantization scale while training (LSQ: gradient through "
        "rounding and clipping), starting from the calibrated range (false: the calibrated scales stay).",
    )
    range_lr: float = Field(
        1e-2,
        gt=0,
        description="learn_ranges: peak learning rate of the log of each activation scale (1e-2: at most "
        "about 1% of the scale per step).",
    )


def _held_batches(ctx: PassContext, opts: QatOptions) -> list[Any]:
    """Calibration batches neither calibration nor (where there is a train split) training used."""
    batches = [x for x, *_ in ctx.data.calibration]
    held = batches[opts.calibration_batches : opts.calibration_batches + opts.curve_batches]
    return held or batches[-opts.curve_batches :]


class Curve:
    """Fidelity of the fake-quantized model to float on held batches, per epoch."""

    def __init__(self, model: nn.Module, float_model: nn.Module, held: list[Any], output: Any) -> None:
        self.model, self.held, self.output = model, held, output
        with torch.no_grad():
            self.ref = torch.cat([select_output(call(float_model.eval(), x), output).float() for x in held])
        self.points: list[dict[str, Any]] = []
        self.after_train: Any = lambda: None  # re-applies what .train() undoes (frozen BatchNorms)

    def outputs(self, model: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([select_output(call(model, x), self.output).float() for x in self.held])

    def record(self, epoch: int, loss: float | None) -> None:
        was_training = self.model.training
        self.model.eval()
        out = self.outputs(self.model)
        if was_training:
            self.model.train()
            self.after_train()
        fid = compare_outputs(self.ref, out)
        point = {"epoch": epoch, "loss": None if loss is None else round(loss, 5)}
        point["cosine"] = round(fid["cosine_similarity"], 6)
        if "top1_agreement" in fid:
            point["agreement"] = round(100 * fid["top1_agreement"], 2)
        self.points.append(point)


def weight_fake_quant(lib: Any, per_channel: bool, **kwargs: Any) -> Any:
    """The weights' fake-quantizer, rounding as the int8 model will (``lib``: torch.ao's or
    torchao's quantization module).

    The default QAT configs (torch.ao's x86 qconfig, torchao's X86 QAT config) fake-quantize
    per-channel weights with ``FusedMovingAvgObsFakeQuantize``, whose kernel divides a symmetric
    range by 128 or 127, while conversion takes the observer's scale (range / 127.5). Every
    channel's scale differs by 0.4-0.8%, a tenth of the outputs land one step apart, and QAT trains
    a model that is not the one converted (cosine 0.988 between the two on a trained digits
    MobileNetV2, FX). The plain ``FakeQuantize`` with the same observer rounds as conversion does
    (0.9994, and 0.99999 on PT2E).
    """
    observer = lib.MovingAveragePerChannelMinMaxObserver if per_channel else lib.MovingAverageMinMaxObserver
    return lib.FakeQuantize.with_args(observer=observer, **kwargs)


def _prepare_pt2e(
    model: nn.Module, ctx: PassContext, keep: list[str], per_channel: bool
) -> torch.fx.GraphModule:
    import torchao.quantization.pt2e as pt2e
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    gm = export_dynamic(model.train(), ctx.example_input).module()
    changes = normalise(gm, model)
    config = get_default_x86_inductor_quantization_config(is_qat=True)
    weight = config.weight
    assert weight is not None
    low, high = pt2e_weight_range()  # 7-bit weights without VNNI, as quantize.static's PT2E
    weight = dataclasses.replace(
        weight,
        quant_min=low,
        quant_max=high,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        observer_or_fake_quant_ctr=weight_fake_quant(pt2e, per_channel, eps=2**-12),
    )
    quantizer = X86InductorQuantizer().set_global(dataclasses.replace(config, weight=weight))
    for name in keep:
        quantizer.set_module_name_qconfig(name, None)
    try:
        with present_convolutions_only(gm.graph):
            prepared = prepare_qat_pt2e(gm, quantizer)
    except Exception as exc:
        where, module = failing_node(exc)
        raise PassError(
            f"the X86 quantizer cannot annotate this graph for QAT{where}: {first_line(exc, 200)}",
            hint=f"`keep_float: [{module}]` quantizes the rest" if module else "use `mode: fx`",
        ) from exc
    allow_exported_model_train_eval(prepared)  # .train()/.eval() switch BatchNorm and dropout
    prepared.meta["torchtame_normalised"] = changes
    return prepared


@contextlib.contextmanager
def present_convolutions_only(graph: torch.fx.Graph) -> Iterator[None]:
    """torchao fuses (prepare) and folds (convert) QAT conv-BatchNorm pairs by exporting a pattern
    graph per convolution kind (1d, 2d, transposed 1d and 2d) and per variant of it: 96 exports
    per convert, some 28 s on 2 cores whatever the model's size. Here a kind with no node in
    ``graph`` is skipped (no pattern of it can match); 2d always runs, as the helpers' clean-up
    ran at least once before. A graph of decomposed ``aten.convolution`` nodes skips nothing, and
    so does a torchao that renamed its helpers (its test says so)."""
    import torch.nn.functional as F
    import torchao.quantization.pt2e.qat_utils as qat_utils

    aten = torch.ops.aten
    packets = {getattr(n.target, "overloadpacket", None) for n in graph.nodes if n.op == "call_function"}
    kinds = {
        F.conv1d: aten.conv1d,
        F.conv_transpose1d: aten.conv_transpose1d,
        F.conv_transpose2d: aten.conv_transpose2d,
    }
    absent = set() if aten.convolution in packets else {fn for fn, op in kinds.items() if op not in packets}
    names = ("_fuse_conv_bn_qat_helper", "_fold_conv_bn_qat_helper")  # private: a rename skips nothing
    saved = {name: getattr(qat_utils, name) for name in names if hasattr(qat_utils, name)}

    def skipping(helper: Any) -> Any:
        def run(m: torch.fx.GraphModule, conv_fn: Any, *args: Any, **kwargs: Any) -> torch.fx.GraphModule:
            return m if conv_fn in absent else helper(m, conv_fn, *args, **kwargs)

        return run

    try:
        for name, helper in saved.items():
            setattr(qat_utils, name, skipping(helper))
        yield
    finally:
        for name, helper in saved.items():
            setattr(qat_utils, name, helper)


def _prepare_fx(
    model: nn.Module, ctx: PassContext, keep: list[str], backend: str, per_channel: bool
) -> nn.Module:
    import torch.ao.quantization as tq
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    args, kwargs = as_args(ctx.example_input)
    if kwargs:
        raise PassError(
            "FX QAT cannot take a model called with keyword inputs", hint="use `mode: pt2e` (torch.export)"
        )
    mapping = tq.get_default_qat_qconfig_mapping(backend)
    low, high = weight_range("fx", backend)  # 7-bit weights on x86/fbgemm, 8-bit activations
    weight = weight_fake_quant(
        tq,
        per_channel,
        quant_min=low,
        quant_max=high,
        dtype=torch.qint8,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
    )
    # the default's arguments, but the plain FakeQuantize: it quantizes with the scale it stores
    # (the fused kernel recomputes it from the observer each call)
    activation = tq.FakeQuantize.with_args(
        **{**mapping.global_qconfig.activation.p.keywords, "reduce_range": False}
    )
    mapping.set_global(tq.QConfig(activation=activation, weight=weight))
    for name in keep:
        mapping.set_module_name(name, None)
    try:
        return prepare_qat_fx(model.train(), mapping, args)
    except Exception as exc:
        raise PassError(
            f"FX cannot trace the model for QAT: {first_line(exc, 200)}", hint="use `mode: pt2e`"
        ) from exc


def prepare(model: nn.Module, ctx: PassContext, opts: QatOptions, backend: str) -> tuple[nn.Module, str, str]:
    """The fake-quantized model, its mode and why that mode (auto: PT2E, else FX)."""
    keep = match_modules(model, opts.keep_float, "keep_float")
    per_channel = opts.weight_granularity == "per_channel"
    if opts.mode == "fx":
        return _prepare_fx(model, ctx, keep, backend, per_channel), "fx", "asked for"
    if opts.mode == "pt2e":
        return _prepare_pt2e(model, ctx, keep, per_channel), "pt2e", "asked for"
    try:
        return _prepare_pt2e(model, ctx, keep, per_channel), "pt2e", "torch.export captured the model"
    except PassError as exc:
        log.info("quantize.qat auto: PT2E not possible (%s); using FX", exc.message)
        return (
            _prepare_fx(model, ctx, keep, backend, per_channel),
            "fx",
            f"PT2E not possible: {first_line(exc.message, 160)}",
        )


def _freezer(prepared: nn.Module, mode: str, opts: QatOptions, total: int) -> tuple[Any, dict[str, int]]:
    """An ``on_step`` hook that freezes BatchNorm statistics and observer ranges when due."""
    from torchao.quantization.pt2e import disable_observer

    default = max(1, (2 * total) // 3)
    bn_at = opts.freeze_bn_after
    obs_at = opts.freeze_observers_after or default
    done: dict[str, int] = {}

    def on_step(step: int) -> None:
        if step == obs_at:
            prepared.apply(disable_observer)
            if mode == "fx":
                prepared.apply(torch.ao.quantization.disable_observer)
            done["observers_frozen_at"] = step
        if step == bn_at:
            refreeze()
            done["batchnorm_frozen_at"] = step

    def refreeze() -> None:
        if mode == "pt2e":
            _freeze_pt2e_bn(prepared)  # .train() (after a curve point) turns it back on
        else:
            prepared.apply(torch.ao.nn.intrinsic.qat.freeze_bn_stats)

    def after_eval() -> None:
        if "batchnorm_frozen_at" in done:
            refreeze()

    on_step.after_eval = after_eval  # type: ignore[attr-defined]
    return on_step, done


def _freeze_pt2e_bn(gm: torch.fx.GraphModule) -> None:
    """Stop BatchNorm statistics updating in an exported training graph (the batch_norm op's
    ``training`` argument, the sixth, set to False: running statistics are used, not updated)."""
    ops = {torch.ops.aten._native_batch_norm_legit.default, torch.ops.aten.batch_norm.default}
    for node in gm.graph.nodes:
        if node.target in ops:
            args = list(node.args)
            args[5] = False
            node.args = tuple(args)
    gm.recompile()


def _activation_quantizers(prepared: nn.Module) -> list[nn.Module]:
    """The fake-quantizers of activations (per-tensor affine, with a min/max observer to set)."""
    return [
        m
        for m in prepared.modules()
        if hasattr(m, "disable_fake_quant")
        and getattr(m, "qscheme", None) == torch.per_tensor_affine
        and hasattr(getattr(m, "activation_post_process", None), "min_val")
    ]


def _range_fixed(fq: nn.Module) -> bool:
    """Whether a fake-quantizer's range is set and kept (its observer off: range-searched)."""
    return not bool(getattr(fq, "observer_enabled", torch.ones(1))[0])


def calibrate_ranges(prepared: nn.Module, ctx: PassContext, opts: QatOptions) -> tuple[int, dict[str, Any]]:
    """Calibrate the fake-quantized model; with ``range_search``, its activation ranges from the
    histogram search post-training int8 uses (float activations observed, as PTQ observes them),
    then frozen: the moving-average min/max of the default QAT observers starts QAT from ranges
    wider than post-training int8's (a trained digits MobileNetV2: cosine 0.9833 against 0.9899)."""
    from torch.ao.quantization.observer import HistogramObserver

    from .ranges import observed_choices, observer_class

    acts = _activation_quantizers(prepared) if opts.activation_ranges == "range_search" else []
    histograms, hooks = [], []
    for fq in acts:
        obs = fq.activation_post_process
        hist = observer_class(HistogramObserver)(
            dtype=obs.dtype, qscheme=obs.qscheme, quant_min=obs.quant_min, quant_max=obs.quant_max
        )
        histograms.append(hist)
        hooks.append(fq.register_forward_pre_hook(lambda _m, args, h=hist: h(args[0].detach())))
        fq.disable_fake_quant()
    try:
        used = calibrate_loader(
            prepared, ctx.data.calibration, opts.calibration_batches, ctx.progress, "calibrate (qat)"
        )
    finally:
        for hook in hooks:
            hook.remove()
    holder = nn.ModuleList(histograms)
    summary = observed_choices(holder) if acts else {}
    for fq, hist in zip(acts, histograms, strict=True):
        fq.enable_fake_quant()
        if not hasattr(hist, "range_choice"):  # not reached by calibration: keeps its observer
            continue
        obs = fq.activation_post_process
        obs.min_val.copy_(torch.tensor(hist.range_choice["min"]))
        obs.max_val.copy_(torch.tensor(hist.range_choice["max"]))
        scale, zero_point = obs.calculate_qparams()  # what conversion will compute from them
        fq.scale.copy_(scale.reshape(fq.scale.shape))
        fq.zero_point.copy_(zero_point.reshape(fq.zero_point.shape).to(fq.zero_point))
        fq.disable_observer()
    return used, summary


class _LearnedScale:
    """Fake-quantize with a learned scale (mixed into the fake-quantizer's own class, so FX's and
    PT2E's conversion take it through ``calculate_qparams``).

    LSQ (Esser et al. 2020): the gradient reaches the scale through rounding and clipping
    (``torch._fake_quantize_learnable_per_tensor_affine``). The log of the scale is learned, so
    one learning rate moves every tensor's scale by the same fraction whatever its size; the zero
    point stays the calibrated one. torchao's ``LearnableFakeQuantize`` learns the raw scale at the
    weights' learning rate (1e-5 moves a scale of 0.02 by 0.05% per step) and replaces the
    observer that the range search sets.
    """

    log_scale: nn.Parameter
    fake_quant_enabled: torch.Tensor
    activation_post_process: nn.Module
    zero_point: torch.Tensor
    scale: torch.Tensor

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        if not bool(self.fake_quant_enabled[0]):
            return X
        obs = self.activation_post_process
        zero_point = self.zero_point.to(X.dtype)
        return torch._fake_quantize_learnable_per_tensor_affine(
            X, self.log_scale.exp(), zero_point, obs.quant_min, obs.quant_max, 1.0
        )

    def calculate_qparams(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.log_scale.detach().exp().reshape(self.scale.shape), self.zero_point.clone()


def learn_ranges(prepared: nn.Module, lr_scale: float) -> list[nn.Module]:
    """Give every calibrated activation fake-quantizer a learned scale (:class:`_LearnedScale`);
    ``lr_scale``: its learning rate relative to the weights'."""
    from ..training import LR_SCALE

    learned = []
    for fq in _activation_quantizers(prepared):
        if not _range_fixed(fq):
            continue  # not calibrated by the range search: its observer still sets it
        fq.calibrated_scale = float(fq.scale.reshape(-1)[0])
        fq.log_scale = nn.Parameter(fq.scale.detach().float().clamp(min=1e-8).log().reshape(1))
        setattr(fq.log_scale, LR_SCALE, lr_scale)
        base = type(fq)
        # its methods copied into a subclass of the fake-quantizer's own class (a mixin base would
        # change the instance layout, which ``__class__`` assignment refuses)
        methods = {"forward": _LearnedScale.forward, "calculate_qparams": _LearnedScale.calculate_qparams}
        fq.__class__ = type(f"Learned{base.__name__}", (base,), methods)
        learned.append(fq)
    return learned


def _range_changes(learned: list[nn.Module]) -> dict[str, Any]:
    """How far the learned scales moved from the calibrated ones (ratios); the fake-quantizers'
    ``scale`` buffers take the learned values."""
    ratios = []
    for fq in learned:
        scale = fq.log_scale.detach().exp()
        fq.scale.copy_(scale.reshape(fq.scale.shape))
        ratios.append(float(scale) / fq.calibrated_scale)
    if not ratios:
        log.info(
            "quantize.qat: learn_ranges found no calibrated activation range to learn (observers set them)"
        )
        return {
            "tensors": 0,
            "why": "no activation range set by the range search (activation_ranges: minmax)",
        }
    return {
        "tensors": len(ratios),
        "scale_ratio_min": round(min(ratios), 4),
        "scale_ratio_median": round(sorted(ratios)[len(ratios) // 2], 4),
        "scale_ratio_max": round(max(ratios), 4),
    }


def _steps(ctx: PassContext, opts: QatOptions) -> int:
    if opts.steps is not None:
        return opts.steps
    loader = ctx.data.train if ctx.data.train is not None else ctx.data.calibration
    return (opts.epochs or 1) * len(loader)


def _student(float_model: nn.Module) -> nn.Module:
    """A copy to train, without dropout (QAT here recovers fidelity to float: dropout's noise only
    hides it)."""
    student = copy.deepcopy(float_model)
    for m in student.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return student


NAME = "quantize.qat"


@register_pass(
    NAME,
    QatOptions,
    traits={"quantizes", "trains"},
    hints={
        "fidelity": "train longer (`epochs`), with a lower `lr`, or keep the most sensitive layers float "
        "(`keep_float`)",
        "slower": "QAT's int8 graph runs like quantize.static's: see its hints (PT2E is compiled)",
    },
)
def quantize_qat(model: nn.Module | None, ctx: PassContext, opts: QatOptions) -> Variant:
    """Quantization-aware training (distillation from the baseline by default), then int8."""
    with weight_bits(opts.weight_bits):
        return _quantize_qat(model, ctx, opts)


def _quantize_qat(model: nn.Module | None, ctx: PassContext, opts: QatOptions) -> Variant:
    """The pass itself, inside :func:`~torchtame.runtime.weight_bits`."""
    assert model is not None
    require_float(ctx, NAME, "start QAT `from:` a float variant (baseline, pruned, fine-tuned)", float32=True)
    if opts.loss == "distill" and ctx.baseline.module is None:
        raise PassError("`loss: distill` learns from the baseline, which has no torch module here")
    backend = check_backend(opts.backend, static=True)
    float_model = model.float().eval()
    prepared, mode, why = prepare(_student(float_model), ctx, opts, backend)
    with quantized_engine(backend if mode == "fx" else None):
        prepared.eval()
        used, ranges = calibrate_ranges(prepared, ctx, opts)
        learned = learn_ranges(prepared, opts.range_lr / opts.lr) if opts.learn_ranges else None
        curve = Curve(
            prepared,
            ctx.baseline.module if ctx.baseline.module is not None else float_model,
            _held_batches(ctx, opts),
            ctx.output,
        )
        curve.record(0, None)
        total = _steps(ctx, opts)
        on_step, frozen = _freezer(prepared, mode, opts, total)
        curve.after_train = on_step.after_eval
        stats = train_with(
            prepared,
            ctx,
            opts,
            f"quantization-aware training ({mode})",
            ctx.seed,
            on_step=on_step,
            on_epoch=curve.record,
        )
        prepared.eval()
        trained = curve.outputs(prepared)
        moved = _range_changes(learned) if learned is not None else None
        q = _convert(prepared, mode)
        converted = compare_outputs(trained, curve.outputs(q))["cosine_similarity"]
    graph = inspect_pt2e(q) if mode == "pt2e" else inspect_fx(q)  # type: ignore[arg-type]
    first, last = curve.points[0], curve.points[-1]
    log.info(
        "quantize.qat (%s): cosine to float %.5f before training, %.5f after %d steps",
        mode,
        first["cosine"],
        last["cosine"],
        stats["steps"],
    )
    info: dict[str, Any] = {
        "mode": mode,
        "mode_reason": why,
        "backend": "x86 inductor" if mode == "pt2e" else backend,
        "weight_grid": list(weight_range(mode, backend)),
        "calibration_batches": used,
        "activation_ranges": {"method": opts.activation_ranges, **ranges},
        "learned_ranges": moved,  # None: learn_ranges false
        "training": {k: v for k, v in stats.items() if k != "epoch_losses"},
        **frozen,
        "curve": curve.points,
        # what was trained is what ships: the int8 model against the fake-quantized one, held batches
        "int8_vs_trained_cosine": round(converted, 6),
        "kept_float": opts.keep_float,
        "graph": graph,
    }
    if opts.loss == "distill":
        info["teacher"] = ctx.baseline.name
    if mode == "pt2e":
        info["normalised"] = prepared.meta.get("torchtame_normalised")
        info["cpu_only"] = "x86 Inductor int8 kernels; no PT2E static int8 quantizer targets CUDA"
    return ctx.variant(
        q,
        quantized=True,
        devices="cpu_only",
        backend=backend if mode == "fx" else None,
        dtype="int8",
        compiled=mode == "pt2e",
        info=info,
    )


def _convert(prepared: nn.Module, mode: str) -> nn.Module:
    if mode == "pt2e":
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e

        with present_convolutions_only(prepared.graph):  # type: ignore[arg-type]
            converted = convert_pt2e(prepared)  # type: ignore[arg-type]
        drop_unused_attributes(converted)
        return converted
    from torch.ao.quantization.quantize_fx import convert_fx

    fake = [m for n, m in prepared.named_modules() if n.endswith("weight_fake_quant")]
    grids = {(m.quant_min, m.quant_max) for m in fake}
    converted = convert_fx(prepared)  # type: ignore[arg-type]
    if len(grids) == 1:  # the pass sets one weight fake-quantizer config for every layer
        low, high = grids.pop()
        clamped = clamp_int8_weights(converted, low, high)
        log.debug("quantize.qat: %d converted int8 weights clamped to %d..%d", clamped, low, high)
    return converted


def clamp_int8_weights(model: nn.Module, low: int, high: int) -> int:
    """Clamp the int8 weights torch.ao's FX conversion stored to the grid the fake-quantizers
    trained on; returns how many changed.

    The symmetric scale of a 7-bit grid (-64..63) is range / 63.5, so each channel's positive
    extreme lands on 63.5: the fake-quantizer rounds and clamps it to 63, while conversion stores
    64 (it clamps to int8's range only). Every channel's largest weight then differs from the one
    trained: cosine 0.9969 between the trained and the converted model on a digits MobileNetV2
    (0.99999 after clamping, as PT2E, whose quantize ops clamp, converts)."""
    changed = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if not callable(weight) or not hasattr(m, "set_weight_bias"):
            continue
        w = weight()
        if not isinstance(w, torch.Tensor) or not w.is_quantized:
            continue
        ints = w.int_repr()
        kept = ints.clamp(low, high)
        n = int((kept != ints).sum())
        if not n:
            continue
        if w.qscheme() in (torch.per_channel_symmetric, torch.per_channel_affine):
            w = torch._make_per_channel_quantized_tensor(
                kept, w.q_per_channel_scales(), w.q_per_channel_zero_points(), w.q_per_channel_axis()
            )
        else:
            w = torch._make_per_tensor_quantized_tensor(kept, w.q_scale(), w.q_zero_point())
        m.set_weight_bias(w, m.bias())
        changed += n
    return changed
