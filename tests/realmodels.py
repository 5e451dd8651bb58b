"""Model code others wrote (transformers), and models shaped as people write them, built from
configs with random weights: no download. Used by test_real_models.py through recipes."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "ran",
    "fast",
    "slow",
    "big",
    "small",
    "red",
    "blue",
    "green",
    "house",
    "tree",
    "car",
    "road",
    "sky",
]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
SENTENCES = [
    "the cat sat on the mat",
    "a dog ran fast",
    "the big red car",
    "small blue house on the road",
    "the green tree and the sky",
    "a cat ran on the road",
    "the slow dog sat",
    "a big tree on a small house",
]


def save_tiny_bert(directory: Path, task: str = "feature-extraction") -> Path:
    """A local Hugging Face directory: a 2-layer BERT (hidden 32, 4 heads) and its tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
    )
    torch.manual_seed(0)
    cls = BertModel if task == "feature-extraction" else BertForSequenceClassification
    cls(config).save_pretrained(directory)
    return directory


def write_texts(path: Path, copies: int = 6, labels: bool = False) -> Path:
    rows = [s for _ in range(copies) for s in SENTENCES]
    if labels:
        path.write_text(
            "text,label\n"
            + "".join(f"{s},{'animal' if ('cat' in s or 'dog' in s) else 'thing'}\n" for s in rows)
        )
    else:
        path.write_text("\n".join(rows) + "\n")
    return path


def token_ids(n: int = 48, length: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (padded with 0 after a random length) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(VOCAB), (n, length), generator=g)
    lengths = torch.randint(4, length + 1, (n,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids * mask, mask


# ------------------------------------------------------------------ models as `module:callable`


def distilbert() -> nn.Module:
    """transformers' DistilBertModel from a tiny random config (hidden 32, 4 heads, 2 layers)."""
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    config = DistilBertConfig(
        vocab_size=len(VOCAB), dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64
    )
    return DistilBertModel(config)


def hf_rows() -> list[dict[str, torch.Tensor]]:
    """Hugging Face style rows: dicts of input_ids and attention_mask (no label)."""
    ids, mask = token_ids()
    return [{"input_ids": i, "attention_mask": m} for i, m in zip(ids, mask, strict=True)]


class LSTMClassifier(nn.Module):
    """Embedding -> LSTM -> Linear on token ids: a text classifier as people write one."""

    def __init__(self, vocab: int = len(VOCAB), dim: int = 32, classes: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.lstm = nn.LSTM(dim, dim, batch_first=True)
        self.fc = nn.Linear(dim, 64)
        self.head = nn.Linear(64, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(input_ids))
        return self.head(torch.relu(self.fc(out[:, -1])))


def lstm_classifier() -> nn.Module:
    torch.manual_seed(0)
    return LSTMClassifier()


def token_classes() -> TensorDataset:
    """Token ids labelled by their last token (id mod 3, three balanced classes): learnable."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, len(VOCAB), (256, 10), generator=g)
    return TensorDataset(ids, ids[:, -1] % 3)


class TwoImages(nn.Module):
    """Two image inputs (e.g. a frame and a mask) through two conv stems, fused by concatenation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.fuse = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 4)

    def forward(self, image: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.fuse(torch.cat([self.a(image), self.b(mask)], 1)).flatten(1))


def two_images() -> nn.Module:
    torch.manual_seed(0)
    return TwoImages()


def image_pairs() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    images, masks = torch.randn(64, 3, 16, 16, generator=g), torch.rand(64, 1, 16, 16, generator=g)
    labels = (images.mean((1, 2, 3)) > 0).long() + 2 * (masks.mean((1, 2, 3)) > 0.5).long()
    return TensorDataset(images, masks, labels)


class DictOutput(nn.Module):
    """Returns {"logits", "embedding"} as many research models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        emb = self.body(x)
        return {"logits": self.head(torch.relu(emb)), "embedding": nn.functional.normalize(emb, dim=1)}


def dict_output() -> nn.Module:
    torch.manual_seed(0)
    return DictOutput()
