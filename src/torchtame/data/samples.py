"""Samples as people hand them over, turned into ``(inputs, label)`` pairs.

A sample may be a tensor, a tuple/list (a ``TensorDataset`` row, one-element tuples too), or a
dict keyed by ``forward()``'s argument names (Hugging Face rows); values may be tensors, NumPy
arrays or lists of numbers. Where the label is depends on ``data.label``:

- ``auto`` (default): a dict's ``labels`` / ``label`` key; a tuple's last element when it is an
  integer scalar (class index); otherwise no label. A float scalar last is ambiguous (a label or
  an input?) and is an error that names ``data.label``.
- ``none``: every element is an input. ``last``: the last element is the label.
- an integer: the element at that index; a string: that key of a dict sample.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from ..errors import DataError

LabelRule = Literal["auto", "none", "last"] | int | str
NO_LABEL = -1


def _tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray | np.generic | int | float | bool) or (
        isinstance(value, list | tuple) and value and not isinstance(value[0], torch.Tensor | Mapping)
    ):
        return torch.as_tensor(np.asarray(value))
    raise DataError(
        f"data: {where} is a {type(value).__name__}, not a tensor, array or list of numbers",
        hint="samples must hold tensors (tokenize text first, or use `source: text`)",
    )


def _is_int_scalar(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | np.integer):
        return True
    if isinstance(value, np.ndarray):
        return value.size == 1 and value.dtype.kind in "iu"
    if isinstance(value, torch.Tensor):
        return (
            value.numel() == 1
            and not value.is_floating_point()
            and not value.is_complex()
            and (value.dtype != torch.bool)
        )
    return False


def _is_float_scalar(value: Any) -> bool:
    if isinstance(value, float | np.floating):
        return True
    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()


def _label(value: Any, where: str) -> torch.Tensor:
    t = _tensor(value, where).reshape(-1)
    if t.numel() != 1 or t.is_floating_point():
        raise DataError(
            f"data: {where} is not a class index (got {t.dtype} with {t.numel()} values)",
            hint="labels are integer class indices; set `label: none` if this is a model input",
        )
    return t[0].to(torch.int64)


def _inputs(items: list[Any], where: str) -> Any:
    if len(items) == 1:
        one = items[0]
        if isinstance(one, Mapping):
            return {str(k): _tensor(v, f"{where}[{k!r}]") for k, v in one.items()}
        if isinstance(one, int | float | bool | np.generic):
            raise DataError(
                f"data: each sample is a single {type(one).__name__}, not tensors (a tensor, a tuple or a "
                "dict of tensors)",
                hint="return a Dataset (e.g. TensorDataset(inputs, labels)), a list of tensors or dicts",
            )
        return _tensor(one, where)
    return tuple(_tensor(v, f"{where}[{i}]") for i, v in enumerate(items))


def split_sample(sample: Any, rule: LabelRule = "auto") -> tuple[Any, torch.Tensor]:
    """``(inputs, label)`` of one sample; the label is -1 where there is none."""
    none = torch.tensor(NO_LABEL)
    if isinstance(sample, Mapping):
        keys = list(sample)
        if rule == "auto":
            key = next((k for k in ("labels", "label") if k in sample), None)
        elif rule in ("none",):
            key = None
        elif isinstance(rule, str) and rule != "last":
            if rule not in sample:
                raise DataError(
                    f"data.label: samples have no key {rule!r}; keys: {', '.join(map(str, keys))}"
                )
            key = rule
        else:
            raise DataError(
                f"data.label: {rule!r} needs tuple samples, but samples are dicts",
                hint="name the label's key (e.g. `label: labels`) or use `label: auto`",
            )
        rest = {k: v for k, v in sample.items() if k != key}
        label = _label(sample[key], f"sample[{key!r}]") if key is not None else none
        return _inputs([rest], "sample"), label
    if not isinstance(sample, Sequence) or isinstance(sample, str | torch.Tensor):
        if rule not in ("auto", "none"):
            raise DataError(f"data.label: {rule!r} needs tuple samples, but each sample is one tensor")
        return _inputs([sample], "sample"), none
    items = list(sample)
    if not items:
        raise DataError("data: a sample is an empty tuple")
    index: int | None = None
    if rule == "last":
        index = len(items) - 1
    elif isinstance(rule, int) and not isinstance(rule, bool):
        if not -len(items) <= rule < len(items):
            raise DataError(f"data.label: index {rule} is out of range for samples of {len(items)} elements")
        index = rule % len(items)
    elif rule == "auto" and len(items) >= 2:
        if _is_int_scalar(items[-1]):
            index = len(items) - 1
        elif _is_float_scalar(items[-1]):
            raise DataError(
                "data: the last element of each sample is a float scalar: a regression target or an input?",
                hint="set `label: none` (it is an input) or `label: last` (a class index)",
            )
    elif rule not in ("auto", "none"):
        raise DataError(f"data.label: {rule!r} names a key, but samples are tuples", hint="use an index")
    if index is None:
        return _inputs(items, "sample"), none
    label = _label(items[index], f"sample[{index}]")
    if len(items) == 1:
        raise DataError("data.label: the only element of each sample is the label; there is no input left")
    return _inputs(items[:index] + items[index + 1 :], "sample"), label


class Samples(Dataset):
    """Any indexable collection of samples (a Dataset, a list, a Hugging Face dataset), each
    returned as ``(inputs, label)``."""

    def __init__(self, items: Any, rule: LabelRule = "auto") -> None:
        self.items = items
        self.rule = rule

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        return split_sample(self.items[i], self.rule)


class _Columns:
    """A dict of equal-length columns (tensors or arrays) seen as a list of dict rows."""

    def __init__(self, columns: Mapping[str, Any]) -> None:
        self.columns = {k: _tensor(v, f"column {k!r}") for k, v in columns.items()}
        lengths = {len(v) for v in self.columns.values()}
        if len(lengths) != 1:
            sizes = ", ".join(f"{k}: {len(v)}" for k, v in self.columns.items())
            raise DataError(f"data: the columns have different lengths ({sizes})")
        self.n = lengths.pop()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.columns.items()}


def columns_dataset(obj: Mapping[str, Any]) -> _Columns:
    """A dict of columns (``{"input_ids": [N, T], "label": [N]}``) as a dataset of dict rows."""
    return _Columns(obj)
