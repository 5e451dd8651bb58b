"""End to end: the quickstart through the CLI, and the Python API on a small recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchtame import run

from .conftest import load_results, run_cli, tiny_recipe


def test_quickstart_run_directory(quickstart_run) -> None:
    proc, run_dir = quickstart_run
    names = {p.name for p in run_dir.iterdir()}
    assert {"recipe.yaml", "results.json", "report.md", "report.html", "variants"} <= names
    res = load_results(run_dir)
    assert res["status"] == "complete" and res["finished"]
    ok = [v for v in res["variants"] if v["status"] == "ok"]
    measured = [v for v in ok if v["accuracy"] and v["latency"] and v["size"]["bytes"]]
    assert len(measured) >= 4
    for v in ok:
        for f in v["artifact"]:
            assert (run_dir / f).is_file()
    by = {v["name"]: v for v in res["variants"]}
    assert by["baseline"]["accuracy"]["top1"] >= 97.0
    assert by["int8-dynamic"]["size"]["bytes"] < by["baseline"]["size"]["bytes"]
    assert by["int8-static"]["size"]["bytes"] < 0.3 * by["baseline"]["size"]["bytes"]
    assert by["int8-static"]["accuracy"]["top1_drop"] <= 1.0
    assert "variant" in proc.stdout and "baseline" in proc.stdout and "int8-static" in proc.stdout
    assert "run directory:" in proc.stdout


def test_quickstart_prune_finetune_within_2_points_and_faster(quickstart_run) -> None:
    _, run_dir = quickstart_run
    by = {v["name"]: v for v in load_results(run_dir)["variants"]}
    ft = by["pruned-ft"]
    assert ft["accuracy"]["top1_drop"] <= 2.0
    assert ft["accuracy"]["top1"] > by["pruned"]["accuracy"]["top1"] - 0.5
    assert ft["size"]["macs"] <= 0.5 * by["baseline"]["size"]["macs"]
    base = {(m["device"], m["batch_size"]): m["p50_ms"] for m in by["baseline"]["latency"]}
    big = max(bs for _, bs in base)
    ft_lat = {(m["device"], m["batch_size"]): m["p50_ms"] for m in ft["latency"]}
    assert ft_lat[("cpu", big)] < base[("cpu", big)]
    assert "pruned-ft-int8" in by and by["pruned-ft-int8"]["status"] == "ok"


def test_quickstart_onnx_twins_are_verified(quickstart_run) -> None:
    _, run_dir = quickstart_run
    variants = load_results(run_dir)["variants"]
    by = {v["name"]: v for v in variants}
    float32 = [v["name"] for v in variants if v.get("kind") == "torch" and v.get("dtype") == "float32"]
    assert set(float32) == {"baseline", "pruned", "pruned-ft"}
    for name in (f"{n}-onnx" for n in float32):
        assert by[name]["status"] == "ok", by[name].get("error")
        parity = by[name]["info"]["parity"]
        assert parity["max_rel_error"] < 1e-4 and parity["cosine_similarity"] > 0.9999, (name, parity)
        assert by[name]["latency"][0]["runtime"] == "onnxruntime"
    assert by["onnx-int8"]["size"]["bytes"] < 0.3 * by["baseline-onnx"]["size"]["bytes"]


def test_api_returns_what_results_json_holds(tmp_path: Path) -> None:
    steps = [
        {"name": "int8", "pass": "quantize.static", "options": {"mode": "fx"}},
        {"name": "pruned", "pass": "prune.structured", "options": {"ratio": 0.25}},
    ]
    result = run(tiny_recipe(tmp_path, steps=steps))
    on_disk = json.loads((result.run_dir / "results.json").read_text())
    assert json.loads(json.dumps(result.results, default=str)) == on_disk
    assert result.status == "complete"
    assert result.variant("int8")["size"]["bytes"] < result.variant("baseline")["size"]["bytes"]
    assert set(result.variants) == {"baseline", "int8", "pruned"}


def test_trained_model_is_cached_and_reused(tmp_path: Path) -> None:
    first = run(tiny_recipe(tmp_path))
    second = run(tiny_recipe(tmp_path))
    assert first.results["model"]["training"]["cached"] is False
    assert second.results["model"]["training"]["cached"] is True
    assert first.variant("baseline")["accuracy"]["top1"] == second.variant("baseline")["accuracy"]["top1"]


def test_failed_step_is_recorded_and_others_go_on(tmp_path: Path) -> None:
    steps = [
        {"name": "bad", "pass": "quantize.dynamic", "options": {"exclude": ["no_such_layer"]}},
        {"name": "after-bad", "from": "bad", "pass": "quantize.static"},
        {"name": "good", "pass": "quantize.static"},
    ]
    result = run(tiny_recipe(tmp_path, steps=steps))
    assert result.status == "complete"
    assert result.variant("bad")["status"] == "failed"
    assert "no_such_layer" in result.variant("bad")["error"]
    assert "skipped" in result.variant("after-bad")["error"]
    assert result.variant("good")["status"] == "ok"
    md = (result.run_dir / "report.md").read_text()
    assert "## Failures" in md and "no_such_layer" in md


def test_cli_strict_exits_1_on_failed_variant(tmp_path: Path) -> None:
    import yaml

    recipe = tiny_recipe(
        tmp_path, steps=[{"name": "bad", "pass": "quantize.dynamic", "options": {"exclude": ["nope"]}}]
    )
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = run_cli(str(path), "--strict", "--quiet")
    assert proc.returncode == 1
    assert "1 variant(s) failed" in proc.stderr


@pytest.mark.parametrize(
    ("task", "fidelity"), [("auto", "cosine_similarity"), ("classification", "top1_agreement")]
)
def test_synthetic_data_reports_accuracy_as_not_measured(tmp_path: Path, task: str, fidelity: str) -> None:
    """Without labels accuracy is not measured; fidelity is: cosine by default (an unlabelled
    output may be an embedding), top-1 agreement when the recipe says the output is class scores."""
    recipe = tiny_recipe(
        tmp_path,
        data={"source": "synthetic", "shape": [1, 8, 8], "num_samples": 32, "batch_size": 16},
        steps=[{"name": "int8", "pass": "quantize.dynamic"}],
        evaluate={"task": task, "latency": {"batch_sizes": [1], "warmup": 1, "min_runs": 3, "min_time_s": 0}},
    )
    recipe["model"].pop("train")
    result = run(recipe)
    base, q = result.variant("baseline"), result.variant("int8")
    assert "top1" not in base["accuracy"] and "top1" not in q["accuracy"]
    assert result.results["settings"]["task"] == ("features" if task == "auto" else "classification")
    assert q["accuracy"][fidelity] >= (90 if fidelity == "top1_agreement" else 0.9)
    md = (result.run_dir / "report.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| variant"))
    assert "top-1 %" not in head  # a column of nothing measured is left out
    assert ("not measured" in md) == (task == "classification")  # said in the data line then


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["run", "--help"], ["compare", "--help"]])
def test_cli_help_and_version(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 0 and proc.stdout.strip()


def test_progress_display_renders_on_a_terminal(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from torchtame.cli import rich_progress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    steps = [{"name": "int8", "pass": "quantize.static"}]
    with rich_progress(console) as progress:
        result = run(tiny_recipe(tmp_path, steps=steps), progress=progress)
    assert result.status == "complete"
    text = buf.getvalue()
    assert "train model" in text or "latency" in text


def margin_metric(logits, labels, baseline_logits):
    """A user metric: mean top-1 softmax probability (confidence)."""
    return {"confidence": round(logits.softmax(1).max(1).values.mean().item() * 100, 3)}


def test_python_metric_callable(tmp_path: Path) -> None:
    recipe = tiny_recipe(
        tmp_path,
        evaluate={"metrics": ["top1", "tests.test_e2e:margin_metric"], "latency": {"enabled": False}},
    )
    result = run(recipe)
    acc = result.variant("baseline")["accuracy"]
    assert 10 < acc["confidence"] <= 100 and "top1" in acc
    assert result.variant("baseline")["latency"] == []
