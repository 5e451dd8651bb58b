"""Reports of a run: the terminal table, Markdown, and an HTML page with plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import TorchtameError
from .rows import Row, pareto_front, rows_from_results


def write_reports(run_dir: Path, results: dict[str, Any], formats: list[str]) -> list[Path]:
    """Write ``report.md`` / ``report.html`` beside ``results.json`` (which is always written)."""
    written = []
    recipe = run_dir / "recipe.yaml"
    recipe_yaml = recipe.read_text(encoding="utf-8") if recipe.is_file() else None
    if "md" in formats:
        from .markdown import render_markdown

        path = run_dir / "report.md"
        path.write_text(render_markdown(results, recipe_yaml), encoding="utf-8")
        written.append(path)
    if "html" in formats:
        from .html import render_html

        path = run_dir / "report.html"
        path.write_text(render_html(results, recipe_yaml), encoding="utf-8")
        written.append(path)
    return written


def load_results(run_dir: str | Path) -> dict[str, Any]:
    """Read a run directory's ``results.json`` (or a results.json path)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise TorchtameError(
            f"{str(path)!r} does not exist", hint="pass a run directory written by `optimize RECIPE`"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TorchtameError(f"{str(path)!r} is not valid JSON: {exc}") from exc


__all__ = ["Row", "load_results", "pareto_front", "rows_from_results", "write_reports"]
