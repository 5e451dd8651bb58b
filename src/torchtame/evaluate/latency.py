"""The latency harness: warm-up, then timed runs until a minimum count and time are both reached.

CPU timing uses ``time.perf_counter``; CUDA timing uses CUDA events on the device's stream after a
synchronize (GPU time per call, not launch time), or the host clock up to a device synchronize for
runtimes with streams of their own (onnxruntime). Each figure records which (``timer``).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
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
    timer: str = "wall-clock"

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
    timer: str = "auto",
    batch: int | None = None,
) -> LatencyStats:
    """Time ``fn(x)``: ``warmup`` untimed calls, then until ``min_runs`` and ``min_time_s``.

    On CUDA, ``timer="auto"`` uses CUDA events recorded on ``device``'s current stream (inside
    that device's context, so ``cuda:1`` times its own kernels, not launches); ``timer="wall"``
    times each call on the host clock up to a synchronize of the device (for runtimes with their
    own streams, such as onnxruntime). On the CPU both are the host clock. ``threads`` is a
    runtime's own thread count (onnxruntime's intra-op pool); without it the figure records
    ``torch.get_num_threads()`` as the timed calls saw it. ``batch``: the batch size, where
    ``x`` is not an input structure (a bound onnxruntime session's binding).
    """
    on_cuda = device.startswith("cuda")
    dev = torch.device(device)
    with torch.cuda.device(dev) if on_cuda else contextlib.nullcontext():
        for _ in range(warmup):
            fn(x)
        one = _clock(dev, timer) if on_cuda else _host_ms
        if on_cuda:
            torch.cuda.synchronize(dev)
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < min_time_s):
            times.append(one(fn, x))
    used_threads = threads if threads is not None else torch.get_num_threads()
    stats = summarize(
        times, device=device, batch_size=batch or batch_size(x), threads=used_threads, dtype=dtype
    )
    return replace(stats, timer="cuda-events" if on_cuda and timer == "auto" else "wall-clock")


def _host_ms(fn: Callable[[Any], Any], x: Any, dev: torch.device | None = None) -> float:
    """One call on the host clock (up to a synchronize of the CUDA device ``dev``, if given)."""
    t0 = time.perf_counter()
    fn(x)
    if dev is not None:
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) * 1000.0


def _clock(dev: torch.device, timer: str) -> Callable[[Callable[[Any], Any], Any], float]:
    """One timed call on CUDA: events on ``dev``'s current stream, or the host clock up to a
    synchronize of the device (``timer="wall"``)."""
    if timer == "wall":
        return functools.partial(_host_ms, dev=dev)
    stream = torch.cuda.current_stream(dev)

    def events(fn: Callable[[Any], Any], x: Any) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        fn(x)
        end.record(stream)
        end.synchronize()
        return begin.elapsed_time(end)

    return events
