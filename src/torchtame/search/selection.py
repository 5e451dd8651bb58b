"""Pick the fastest variant that meets every constraint, and say why each other one does not."""

from __future__ import annotations

from typing import Any

from ..errors import first_line
from ..recipe import Constraints

MIB = 1024 * 1024


def accuracy_drop(entry: dict[str, Any]) -> tuple[float | None, str]:
    """Top-1 drop in points, or (without labels) 100 - agreement with the baseline."""
    acc = entry.get("accuracy") or {}
    if "top1_drop" in acc:
        return acc["top1_drop"], "top-1"
    if entry.get("name") == "baseline":
        return 0.0, "agreement"
    if "top1_agreement" in acc:
        return round(100.0 - acc["top1_agreement"], 3), "agreement"
    return None, "not measured"


def latency_of(entry: dict[str, Any], device: str, batch: int) -> float | None:
    for m in entry.get("latency", []):
        if m["device"] == device and m["batch_size"] == batch:
            return m["p50_ms"]
    return None


def verdict(entry: dict[str, Any], c: Constraints, device: str, batch: int) -> dict[str, Any]:
    """Whether one variant meets the constraints, with the figures and the reasons it fails."""
    reasons: list[str] = []
    drop, basis = accuracy_drop(entry)
    lat = latency_of(entry, device, batch)
    size = (entry.get("size") or {}).get("bytes")
    if entry.get("status") != "ok":
        reasons.append("failed: " + first_line(entry.get("error"), 120))
    else:
        if c.max_accuracy_drop is not None:
            if drop is None:
                reasons.append("accuracy not measured")
            elif drop > c.max_accuracy_drop:
                reasons.append(f"accuracy drop {drop:.2f} > {c.max_accuracy_drop:g} points ({basis})")
        if lat is None:
            reasons.append(f"no latency on {device} at batch {batch}")
        elif c.max_latency_ms is not None and lat > c.max_latency_ms:
            reasons.append(f"p50 {lat:.3f} ms > {c.max_latency_ms:g} ms ({device}, batch {batch})")
        if c.max_size_mb is not None and size is not None and size / MIB > c.max_size_mb:
            reasons.append(f"size {size / MIB:.3f} MiB > {c.max_size_mb:g} MiB")
    return {
        "name": entry["name"],
        "meets": not reasons,
        "reasons": reasons,
        "accuracy_drop": drop,
        "p50_ms": lat,
        "size_mib": None if size is None else round(size / MIB, 4),
    }


def select(results: dict[str, Any], c: Constraints, device: str, batch: int) -> dict[str, Any]:
    """The fastest variant meeting every constraint; if none, the best found and why not."""
    verdicts = [verdict(v, c, device, batch) for v in results["variants"]]
    meeting = [v for v in verdicts if v["meets"]]
    chosen = min(meeting, key=lambda v: v["p50_ms"]) if meeting else None
    best = None
    if chosen is None:
        measured = [v for v in verdicts if v["p50_ms"] is not None]
        if measured:  # fewest failed constraints, then the smallest drop, then the fastest
            best = min(measured, key=lambda v: (len(v["reasons"]), v["accuracy_drop"] or 0.0, v["p50_ms"]))
    return {
        "constraints": c.model_dump(exclude_none=True),
        "latency_setting": {"device": device, "batch_size": batch},
        "chosen": chosen["name"] if chosen else None,
        "best_found": best["name"] if best else None,
        "candidates": verdicts,
    }
