"""The latency harness: warm-up, then timed runs until a minimum count and time are both reached.

CPU timing uses ``time.perf_counter``; CUDA timing uses CUDA events after a synchronize, so the
figures are GPU time per call, not launch time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..inputs import batch_size


@dataclass(frozen=True)
class LatencyStats:
    """Per-call latency in milliseconds, and throughput in samples per second."""

    device: str
    batch_size: int
    threads: int
    dtype: str
    runs: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    stdev_ms: float
    throughput: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile of already sorted values (q in 0..100)."""
    if not sorted_values:
        raise ValueError("no values")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(
    times_ms: list[float], *, device: str, batch_size: int, threads: int, dtype: str
) -> LatencyStats:
    s = sorted(times_ms)
    mean = statistics.fmean(s)
    p50 = percentile(s, 50)
    return LatencyStats(
        device=device,
        batch_size=batch_size,
        threads=threads,
        dtype=dtype,
        runs=len(s),
        mean_ms=round(mean, 5),
        p50_ms=round(p50, 5),
        p90_ms=round(percentile(s, 90), 5),
        p99_ms=round(percentile(s, 99), 5),
        min_ms=round(s[0], 5),
        stdev_ms=round(statistics.stdev(s) if len(s) > 1 else 0.0, 5),
        throughput=round(batch_size * 1000.0 / p50, 3) if p50 > 0 else float("inf"),
    )


def measure_latency(
    fn: Callable[[Any], Any],
    x: Any,
    *,
    device: str = "cpu",
    warmup: int = 5,
    min_runs: int = 20,
    min_time_s: float = 0.5,
    max_runs: int = 100_000,
    threads: int | None = None,
    dtype: str = "float32",
) -> LatencyStats:
    """Time ``fn(x)``: ``warmup`` untimed calls, then until ``min_runs`` and ``min_time_s``."""
    on_cuda = device.startswith("cuda")
    for _ in range(warmup):
        fn(x)
    if on_cuda:
        torch.cuda.synchronize(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < min_time_s):
        if on_cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn(x)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t0) * 1000.0)
    used_threads = threads if threads is not None else torch.get_num_threads()
    return summarize(times, device=device, batch_size=batch_size(x), threads=used_threads, dtype=dtype)
