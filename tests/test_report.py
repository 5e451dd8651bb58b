"""Reports from a stored results.json: Markdown, HTML with plots, compare, Pareto front."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest

from torchtame.report import pareto_front, rows_from_results, write_reports
from torchtame.report.compare import compare_runs, setting_differences
from torchtame.report.html import render_html
from torchtame.report.markdown import render_markdown

from .conftest import run_cli

STORED = Path(__file__).parent / "data" / "results.json"


@pytest.fixture()
def results() -> dict:
    return json.loads(STORED.read_text())


def test_pareto_front() -> None:
    pts = [("a", 1.0, 90.0), ("b", 2.0, 95.0), ("c", 3.0, 94.0), ("d", 0.5, 80.0), ("e", 2.0, 95.0)]
    assert sorted(pareto_front(pts)) == ["a", "b", "d", "e"]  # c: b is faster and more accurate
    assert pareto_front([("x", 1.0, 1.0)]) == ["x"]
    assert pareto_front([("x", 1.0, 1.0), ("y", 1.0, 2.0)]) == ["y"]


def test_rows_have_ratios(results: dict) -> None:
    rows = {r.name: r for r in rows_from_results(results)}
    assert rows["baseline"].size_ratio == 1.0
    assert rows["int8"].size_ratio < 0.5
    assert rows["baseline"].speedup[("cpu", 1)] == pytest.approx(1.0)
    assert rows["broken"].status == "failed"
    base_p50 = rows["baseline"].latency[("cpu", 16)]["p50_ms"]
    assert rows["pruned"].speedup[("cpu", 16)] == pytest.approx(
        base_p50 / rows["pruned"].latency[("cpu", 16)]["p50_ms"]
    )


def test_markdown_has_table_failures_and_environment(results: dict) -> None:
    md = render_markdown(results)
    assert "| `baseline` |" in md and "| `int8` |" in md
    assert "cpu b16 p50 ms" in md and "speed-up" in md
    assert "## Failures" in md and "nope" in md
    assert "## Not measured" in md and "cuda: CUDA is not available" in md
    assert "## Environment" in md and "quantized engines" in md


def test_html_embeds_three_plots_and_the_table(results: dict) -> None:
    page = render_html(results)
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,', page)
    assert images == ["Latency vs accuracy", "Size per variant", "Speed-up per device"]
    assert "<table>" in page and "broken" in page and "class='failed'" in page


def test_report_command_rebuilds(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(STORED, run_dir / "results.json")
    proc = run_cli("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "report.md").is_file() and (run_dir / "report.html").is_file()
    (run_dir / "recipe.yaml").write_text("name: tiny\n")
    assert run_cli("report", str(run_dir)).returncode == 0
    assert "## Recipe (as resolved)" in (run_dir / "report.md").read_text()
    assert "<h2>Recipe</h2>" in (run_dir / "report.html").read_text()


def test_write_reports_formats(tmp_path: Path, results: dict) -> None:
    assert [p.name for p in write_reports(tmp_path, results, ["md"])] == ["report.md"]
    md = (tmp_path / "report.md").read_text()
    rows = {r.name: r for r in rows_from_results(results)}
    p50 = rows["int8"].latency[("cpu", 16)]["p50_ms"]
    assert f"{p50:.3f}" in md and f"{rows['int8'].speedup[('cpu', 16)]:.2f}x" in md
    assert "failed (see Failures)" in md and "nope" not in md.split("## Failures")[0]  # not in a cell
    written = write_reports(tmp_path, results, ["md", "html", "json"])  # results.json is the store's
    assert sorted(p.name for p in written) == ["report.html", "report.md"]
    page = (tmp_path / "report.html").read_text()
    assert "<table>" in page and f"{p50:.3f}" in page


def test_speedups_with_intervals_are_shown(results: dict) -> None:
    stored = copy.deepcopy(results)
    for v in stored["variants"]:
        for m in v.get("latency", []):
            if v["name"] == "int8" and m["batch_size"] == 16:
                m.update(speedup=4.65, speedup_low=4.34, speedup_high=4.96, rounds=3)
    rows = {r.name: r for r in rows_from_results(stored)}
    assert rows["int8"].speedup_cell(("cpu", 16)) == "4.65x ±0.31"
    assert "4.65x ±0.31" in render_markdown(stored)


def _second_run(tmp_path: Path, results: dict) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "results.json").write_text(json.dumps(results))
    other = copy.deepcopy(results)
    other["run_dir"] = "runs/tiny-other"
    other["settings"]["threads"] = 1
    for v in other["variants"]:
        for m in v.get("latency", []):
            m["p50_ms"] *= 2
            m["threads"] = 1
    (b / "results.json").write_text(json.dumps(other))
    return a, b


@pytest.mark.parametrize("fmt", ["table", "md", "html", "json"])
def test_compare_two_runs(tmp_path: Path, results: dict, fmt: str) -> None:
    a, b = _second_run(tmp_path, results)
    text = compare_runs([a, b], fmt)
    assert "tiny-stored" in text and "tiny-other" in text
    assert "threads" in text  # the differing setting is called out
    if fmt == "json":
        data = json.loads(text)
        assert len(data["variants"]) == 2 * len(results["variants"])
        assert any("threads" in d for d in data["differences"])


def test_compare_cli(tmp_path: Path, results: dict) -> None:
    a, b = _second_run(tmp_path, results)
    out = tmp_path / "cmp.md"
    proc = run_cli("compare", str(a), str(b), "--format", "md", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| tiny-other | int8 |" in out.read_text()
    bad = run_cli("compare", str(tmp_path))
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_setting_differences_silent_for_identical(results: dict) -> None:
    assert setting_differences([results, copy.deepcopy(results)]) == []


@pytest.mark.skipif(
    __import__("torchtame.report.browser", fromlist=["x"]).find_chromium() is None,
    reason="needs Chromium (Debian: apt-get install chromium)",
)
def test_html_renders_with_its_images_in_chromium(tmp_path: Path, results: dict) -> None:
    from torchtame.report.browser import page_width, render

    wide = copy.deepcopy(results)  # many latency columns: the table must scroll, not the page
    for v in wide["variants"]:
        for m in list(v.get("latency", [])):
            for bs in (2, 4, 8, 32, 64, 128):
                v["latency"].append({**m, "batch_size": bs})
    write_reports(tmp_path, wide, ["html"])
    shot = tmp_path / "shot.png"
    rendered, total = render(tmp_path / "report.html", shot, width=1280)
    assert total == 3 and rendered == 3
    assert shot.is_file() and shot.stat().st_size > 10_000
    assert page_width() is not None and page_width() <= 1280


def test_recovery_section_and_plot(results: dict) -> None:
    stored = copy.deepcopy(results)
    q = next(v for v in stored["variants"] if v["name"] == "int8")
    q["info"]["recovery"] = {
        "mode": "auto",
        "chosen": ["bias_correction"],
        "cosine": 0.99,
        "trials": [
            {"algorithms": [], "cosine": 0.97},
            {"algorithms": ["bias_correction"], "cosine": 0.99},
        ],
        "applied": [{"algorithm": "bias_correction", "applied": 5}],
    }
    md = render_markdown(stored)
    assert "## Recovery" in md and "kept bias_correction" in md and "none: cosine 0.97000" in md
    page = render_html(stored)
    assert 'alt="Recovery: fidelity per algorithm"' in page
    assert "## Recovery" not in render_markdown(results)
