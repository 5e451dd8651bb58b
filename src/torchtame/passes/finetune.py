"""A short fine-tuning run on the train split, to recover accuracy after pruning."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import PassError
from ..options import TrainOptions
from ..registry import register_pass
from ..training import train_with_options
from ..variant import PassContext, Variant
from ._select import require_float


class FinetuneOptions(TrainOptions):
    """Fine-tuning options (the shared training options)."""


def train_with(
    model: nn.Module, ctx: PassContext, opts: TrainOptions, description: str, seed: int, **hooks: Any
) -> dict:
    """Train ``model`` in place with ``opts``; returns the stats. Cross-entropy trains on the train
    split; distillation from the baseline needs no labels and uses the train split's inputs, or
    the calibration split's where there is no train split. ``hooks``: ``on_step``/``on_epoch`` of
    :func:`torchtame.training.train`."""
    distill = opts.loss == "distill"
    loader = ctx.data.train if ctx.data.train is not None or not distill else ctx.data.calibration
    return train_with_options(
        model,
        loader,
        opts,
        device=ctx.train_device,
        seed=seed,
        progress=ctx.progress,
        description=description,
        output=ctx.output,
        teacher=ctx.baseline.module if distill else None,
        features=ctx.task == "features",
        use_labels=bool(ctx.data.use_labels),
        **hooks,
    )


NAME = "finetune"


@register_pass(
    NAME,
    FinetuneOptions,
    traits={"trains", "same_architecture"},
    hints={"fidelity": "lower `lr` or train longer; check the train split"},
)
def finetune(model: nn.Module | None, ctx: PassContext, opts: FinetuneOptions) -> Variant:
    """Fine-tune a float variant: cross-entropy on labels, or distillation from the baseline."""
    assert model is not None
    require_float(ctx, "finetune", "fine-tune before quantizing")
    if opts.loss == "distill" and (ctx.baseline is ctx.parent or ctx.baseline.module is None):
        raise PassError(
            "`loss: distill` learns from the baseline, but the variant to fine-tune is the baseline itself",
            hint="distill a pruned variant; outside a recipe pass the original: "
            "apply_pass('finetune', pruned, data, {'loss': 'distill'}, baseline=model)",
        )
    stats = train_with(model.float(), ctx, opts, f"fine-tune {ctx.parent.name}", ctx.seed)
    info = {"finetuned_from": ctx.parent.name, **stats}
    if opts.loss == "distill":
        info["teacher"] = ctx.baseline.name
    return ctx.variant(model, info=info)
