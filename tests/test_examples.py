"""Every example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(path: Path, tmp_path: Path) -> None:
    args = [sys.executable, str(path)]
    if path.name == "run_recipe.py":
        import yaml

        recipe = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
        recipe["output_dir"] = str(tmp_path)
        recipe["export"] = {"onnx": False}
        recipe["steps"] = recipe["steps"][:2]
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
        args.append(str(tmp_path / "r.yaml"))
    proc = subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    CHECKS[path.name](out)


def _export_and_verify(out: str) -> None:
    fp32, int8 = out.strip().splitlines()[-2:]
    assert "max abs error" in fp32
    error = float(re.search(r"max abs error ([\d.e+-]+)", fp32).group(1))
    agreement = float(re.search(r"top-1 agreement ([\d.]+)", fp32).group(1))
    assert error < 1e-3 and agreement >= 0.99, fp32
    ratio = float(re.search(r"([\d.]+)x the fp32 file size", int8).group(1))
    assert ratio < 0.35, int8  # int8 weights: about a quarter of the float file


def _prune_and_finetune(out: str) -> None:
    rows = {line.split()[0]: line for line in out.splitlines() if "MACs" in line}
    top1 = {k: float(re.search(r"top-1\s+([\d.]+)%", v).group(1)) for k, v in rows.items()}
    macs = {k: float(re.search(r"MACs\s+([\d.]+)M", v).group(1)) for k, v in rows.items()}
    assert macs["pruned"] < 0.5 * macs["baseline"] and macs["pruned+ft"] == macs["pruned"], macs
    assert top1["baseline"] > 90 and top1["pruned"] > top1["no-refit"] and top1["pruned+ft"] > 90, top1
    # keep_best chooses by the calibration split's loss: at most a few of the 539 evaluation
    # samples may go the other way
    assert top1["pruned+ft"] >= top1["pruned"] - 1.0, top1
    assert re.search(r"kept epoch \d", out), out


def _quantize_one_model(out: str) -> None:
    acc = re.search(r"top-1: fp32 ([\d.]+)%\s+int8 ([\d.]+)%", out)
    assert acc and float(acc.group(1)) > 90 and float(acc.group(1)) - float(acc.group(2)) <= 2.0, out
    ms = re.search(r"fp32 ([\d.]+) ms, int8 ([\d.]+) ms \(([\d.]+)x\)", out)
    assert ms and float(ms.group(1)) > 0 and float(ms.group(2)) > 0, out
    assert abs(float(ms.group(1)) / float(ms.group(2)) - float(ms.group(3))) < 0.01


def _run_recipe(out: str) -> None:
    line = next(line for line in out.splitlines() if line.startswith("fastest variant"))
    name = re.search(r"baseline: (\S+) \(", line).group(1)
    directory = Path(line.split("-> ")[1].strip())
    assert directory.name == name and directory.is_dir() and any(directory.iterdir()), line
    assert re.search(r"\(([\d.]+) ms at batch \d+, ([\d.]+) MB\)", line), line


def _huggingface_local(out: str) -> None:  # every variant built, bf16 faithful, integer inputs named
    """Every variant built, bf16 faithful, integer inputs named."""
    assert "failed" not in out
    assert "input_ids: int64[1, 16]" in out
    bf16 = next(line for line in out.splitlines() if line.startswith("bf16"))
    assert float(bf16.split()[2]) >= 0.999  # printed from its own measurement: no default stands in
    for line in out.splitlines():
        if "peak b8" in line:  # every variant's memory at batch 8 was measured
            assert float(re.search(r"peak b8\s+([\d.]+) MiB", line).group(1)) > 0, line


def _deploy(out: str) -> None:
    """The chosen variant, served from its run directory in a new process, gives the outputs the
    run measured: the same top-1 agreement with the baseline."""
    served = re.search(
        r"served (\d+) samples: top-1 agreement with the baseline ([\d.]+)% "
        r"\(the run recorded ([\d.]+)%\)",
        out,
    )
    assert served, out
    assert int(served.group(1)) > 500
    assert abs(float(served.group(2)) - float(served.group(3))) < 0.01, served.group(0)
    assert float(served.group(2)) >= 95.0, served.group(0)
    assert re.search(r"chosen variant: \S+ \((int8|onnx-static-int8), (torch|onnx)\)", out), out
    assert re.search(r"at [\d.]+ ms per batch of 32 \([\d.]+x the baseline\)", out), out


CHECKS = {
    "deploy.py": _deploy,
    "export_and_verify.py": _export_and_verify,
    "prune_and_finetune.py": _prune_and_finetune,
    "quantize_one_model.py": _quantize_one_model,
    "run_recipe.py": _run_recipe,
    "huggingface_local.py": _huggingface_local,
}


def test_every_example_has_its_figures_checked() -> None:
    assert sorted(CHECKS) == [p.name for p in EXAMPLES]
