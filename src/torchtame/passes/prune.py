"""Structured (channel) pruning through torch-pruning.

Importance criteria and the pruner are separate objects, as in Torch-Pruning itself: the recipe
picks a criterion by name, a ratio (global, or per layer) or a target fraction of MACs/params,
and the pass removes whole channels, so the pruned model is smaller and faster without sparse
kernels. Optional fine-tuning between iterative steps recovers accuracy.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from ..errors import PassError
from ..evaluate.macs import count_macs_params
from ..options import Strict, TrainOptions
from ..registry import register_pass
from ..variant import PassContext, Variant
from ._select import match_modules, require_float
from .finetune import train_with

Criterion = Literal["l1", "l2", "magnitude", "bn_scale", "taylor", "lamp", "fpgm", "random"]


class Target(Strict):
    macs: float | None = Field(None, gt=0, lt=1, description="Keep at most this fraction of MACs.")
    params: float | None = Field(None, gt=0, lt=1, description="Keep at most this fraction of params.")

    @model_validator(mode="after")
    def _one(self) -> Target:
        if (self.macs is None) == (self.params is None):
            raise ValueError("set exactly one of `macs` or `params`")
        return self


class FinetuneBetween(TrainOptions):
    """Training between iterative pruning steps (default: one epoch)."""

    epochs: int | None = Field(None, ge=1, le=1000, description="Passes over the train split (default 1).")


class PruneOptions(Strict):
    importance: Criterion = Field("l2", description="Channel importance criterion.")
    ratio: float | None = Field(
        0.5, ge=0, lt=1, description="Fraction of channels to remove in each prunable layer."
    )
    layer_ratios: dict[str, float] = Field(
        default_factory=dict, description="Per-layer ratios by module name (override `ratio`)."
    )
    target: Target | None = Field(None, description="Prune until at most this fraction remains.")
    global_pruning: bool = Field(False, description="Rank channels across layers, not per layer.")
    ignored_layers: list[str] | None = Field(
        None, description="Module names/regexes left untouched (default: the classifier head)."
    )
    round_to: int | None = Field(None, ge=1, description="Keep channel counts multiples of this.")
    iterative_steps: int = Field(1, ge=1, le=100)
    finetune_between: FinetuneBetween | None = None
    taylor_batches: int = Field(4, ge=1, description="Batches with gradients for `taylor`.")
    max_layer_ratio: float = Field(0.9, gt=0, le=1, description="Never remove more per layer.")

    @model_validator(mode="after")
    def _ratio_or_target(self) -> PruneOptions:
        if self.target is not None:
            self.ratio = None
        if self.ratio is None and self.target is None and not self.layer_ratios:
            raise ValueError("set `ratio`, `layer_ratios` or `target`")
        for name, r in self.layer_ratios.items():
            if not 0 <= r < 1:
                raise ValueError(f"layer_ratios[{name!r}] = {r} must be in [0, 1)")
        return self


def make_importance(name: str) -> Any:
    import torch_pruning as tp

    imp = tp.importance
    return {
        "l1": lambda: imp.GroupMagnitudeImportance(p=1),
        "l2": lambda: imp.GroupMagnitudeImportance(p=2),
        "magnitude": lambda: imp.GroupMagnitudeImportance(p=2),
        "bn_scale": lambda: imp.BNScaleImportance(),
        "taylor": lambda: imp.GroupTaylorImportance(),
        "lamp": lambda: imp.LAMPImportance(p=2),
        "fpgm": lambda: imp.FPGMImportance(p=2),
        "random": lambda: imp.RandomImportance(),
    }[name]()


def default_head(model: nn.Module, example: torch.Tensor) -> list[str]:
    """The classifier head: the last Linear/Conv whose output width is the model's output width."""
    with torch.no_grad():
        out = model(example)
    width = out.shape[-1] if out.dim() == 2 else out.shape[1]
    head = None
    for name, m in model.named_modules():
        w = getattr(m, "out_features", None) or getattr(m, "out_channels", None)
        if isinstance(m, nn.Linear | nn.Conv2d | nn.Conv1d) and w == width:
            head = name
    return [head] if head else []


def channel_counts(model: nn.Module) -> dict[str, int]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d):
            out[name] = m.out_channels
        elif isinstance(m, nn.Linear):
            out[name] = m.out_features
    return out


def _check_supported(model: nn.Module, ignored: list[str]) -> None:
    for name, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention) and not any(
            name == i or name.startswith(i + ".") for i in ignored
        ):
            raise PassError(
                f"torch-pruning cannot prune attention layer {name!r} (MultiheadAttention) "
                "without head configuration",
                hint=f"add it to `ignored_layers: [{name}]`",
            )


def _taylor_grads(model: nn.Module, ctx: PassContext, batches: int) -> None:
    loader = ctx.data.train or ctx.data.calibration
    if not ctx.data.has_labels:
        raise PassError("`importance: taylor` needs labelled data", hint="use l2 or lamp instead")
    model.zero_grad()
    loss_fn = nn.CrossEntropyLoss()
    for i, (x, y) in enumerate(loader):
        if i >= batches:
            break
        loss_fn(model(x), y).backward()


@register_pass("prune.structured", PruneOptions)
def prune_structured(model: nn.Module | None, ctx: PassContext, opts: PruneOptions) -> Variant:
    """Remove whole channels ranked by an importance criterion (torch-pruning)."""
    import torch_pruning as tp

    assert model is not None
    require_float(ctx, "prune.structured", "prune first, then quantize (`from:` the pruned variant)")
    model = model.float().eval()
    example = ctx.example_input
    names = (
        default_head(model, example)
        if opts.ignored_layers is None
        else match_modules(model, opts.ignored_layers, "ignored_layers")
    )
    _check_supported(model, names)
    ignored = [model.get_submodule(n) for n in names]
    ratio_dict = {
        model.get_submodule(n): r
        for pattern, r in opts.layer_ratios.items()
        for n in match_modules(model, [pattern], "layer_ratios")
    }
    before_channels = channel_counts(model)
    base_macs, base_params = count_macs_params(model, example)

    if opts.target is not None:
        steps, ratio = max(opts.iterative_steps, 20), opts.max_layer_ratio
    else:
        steps, ratio = opts.iterative_steps, opts.ratio or 0.0
    try:
        pruner = tp.pruner.MetaPruner(
            model,
            example,
            importance=make_importance(opts.importance),
            global_pruning=opts.global_pruning,
            pruning_ratio=ratio,
            pruning_ratio_dict=ratio_dict or None,
            max_pruning_ratio=opts.max_layer_ratio,
            iterative_steps=steps,
            ignored_layers=ignored,
            round_to=opts.round_to,
        )
    except Exception as exc:
        raise PassError(
            f"torch-pruning cannot build a dependency graph of this model: {str(exc)[:200]}",
            hint="add the layer it names to `ignored_layers`",
        ) from exc

    history = []
    with ctx.progress.task(f"prune ({opts.importance})", total=steps) as task:
        for step in range(steps):
            if opts.importance == "taylor":
                model.train()
                _taylor_grads(model, ctx, opts.taylor_batches)
                model.eval()
            try:
                pruner.step()
            except Exception as exc:
                raise PassError(
                    f"torch-pruning failed at step {step + 1}: {str(exc)[:200]}",
                    hint="add the layer it names to `ignored_layers`",
                ) from exc
            model.zero_grad(set_to_none=True)
            macs, params = count_macs_params(model, example)
            history.append({"step": step + 1, "macs": macs, "params": params})
            task.advance(1)
            if opts.finetune_between is not None and step + 1 < steps:
                train_with(
                    model, ctx, opts.finetune_between, f"fine-tune between steps {step + 1}", ctx.seed + step
                )
            if opts.target is not None:
                frac = macs / base_macs if opts.target.macs is not None else params / base_params
                goal = opts.target.macs if opts.target.macs is not None else opts.target.params
                if frac <= goal:
                    break
    model.eval()
    macs, params = count_macs_params(model, example)
    if opts.target is not None:
        goal = opts.target.macs if opts.target.macs is not None else opts.target.params
        frac = macs / base_macs if opts.target.macs is not None else params / base_params
        if frac > goal + 1e-9:
            raise PassError(
                f"pruning reached {frac:.1%} of the baseline "
                f"{'MACs' if opts.target.macs is not None else 'params'}, not the target {goal:.0%}",
                hint="raise `max_layer_ratio`, or prune fewer ignored layers",
            )
    after = channel_counts(model)
    return ctx.variant(
        model,
        info={
            "importance": opts.importance,
            "ratio": opts.ratio,
            "ignored_layers": names,
            "macs_fraction": round(macs / base_macs, 4),
            "params_fraction": round(params / base_params, 4),
            "steps": history,
            "channels": {n: [before_channels[n], after[n]] for n in before_channels if n in after},
        },
    )
