"""Pick the fastest variant that meets every constraint, and say why each other one does not."""

from __future__ import annotations

from typing import Any

from ..errors import first_line
from ..recipe import Constraints
from ..results import VariantEntry, accuracy_of, latency_at, size_bytes

MIB = 1024 * 1024


def accuracy_drop(entry: VariantEntry, use_labels: bool = True) -> tuple[float | None, str]:
    """Top-1 drop in points, or (where the optimizer has no labels) 100 - agreement with the
    baseline."""
    acc = accuracy_of(entry)
    if use_labels and "top1_drop" in acc:
        return acc["top1_drop"], "top-1"
    if entry.get("name") == "baseline":
        return 0.0, "agreement"
    if "top1_agreement" in acc:
        return round(100.0 - acc["top1_agreement"], 3), "agreement"
    return None, "not measured"


def latency_of(entry: VariantEntry, device: str, batch: int, key: str = "p50_ms") -> float | None:
    m = latency_at(entry, device, batch)
    return m.get(key) if m is not None else None


def fidelity(entry: VariantEntry, name: str) -> float | None:
    """Cosine or agreement to the baseline (the baseline is 1.0 / 100% by definition)."""
    acc = accuracy_of(entry)
    key = "cosine_similarity" if name == "cosine" else "top1_agreement"
    if entry.get("name") == "baseline" and acc.get(key) is None:
        return 1.0 if name == "cosine" else 100.0
    return acc.get(key)


def fidelity_reasons(entry: VariantEntry, c: Constraints, use_labels: bool = True) -> list[str]:
    """Why a variant misses the accuracy / fidelity constraints (empty if it meets them)."""
    reasons = []
    if c.max_accuracy_drop is not None:
        drop, basis = accuracy_drop(entry, use_labels)
        if drop is None:
            reasons.append("accuracy not measured")
        elif drop > c.max_accuracy_drop:
            reasons.append(f"accuracy drop {drop:.2f} > {c.max_accuracy_drop:g} points ({basis})")
    if c.min_cosine is not None:
        cos = fidelity(entry, "cosine")
        if cos is None:
            reasons.append("cosine not measured")
        elif cos < c.min_cosine:
            reasons.append(f"cosine {cos:.4f} < {c.min_cosine:g}")
    if c.min_agreement is not None:
        agreement = fidelity(entry, "agreement")
        if agreement is None:
            reasons.append("agreement not measured (the output is not class scores: use min_cosine)")
        elif agreement < c.min_agreement:
            reasons.append(f"agreement {agreement:.2f}% < {c.min_agreement:g}%")
    return reasons


def verdict(
    entry: VariantEntry, c: Constraints, device: str, batch: int, use_labels: bool = True
) -> dict[str, Any]:
    """Whether one variant meets the constraints, with the figures and the reasons it fails."""
    reasons: list[str] = []
    drop, _ = accuracy_drop(entry, use_labels)
    lat = latency_of(entry, device, batch)
    size = size_bytes(entry)
    if entry.get("status") != "ok":
        reasons.append("failed: " + first_line(entry.get("error"), 120))
    else:
        reasons += fidelity_reasons(entry, c, use_labels)
        if lat is None:
            reasons.append(f"no latency on {device} at batch {batch}")
        elif c.max_latency_ms is not None and lat > c.max_latency_ms:
            reasons.append(f"p50 {lat:.3f} ms > {c.max_latency_ms:g} ms ({device}, batch {batch})")
        if c.max_size_mb is not None and size is not None and size / MIB > c.max_size_mb:
            reasons.append(f"size {size / MIB:.3f} MiB > {c.max_size_mb:g} MiB")
        memory = latency_of(entry, device, batch, "peak_memory_mb")
        if c.max_memory_mb is not None:
            if memory is None:
                reasons.append(f"no memory reading on {device} at batch {batch} (evaluate.memory)")
            elif memory > c.max_memory_mb:
                reasons.append(
                    f"peak memory {memory:.1f} MiB > {c.max_memory_mb:g} MiB ({device}, batch {batch})"
                )
    return {
        "name": entry["name"],
        "meets": not reasons,
        "reasons": reasons,
        "accuracy_drop": drop,
        "cosine": fidelity(entry, "cosine"),
        "agreement": fidelity(entry, "agreement"),
        "p50_ms": lat,
        "size_mib": None if size is None else round(size / MIB, 4),
        "peak_memory_mb": latency_of(entry, device, batch, "peak_memory_mb"),
    }


def select(results: dict[str, Any], c: Constraints, device: str, batch: int) -> dict[str, Any]:
    """The fastest variant meeting every constraint; if none, the best found and why not."""
    use_labels = (results.get("data") or {}).get("labels", "use") == "use"
    verdicts = [verdict(v, c, device, batch, use_labels) for v in results["variants"]]
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


def select_for(recipe: Any, results: dict[str, Any], devices: list[str]) -> dict[str, Any] | None:
    """The recipe's selection over a run's results (None when the recipe has no constraints)."""
    import logging

    from ..devices import resolve_device

    c = recipe.constraints
    if c.empty:
        return None
    device = (resolve_device(c.device).device or c.device) if c.device else devices[0]
    batch = c.batch_size or recipe.evaluate.latency.batch_sizes[0]
    sel = select(results, c, device, batch)
    log = logging.getLogger("torchtame")
    if sel["chosen"]:
        log.info("chosen: %s, the fastest variant that meets every constraint", sel["chosen"])
    else:
        log.warning("no variant meets every constraint; the best found is %s", sel["best_found"])
    return sel
