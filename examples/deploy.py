"""Deploy the variant a run chose, in a new process, as a serving job would.

.venv/bin/python examples/deploy.py            # makes a small run first, then serves from it
.venv/bin/python examples/deploy.py RUN_DIR    # serves the chosen variant of an earlier run

The serving half uses only the run directory: ``torchtame.load_variant`` reads its results.json,
loads the chosen variant's artefact (a TorchScript int8 module, an exported program or an ONNX
file alike) and returns a callable. It then serves the run's evaluation split batch by batch
and checks that the outputs agree with the baseline as closely as the run recorded.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import torchtame

RECIPE = """
name: deploy-example
seed: 0
model: {source: python, target: torchtame.zoo:digits_cnn, kwargs: {width: 16, hidden: 64},
        train: {epochs: 4, lr: 0.003}}
data: {source: digits, batch_size: 64, split: {train: 0.6, calibration: 0.1, evaluation: 0.3}}
devices: [cpu]
steps:
  - {name: int8, pass: quantize.static, options: {mode: fx}}
  - {name: onnx-int8, pass: quantize.onnx}
constraints: {max_accuracy_drop: 1.0, batch_size: 32}
evaluate: {latency: {batch_sizes: [1, 32], min_time_s: 0.05}, memory: false}
report: {formats: [json]}
"""


def make_run(out: Path) -> Path:
    """A small run whose recipe has constraints, so that it chooses a variant."""
    recipe = torchtame.load_recipe(RECIPE, output_dir=str(out))
    return torchtame.run(recipe).run_dir


def serve(run_dir: Path) -> None:
    recipe = torchtame.load_recipe(run_dir / "recipe.yaml")
    data = torchtame.load_data(recipe.data, recipe.seed)
    with torchtame.load_variant(run_dir, "baseline") as baseline, torchtame.load_variant(run_dir) as chosen:
        served, reference = [], []
        for inputs, *_ in data.evaluation:  # the batches a client would send
            served.append(chosen.predict(inputs))
            reference.append(baseline.predict(inputs))
        out, ref = torch.cat(served), torch.cat(reference)
    agreement = (out.argmax(1) == ref.argmax(1)).float().mean().item() * 100
    recorded = chosen.result.fidelity.agreement
    timing = chosen.result.latency_at("cpu", 32)
    print(f"chosen variant: {chosen.name} ({chosen.result.dtype}, {chosen.result.kind})")
    print(
        f"served {len(out)} samples: top-1 agreement with the baseline {agreement:.3f}% "
        f"(the run recorded {recorded:.3f}%)"
    )
    if timing is not None and timing.speedup is not None:
        print(
            f"the run measured it at {timing.p50_ms:.3f} ms per batch of 32 "
            f"({timing.speedup:.2f}x the baseline)"
        )


if __name__ == "__main__":
    if len(sys.argv) > 1:
        serve(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = make_run(Path(tmp))
            # a new process: nothing of the run is in memory there, only its directory
            subprocess.run([sys.executable, __file__, str(run_dir)], check=True)
