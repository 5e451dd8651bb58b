"""The shape of results.json, written and read through this one module.

results.json stays plain JSON (a run from any earlier version loads): its parts are typed here as
``TypedDict``s, which are dicts at run time, so the pipeline writes them and every reader
(reports, health, selection, compare, the deployment API) reads them with the same keys. The
accessors below are the one way to dig into an entry (``size_bytes(entry)`` instead of
``(entry.get("size") or {}).get("bytes")``).

For deployment code, :func:`view` turns an entry into a frozen :class:`VariantResult` with named
fields (``result.variants["int8"].latency_at("cpu", 8).p50_ms``, ``.fidelity.cosine``,
``.size.bytes``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

# --------------------------------------------------------------------------- the JSON parts


class LatencyEntry(TypedDict, total=False):
    """One timing of a variant: a device, batch size and thread count on one node."""

    device: str
    batch_size: int
    threads: int
    dtype: str
    node: str | None
    runs: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    stdev_ms: float
    throughput: float
    timer: str
    io: str
    runtime: str
    mha_fastpath: bool
    graph_optimization: str
    peak_memory_mb: float | None
    memory_samples_mb: list[float]
    memory_ratio: float
    peak_memory_low_mb: float
    peak_memory_high_mb: float
    speedup: float  # the baseline's p50 over this one, same setting (median of paired rounds)
    speedup_low: float | None  # its 95% interval (None with one round)
    speedup_high: float | None
    compiled_p50_ms: float  # the baseline only: fp32 compiled (Inductor, freezing), same rounds
    compiled_round_p50_ms: list[float]
    speedup_compiled: float  # compiled variants: against fp32 compiled, same rounds
    speedup_compiled_low: float | None
    speedup_compiled_high: float | None
    memory_error: str
    rounds: int
    round_p50_ms: list[float]
    first_p50_ms: float


class AccuracyEntry(TypedDict, total=False):
    """Accuracy on labelled data and fidelity to the baseline's outputs."""

    top1: float
    top5: float
    top1_drop: float
    top5_drop: float
    top1_agreement: float
    cosine_similarity: float
    max_abs_error: float
    mean_abs_error: float
    device: str


class SizeEntry(TypedDict, total=False):
    """Size on disk, parameters and MACs."""

    bytes: int
    params: int
    nonzero_params: int
    macs: int | None
    macs_source: str | None
    sparse_format_bytes: int  # where >= 30% of parameters are zero: non-zeros + bitmask
    compressed_bytes: int  # ...and the saved files compressed with xz


class Finding(TypedDict, total=False):
    """One health finding (see ``evaluate/health.py``)."""

    code: str
    level: str  # error | warning | info
    message: str
    suggestion: str


# "pass" and "from" are Python keywords: the functional form names them as results.json does
VariantEntry = TypedDict(
    "VariantEntry",
    {
        "name": str,
        "status": str,  # ok | failed
        "pass": str,
        "from": str | None,
        "lineage": list[str],
        "options": Any,
        "kind": str,
        "dtype": str,
        "quantized": bool,
        "backend": str | None,
        "input_dtype": str,
        "device_policy": str,
        "compiled": bool,
        "info": dict[str, Any],
        "artifact": list[str],
        "size": SizeEntry,
        "skipped_devices": list[dict[str, Any]],
        "accuracy": AccuracyEntry | None,
        "latency": list[LatencyEntry],
        "outputs": dict[str, Any],
        "compile_s": dict[str, float],
        "health": list[Finding],
        "error": str,
        "resumed": bool,
        "build_s": float | None,
        "measure_s": float,
        "duration_s": float,
        "built_on": str,
        "warnings_caught": int,
    },
    total=False,
)


class Results(TypedDict, total=False):
    """The whole of results.json."""

    torchtame: str
    status: str  # running | complete | failed | interrupted
    recipe: str
    run_dir: str
    started: str
    finished: str | None
    environment: dict[str, Any]
    devices: list[dict[str, Any]]
    settings: dict[str, Any]
    data: dict[str, Any] | None
    model: dict[str, Any] | None
    variants: list[VariantEntry]
    warnings: dict[str, int]
    error: str | None
    execution: dict[str, Any]
    health: dict[str, Any]
    search: dict[str, Any]
    selection: dict[str, Any]


# --------------------------------------------------------------------------- accessors


def read_results(run_dir: str | Path) -> Results:
    """results.json of a run directory."""
    data: Results = json.loads((Path(run_dir) / "results.json").read_text(encoding="utf-8"))
    return data


def find_entry(results: Mapping[str, Any], name: str) -> VariantEntry | None:
    return next((v for v in results.get("variants") or [] if v.get("name") == name), None)


def accuracy_of(entry: Mapping[str, Any]) -> AccuracyEntry:
    """The entry's accuracy part ({} when nothing was measured)."""
    out: AccuracyEntry = entry.get("accuracy") or {}
    return out


def size_of(entry: Mapping[str, Any]) -> SizeEntry:
    out: SizeEntry = entry.get("size") or {}
    return out


def size_bytes(entry: Mapping[str, Any]) -> int | None:
    return size_of(entry).get("bytes")


def info_of(entry: Mapping[str, Any]) -> dict[str, Any]:
    return entry.get("info") or {}


def findings_of(entry: Mapping[str, Any]) -> list[Finding]:
    return list(entry.get("health") or [])


def latencies(entry: Mapping[str, Any]) -> list[LatencyEntry]:
    return list(entry.get("latency") or [])


def setting(m: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two timings comparable: node, device, batch size, thread count."""
    return (m.get("node"), m["device"], m["batch_size"], m.get("threads"))


def latency_at(
    entry: Mapping[str, Any], device: str, batch: int, node: str | None = None
) -> LatencyEntry | None:
    """The entry's timing at one device and batch size (on ``node``, where given)."""
    for m in latencies(entry):
        if m["device"] == device and m["batch_size"] == batch and (node is None or m.get("node") == node):
            return m
    return None


def speedup_of(m: Mapping[str, Any], baseline: Mapping[str, Any] | None) -> float | None:
    """The timing's speed-up against the baseline: as recorded, or (runs before speed-ups were
    recorded) the ratio of p50s at the same setting."""
    if m.get("speedup") is not None:
        return m["speedup"]
    ref = next((b for b in latencies(baseline or {}) if setting(b) == setting(m)), None)
    return ref["p50_ms"] / m["p50_ms"] if ref and m.get("p50_ms") else None


def chosen_name(results: Mapping[str, Any]) -> str | None:
    """The variant the run chose (the fastest that meets every constraint), if it chose one."""
    return (results.get("selection") or {}).get("chosen")


# --------------------------------------------------------------------------- typed views


@dataclass(frozen=True)
class Latency:
    """One timing; ``speedup`` is the baseline's p50 over this one (same node, device, batch)."""

    device: str
    batch_size: int
    p50_ms: float
    p90_ms: float | None
    p99_ms: float | None
    throughput: float | None
    threads: int | None
    rounds: int
    speedup: float | None
    speedup_low: float | None
    speedup_high: float | None
    speedup_compiled: float | None  # compiled variants: against the compiled baseline
    peak_memory_mb: float | None


@dataclass(frozen=True)
class Fidelity:
    """Accuracy with labels, and closeness to the baseline's outputs (None: not measured)."""

    top1: float | None
    top1_drop: float | None
    agreement: float | None
    cosine: float | None


@dataclass(frozen=True)
class Size:
    bytes: int | None
    params: int | None
    macs: int | None
    ratio: float | None  # of the baseline's bytes

    @property
    def mb(self) -> float | None:
        return None if self.bytes is None else self.bytes / 1e6


@dataclass(frozen=True)
class VariantResult:
    """One variant of a run, with named fields (``entry`` is its results.json entry as written)."""

    name: str
    status: str
    pass_name: str
    parent: str | None
    dtype: str
    kind: str
    quantized: bool
    latency: tuple[Latency, ...]
    fidelity: Fidelity
    size: Size
    health: tuple[Finding, ...]
    artifact: tuple[str, ...]
    error: str | None
    entry: VariantEntry = field(repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def latency_at(self, device: str = "cpu", batch_size: int | None = None) -> Latency | None:
        """The timing at ``device`` and ``batch_size`` (default: the largest batch measured)."""
        here = [m for m in self.latency if m.device == device]
        if batch_size is None:
            return max(here, key=lambda m: m.batch_size, default=None)
        return next((m for m in here if m.batch_size == batch_size), None)

    def findings(self, level: str | None = None) -> list[Finding]:
        return [f for f in self.health if level is None or f.get("level") == level]


def view(entry: Mapping[str, Any], baseline: Mapping[str, Any] | None = None) -> VariantResult:
    """The typed view of one results entry (``baseline``: the baseline's entry, for speed-ups and
    the size ratio)."""
    acc = accuracy_of(entry)
    size = size_of(entry)
    base_bytes = size_bytes(baseline) if baseline is not None else None

    return VariantResult(
        name=entry["name"],
        status=entry.get("status", "ok"),
        pass_name=entry.get("pass", "baseline"),
        parent=entry.get("from"),
        dtype=entry.get("dtype", "float32"),
        kind=entry.get("kind", "torch"),
        quantized=bool(entry.get("quantized")),
        latency=tuple(
            Latency(
                device=m["device"],
                batch_size=m["batch_size"],
                p50_ms=m["p50_ms"],
                p90_ms=m.get("p90_ms"),
                p99_ms=m.get("p99_ms"),
                throughput=m.get("throughput"),
                threads=m.get("threads"),
                rounds=m.get("rounds", 1),
                speedup=speedup_of(m, baseline),
                speedup_low=m.get("speedup_low"),
                speedup_high=m.get("speedup_high"),
                speedup_compiled=m.get("speedup_compiled"),
                peak_memory_mb=m.get("peak_memory_mb"),
            )
            for m in latencies(entry)
        ),
        fidelity=Fidelity(
            top1=acc.get("top1"),
            top1_drop=acc.get("top1_drop"),
            agreement=acc.get("top1_agreement"),
            cosine=acc.get("cosine_similarity"),
        ),
        size=Size(
            bytes=size.get("bytes"),
            params=size.get("params"),
            macs=size.get("macs"),
            ratio=round(size["bytes"] / base_bytes, 4) if base_bytes and size.get("bytes") else None,
        ),
        health=tuple(findings_of(entry)),
        artifact=tuple(entry.get("artifact") or ()),
        error=entry.get("error"),
        entry=entry,  # type: ignore[arg-type]
    )


def views(entries: Iterable[Mapping[str, Any]]) -> dict[str, VariantResult]:
    """Typed views of a run's entries, by name, in the order they were recorded."""
    entries = list(entries)
    baseline = next((e for e in entries if e.get("name") == "baseline"), None)
    return {e["name"]: view(e, baseline) for e in entries}


__all__ = [
    "AccuracyEntry",
    "Fidelity",
    "Finding",
    "Latency",
    "LatencyEntry",
    "Results",
    "Size",
    "SizeEntry",
    "VariantEntry",
    "VariantResult",
    "accuracy_of",
    "chosen_name",
    "find_entry",
    "findings_of",
    "info_of",
    "latencies",
    "latency_at",
    "read_results",
    "setting",
    "size_bytes",
    "size_of",
    "speedup_of",
    "view",
    "views",
]
