"""The loaders a data source produces, and the checks every source's data goes through."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field, model_validator
from torch.utils.data import DataLoader, Dataset, Subset

from ..errors import DataError, first_line
from ..inputs import Inputs, describe, is_structure, repeat_batch, tensors
from ..options import DataSourceOptions, Strict
from ..registry import DATA_SOURCES


@dataclass
class DataBundle:
    """Loaders for each split plus what is known about the data."""

    train: DataLoader | None
    calibration: DataLoader
    evaluation: DataLoader
    has_labels: bool
    num_classes: int | None
    sample_shape: tuple[int, ...]
    description: str
    use_labels: bool | None = None  # may the optimizer use the labels? (data.labels: report_only)

    def __post_init__(self) -> None:
        if self.use_labels is None:
            self.use_labels = self.has_labels

    @property
    def labels_mode(self) -> str:
        """use | report_only | none: what labels there are and who may see them."""
        if not self.has_labels:
            return "none"
        return "use" if self.use_labels else "report_only"

    def example_input(self, batch_size: int = 1) -> Inputs:
        """A real batch of ``batch_size`` evaluation samples (repeated if the split is smaller)."""
        return repeat_batch(first_inputs(self.evaluation), batch_size)

    @property
    def input_description(self) -> str:
        """The structure, dtypes and shapes of one sample, e.g. ``input_ids: int64[1, 32], ...``."""
        return describe(self.example_input(1))


def first_inputs(loader: DataLoader) -> Inputs:
    batch = next(iter(loader))
    return batch[0] if isinstance(batch, list | tuple) else batch


class Split(Strict):
    train: float = Field(0.6, ge=0, le=1)
    calibration: float = Field(0.1, gt=0, le=1)
    evaluation: float = Field(0.3, gt=0, le=1)

    @model_validator(mode="after")
    def _sum(self) -> Split:
        total = self.train + self.calibration + self.evaluation
        if total > 1.0 + 1e-9:
            raise ValueError(f"split fractions add up to {total:g}; they must add up to at most 1")
        return self


def load_data(spec: DataSourceOptions, seed: int) -> DataBundle:
    """Build the loaders the recipe's ``data`` section names, and check they are usable."""
    entry = DATA_SOURCES.get(spec.source)  # type: ignore[attr-defined]
    bundle = entry.fn(spec, seed)
    if spec.labels == "report_only":
        bundle.use_labels = False
    elif spec.labels == "ignore":
        bundle.has_labels = bundle.use_labels = False
    for split in ("calibration", "evaluation"):
        loader = getattr(bundle, split)
        if len(loader.dataset) == 0:  # type: ignore[arg-type]
            raise DataError(
                f"data: the {split} split is empty", hint="give the source more samples or a larger split"
            )
    try:
        x = first_inputs(bundle.evaluation)
    except RuntimeError as exc:  # default_collate cannot stack samples of different shapes
        raise DataError(
            f"data: the samples of one batch cannot be stacked: {first_line(exc, 160)}",
            hint="pad every sample to one length (tokenizer `padding: max_length`) or set `batch_size: 1`",
        ) from exc
    if not is_structure(x):
        raise DataError(
            f"data: the model inputs of a batch are a {type(x).__name__}, not tensors",
            hint="samples must hold tensors (or numbers/arrays convertible to tensors)",
        )
    if any(t.is_floating_point() and not torch.isfinite(t).all() for t in tensors(x)):
        raise DataError(
            "data: the evaluation inputs contain NaN or infinite values",
            hint="clean the data or fix its normalisation",
        )
    return bundle


def split_indices(n: int, split: Split, seed: int) -> tuple[list[int], list[int], list[int]]:
    if n == 0:
        raise DataError("data: the dataset is empty", hint="point the source at data with samples")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_cal = max(1, round(split.calibration * n))
    n_eval = max(1, round(split.evaluation * n))
    n_train = min(n - n_cal - n_eval, round(split.train * n))
    if n_train < 0:
        raise DataError(f"data: {n} samples are too few for the requested split")
    return perm[:n_train], perm[n_train : n_train + n_cal], perm[n_train + n_cal : n_train + n_cal + n_eval]


def make_loaders(
    spec: DataSourceOptions,
    seed: int,
    train: Dataset | None,
    calibration: Dataset,
    evaluation: Dataset,
) -> tuple[DataLoader | None, DataLoader, DataLoader]:
    def limited(ds: Dataset, batches: int | None) -> Dataset:
        if batches is None or batches * spec.batch_size >= len(ds):  # type: ignore[arg-type]
            return ds
        return Subset(ds, range(batches * spec.batch_size))

    train_loader = None
    if train is not None and len(train) > 0:  # type: ignore[arg-type]
        train_loader = DataLoader(
            train,
            batch_size=spec.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
    cal = DataLoader(limited(calibration, spec.calibration_batches), batch_size=spec.batch_size)
    ev = DataLoader(limited(evaluation, spec.evaluation_batches), batch_size=spec.batch_size)
    return train_loader, cal, ev
