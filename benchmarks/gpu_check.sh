#!/usr/bin/env bash
# One prepared device check for a session lent a CUDA machine (the `device` tool's `run`).
# It installs torchtame into the machine's Python, runs the CUDA-marked tests, the quickstart and
# the ResNet-18 recipe on [cpu, cuda], and leaves logs and results.json files in $OUT.
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
for recipe in recipes/quickstart.yaml recipes/resnet18-static-int8.yaml; do
  name=$(basename "$recipe" .yaml)
  timeout 150 python3 -m torchtame "$recipe" --device cpu --device cuda -o "/tmp/gpu-runs" --quiet \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $?"
  cp "$(ls -d /tmp/gpu-runs/${name}-* | tail -1)/results.json" "$OUT/$name-results.json" 2>/dev/null
  tail -16 "$OUT/$name.log"
done
