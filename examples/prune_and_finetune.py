"""Prune half the channels of a CNN and see accuracy come back: the least-squares refit of the
layers after the pruned ones (`reconstruct`, on by default) recovers most of it without training;
a short fine-tuning run then keeps its weights only where they lower the loss on the calibration
split (`keep_best`), so it never returns a worse model than it was given.

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

options = {"importance": "l2", "ratio": 0.5}
raw = torchtame.apply_pass("prune.structured", model, data, {**options, "reconstruct": False})
pruned = torchtame.apply_pass("prune.structured", model, data, options)
tuned = torchtame.apply_pass("finetune", pruned, data, {"epochs": 3, "lr": 3e-4})
print(f"fine-tuning kept epoch {tuned.info['kept_epoch']} (calibration loss {tuned.info['held_out_loss']})")

example = data.example_input(1)
rows = (("baseline", model), ("no-refit", raw.module), ("pruned", pruned.module), ("pruned+ft", tuned.module))
for name, m in rows:
    macs, params = count_macs_params(m, example)
    acc = top1_accuracy(m, data.evaluation)
    print(f"{name:<10} top-1 {acc:6.2f}%  MACs {macs / 1e6:5.2f}M  params {params / 1e3:6.1f}k")
