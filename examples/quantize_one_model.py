"""Quantize one model with the Python API and compare it with its float original.

.venv/bin/python examples/quantize_one_model.py
"""

from __future__ import annotations

import torch

import torchtame
from torchtame.data import DigitsData
from torchtame.evaluate import measure_latency, top1_accuracy
from torchtame.runtime import quantized_engine
from torchtame.training import train
from torchtame.zoo import digits_cnn

data = torchtame.load_data(DigitsData(source="digits", batch_size=64), seed=0)
model = digits_cnn()
train(model, data.train, epochs=6, lr=3e-3)  # a real model, trained in a few seconds

int8 = torchtame.apply_pass(
    "quantize.static", model, data, {"backend": "x86", "activation_observer": "histogram"}
)
x = data.example_input(64)
with quantized_engine(int8.backend), torch.inference_mode():  # as deployed: no autograd
    fp32_ms = measure_latency(model, x, min_runs=30, min_time_s=0.3).p50_ms
    int8_ms = measure_latency(int8.module, x, min_runs=30, min_time_s=0.3).p50_ms
fp32_acc = top1_accuracy(model, data.evaluation)
int8_acc = top1_accuracy(int8.module, data.evaluation, int8.backend)
print(f"top-1: fp32 {fp32_acc:.2f}%  int8 {int8_acc:.2f}%")
print(f"p50 at batch 64: fp32 {fp32_ms:.3f} ms, int8 {int8_ms:.3f} ms ({fp32_ms / int8_ms:.2f}x)")
