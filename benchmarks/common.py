"""What every benchmark here shares: the machine line, side-by-side timing, RESULTS.md sections.

Timing: every row of a comparison (the fp32 reference included) is timed in each of ``rounds``
rounds, in a new random order each round, with torchtame's harness; a row keeps the median of its
p50s. Machine drift then hits all rows alike instead of the ones timed last.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import random
import re
import statistics
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from torchtame.evaluate.latency import measure_latency
from torchtame.inputs import call

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {torch.get_num_threads()} torch threads, {gpu}; torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def interleaved_p50(
    fns: dict[str, Callable[[Any], Any]],
    x: Any,
    rounds: int = 3,
    min_time_s: float = 1.0,
    seed: int = 0,
    contexts: dict[str, Callable[[], AbstractContextManager[Any]]] | None = None,
) -> dict[str, float]:
    """Median over ``rounds`` of each callable's p50 (ms), rounds in a random order each time.

    ``contexts[name]()`` is entered around that callable's timing (a quantized engine, the
    attention fast-path switch), so every row runs under its own settings in the shared rounds.
    """
    rng = random.Random(seed)
    contexts = contexts or {}
    p50s: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        order = list(fns)
        rng.shuffle(order)
        for name in order:
            with contexts.get(name, contextlib.nullcontext)(), torch.inference_mode():
                stats = measure_latency(
                    lambda v, f=fns[name]: call(f, v), x, warmup=3, min_runs=10, min_time_s=min_time_s
                )
            p50s[name].append(stats.p50_ms)
    return {name: statistics.median(v) for name, v in p50s.items()}


def cosine(ref: torch.Tensor, out: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(ref.flatten(1).float(), out.flatten(1).float()).mean().item()


def agreement(ref: torch.Tensor, out: torch.Tensor) -> float:
    return 100.0 * (ref.argmax(-1) == out.argmax(-1)).float().mean().item()


def parser(doc: str | None, quick_help: str) -> argparse.ArgumentParser:
    """Every benchmark's arguments: ``--quick`` (tiny sizes, written to a scratch directory unless
    ``--results-dir`` says where) and ``--results-dir``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{quick_help}; writes to a scratch directory")
    ap.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help="where RESULTS.md and results/*.json go (default: benchmarks/, or a scratch dir with --quick)",
    )
    return ap


def out_dir(args: argparse.Namespace) -> Path:
    """benchmarks/ for a real run; a scratch directory (or ``--results-dir``) for ``--quick``."""
    if args.results_dir is not None:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        return Path(args.results_dir)
    return Path(tempfile.mkdtemp(prefix="torchtame-bench-")) if args.quick else HERE


def section_text(name: str, data: dict[str, Any], render: Callable[[dict[str, Any]], list[str]]) -> str:
    """A RESULTS.md section, rendered from its JSON alone (``meta`` and what ``render`` reads)."""
    meta = data["meta"]
    head = [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; took {meta['seconds']:.0f} s",
        f"- machine: {meta['machine']}",
        f"- raw figures: `benchmarks/results/{name}.json`",
        "",
    ]
    title = [f"<!-- {name}:start -->", f"## {meta['title']}", ""]
    return "\n".join([*title, *head, *render(data), f"<!-- {name}:end -->"])


def publish(
    out: Path,
    name: str,
    title: str,
    command: str,
    seconds: float,
    data: dict[str, Any],
    render: Callable[[dict[str, Any]], list[str]],
) -> str:
    """Write ``out/results/NAME.json`` (the figures and how they were made) and replace this
    benchmark's section of ``out/RESULTS.md`` with what ``render`` makes of that JSON."""
    meta = {
        "title": title,
        "command": command,
        "date": dt.date.today().isoformat(),
        "seconds": round(seconds, 1),
        "machine": machine(),
    }
    data = {"meta": meta, **data}
    (out / "results").mkdir(parents=True, exist_ok=True)
    text_json = json.dumps(data, indent=2, default=_plain) + "\n"
    (out / "results" / f"{name}.json").write_text(text_json, encoding="utf-8")
    section = section_text(name, json.loads(text_json), render)  # exactly what a re-render sees
    results = out / "RESULTS.md"
    text = results.read_text(encoding="utf-8") if results.is_file() else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- {name}:start -->.*?<!-- {name}:end -->", re.S)
    text = (
        pattern.sub(lambda _: section, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + section + "\n"
    )
    results.write_text(text, encoding="utf-8")
    print(f"wrote {results} (section {name}) and {out / 'results' / f'{name}.json'}")
    return section


def _plain(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")
