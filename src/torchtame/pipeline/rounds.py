"""Side-by-side timing rounds: every variant timed again, the baseline with them, in shuffled order.

A variant is first timed when it is built, minutes apart from the baseline on a long run; on a
machine whose speed drifts (shared hosts, thermal limits, VMs) a speed-up then mixes the variant
with the drift. With ``evaluate.latency.rounds: R`` (R > 1) the pipeline ends with R rounds per
device and batch size in which every measured variant is timed once, in a new random order each
round; each latency entry then takes its median round's figures and records every round's p50
(``round_p50_ms``) and the first, build-time reading (``first_p50_ms``).

Each speed-up is then the median of the per-round ratios to the baseline's p50 in the same
round, with a 95% bootstrap interval over the rounds (:mod:`torchtame.evaluate.stats`). Where a
variant is compiled (PT2E, torchao), the baseline is also timed compiled (Inductor with the same
freezing) in the same rounds, and the compiled variant's speed-up against it is recorded beside
the eager one (``speedup_compiled``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import statistics
from typing import Any

from ..evaluate import make_runner
from ..evaluate.stats import paired_ratio
from ..inputs import batch_size
from ..progress import NullProgress, Progress
from ..results import latencies
from ..variant import Variant
from .measure import Measurer, _copy, packs_per_shape

STATS = ("runs", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "min_ms", "stdev_ms", "throughput")
COMPILED_BASELINE = "baseline (compiled)"


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
    by_name = {e["name"]: e for e in entries if e.get("status") == "ok" and e["name"] in variants}
    rng = random.Random(seed)
    done = 0
    for device in measurer.devices:
        for bs in measurer.config.latency.batch_sizes:
            # the entries measured here (same node) at this device and batch
            figures = {
                name: m
                for name, e in by_name.items()
                for m in latencies(e)
                if m["device"] == device and m["batch_size"] == bs and m.get("node") in (None, measurer.node)
            }
            if len(figures) < 2:
                continue
            timed = dict(variants)
            compiled = [n for n in figures if variants[n].compiled]
            if compiled and "baseline" in figures:  # compiled against compiled as well as eager
                timed[COMPILED_BASELINE] = dataclasses.replace(variants["baseline"], compiled=True)
            names = [*figures, *([COMPILED_BASELINE] if COMPILED_BASELINE in timed else [])]
            samples = _rounds(timed, names, measurer, device, bs, rounds, rng, progress)
            for name, m in figures.items():
                _update(m, samples[name])
                done += 1
            if "baseline" in figures:
                _ratios(figures, samples, compiled, seed)
    return done


def _rounds(
    variants: dict[str, Variant],
    names: list[str],
    measurer: Measurer,
    device: str,
    bs: int,
    rounds: int,
    rng: random.Random,
    progress: Progress,
) -> dict[str, list[dict[str, Any]]]:
    """Every variant of ``names`` timed once per round, in a new order each round."""
    lat = measurer.config.latency
    opts = (lat.threads, lat.inference_mode, lat.onnx_graph_optimization)
    x = measurer.data.example_input(bs)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        timings = {}
        for name in names:
            v = variants[name]
            fresh = _copy(v) if packs_per_shape(v) or name == COMPILED_BASELINE else v
            run, _ = stack.enter_context(make_runner(fresh, device, *opts))
            timing = run.timing
            assert timing is not None
            timings[name] = (timing, timing.prepare(x))
            timing.fn(timings[name][1])  # compiles (compiled variants), packs, allocates
        for r in range(rounds):
            order = list(names)
            rng.shuffle(order)
            progress.status(f"timing round {r + 1}/{rounds} on {device}, batch {bs}")
            for name in order:
                timing, prepared = timings[name]
                stats = measurer.timed(timing, prepared, device, variants[name].dtype, batch_size(x))
                samples[name].append(stats.to_dict())
    return samples


def _update(entry: dict[str, Any], rounds: list[dict[str, Any]]) -> None:
    """The entry takes its median round's statistics (p50 decides which round that is)."""
    p50s = [r["p50_ms"] for r in rounds]
    median = statistics.median_low(p50s)
    chosen = rounds[p50s.index(median)]
    entry["first_p50_ms"] = entry.get("first_p50_ms", entry["p50_ms"])
    entry.update({k: chosen[k] for k in STATS})
    entry["rounds"] = len(rounds)
    entry["round_p50_ms"] = [round(p, 5) for p in p50s]


def _ratios(
    figures: dict[str, dict[str, Any]],
    samples: dict[str, list[dict[str, Any]]],
    compiled: list[str],
    seed: int,
) -> None:
    """Paired speed-ups with their intervals: against the baseline, and (the ``compiled``
    variants) against the compiled baseline, round by round."""
    base = [r["p50_ms"] for r in samples["baseline"]]
    for name, m in figures.items():
        m.update(paired_ratio(base, [r["p50_ms"] for r in samples[name]], seed=seed).as_fields())
    if COMPILED_BASELINE not in samples:
        return
    reference = [r["p50_ms"] for r in samples[COMPILED_BASELINE]]
    figures["baseline"]["compiled_p50_ms"] = round(statistics.median(reference), 5)
    figures["baseline"]["compiled_round_p50_ms"] = [round(p, 5) for p in reference]
    for name in compiled:
        mine = [r["p50_ms"] for r in samples[name]]
        figures[name].update(paired_ratio(reference, mine, seed=seed).as_fields("speedup_compiled"))
