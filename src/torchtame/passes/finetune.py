"""A short fine-tuning run on the train split, to recover accuracy after pruning."""

from __future__ import annotations

from torch import nn

from ..options import TrainOptions
from ..registry import register_pass
from ..training import train_with_options
from ..variant import PassContext, Variant
from ._select import require_float


class FinetuneOptions(TrainOptions):
    """Fine-tuning options (the shared training options)."""


def train_with(model: nn.Module, ctx: PassContext, opts: TrainOptions, description: str, seed: int) -> dict:
    """Train ``model`` in place on the context's train split with ``opts``; returns the stats."""
    return train_with_options(
        model,
        ctx.data.train,
        opts,
        device=ctx.train_device,
        seed=seed,
        progress=ctx.progress,
        description=description,
        output=ctx.output,
    )


@register_pass("finetune", FinetuneOptions)
def finetune(model: nn.Module | None, ctx: PassContext, opts: FinetuneOptions) -> Variant:
    """Fine-tune a float variant with cross-entropy on the train split."""
    assert model is not None
    require_float(ctx, "finetune", "fine-tune before quantizing")
    stats = train_with(model.float(), ctx, opts, f"fine-tune {ctx.parent.name}", ctx.seed)
    return ctx.variant(model, info={"finetuned_from": ctx.parent.name, **stats})
