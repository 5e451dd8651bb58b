"""Benchmark evidence that reproduces: every script's --quick mode runs here (so a crash cannot hide
until after a long run), and every committed RESULTS.md section is what its script renders from
its committed JSON."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# section name -> the script that writes it
SECTIONS = {
    "harness": "harness_stability",
    "quickstart": "quickstart",
    "int8_modes": "int8_modes",
    "peers": "peers",
    "unlabeled": "unlabeled",
    "ray_cluster": "ray_cluster",
    "compression": "compression",
    "recovery": "recovery",
    "transformer_int8": "transformer_int8",
    "auto_vs_search": "auto_vs_search",
    "recovery_cost": "recovery_cost",
}


def _module(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _sections(text: str) -> dict[str, str]:
    return {
        m.group(1): m.group(0) for m in re.finditer(r"<!-- (\w+):start -->.*?<!-- \1:end -->", text, re.S)
    }


def test_every_benchmark_script_has_a_quick_mode() -> None:
    scripts = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "common")
    assert scripts == sorted([*SECTIONS.values(), "gpu_check"])
    for name in scripts:
        assert "--quick" in (BENCH / f"{name}.py").read_text(encoding="utf-8"), name


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_committed_sections_render_from_their_json(section: str) -> None:
    """RESULTS.md holds exactly what the script renders from benchmarks/results/SECTION.json."""
    committed = _sections((BENCH / "RESULTS.md").read_text(encoding="utf-8"))
    data = json.loads((BENCH / "results" / f"{section}.json").read_text(encoding="utf-8"))
    common = _module("common")
    rendered = common.section_text(section, data, _module(SECTIONS[section]).render)
    assert committed[section] == rendered, f"re-run `{data['meta']['command']}` and commit what it writes"
    assert "--quick" not in data["meta"]["command"]  # evidence comes from full runs


QUICK = [*SECTIONS.values(), "gpu_check"]


@pytest.mark.slow
@pytest.mark.parametrize("script", QUICK)
def test_quick_mode_runs_and_writes_its_section(script: str, tmp_path: Path) -> None:
    args = [sys.executable, str(BENCH / f"{script}.py"), "--quick"]
    if script != "gpu_check":
        args += ["--results-dir", str(tmp_path)]
    env = dict(os.environ, PYTHONWARNINGS="ignore", RAY_AUTH_MODE="disabled")
    proc = subprocess.run(args, cwd=BENCH, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    if script == "gpu_check":
        assert "ok    auto resolved to" in proc.stdout and "FAIL" not in proc.stdout
        return
    section = next(k for k, v in SECTIONS.items() if v == script)
    written = _sections((tmp_path / "RESULTS.md").read_text(encoding="utf-8"))[section]
    data = json.loads((tmp_path / "results" / f"{section}.json").read_text(encoding="utf-8"))
    assert data["meta"]["command"] == f"python benchmarks/{script}.py --quick"
    assert written == _module("common").section_text(section, data, _module(script).render)
    if script in TIMED:  # every speed-up carries its rounds' spread
        assert re.search(r"\d\.\d\dx \[\d+\.\d\d, \d+\.\d\d\]", written), written[:3000]


# the scripts whose sections show speed-ups of interleaved rounds
TIMED = {"int8_modes", "transformer_int8", "peers", "recovery", "compression", "auto_vs_search", "unlabeled"}


def test_a_speed_up_spread_pairs_the_rounds() -> None:
    common = _module("common")
    per_round = {"fp32": [10.0, 20.0, 12.0], "int8": [5.0, 4.0, 4.0]}  # the machine slowed in round 2
    spread = common.ratio_ranges(per_round, ["fp32"])["fp32"]
    assert spread == {"fp32": [1.0, 1.0], "int8": [2.0, 5.0]}  # not 10/5 .. 20/4 unpaired
    assert common.with_spread(3.0, spread["int8"]) == "3.00x [2.00, 5.00]"
    assert common.with_spread(3.0, None) == "3.00x"
