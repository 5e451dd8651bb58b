"""The latency harness on work of known cost, and its statistics."""

from __future__ import annotations

import time

import pytest
import torch

from torchtame.evaluate.latency import measure_latency, percentile, summarize


def _sleeper(ms: float):
    def fn(x):
        time.sleep(ms / 1000.0)
        return x

    return fn


def test_known_cost_is_measured() -> None:
    s = measure_latency(_sleeper(4.0), torch.zeros(8, 3), warmup=2, min_runs=15, min_time_s=0.0)
    assert s.runs == 15
    assert 4.0 <= s.p50_ms < 6.5, s
    assert s.min_ms >= 4.0
    assert s.p50_ms <= s.p90_ms <= s.p99_ms
    assert s.batch_size == 8
    assert s.throughput == pytest.approx(8 * 1000 / s.p50_ms, rel=1e-3)


def test_min_time_extends_the_runs() -> None:
    t0 = time.perf_counter()
    s = measure_latency(_sleeper(2.0), torch.zeros(1), warmup=0, min_runs=3, min_time_s=0.2)
    assert time.perf_counter() - t0 >= 0.2
    assert s.runs > 3


def test_max_runs_caps() -> None:
    s = measure_latency(lambda x: x, torch.zeros(1), warmup=0, min_runs=5, min_time_s=10.0, max_runs=50)
    assert s.runs == 50


def test_warmup_calls_are_not_timed() -> None:
    calls = []

    def fn(x):
        calls.append(1)
        time.sleep(0.05 if len(calls) <= 3 else 0.001)  # slow first calls, like lazy init

    s = measure_latency(fn, torch.zeros(1), warmup=3, min_runs=10, min_time_s=0.0)
    assert len(calls) == 13
    assert s.p99_ms < 20


def test_threads_are_recorded() -> None:
    s = measure_latency(lambda x: x, torch.zeros(1), min_runs=2, min_time_s=0, threads=1)
    assert s.threads == 1


def test_percentiles_and_summary() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 100.0
    s = summarize(values, device="cpu", batch_size=2, threads=1, dtype="float32")
    assert s.mean_ms == pytest.approx(50.5) and s.stdev_ms == pytest.approx(29.011, rel=1e-3)


def test_matmul_cost_scales() -> None:
    small, big = torch.randn(64, 64), torch.randn(384, 384)
    a = measure_latency(lambda x: x @ x, small, min_runs=20, min_time_s=0.05)
    b = measure_latency(lambda x: x @ x, big, min_runs=20, min_time_s=0.05)
    assert b.p50_ms > 5 * a.p50_ms  # 216x the flops: clearly slower


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_time_gpu_work() -> None:
    x = torch.randn(2048, 2048, device="cuda")
    s = measure_latency(lambda t: t @ t, x, device="cuda", min_runs=10, min_time_s=0)
    assert s.device == "cuda" and s.p50_ms > 0
