"""Record variants in results.json: built and measured, failed, or reused from an earlier run; and
check the health of every measured variant. Shared by the local and the Ray execution."""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._warnings import caught
from ..errors import TorchtameError, first_line
from ..evaluate.health import check as check_health
from ..evaluate.health import summary as health_summary
from ..evaluate.stats import paired_ratio, spread
from ..recipe import Recipe
from ..results import VariantEntry, latencies, setting
from ..variant import Variant
from .store import RunStore

log = logging.getLogger("torchtame")

Measure = Callable[[Variant, list[Path], dict[str, Any] | None], dict[str, Any]]


class Recorder:
    """Adds entries to the run store (saved at once) and keeps the run's library warnings."""

    def __init__(self, store: RunStore, recipe: Recipe) -> None:
        self.store = store
        self.recipe = recipe
        self.task = "classification"
        self.warnings: Counter[str] = Counter()
        self.thresholds = recipe.evaluate.health

    def resumed(self, entry: VariantEntry) -> dict[str, Any]:
        log.info("resumed: %s was finished by the earlier run", entry["name"])
        entry = {**entry, "resumed": True}
        self.store.add(entry)
        return entry

    def failed(self, v: Variant, t0: float, error: str, warns: Counter[str] | None = None) -> dict[str, Any]:
        """A variant that could not be built (or measured): its lineage and the reason."""
        made = v.to_entry()
        entry: VariantEntry = {"name": v.name, "status": "failed"}
        entry.update({k: made[k] for k in ("pass", "from", "lineage", "options")})
        entry["error"] = error
        log.warning("variant %s failed: %s", v.name, first_line(error, 500))
        return self._add(entry, t0, warns)

    def measured(
        self,
        v: Variant,
        t0: float,
        warns: Counter[str] | None,
        measure: Callable[[], tuple[list[Path], dict[str, Any]]],
    ) -> dict[str, Any]:
        """Run ``measure`` (save the artefact, measure it; returns the files and the figures) and
        record the variant, or record it failed if measuring raised."""
        warns = warns if warns is not None else Counter()
        started = time.perf_counter()
        try:
            with caught("measure", warns):
                files, figures = measure()
        except TorchtameError as exc:
            return self.failed(v, t0, f"measuring failed: {exc}", warns)
        except Exception as exc:
            log.debug("measuring %s failed:\n%s", v.name, traceback.format_exc())
            return self.failed(
                v, t0, f"measuring failed: {type(exc).__name__}: {str(exc).strip()[:300]}", warns
            )
        made = v.to_entry()
        entry: VariantEntry = {"name": v.name, "status": "ok"}
        entry.update({k: made.pop(k) for k in ("pass", "from", "lineage", "options")})
        made.pop("name")
        entry.update({**made, "artifact": self.store.relative(files), **figures})
        self._against_baseline(entry)
        entry.setdefault("build_s", round(started - t0, 3))
        entry.setdefault("measure_s", round(time.perf_counter() - started, 3))
        self.check(entry)
        return self._add(entry, t0, warns)

    def _add(self, entry: VariantEntry, t0: float, warns: Counter[str] | None) -> dict[str, Any]:
        entry["duration_s"] = round(time.perf_counter() - t0, 3)
        if warns:
            entry["warnings_caught"] = sum(warns.values())
            self.warnings.update(warns)
            self.store.results["warnings"] = dict(self.warnings.most_common())
        self.store.add(entry)
        return entry

    def _against_baseline(self, entry: VariantEntry) -> None:
        """Each timing's speed-up and memory ratio against the baseline's at the same setting
        (node, device, batch, threads), and the spread of its memory readings. One timing has no
        interval; the side-by-side rounds (:mod:`.rounds`) replace these with paired figures."""
        base = self.store.entry("baseline") if entry["name"] != "baseline" else entry
        ref = {setting(m): m for m in latencies(base or {})}
        for m in latencies(entry):
            theirs = ref.get(setting(m))
            if theirs is not None and m.get("p50_ms"):
                m.update(paired_ratio([theirs["p50_ms"]], [m["p50_ms"]]).as_fields())
            mine, other = m.get("peak_memory_mb"), (theirs or {}).get("peak_memory_mb")
            if mine is not None and other:
                m["memory_ratio"] = round(mine / other, 4)
            low_high = spread(m.get("memory_samples_mb") or [])
            if low_high is not None:
                m["peak_memory_low_mb"], m["peak_memory_high_mb"] = low_high["low"], low_high["high"]

    def capacity(self) -> dict[str, float]:
        """MiB of memory per device kind, from the environment the run recorded."""
        env = self.store.results.get("environment") or {}
        out = {}
        if (env.get("cpu") or {}).get("memory_available_mb"):
            out["cpu"] = env["cpu"]["memory_available_mb"]
        gpus = (env.get("cuda") or {}).get("devices") or []
        if gpus:
            out["cuda"] = min(d["memory_gib"] for d in gpus) * 1024
        return out

    def check(self, entry: VariantEntry) -> None:
        """The health findings of one measured entry, against its parent's entry."""
        if not self.recipe.evaluate.health.enabled or entry.get("status") != "ok":
            return
        parent = self.store.entry(entry["from"]) if entry.get("from") else None
        entry["health"] = check_health(
            entry,
            parent,
            self.task,
            self.thresholds,
            self.capacity(),
            meets_constraints=self._meets_fidelity_constraints(entry),
        )
        for f in entry["health"]:
            if f["level"] != "info":
                log.debug("%s: %s. Next: %s", entry["name"], f["message"], f["suggestion"])

    def _meets_fidelity_constraints(self, entry: VariantEntry) -> bool:
        """Whether the recipe sets fidelity constraints and ``entry`` meets them."""
        from ..search.selection import fidelity_reasons

        c = self.recipe.constraints
        if not c.fidelity:
            return False
        use_labels = (self.store.results.get("data") or {}).get("labels", "use") == "use"
        return not fidelity_reasons(entry, c, use_labels)

    def close(self) -> None:
        """Check every entry again (a parent measured after its child, with Ray) and log the
        library warnings and the health summary once."""
        for entry in self.store.results["variants"]:
            if entry.get("status") == "ok" and not entry.get("resumed"):
                self.check(entry)
        if self.warnings:
            top = ", ".join(f"{k.split(': ', 1)[-1][:60]!r} x{n}" for k, n in self.warnings.most_common(3))
            log.info(
                "caught %d library warnings (%d distinct; most frequent: %s); all are in results.json",
                sum(self.warnings.values()),
                len(self.warnings),
                top,
            )
        counts = self.store.results["health"] = health_summary(self.store.results)
        if counts["error"] or counts["warning"]:
            log.warning(
                "health: %d error(s), %d warning(s): %s (details and next steps in report.md)",
                counts["error"],
                counts["warning"],
                counts["line"],
            )
