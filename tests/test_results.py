"""Typed results: a run written before the typed entries loads unchanged; typed views and the
deployment API read it; engines are chosen by name and the pipeline sees none of their insides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torchtame import RunError, load_recipe, load_variant, run
from torchtame.evaluate.health import HealthConfig
from torchtame.pipeline.engine import LocalEngine
from torchtame.registry import ENGINES, PASSES, register_engine
from torchtame.report import rows_from_results, write_reports
from torchtame.results import chosen_name, find_entry, latency_at, read_results, size_bytes, views

from .conftest import ROOT, tiny_recipe

OLD_RUN = ROOT / "tests" / "data" / "pre-typed-results.json"  # the quickstart run written before #23


@pytest.fixture()
def old_run(tmp_path: Path) -> Path:
    shutil.copy(OLD_RUN, tmp_path / "results.json")
    return tmp_path


def test_a_run_from_before_the_typed_entries_loads(old_run: Path) -> None:
    results = read_results(old_run)
    assert results["status"] == "complete"
    typed = views(results["variants"])
    assert list(typed) == [v["name"] for v in results["variants"]]
    base, q = typed["baseline"], typed["int8-static"]
    assert base.fidelity.top1 == pytest.approx(98.887) and q.fidelity.agreement == 100.0
    assert q.size.bytes == size_bytes(find_entry(results, "int8-static")) == 661983
    assert q.size.ratio == pytest.approx(661983 / base.size.bytes, rel=1e-3)
    timing = q.latency_at("cpu", 64)
    raw = latency_at(find_entry(results, "int8-static"), "cpu", 64)
    base_raw = latency_at(find_entry(results, "baseline"), "cpu", 64)
    assert timing.p50_ms == raw["p50_ms"] and timing.rounds == 3
    assert timing.speedup == pytest.approx(base_raw["p50_ms"] / raw["p50_ms"], rel=1e-3)
    assert q.latency_at("cpu").batch_size == 64  # the largest batch by default
    assert base.latency_at("cpu", 1).speedup == 1.0
    assert [f["code"] for f in q.findings("info")] == ["float_islands"]
    assert typed["fp16"].latency == ()  # measured nowhere (cuda only)
    assert chosen_name(results) is None
    # reports render from it as before
    rows = rows_from_results(results)
    assert [r.name for r in rows] == list(typed)
    write_reports(old_run, results, ["md", "json"])
    assert "int8-static" in (old_run / "report.md").read_text()
    assert json.loads((old_run / "results.json").read_text()) == json.loads(OLD_RUN.read_text())


def test_load_variant_refuses_with_the_fix(old_run: Path, tmp_path: Path) -> None:
    with pytest.raises(RunError, match="chose no variant") as exc:
        load_variant(old_run)
    assert "int8-static" in exc.value.hint
    with pytest.raises(RunError, match="'nope' is not in that run"):
        load_variant(old_run, "nope")
    with pytest.raises(RunError, match="no artefact to load"):
        load_variant(old_run, "int8-static")  # the artefacts were not committed
    with pytest.raises(RunError, match="not a torchtame run directory"):
        load_variant(tmp_path / "missing")


def test_the_recipe_health_section_is_the_health_model() -> None:
    recipe = load_recipe({**tiny_recipe(Path("/tmp")), "evaluate": {"health": {"warn_cosine": 0.98}}})
    assert type(recipe.evaluate.health) is HealthConfig
    assert recipe.evaluate.health.warn_cosine == 0.98


def test_passes_declare_their_traits() -> None:
    assert PASSES.has_trait("finetune", "same_architecture") and PASSES.has_trait("finetune", "trains")
    assert PASSES.has_trait("prune.structured", "trains")
    assert not PASSES.has_trait("quantize.static", "trains")
    assert PASSES.has_trait("export.onnx", "exports")
    entry = PASSES.get("quantize.static")
    assert "mode: pt2e" in entry.hint("slower", {"info": {"mode": "fx"}})
    assert "mode: fx" in entry.hint("slower", {"info": {"mode": "pt2e"}})
    half = PASSES.get("quantize.half")
    assert "use `dtype: bfloat16`" in half.hint("fidelity", {"dtype": "float16"})
    assert "use `dtype: bfloat16`" not in half.hint("fidelity", {"dtype": "bfloat16"})
    with pytest.raises(ValueError, match="unknown traits"):
        PASSES.register("x.bad", traits={"fast"})


class RecordingEngine(LocalEngine):
    """The local engine, counting what the pipeline asks of it."""

    calls: list[str] = []

    def measure_baseline(self, host, baseline):  # type: ignore[no-untyped-def]
        self.calls.append("baseline")
        assert not hasattr(host, "build_variants")  # a StepHost, not the Pipeline
        return super().measure_baseline(host, baseline)

    def run_steps(self, host, jobs):  # type: ignore[no-untyped-def]
        self.calls.append(f"steps:{','.join(j.name for j in jobs)}")
        return super().run_steps(host, jobs)

    def retime(self, host) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("retime")

    def describe(self) -> dict:
        return {"engine": "recording"}

    def close(self) -> None:
        self.calls.append("close")


def test_engines_are_chosen_by_name(tmp_path: Path) -> None:
    if "recording" not in ENGINES:
        register_engine("recording")(lambda config: RecordingEngine())
    RecordingEngine.calls.clear()
    steps = [{"name": "int8", "pass": "quantize.dynamic"}]
    result = run(tiny_recipe(tmp_path, steps=steps, execution={"engine": "recording"}))
    assert RecordingEngine.calls == ["baseline", "steps:int8", "retime", "close"]
    assert result.results["execution"] == {"engine": "recording"}
    assert result.variants["int8"].ok and result.chosen is None
    with pytest.raises(Exception, match=r"'nowhere' is not an execution engine; allowed: .*local"):
        load_recipe(tiny_recipe(tmp_path, execution={"engine": "nowhere"}))
