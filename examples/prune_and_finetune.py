"""Prune half the channels of a CNN, fine-tune it briefly, and see accuracy come back.

.venv/bin/python examples/prune_and_finetune.py
"""

from __future__ import annotations

import torchtame
from torchtame.data import DigitsData
from torchtame.evaluate import top1_accuracy
from torchtame.evaluate.macs import count_macs_params
from torchtame.training import train
from torchtame.zoo import digits_cnn

data = torchtame.load_data(DigitsData(source="digits", batch_size=64), seed=0)
model = digits_cnn()
train(model, data.train, epochs=6, lr=3e-3)

pruned = torchtame.apply_pass("prune.structured", model, data, {"importance": "l2", "ratio": 0.5})
tuned = torchtame.apply_pass("finetune", pruned, data, {"epochs": 3, "lr": 2e-3})

example = data.example_input(1)
for name, m in (("baseline", model), ("pruned", pruned.module), ("pruned+ft", tuned.module)):
    macs, params = count_macs_params(m, example)
    acc = top1_accuracy(m, data.evaluation)
    print(f"{name:<10} top-1 {acc:6.2f}%  MACs {macs / 1e6:5.2f}M  params {params / 1e3:6.1f}k")
