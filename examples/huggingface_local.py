"""Optimize a Hugging Face Transformer from a local directory, end to end, with no code around it.

.venv/bin/python examples/huggingface_local.py [MODEL_DIR]

Give it a directory saved with ``model.save_pretrained(d); tokenizer.save_pretrained(d)``. Without
one, it saves a tiny random BERT (and its tokenizer) to a temporary directory first, so the
example runs anywhere without a download. The recipe measures the model's last_hidden_state:
fidelity is cosine similarity to the fp32 baseline (there are no labels).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torchtame


def tiny_bert(directory: Path) -> Path:
    """Stand-in for your model: a 2-layer BERT with random weights and a 25-word tokenizer."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast
    from transformers.utils import logging

    logging.disable_progress_bar()

    words = "the a cat dog sat on mat ran fast slow big small red blue green house tree car road sky"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words.split()])
    )
    BertTokenizerFast(vocab_file=str(directory / "vocab.txt")).save_pretrained(directory)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=25, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    BertModel(config).save_pretrained(directory)
    return directory


work = Path(tempfile.mkdtemp(prefix="torchtame-hf-"))
model_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else tiny_bert(work / "tiny-bert")
texts = work / "texts.txt"
texts.write_text(
    "\n".join(["the cat sat on the mat", "a dog ran fast", "the big red car", "a small house"] * 12)
)

result = torchtame.run(
    {
        "name": "hf-local",
        "output_dir": str(work / "runs"),
        "model": {"source": "transformers", "path": str(model_dir), "task": "feature-extraction"},
        "data": {"source": "text", "path": str(texts), "max_length": 16, "batch_size": 8},
        "devices": ["cpu"],
        "steps": [
            {"name": "int8-dynamic", "pass": "quantize.dynamic"},
            {"name": "bf16", "pass": "quantize.half", "options": {"dtype": "bfloat16"}},
            {"name": "heads-pruned", "pass": "prune.structured", "options": {"ratio": 0.5}},
            {"name": "onnx-int8", "pass": "quantize.onnx", "options": {"mode": "dynamic"}},
        ],
        "export": {"onnx": True, "variants": ["baseline"]},
        "evaluate": {"latency": {"batch_sizes": [1, 8], "min_time_s": 0.2}},
    }
)
for v in result.results["variants"]:
    if v["status"] != "ok":
        print(f"{v['name']:<14} failed: {v['error'].splitlines()[0]}")
        continue
    p50 = {m["batch_size"]: m["p50_ms"] for m in v["latency"]}
    cos = v["accuracy"].get("cosine_similarity", 1.0)
    print(
        f"{v['name']:<14} cosine {cos:.4f}  size {v['size']['bytes'] / 1e6:6.3f} MB  p50 b8 {p50[8]:7.3f} ms"
    )
print(f"inputs: {result.results['model']['inputs']}; report: {result.run_dir / 'report.md'}")
