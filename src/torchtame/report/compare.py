"""`optimize compare`: several saved runs side by side, with a warning where settings differ."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from . import load_results
from .rows import Row, fmt_num, latency_keys, rows_from_results


def _label(results: dict[str, Any], path: Path) -> str:
    return Path(results.get("run_dir") or path).name


def setting_differences(runs: list[dict[str, Any]]) -> list[str]:
    """Settings that differ between runs, so numbers are not compared silently across them."""
    notes = []
    checks = {
        "threads": lambda r: r.get("settings", {}).get("threads"),
        "latency settings": lambda r: json.dumps(r.get("settings", {}).get("latency"), sort_keys=True),
        "machine": lambda r: (
            r.get("environment", {}).get("cpu", {}).get("processor"),
            r.get("environment", {}).get("platform"),
        ),
        "torch": lambda r: r.get("environment", {}).get("torch"),
        "data": lambda r: (r.get("data") or {}).get("description"),
    }
    for what, fn in checks.items():
        if len({str(fn(r)) for r in runs}) > 1:
            notes.append(f"runs differ in {what}: " + "; ".join(str(fn(r)) for r in runs))
    return notes


def compare_runs(paths: list[Path], fmt: str = "table", console: Console | None = None) -> str:
    """Several runs side by side, as ``table`` (printed to ``console`` where given), ``json``,
    ``md`` or ``html``; differences in their settings are noted."""
    runs = [load_results(p) for p in paths]
    labels = [_label(r, p) for r, p in zip(runs, paths, strict=True)]
    all_rows = [(label, row) for label, r in zip(labels, runs, strict=True) for row in rows_from_results(r)]
    notes = setting_differences(runs)
    if fmt == "json":
        return _json(labels, notes, all_rows)
    head, body = _cells(all_rows)
    if fmt == "table":
        return _table(head, body, notes, len(runs), console)
    if fmt == "md":
        return _markdown(head, body, notes, labels)
    return _html(head, body, notes)


def _json(labels: list[str], notes: list[str], all_rows: list[tuple[str, Row]]) -> str:
    data = {
        "runs": labels,
        "differences": notes,
        "variants": [
            {
                "run": label,
                "name": row.name,
                "status": row.status,
                "top1": row.top1,
                "top1_drop": row.top1_drop,
                "agreement": row.agreement,
                "cosine": row.cosine,
                "headline": dict(zip(("metric", "value"), row.headline, strict=True)),
                "health": row.health,
                "size_bytes": row.size_bytes,
                "size_ratio": row.size_ratio,
                "params": row.params,
                "macs": row.macs,
                "latency": [
                    {
                        "device": k[0],
                        "batch_size": k[1],
                        "p50_ms": m["p50_ms"],
                        "p90_ms": m["p90_ms"],
                        "speedup": row.speedup.get(k),
                        "speedup_low": (row.interval.get(k) or (None, None))[0],
                        "speedup_high": (row.interval.get(k) or (None, None))[1],
                        "peak_memory_mb": m.get("peak_memory_mb"),
                    }
                    for k, m in row.latency.items()
                ],
            }
            for label, row in all_rows
        ],
    }
    return json.dumps(data, indent=2)


def _cells(all_rows: list[tuple[str, Row]]) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of every row (the table, Markdown and HTML share them)."""
    keys = latency_keys([row for _, row in all_rows])
    head = ["run", "variant", "status", *Row.SUMMARY_HEAD]
    # a memory column only where some run measured memory at that setting
    with_memory = {k for k in keys if any(row.memory(k) is not None for _, row in all_rows)}
    for k in keys:
        head += [f"{k[0]} b{k[1]} p50 ms", "speed-up", *(["peak MiB"] if k in with_memory else [])]
    head.append("flags")
    body = []
    for label, row in all_rows:
        cells = [label, row.name, row.status, *row.summary_cells()]
        for k in keys:
            m = row.latency.get(k)
            cells += [fmt_num(m["p50_ms"], 3) if m else "-", row.speedup_cell(k)]
            if k in with_memory:
                cells.append(fmt_num(row.memory(k), 1))
        body.append([*cells, row.flags or "-"])
    return head, body


def _table(
    head: list[str], body: list[list[str]], notes: list[str], runs: int, console: Console | None
) -> str:
    table = Table(title=f"torchtame compare: {runs} runs")
    for h in head:
        left = h in ("run", "variant", "status")
        table.add_column(h, justify="left" if left else "right", no_wrap=left, min_width=6 if left else None)
    for cells in body:
        table.add_row(*cells)
    if notes:
        table.caption = "\n".join(notes)
    if console is not None:
        console.print(table)
        return ""
    from io import StringIO

    buf = Console(file=StringIO(), width=200)
    buf.print(table)
    return buf.file.getvalue()  # type: ignore[attr-defined]


def _markdown(head: list[str], body: list[list[str]], notes: list[str], labels: list[str]) -> str:
    lines = [f"# torchtame compare: {', '.join(labels)}", ""]
    lines += [f"> {n}" for n in notes] + ([""] if notes else [])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    lines += ["| " + " | ".join(c) + " |" for c in body]
    return "\n".join(lines) + "\n"


def _html(head: list[str], body: list[list[str]], notes: list[str]) -> str:
    rows_html = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in body
    )
    notes_html = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in notes)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>torchtame compare</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:2rem}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px}.note{color:#a60}</style></head><body>"
        f"<h1>torchtame compare</h1>{notes_html}<table><thead><tr>"
        + "".join(f"<th>{html.escape(h)}</th>" for h in head)
        + f"</tr></thead><tbody>{rows_html}</tbody></table></body></html>"
    )
