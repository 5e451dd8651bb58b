"""Text data: a text or CSV file tokenized with a local Hugging Face tokenizer (never the hub)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch.utils.data import Dataset, Subset

from ..errors import DataError, first_line
from ..optional import require
from ..options import DataSourceOptions, UserPath
from ..registry import register_data_source
from .bundle import DataBundle, Split, make_loaders, split_indices


class TextData(DataSourceOptions):
    source: Literal["text"]
    path: UserPath = Field(description="A .txt file (one text per line) or a .csv/.tsv file with a header.")
    tokenizer: UserPath | None = Field(
        None,
        description="Local Hugging Face directory holding the tokenizer (default: the path of a "
        "`transformers` model).",
    )
    text_column: str = Field("text", description="CSV column of the text.")
    text_pair_column: str | None = Field(None, description="CSV column of a second text (pairs).")
    label_column: str | None = Field(
        None, description="CSV column of the label (integers, or names mapped to indices in sorted order)."
    )
    max_length: int = Field(128, ge=2, description="Tokens per sample (longer texts are truncated).")
    padding: Literal["max_length", "longest"] = Field(
        "max_length", description="Pad every sample to max_length, or to the longest text in the file."
    )
    max_samples: int | None = Field(None, ge=1, description="Use at most this many texts.")
    split: Split = Field(default_factory=Split)


class TextDataset(Dataset):
    """Tokenized texts as ``({input_ids, attention_mask, ...}, label)`` samples."""

    def __init__(self, encodings: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.encodings, self.labels = encodings, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return {k: v[i] for k, v in self.encodings.items()}, self.labels[i]


def read_texts(spec: TextData) -> tuple[list[Any], list[str] | None]:
    """Texts (or text pairs) and raw labels from the file."""
    path = spec.path
    if not path.is_file():
        raise DataError(f"data.path: text file {str(path)!r} does not exist")
    if path.suffix.lower() not in (".csv", ".tsv"):
        texts = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if spec.label_column or spec.text_pair_column:
            raise DataError(
                "data.label_column / text_pair_column need a .csv or .tsv file with a header",
                hint="write the texts as CSV (columns: text,label) or drop those fields",
            )
        return texts[: spec.max_samples], None
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
    columns = list(rows[0]) if rows else []
    for field in ("text_column", "text_pair_column", "label_column"):
        col = getattr(spec, field)
        if col is not None and col not in columns:
            raise DataError(
                f"data.{field}: {str(path)!r} has no column {col!r}; columns: {', '.join(columns)}"
            )
    rows = [r for r in rows if (r.get(spec.text_column) or "").strip()][: spec.max_samples]
    texts: list[Any] = [r[spec.text_column] for r in rows]
    if spec.text_pair_column:
        texts = [(t, r[spec.text_pair_column]) for t, r in zip(texts, rows, strict=True)]
    labels = [r[spec.label_column] for r in rows] if spec.label_column else None
    return texts, labels


def label_indices(raw: list[str]) -> tuple[torch.Tensor, int]:
    """Integer labels as given, or names mapped to indices in sorted order; and the class count."""
    try:
        values = [int(v) for v in raw]
        return torch.tensor(values, dtype=torch.int64), max(values) + 1
    except ValueError:
        names = sorted(set(raw))
        index = {n: i for i, n in enumerate(names)}
        return torch.tensor([index[v] for v in raw], dtype=torch.int64), len(names)


def load_tokenizer(path: Path) -> Any:
    transformers = require("transformers", "the text data source", DataError)
    if not path.is_dir():
        raise DataError(
            f"data.tokenizer: {str(path)!r} is not a directory",
            hint="point it at a local Hugging Face model directory (tokenizer.json / vocab.txt)",
        )
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"data.tokenizer: no tokenizer could be loaded from {str(path)!r}: {first_line(exc, 200)}",
            hint="save one there with tokenizer.save_pretrained(path); torchtame never downloads",
        ) from exc


@register_data_source("text", TextData)
def _text(spec: TextData, seed: int) -> DataBundle:
    """A text or CSV file tokenized with a local Hugging Face tokenizer (optional label column)."""
    if spec.tokenizer is None:
        raise DataError(
            "data.tokenizer is not set and the model is not a `transformers` model to take it from",
            hint="set `tokenizer:` to a local Hugging Face directory",
        )
    texts, raw_labels = read_texts(spec)
    if not texts:
        raise DataError(f"data.path: {str(spec.path)!r} holds no text")
    tokenizer = load_tokenizer(spec.tokenizer)
    pairs = isinstance(texts[0], tuple)
    first = [t[0] for t in texts] if pairs else texts
    second = [t[1] for t in texts] if pairs else None
    enc = tokenizer(
        first,
        second,
        padding="max_length" if spec.padding == "max_length" else "longest",
        truncation=True,
        max_length=spec.max_length,
        return_tensors="pt",
    )
    names = [n for n in tokenizer.model_input_names if n in enc]
    encodings = {n: enc[n] for n in names}
    if raw_labels is not None:
        labels, num_classes = label_indices(raw_labels)
    else:
        labels, num_classes = torch.full((len(first),), -1, dtype=torch.int64), None
    full = TextDataset(encodings, labels)
    tr, ca, ev = split_indices(len(full), spec.split, seed)
    has_labels = raw_labels is not None
    loaders = make_loaders(
        spec, seed, Subset(full, tr) if has_labels else None, Subset(full, ca), Subset(full, ev)
    )
    length = encodings[names[0]].shape[1]
    kind = "labelled" if has_labels else "no labels"
    desc = f"text {spec.path.name} ({len(full)} texts, {length} tokens, {kind})"
    return DataBundle(*loaders, has_labels, num_classes, (length,), desc)
