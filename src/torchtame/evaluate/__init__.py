"""Measurements of a variant: accuracy and fidelity, latency, size, MACs."""

from .accuracy import METRICS, evaluate_accuracy, predict, top1_accuracy
from .latency import LatencyStats, measure_latency
from .macs import count_macs_params
from .runner import make_runner
from .size import size_report

__all__ = [
    "METRICS",
    "LatencyStats",
    "count_macs_params",
    "evaluate_accuracy",
    "make_runner",
    "measure_latency",
    "predict",
    "size_report",
    "top1_accuracy",
]
