"""Export a model to ONNX, verify it against PyTorch in onnxruntime, then quantize it there.

.venv/bin/python examples/export_and_verify.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torchtame
from torchtame.data import DigitsData
from torchtame.training import train
from torchtame.zoo import digits_cnn

data = torchtame.load_data(DigitsData(source="digits", batch_size=64), seed=0)
model = digits_cnn()
train(model, data.train, epochs=4, lr=3e-3)

out = Path(tempfile.mkdtemp(prefix="torchtame-example-"))
fp32 = torchtame.apply_pass("export.onnx", model, data, {"opset": 18}, work_dir=out / "fp32")
parity = fp32.info["parity"]
print(
    f"{fp32.onnx_path}: exporter {fp32.info['exporter']}, max abs error {parity['max_abs_error']:.2e}, "
    f"top-1 agreement {parity['top1_agreement']:.3f} over {int(parity['samples'])} samples"
)

int8 = torchtame.apply_pass(
    "quantize.onnx", fp32, data, {"mode": "static", "format": "QDQ"}, work_dir=out / "int8"
)
ratio = int8.onnx_path.stat().st_size / fp32.onnx_path.stat().st_size
print(f"{int8.onnx_path}: {ratio:.2f}x the fp32 file size")
