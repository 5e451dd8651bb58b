"""Option base classes and the option models several passes and sources share.

Nothing here imports the rest of the package: passes, sources and the recipe build on it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

UserPath = Annotated[Path, AfterValidator(lambda p: p.expanduser())]
"""A path in a recipe; ``~`` is expanded."""

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"


class Strict(BaseModel):
    """Base of every recipe section and options model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class NoOptions(Strict):
    """For registered items that take no options."""


class TrainOptions(Strict):
    """How to train: the one training options model (pre-training, fine-tuning, between steps)."""

    epochs: int | None = Field(3, ge=1, le=1000, description="Passes over the train split.")
    steps: int | None = Field(None, ge=1, description="Optimizer steps instead of epochs.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate (one-cycle schedule).")
    optimizer: Literal["adam", "adamw", "sgd"] = "adam"
    weight_decay: float = Field(0.0, ge=0)
    loss: Literal["ce", "distill"] = Field(
        "ce",
        description="ce: cross-entropy on labels; distill: learn the baseline's outputs (KL divergence "
        "of softened class scores, or cosine/MSE for embeddings); needs no labels.",
    )
    temperature: float = Field(4.0, gt=0, description="distill: softening of the class scores.")
    alpha: float = Field(
        0.0, ge=0, le=1, description="distill: weight of cross-entropy on labels, where labels may be used."
    )
    feature_loss: Literal["cosine", "mse"] = Field("cosine", description="distill: loss for embeddings.")
    logits_loss: Literal["kl", "cosine", "mse"] = Field(
        "kl",
        description="distill: loss for class scores: kl (KL divergence of the scores softened by "
        "`temperature`), or cosine / mse on the scores themselves (what fidelity measures; it keeps "
        "learning where the teacher's scores are nearly flat, as in untrained or random-weight models).",
    )
    intermediate: Literal["none", "attention"] | list[str] = Field(
        "none",
        description="distill: also match the teacher's outputs of intermediate modules (MSE normalised by "
        "the teacher's mean square, averaged over the modules, weighted by `intermediate_weight`): "
        "`attention` (every outermost attention module: nn.MultiheadAttention and classes named "
        "*Attention, as timm's and transformers' are), or a list of module names both models have. "
        "After head pruning it tells each pruned attention what the full one computed.",
    )
    intermediate_weight: float = Field(1.0, gt=0, le=100, description="distill: weight of `intermediate`.")
    mixup: float = Field(
        0.0,
        ge=0,
        le=10,
        description="Train on mixed pairs of inputs (mixup, Beta(mixup, mixup) weights; 0: off). With "
        "`loss: distill` the teacher sees the same mixed inputs, so the student learns the teacher between "
        "samples as well as on them (function matching); cross-entropy mixes the two labels. Float tensor "
        "inputs only (images, features), not token ids.",
    )

    @model_validator(mode="after")
    def _steps_or_epochs(self) -> TrainOptions:
        if self.steps is not None:
            self.epochs = None
        if self.intermediate != "none" and self.loss != "distill":
            raise ValueError(
                "`intermediate` matches the teacher's intermediate outputs, which only distillation has: "
                "set `loss: distill`, or drop `intermediate`"
            )
        return self


class PretrainOptions(TrainOptions):
    """Train the model on the data's train split before optimizing (cached by content hash)."""

    epochs: int | None = Field(10, ge=1, le=1000, description="Passes over the train split.")
    lr: float = Field(2e-3, gt=0, description="Peak learning rate (one-cycle schedule).")
    cache: bool = Field(True, description="Reuse a model trained earlier with the same recipe and seed.")


class ModelSourceOptions(Strict):
    """Fields every model source accepts."""

    input_shape: list[int] | None = Field(
        None,
        description="Shape of one input batch the model expects, e.g. [1, 3, 224, 224]; checked against "
        "the data's samples before any work (the batch dimension may be anything).",
    )
    train: PretrainOptions | None = Field(
        None, description="Train on the spot before optimizing (small models, quickstart)."
    )

    def declared_task(self) -> str | None:
        """``classification`` or ``features`` when the source knows what its model outputs."""
        return None

    def declared_output(self) -> str | None:
        """The output (key or index) to measure by default, when the source knows it."""
        return None


class DataSourceOptions(Strict):
    """Fields every data source accepts."""

    batch_size: int = Field(32, ge=1)
    calibration_batches: int | None = Field(
        None, ge=1, description="Use at most this many calibration batches (default: all)."
    )
    evaluation_batches: int | None = Field(
        None, ge=1, description="Use at most this many evaluation batches (default: all)."
    )
    labels: Literal["use", "report_only", "ignore"] = Field(
        "use",
        description="use: the optimizer may use labels (search constraints, fine-tuning); report_only: "
        "labels only measure the reported accuracy, the optimizer sees fidelity; ignore: no labels.",
    )
