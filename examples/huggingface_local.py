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
        # one memory reading per setting is plenty for a model this small (the default is 3)
        "evaluate": {"latency": {"batch_sizes": [1, 8], "min_time_s": 0.1}, "memory_repeats": 1},
    }
)
for v in result.variants.values():
    if not v.ok:
        print(f"{v.name:<14} failed: {v.error.splitlines()[0]}")
        continue
    b8 = v.latency_at("cpu", 8)
    # the baseline is the reference (cosine 1 by definition); every other variant has its own figure
    cos = "reference" if v.name == "baseline" else f"{v.fidelity.cosine:.4f}"
    print(
        f"{v.name:<14} cosine {cos}  size {v.size.bytes / 1e6:6.3f} MB  "
        f"p50 b8 {b8.p50_ms:7.3f} ms  peak b8 {b8.peak_memory_mb or 0:6.1f} MiB"
    )
print(f"inputs: {result.results['model']['inputs']}; report: {result.run_dir / 'report.md'}")
