"""Side-by-side timing rounds: every variant timed again, the baseline with them, in shuffled order.

A variant is first timed when it is built, minutes apart from the baseline on a long run; on a
machine whose speed drifts (shared hosts, thermal limits, VMs) a speed-up then mixes the variant
with the drift. With ``evaluate.latency.rounds: R`` (R > 1) the pipeline ends with R rounds per
device and batch size in which every measured variant is timed once, in a new random order each
round; each latency entry then takes its median round's figures and records every round's p50
(``round_p50_ms``) and the first, build-time reading (``first_p50_ms``).
"""

from __future__ import annotations

import contextlib
import random
import statistics
from typing import Any

from ..evaluate import make_runner
from ..inputs import batch_size
from ..progress import NullProgress, Progress
from ..variant import Variant
from .measure import Measurer, _copy, packs_per_shape

STATS = ("runs", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "min_ms", "stdev_ms", "throughput")


def retime(
    variants: dict[str, Variant],
    entries: list[dict[str, Any]],
    measurer: Measurer,
    rounds: int,
    seed: int = 0,
    progress: Progress | None = None,
) -> int:
    """Time every measured variant in ``rounds`` shuffled rounds per device and batch; update
    their latency entries in place. Returns how many figures were retimed."""
    progress = progress or NullProgress()
    lat = measurer.config.latency
    opts = (lat.threads, lat.inference_mode, lat.onnx_graph_optimization)
    by_name = {e["name"]: e for e in entries if e.get("status") == "ok" and e["name"] in variants}
    rng = random.Random(seed)
    done = 0
    for device in measurer.devices:
        for bs in lat.batch_sizes:
            # the entries measured here (same node) at this device and batch
            figures = {
                name: m
                for name, e in by_name.items()
                for m in e.get("latency") or []
                if m["device"] == device and m["batch_size"] == bs and m.get("node") in (None, measurer.node)
            }
            if len(figures) < 2:
                continue
            x = measurer.data.example_input(bs)
            samples: dict[str, list[dict[str, Any]]] = {name: [] for name in figures}
            with contextlib.ExitStack() as stack:
                timings = {}
                for name in figures:
                    v = variants[name]
                    fresh = _copy(v) if packs_per_shape(v) else v
                    run, _ = stack.enter_context(make_runner(fresh, device, *opts))
                    timing = run.timing
                    assert timing is not None
                    timings[name] = (timing, timing.prepare(x))
                    timing.fn(timings[name][1])  # compiles (compiled variants), packs, allocates
                for r in range(rounds):
                    order = list(figures)
                    rng.shuffle(order)
                    progress.status(f"timing round {r + 1}/{rounds} on {device}, batch {bs}")
                    for name in order:
                        timing, prepared = timings[name]
                        stats = measurer.timed(timing, prepared, device, variants[name].dtype, batch_size(x))
                        samples[name].append(stats.to_dict())
            for name, m in figures.items():
                _update(m, samples[name])
                done += 1
    return done


def _update(entry: dict[str, Any], rounds: list[dict[str, Any]]) -> None:
    """The entry takes its median round's statistics (p50 decides which round that is)."""
    p50s = [r["p50_ms"] for r in rounds]
    median = statistics.median_low(p50s)
    chosen = rounds[p50s.index(median)]
    entry["first_p50_ms"] = entry.get("first_p50_ms", entry["p50_ms"])
    entry.update({k: chosen[k] for k in STATS})
    entry["rounds"] = len(rounds)
    entry["round_p50_ms"] = [round(p, 5) for p in p50s]
