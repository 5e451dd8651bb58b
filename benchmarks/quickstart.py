"""The README's quickstart table, from a real run, and how much it moves between runs.

    .venv/bin/python benchmarks/quickstart.py [--runs 3]

Runs the embedded default recipe (recipes/quickstart.yaml) ``--runs`` times in one process into a
scratch directory (the first run trains the digits CNN, later runs reuse the cached model, as a
user's second `optimize` would), commits the first run's results.json as
benchmarks/results/quickstart.json, and writes its section of benchmarks/RESULTS.md: the terminal
table of the first run (the block the README shows) and, per variant, the speed-ups of every run,
so the run-to-run spread of each figure is on the page next to it.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common import HERE, write_section
from rich.console import Console

import torchtame
from torchtame.report.rows import rows_from_results
from torchtame.report.table import comparison_table

ROOT = HERE.parent


def table_text(results: dict[str, Any]) -> str:
    """The comparison table exactly as `optimize` prints it (no colour, fixed width)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, color_system=None, force_terminal=False)
    console.print(comparison_table(results))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def speedups(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each variant's speed-up over the baseline per (device, batch), as the table computes it."""
    out: dict[str, dict[str, float]] = {}
    for row in rows_from_results(results):
        out[row.name] = {f"{dev} b{bs}": round(s, 3) for (dev, bs), s in row.speedup.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="torchtame-quickstart-"))
    runs = []
    for i in range(args.runs):
        recipe = torchtame.load_recipe(ROOT / "recipes" / "quickstart.yaml")
        recipe.output_dir = scratch
        started = time.perf_counter()
        result = torchtame.run(recipe)
        seconds = time.perf_counter() - started
        runs.append((result.results, seconds))
        print(f"run {i + 1}: {seconds:.1f} s -> {result.run_dir}", flush=True)
    first = runs[0][0]
    per_run = [speedups(r) for r, _ in runs]
    keys = sorted({k for s in per_run for v in s.values() for k in v})
    body = [
        f"- {args.runs} runs of `optimize` on the embedded default recipe (`recipes/quickstart.yaml`) "
        f"in one process; run times {', '.join(f'{s:.0f} s' for _, s in runs)} (the first trains the "
        "model, the others reuse it from the cache)",
        "- the table is run 1's, as `optimize` prints it; its results.json is "
        "`benchmarks/results/quickstart-results.json`",
        "",
        "```",
        table_text(first),
        "```",
        "",
        "Speed-up over the baseline in each run (same device, batch and thread count), and ± half "
        "the spread (max - min) / median across runs:",
        "",
        "| variant | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    spreads = []
    for name in per_run[0]:
        cells = []
        for k in keys:
            values = [s.get(name, {}).get(k) for s in per_run]
            values = [v for v in values if v is not None]
            if not values:
                cells.append("-")
                continue
            spread = (max(values) - min(values)) / statistics.median(values)
            if name != "baseline":
                spreads.append(spread)
            cells.append(" / ".join(f"{v:.2f}x" for v in values) + f" (±{spread / 2:.0%})")
        body.append(f"| {name} | " + " | ".join(cells) + " |")
    if spreads:
        body += [
            "",
            f"Median run-to-run spread of a speed-up: {statistics.median(spreads):.1%}; "
            f"largest: {max(spreads):.1%}.",
        ]
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    data = {
        "runs": [{"seconds": round(s, 1), "speedups": sp} for (_, s), sp in zip(runs, per_run, strict=True)]
    }
    write_section(
        "quickstart",
        "The quickstart (README table)",
        f"python benchmarks/quickstart.py --runs {args.runs}",
        time.perf_counter() - t0,
        body,
        data,
    )
    (results_dir / "quickstart-results.json").write_text(json.dumps(first, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(scratch, ignore_errors=True)
    print(table_text(first))


if __name__ == "__main__":
    main()
