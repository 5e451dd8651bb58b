"""Flatten results.json into comparable rows: one per variant, latency per (device, batch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..evaluate.health import flags as flag_cell
from ..results import accuracy_of, findings_of, size_bytes, size_of, speedup_of

MB = 1024 * 1024


@dataclass
class Row:
    name: str
    status: str
    pass_name: str
    parent: str | None
    kind: str
    dtype: str
    top1: float | None
    top1_drop: float | None
    agreement: float | None
    cosine: float | None
    size_bytes: int | None
    size_ratio: float | None
    params: int | None
    macs: int | None
    macs_inherited: bool = False
    latency: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    speedup: dict[tuple[str, int], float] = field(default_factory=dict)
    interval: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # 95%, paired rounds
    compiled_speedup: dict[tuple[str, int], float] = field(default_factory=dict)  # vs fp32 compiled
    skipped: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None

    @property
    def headline(self) -> tuple[str, float | None]:
        """The one quality figure to show: top-1 with labels, else agreement for class scores,
        else cosine similarity to the baseline (embeddings, hidden states)."""
        base = self.name == "baseline"
        if self.top1 is not None:
            return "top-1 %", self.top1
        if self.task == "classification" and (self.agreement is not None or base):
            return "agreement %", 100.0 if base and self.agreement is None else self.agreement
        return "cosine", 1.0 if base and self.cosine is None else self.cosine

    def headline_cell(self) -> str:
        what, value = self.headline
        if value is None:
            return "n/a"
        if what == "top-1 %":
            return fmt_num(value)
        return f"agr {value:.1f}" if what == "agreement %" else f"cos {value:.4f}"

    @property
    def size_mb(self) -> float | None:
        return None if self.size_bytes is None else self.size_bytes / MB

    task: str = "classification"
    health: list[dict[str, Any]] = field(default_factory=list)

    def speedup_cell(self, key: tuple[str, int]) -> str:
        """``4.65x ±0.31`` (half the 95% interval), ``4.65x`` without rounds, ``-`` if unmeasured."""
        s = self.speedup.get(key)
        if s is None:
            return "-"
        low_high = self.interval.get(key)
        cell = f"{s:.2f}x ±{(low_high[1] - low_high[0]) / 2:.2f}" if low_high else f"{s:.2f}x"
        compiled = self.compiled_speedup.get(key)
        return f"{cell}, {compiled:.2f}x vs compiled" if compiled is not None else cell

    def memory(self, key: tuple[str, int]) -> float | None:
        """Peak inference memory (MiB) at one (device, batch size), where it was measured."""
        return (self.latency.get(key) or {}).get("peak_memory_mb")

    @property
    def flags(self) -> str:
        """Errors and warnings of the health checks, e.g. ``✖ fidelity ⚠ slower``."""
        return flag_cell(self.health)

    SUMMARY_HEAD = (
        "top-1 %",
        "drop (pts)",
        "agreement %",
        "cosine",
        "size MB",
        "size ratio",
        "params",
        "MACs",
    )

    def summary_cells(self) -> list[str]:
        """Accuracy, drop, agreement, cosine, size, size ratio, params, MACs (SUMMARY_HEAD)."""
        return [
            fmt_num(self.top1) if self.top1 is not None else "not measured",
            fmt_num(self.top1_drop),
            fmt_num(self.agreement) if self.task == "classification" else "-",
            fmt_num(self.cosine, 4),
            fmt_num(self.size_mb, 3),
            fmt_num(self.size_ratio, 3),
            human_count(self.params),
            human_count(self.macs) + ("*" if self.macs_inherited and self.macs is not None else ""),
        ]


def rows_from_results(results: dict[str, Any]) -> list[Row]:
    """One Row per variant, with speed-ups and size ratios against the baseline."""
    rows = []
    task = result_task(results)
    base = next((v for v in results["variants"] if v["name"] == "baseline"), None)
    base_size = size_bytes(base or {})
    for v in results["variants"]:
        acc = accuracy_of(v)
        size = size_of(v)
        lat = {(m["device"], m["batch_size"]): m for m in v.get("latency", [])}
        # speed-ups only between measurements of one node, device, batch and thread count
        speed = {k: s for k, m in lat.items() if (s := speedup_of(m, base)) is not None}
        interval = {  # the baseline against itself is 1 by definition: no interval to show
            k: (m["speedup_low"], m["speedup_high"])
            for k, m in lat.items()
            if v["name"] != "baseline" and None not in (m.get("speedup_low"), m.get("speedup_high"))
        }
        rows.append(
            Row(
                name=v["name"],
                status=v["status"],
                pass_name=v.get("pass", ""),
                parent=v.get("from"),
                kind=v.get("kind", "-"),
                dtype=v.get("dtype", "-"),
                top1=acc.get("top1"),
                top1_drop=acc.get("top1_drop"),
                agreement=acc.get("top1_agreement"),
                cosine=acc.get("cosine_similarity"),
                size_bytes=size.get("bytes"),
                size_ratio=(size["bytes"] / base_size) if base_size and size.get("bytes") else None,
                params=size.get("params"),
                macs=size.get("macs"),
                macs_inherited=str(size.get("macs_source") or "").startswith("inherited"),
                latency=lat,
                speedup=speed,
                interval=interval,
                compiled_speedup={
                    k: m["speedup_compiled"] for k, m in lat.items() if m.get("speedup_compiled") is not None
                },
                skipped=v.get("skipped_devices", []),
                error=v.get("error"),
                task=task,
                health=findings_of(v),
            )
        )
    return rows


def result_task(results: dict[str, Any]) -> str:
    """What the measured output is (runs before the task was recorded were classifiers)."""
    return (results.get("settings") or {}).get("task") or "classification"


def latency_keys(rows: list[Row]) -> list[tuple[str, int]]:
    """Every (device, batch size) measured, in a stable order."""
    keys: list[tuple[str, int]] = []
    for r in rows:
        for k in r.latency:
            if k not in keys:
                keys.append(k)
    return sorted(keys, key=lambda k: (k[0] != "cpu", k[0], k[1]))


def pareto_front(points: list[tuple[str, float, float]]) -> list[str]:
    """Names on the latency-accuracy Pareto front: no other point is at least as fast and at
    least as accurate while strictly better in one. Points are (name, latency, accuracy)."""
    front = []
    for name, lat, acc in points:
        dominated = any(
            (ol <= lat and oa >= acc) and (ol < lat or oa > acc) for on, ol, oa in points if on != name
        )
        if not dominated:
            front.append(name)
    return front


def fmt_num(value: float | int | None, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not suffix:
        return human_count(value)
    return f"{value:.{digits}f}{suffix}"


def human_count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)
