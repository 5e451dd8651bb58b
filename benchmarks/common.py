"""What every benchmark here shares: the machine line, side-by-side timing, RESULTS.md sections.

Timing: every row of a comparison (the fp32 reference included) is timed in each of ``rounds``
rounds, in a new random order each round, with torchtame's harness; a row keeps the median of its
p50s. Machine drift then hits all rows alike instead of the ones timed last.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import platform
import random
import re
import statistics
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


def write_section(
    name: str, title: str, command: str, seconds: float, body: list[str], data: dict[str, Any]
) -> None:
    """Replace this benchmark's section of RESULTS.md and write its raw figures as JSON."""
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    head = [
        f"- command: `{command}`",
        f"- date: {dt.date.today().isoformat()}; took {seconds:.0f} s",
        f"- machine: {machine()}",
        f"- raw figures: `benchmarks/results/{name}.json`",
        "",
    ]
    section = "\n".join([f"<!-- {name}:start -->", f"## {title}", "", *head, *body, f"<!-- {name}:end -->"])
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.is_file() else "# Benchmark results\n"
    pattern = re.compile(rf"<!-- {name}:start -->.*?<!-- {name}:end -->", re.S)
    text = (
        pattern.sub(lambda _: section, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + section + "\n"
    )
    RESULTS.write_text(text, encoding="utf-8")
