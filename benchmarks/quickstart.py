"""The README's quickstart table, from a real run, and how much it moves between runs.

    .venv/bin/python benchmarks/quickstart.py [--runs 3] [--quick]

Runs the embedded default recipe (recipes/quickstart.yaml) ``--runs`` times in one process into a
scratch directory (the first run trains the digits CNN, later runs reuse the cached model, as a
user's second `optimize` would), commits the first run's results.json as
benchmarks/results/quickstart-results.json, and writes its section of benchmarks/RESULTS.md: the
terminal table of the first run (the block the README shows); per variant, the speed-ups of every
run with their 95% intervals (paired rounds within a run); and whether any health finding changed
between runs, with the interval that explains it.
"""

from __future__ import annotations

import io
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from common import HERE, out_dir, parser, publish, shortened
from rich.console import Console

import torchtame
from torchtame.report.rows import rows_from_results
from torchtame.report.table import comparison_table

ROOT = HERE.parent


def table_text(results: dict[str, Any]) -> str:
    """The comparison table exactly as `optimize` prints it (no colour, fixed width)."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=170, color_system=None, force_terminal=False)
    console.print(comparison_table(results))
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def figures(results: dict[str, Any]) -> dict[str, Any]:
    """Each variant's speed-ups (with intervals) per setting and its health findings."""
    speed, health = {}, {}
    for row in rows_from_results(results):
        speed[row.name] = {
            f"{dev} b{bs}": [round(s, 3), *[round(b, 3) for b in row.interval.get((dev, bs), ())]]
            for (dev, bs), s in row.speedup.items()
        }
        health[row.name] = sorted(f"{f['code']}:{f['level']}" for f in row.health if f["level"] != "info")
    return {"speedups": speed, "health": health}


def render(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    keys = sorted({k for r in runs for v in r["speedups"].values() for k in v})
    times = ", ".join(f"{r['seconds']:.0f} s" for r in runs)
    lines = [
        f"- {len(runs)} runs of `optimize` on the embedded default recipe in one process "
        f"({data['recipe']}); run times {times} (the first trains the model, the others reuse it from "
        "the cache)",
        "- the table is run 1's, as `optimize` prints it; its results.json is "
        f"`benchmarks/results/{data['results_file']}`",
        "",
        "```",
        table_text(data["first_results"]),
        "```",
        "",
        "Speed-up over the baseline in each run, with its 95% interval over the run's paired rounds "
        "in brackets, and ± half the spread (max - min) / median of the runs' speed-ups:",
        "",
        "| variant | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    spreads = []
    for name in runs[0]["speedups"]:
        cells = []
        for k in keys:
            values = [r["speedups"].get(name, {}).get(k) for r in runs]
            values = [v for v in values if v is not None]
            if not values:
                cells.append("-")
                continue
            points = [v[0] for v in values]
            spread = (max(points) - min(points)) / statistics.median(points)
            if name != "baseline":
                spreads.append(spread)
            shown = [f"{v[0]:.2f}x" + (f" [{v[1]:.2f}-{v[2]:.2f}]" if len(v) == 3 else "") for v in values]
            cells.append(" / ".join(shown) + f" (±{spread / 2:.0%})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if spreads:
        lines += [
            "",
            f"Median run-to-run spread of a speed-up: {statistics.median(spreads):.1%}; "
            f"largest: {max(spreads):.1%}.",
        ]
    changed = {
        name: [r["health"].get(name, []) for r in runs]
        for name in runs[0]["health"]
        if len({tuple(r["health"].get(name, [])) for r in runs}) > 1
    }
    lines.append("")
    if len(runs) < 2:
        lines.append("Health findings (warnings and errors): one run, nothing to compare.")
    elif not changed:
        lines.append(f"Health findings (warnings and errors) were the same in all {len(runs)} runs.")
    else:
        lines.append("Health findings that changed between runs (warnings and errors per run):")
        for name, hs in changed.items():
            lines.append(f"- {name}: " + " / ".join(", ".join(h) or "none" for h in hs))
    return lines


def quick_recipe(recipe: Any) -> Any:
    """Tiny sizes: two steps, a short training, short timings, no memory readings, no ONNX twins."""
    raw = recipe.model_dump(mode="json", by_alias=True)
    raw["steps"] = raw["steps"][:2]
    return torchtame.load_recipe(shortened(raw, rounds=2))


def main() -> None:
    ap = parser(__doc__, "one run of a two-step, short-timed quickstart")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if args.quick:
        args.runs = 1
    out = out_dir(args)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="torchtame-quickstart-"))
    runs, first = [], None
    for i in range(args.runs):
        recipe = torchtame.load_recipe(ROOT / "recipes" / "quickstart.yaml")
        recipe = quick_recipe(recipe) if args.quick else recipe
        recipe.output_dir = scratch
        started = time.perf_counter()
        result = torchtame.run(recipe)
        seconds = time.perf_counter() - started
        first = first or result.results
        runs.append({"seconds": round(seconds, 1), **figures(result.results)})
        print(f"run {i + 1}: {seconds:.1f} s -> {result.run_dir}", flush=True)
    assert first is not None
    data = {
        "recipe": "`recipes/quickstart.yaml`" + (", cut to two steps (--quick)" if args.quick else ""),
        "results_file": "quickstart-results.json",
        "runs": runs,
        "first_results": first,
    }
    command = "python benchmarks/quickstart.py " + ("--quick" if args.quick else f"--runs {args.runs}")
    title = "The quickstart (README table)"
    publish(out, "quickstart", title, command, time.perf_counter() - t0, data, render)
    text = json.dumps(first, indent=2) + "\n"
    (out / "results" / "quickstart-results.json").write_text(text, encoding="utf-8")
    shutil.rmtree(scratch, ignore_errors=True)
    print(table_text(first))


if __name__ == "__main__":
    main()
