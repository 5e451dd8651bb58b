"""Ratios of paired timings with their uncertainty.

A speed-up compares two variants timed in the same shuffled rounds (``evaluate.latency.rounds``):
round r gives both a p50, and their ratio in that round is free of the drift between rounds. The
speed-up is the median of the per-round ratios; its 95% interval is a percentile bootstrap over
the rounds (resampling whole rounds, so each resample keeps the pairing). With one round there
is no interval: the figure is one reading, and nothing about it is confirmed.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

METHOD = "median of per-round ratios; 95% percentile bootstrap over paired rounds (2000 resamples)"


@dataclass(frozen=True)
class Ratio:
    """``value`` with its interval [``low``, ``high``] (None with one round)."""

    value: float
    low: float | None
    high: float | None
    rounds: int

    @property
    def has_interval(self) -> bool:
        return self.low is not None and self.high is not None

    def below(self, bound: float) -> bool:
        """The whole interval lies below ``bound`` (never true without an interval)."""
        return self.high is not None and self.high < bound

    def spans(self, value: float) -> bool:
        """The interval contains ``value``: no difference from it is measurable."""
        return self.low is not None and self.high is not None and self.low <= value <= self.high

    def half_width(self) -> float | None:
        return None if not self.has_interval else (self.high - self.low) / 2  # type: ignore[operator]

    def as_fields(self, prefix: str = "speedup") -> dict[str, float | None]:
        return {
            prefix: round(self.value, 4),
            f"{prefix}_low": None if self.low is None else round(self.low, 4),
            f"{prefix}_high": None if self.high is None else round(self.high, 4),
        }


def paired_ratio(
    reference: list[float], mine: list[float], resamples: int = 2000, seed: int = 0, level: float = 0.95
) -> Ratio:
    """``reference / mine`` per round (a speed-up when both are times), with its interval.

    The lists are paired by position (round r of each); only rounds with both readings count.
    """
    ratios = [r / m for r, m in zip(reference, mine, strict=False) if m > 0 and r > 0]
    if not ratios:
        raise ValueError("no paired readings")
    value = statistics.median(ratios)
    if len(ratios) < 2:
        return Ratio(value, None, None, len(ratios))
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    tail = (1 - level) / 2
    low = medians[int(tail * (resamples - 1))]
    high = medians[int((1 - tail) * (resamples - 1) + 0.5)]
    return Ratio(value, min(low, value), max(high, value), n)


def spread(samples: list[float]) -> dict[str, float] | None:
    """The low and high of repeated readings (None for fewer than two)."""
    if len(samples) < 2:
        return None
    return {"low": min(samples), "high": max(samples)}
