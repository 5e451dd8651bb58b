"""A short fine-tuning run on the train split, to recover accuracy after pruning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from torch import nn

from ..recipe import Strict
from ..training import train
from ..variant import PassContext, Variant
from . import register_pass
from ._select import require_float


class FinetuneOptions(Strict):
    epochs: int | None = Field(3, ge=1)
    steps: int | None = Field(None, ge=1, description="Optimizer steps instead of epochs.")
    lr: float = Field(1e-3, gt=0)
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    weight_decay: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _steps(self) -> FinetuneOptions:
        if self.steps is not None:
            self.epochs = None
        return self


@register_pass("finetune", FinetuneOptions)
def finetune(model: nn.Module | None, ctx: PassContext, opts: FinetuneOptions) -> Variant:
    """Fine-tune a float variant with cross-entropy on the train split."""
    assert model is not None
    require_float(ctx, "finetune", "fine-tune before quantizing")
    stats = train(
        model.float(),
        ctx.data.train,
        epochs=opts.epochs,
        steps=opts.steps,
        lr=opts.lr,
        optimizer=opts.optimizer,
        weight_decay=opts.weight_decay,
        device=ctx.train_device,
        seed=ctx.seed,
        progress=ctx.progress,
        description=f"fine-tune {ctx.parent.name}",
    )
    return ctx.variant(model, info={"finetuned_from": ctx.parent.name, **stats})
