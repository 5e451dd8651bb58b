"""Peak inference memory: measured per variant, device and batch, and used as a constraint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchtame import run

from .conftest import tiny_recipe

pytestmark = pytest.mark.serial  # timings / memory peaks: nothing else may run beside them

FAST = {"batch_sizes": [1, 32], "warmup": 1, "min_runs": 3, "min_time_s": 0}


class Wide(nn.Module):
    """Activations dominate: 64 channels at 64x64 (1 MiB per sample and layer), few weights."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1))
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x).mean((2, 3)))


class Heavy(nn.Module):
    """Weights dominate: three 2048-wide Linear layers, 48 MiB in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU()
        )
        self.head = nn.Linear(2048, 10)

    def forward(self, x):
        return self.head(self.net(x.flatten(1)))


def wide() -> nn.Module:
    torch.manual_seed(0)
    return Wide()


def heavy() -> nn.Module:
    torch.manual_seed(0)
    return Heavy()


def _memory(entry: dict, batch: int) -> float:
    return next(m["peak_memory_mb"] for m in entry["latency"] if m["batch_size"] == batch)


def test_memory_grows_with_batch_when_activations_dominate(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        model={"source": "python", "target": "tests.test_memory:wide"},
        data={"source": "synthetic", "shape": [3, 64, 64], "num_samples": 32, "batch_size": 16},
        evaluate={"latency": FAST, "memory_repeats": 3},
    )
    base = run(recipe).variant("baseline")
    b1, b32 = _memory(base, 1), _memory(base, 32)
    # 31 more samples x (3 + 64 + 64) channels x 64 x 64 floats: at least 30 MiB more, more like 60
    assert b32 > b1 + 30, (b1, b32)
    reading = next(m for m in base["latency"] if m["batch_size"] == 32)
    assert len(reading["memory_samples_mb"]) == 3 and reading["memory_ratio"] == 1.0


def test_int8_of_a_linear_heavy_model_needs_less_memory(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        model={"source": "python", "target": "tests.test_memory:heavy"},
        data={"source": "synthetic", "shape": [1, 8, 8], "num_samples": 32, "batch_size": 16},
        steps=[
            {"name": "int8", "pass": "quantize.dynamic"},
            {"name": "int8-pt2e", "pass": "quantize.static", "options": {"mode": "pt2e"}},
        ],
        evaluate={"latency": {**FAST, "batch_sizes": [8]}},
        constraints={"max_memory_mb": 1000, "batch_size": 8},
    )
    result = run(recipe)
    fp32, int8 = _memory(result.variant("baseline"), 8), _memory(result.variant("int8"), 8)
    # a compiled variant's figure is steady-state inference; the compile's own peak is apart
    compiled = result.variant("int8-pt2e")["latency"][0]
    assert compiled["memory_method"].startswith("steady state after compile")
    assert compiled["compile_peak_memory_mb"] > compiled["peak_memory_mb"]
    # steady state: int8 needs less than fp32 (the compile's peak, ~2.5x that, is not inference)
    assert compiled["peak_memory_mb"] < fp32 < compiled["compile_peak_memory_mb"], (fp32, compiled)
    # 48 MiB of float32 weights become 12 MiB of int8; the int8 runtime adds ~15 MiB of its own
    assert int8 < 0.7 * fp32, (fp32, int8)
    assert next(m for m in result.variant("int8")["latency"])["memory_ratio"] < 0.75
    # a memory constraint between the two selects the int8 variant
    from torchtame.recipe import Constraints
    from torchtame.search.selection import select

    limit = (fp32 + int8) / 2
    sel = select(result.results, Constraints(max_memory_mb=limit, batch_size=8), "cpu", 8)
    assert sel["chosen"] in ("int8", "int8-pt2e")
    rejected = next(c for c in sel["candidates"] if c["name"] == "baseline")
    assert "peak memory" in rejected["reasons"][0]
    md = (result.run_dir / "report.md").read_text()
    assert "peak MiB" in md


def test_memory_can_be_turned_off(tmp_path: Path) -> None:
    recipe = tiny_recipe(tmp_path, evaluate={"memory": False, "latency": {**FAST, "batch_sizes": [1]}})
    base = run(recipe).variant("baseline")
    assert "peak_memory_mb" not in base["latency"][0]


def test_a_variant_larger_than_the_device_is_a_finding() -> None:
    from torchtame.evaluate.health import check

    entry = {
        "name": "big",
        "status": "ok",
        "latency": [{"device": "cpu", "batch_size": 64, "threads": 2, "p50_ms": 1.0, "peak_memory_mb": 3000}],
    }
    findings = check(entry, None, capacity={"cpu": 2048})
    assert [f["code"] for f in findings] == ["exceeds_device_memory"] and findings[0]["level"] == "error"
    assert check(entry, None, capacity={"cpu": 8192}) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_memory_grows_with_batch(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        model={"source": "python", "target": "tests.test_memory:wide"},
        data={"source": "synthetic", "shape": [3, 64, 64], "num_samples": 32, "batch_size": 16},
        devices=["cuda"],
        evaluate={"latency": FAST},
    )
    base = run(recipe).variant("baseline")
    assert _memory(base, 32) > _memory(base, 1) + 30
    assert all(m["reserved_memory_mb"] >= m["peak_memory_mb"] for m in base["latency"])
