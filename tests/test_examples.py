"""Every example runs as written."""

from __future__ import annotations

import os
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
    assert proc.stdout.strip()
    if path.name == "huggingface_local.py":  # every variant built, bf16 faithful, integer inputs named
        assert "failed" not in proc.stdout
        assert "input_ids: int64[1, 16]" in proc.stdout
        bf16 = next(line for line in proc.stdout.splitlines() if line.startswith("bf16"))
        assert float(bf16.split()[2]) >= 0.999
