#!/usr/bin/env bash
# One prepared device check for a session lent a CUDA machine (the `device` tool's `run`).
# It installs torchtame into the machine's Python, runs the CUDA-marked tests, then the quickstart
# exactly as a user would (default `devices: [auto]`) and the ResNet-18 recipe on [cpu, cuda],
# checks what the quickstart measured where (benchmarks/gpu_check.py), and leaves logs,
# results.json files and check.json in $OUT.
#   run: bash benchmarks/gpu_check.sh      (timeout_s ~ 540; OUT is set by the device tool)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q -e ".[dev]" > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
python3 -m torchtame env --json > "$OUT/env.json"
python3 - <<'PY'
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
PY
timeout 200 python3 -m pytest -q -m cuda tests 2>&1 | tee "$OUT/cuda-tests.log" | tail -5
# the quickstart as the README runs it: auto must mean the CPU and the GPU
timeout 150 python3 -m torchtame recipes/quickstart.yaml -o /tmp/gpu-runs --quiet > "$OUT/quickstart.log" 2>&1
echo "quickstart: exit $?"
cp "$(ls -d /tmp/gpu-runs/quickstart-* | tail -1)/results.json" "$OUT/quickstart-results.json" 2>/dev/null
tail -16 "$OUT/quickstart.log"
timeout 150 python3 -m torchtame recipes/resnet18-static-int8.yaml --device cpu --device cuda -o /tmp/gpu-runs \
  --quiet > "$OUT/resnet18.log" 2>&1
echo "resnet18-static-int8: exit $?"
cp "$(ls -d /tmp/gpu-runs/resnet18-static-int8-* | tail -1)/results.json" "$OUT/resnet18-results.json" 2>/dev/null
tail -16 "$OUT/resnet18.log"
python3 benchmarks/gpu_check.py "$OUT/quickstart-results.json" | tee "$OUT/check.txt"
