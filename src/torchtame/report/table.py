"""The comparison table printed at the end of a run (rich), compact enough for a terminal."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from ..errors import first_line
from .rows import Row, fmt_num, human_count, latency_keys, rows_from_results


def _rounds(rows: list[Row]) -> str:
    counts = sorted({m.get("rounds", 1) for r in rows for m in r.latency.values()})
    return "/".join(map(str, counts))


def comparison_table(results: dict[str, Any], title: str | None = None) -> Table:
    """Variant, dtype, accuracy and drop, size and ratio, MACs, then p50 (speed-up) per setting."""
    rows = rows_from_results(results)
    keys = latency_keys(rows)
    table = Table(title=title or f"torchtame: {results.get('recipe', '')} ({results.get('status')})")
    quality = (
        "top-1 %" if any(r.top1 is not None for r in rows) else rows[0].headline[0] if rows else "top-1 %"
    )
    for col in ("variant", "dtype", quality, "drop", "MB", "x size", "MACs"):
        table.add_column(col, justify="left" if col in ("variant", "dtype") else "right")
    for device, bs in keys:
        table.add_column(f"{device} b{bs}\np50 ms (x)", justify="right")
    mem_key = keys[-1] if keys and any(r.memory(keys[-1]) is not None for r in rows) else None
    if mem_key is not None:
        table.add_column(f"peak MiB\n{mem_key[0]} b{mem_key[1]}", justify="right")
    table.add_column("flags", justify="left")
    for r in rows:
        if r.status != "ok":
            table.add_row(  # the reason is a line under the table, not a metric cell
                f"[red]{r.name}[/red]", "[red]failed[/red]", *[""] * (6 + len(keys) + (mem_key is not None))
            )
            continue
        cells = [
            r.name,
            r.dtype,
            r.headline_cell(),
            fmt_num(r.top1_drop),
            fmt_num(r.size_mb, 3),
            fmt_num(r.size_ratio, 2),
            human_count(r.macs) + ("*" if r.macs_inherited and r.macs is not None else ""),
        ]
        for k in keys:
            m = r.latency.get(k)
            if m is None:
                skipped = next((x["reason"] for x in r.skipped if x["device"] == k[0]), "-")
                cells.append(skipped.split(" (")[0])
                continue
            s = r.speedup_cell(k)
            cells.append(f"{m['p50_ms']:.3f} ({s})" if s != "-" else f"{m['p50_ms']:.3f}")
        if mem_key is not None:
            cells.append(fmt_num(r.memory(mem_key), 1))
        flags = r.flags
        cells.append(
            f"[red]{flags}[/red]" if "✖" in flags else (f"[yellow]{flags}[/yellow]" if flags else "")
        )
        table.add_row(*cells)
    unavailable = [d for d in results.get("devices", []) if not d.get("available")]
    notes = [f"{d['requested']}: {d['reason']}" for d in unavailable]
    if any(r.macs_inherited for r in rows):
        notes.append("* MACs inherited from the float parent")
    if any(r.interval for r in rows):
        notes.append(
            f"(x ±h): speed-up vs baseline, ± half its 95% interval over {_rounds(rows)} paired rounds"
        )
    if any(r.flags for r in rows):
        notes.append(
            "flags: health findings (✖ error, ⚠ warning, ? unconfirmed: 1 round); details and next steps in "
            "report.md"
        )
    failed = [f"✖ {r.name} failed: {escape(first_line(r.error, 160))}" for r in rows if r.status != "ok"]
    if notes or failed:
        table.caption = "\n".join([*failed, "; ".join(notes)] if notes else failed)
    return table
