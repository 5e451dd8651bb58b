"""The pipeline: recipe -> baseline + one variant per step -> measurements -> run directory.

Each variant is built, saved, measured and written to ``results.json`` before the next one, so an
interrupted or failed run leaves every finished variant intact. ``results.json`` is replaced
atomically and says ``complete`` only when the whole run finished.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from .._warnings import caught
from ..data import DataBundle
from ..devices import resolve_device, resolve_devices
from ..errors import RunError, TorchtameError, first_line
from ..evaluate.health import Thresholds
from ..evaluate.health import check as check_health
from ..evaluate.health import summary as health_summary
from ..progress import NullProgress, Progress
from ..recipe import Recipe, load_recipe
from ..variant import Variant
from .executor import Built, StepInputs, build_step, options_json
from .loading import load_inputs
from .measure import Measurer
from .store import RunStore, check_run_dir

log = logging.getLogger("torchtame")


@dataclass
class RunResult:
    """What ``run`` returns: the run directory and the same data ``results.json`` holds."""

    run_dir: Path
    results: dict[str, Any]
    variants: dict[str, Variant] = field(default_factory=dict, repr=False)

    @property
    def status(self) -> str:
        return self.results["status"]

    def variant(self, name: str) -> dict[str, Any]:
        """The results entry of one variant."""
        for v in self.results["variants"]:
            if v["name"] == name:
                return v
        raise KeyError(f"no variant {name!r}; variants: {[v['name'] for v in self.results['variants']]}")


class Pipeline:
    """Runs one recipe. Use :func:`run` unless you need the stages one by one.

    Its public step interface (``run_step``, ``entry``, ``variants``, ``baseline_outputs``) is
    what the search builds its candidates through.
    """

    def __init__(self, recipe: Recipe, progress: Progress | None = None, resume: Path | None = None) -> None:
        self.recipe = recipe
        self.resume_dir = resume
        self.progress = progress or NullProgress()
        self.variants: dict[str, Variant] = {}
        self.warnings: Counter[str] = Counter()
        self.store: RunStore | None = None

    @property
    def run_dir(self) -> Path | None:
        return self.store.run_dir if self.store is not None else None

    @property
    def results(self) -> dict[str, Any]:
        return self.store.results if self.store is not None else {}

    @property
    def baseline_outputs(self) -> torch.Tensor | None:
        return self.measurer.baseline_outputs

    # ----------------------------------------------------------------- stages

    def setup(self) -> None:
        r = self.recipe
        self.choices = resolve_devices(r.devices)
        self.devices = [c.device for c in self.choices if c.device is not None]
        for c in self.choices:
            if c.reason:
                log.info("device %s: %s", c.requested, c.reason)
        self.store = RunStore(r, self.resume_dir)
        self.store.start(r, self.choices, r.evaluate.latency.threads or torch.get_num_threads())

    def load(self) -> tuple[torch.nn.Module, DataBundle]:
        loaded = load_inputs(self.recipe, self.devices, self.progress)
        self.data, self.example, self.output, self.task = (
            loaded.data,
            loaded.example,
            loaded.output,
            loaded.task,
        )
        self.results["settings"].update({"task": self.task, "output": self.output})
        self.results["data"] = loaded.data_info
        self.results["model"] = loaded.model_info
        self.measurer = Measurer(
            self.recipe.evaluate,
            self.data,
            self.choices,
            self.example,
            self.progress,
            output=self.output,
            task=self.task,
        )
        self.inputs = StepInputs(
            self.data, self.example, self.devices, self.variants, self.progress, self.output, self.task
        )
        return loaded.model, self.data

    def build_variants(self, model: torch.nn.Module) -> None:
        assert self.store is not None
        baseline = Variant(name="baseline", module=model, lineage=["baseline"])
        self.variants["baseline"] = baseline
        previous = self.store.previous.get("baseline")
        if previous is not None:
            self.measurer.restore_baseline(baseline, previous)
            self._resumed(previous)
        else:
            self._record(baseline, time.perf_counter(), None)
        base_entry = self.results["variants"][0]
        if base_entry.get("status") == "failed":
            raise RunError(f"the baseline could not be measured: {base_entry['error']}")
        for i, step in enumerate(self.recipe.steps):
            self.run_step(step.name, step.pass_, step.from_, step.options, index=i)
        if self.recipe.strategy == "search":
            from ..search import run_search

            self.results["search"] = run_search(self)
            self.store.save()
        ex = self.recipe.export
        if ex.onnx:
            names = ex.variants or [
                n for n, v in self.variants.items() if v.is_float and v.dtype == "float32"
            ]
            for n in names:
                if f"{n}-onnx" not in self.variants and n in self.variants:
                    self.run_step(f"{n}-onnx", "export.onnx", n, ex.options, index=len(self.variants))

    def select(self) -> None:
        """Record which variant meets the recipe's constraints (when it has any)."""
        c = self.recipe.constraints
        if c.empty:
            return
        from ..search.selection import select

        device = (resolve_device(c.device).device or c.device) if c.device else self.devices[0]
        batch = c.batch_size or self.recipe.evaluate.latency.batch_sizes[0]
        sel = select(self.results, c, device, batch)
        self.results["selection"] = sel
        if sel["chosen"]:
            log.info("chosen: %s, the fastest variant that meets every constraint", sel["chosen"])
        else:
            log.warning("no variant meets every constraint; the best found is %s", sel["best_found"])

    # ----------------------------------------------------------------- the step interface

    def entry(self, name: str) -> dict[str, Any] | None:
        """The results entry of variant ``name`` so far, if it has one."""
        return self.store.entry(name) if self.store is not None else None

    def run_step(
        self, name: str, pass_name: str, parent: str, options: BaseModel, index: int | None = None
    ) -> dict[str, Any]:
        """Build variant ``name`` with ``pass_name`` from ``parent``, measure and record it; returns
        its results entry. ``index`` (default: the number of entries so far) seeds the step."""
        assert self.store is not None
        t0 = time.perf_counter()
        index = len(self.results["variants"]) if index is None else index
        source = self.variants.get(parent)
        failed = Variant(name=name, pass_name=pass_name, parent=parent, options=options_json(options))
        if source is None:
            return self._record(failed, t0, f"skipped: its source variant {parent!r} failed")
        failed.lineage = [*source.lineage, name]
        before = self.store.reusable(name, pass_name, parent, failed.options)
        restored = self.store.load_variant(before) if before is not None else None
        if before is not None and restored is not None:
            self.variants[name] = restored
            return self._resumed(before)
        seed = self.recipe.seed + index + 1
        built = build_step(name, pass_name, source, options, self.inputs, seed, self.store.variant_dir(name))
        if built.variant is None:
            return self._record(failed, t0, built.error, built.warnings)
        self.variants[name] = built.variant
        return self._record(built.variant, t0, None, built.warnings)

    # ----------------------------------------------------------------- recording

    def _resumed(self, entry: dict[str, Any]) -> dict[str, Any]:
        assert self.store is not None
        log.info("resumed: %s was finished by the earlier run", entry["name"])
        entry = {**entry, "resumed": True}
        self.store.add(entry)
        return entry

    def _record(
        self, v: Variant, t0: float, error: str | None, warns: Counter[str] | None = None
    ) -> dict[str, Any]:
        """Measure a built variant (unless it failed) and add its entry to results.json."""
        assert self.store is not None
        made = v.to_entry()
        entry: dict[str, Any] = {"name": v.name, "status": "failed" if error else "ok"}
        made.pop("name")
        entry.update({k: made.pop(k) for k in ("pass", "from", "lineage", "options")})
        warns = warns if warns is not None else Counter()
        if error is None:
            try:
                with caught("measure", warns):
                    files = self.store.save_artifact(v, self.example)
                    parent = self.entry(v.parent) if v.parent else None
                    measured = {**made, "artifact": self.store.relative(files)}
                    measured.update(self.measurer.measure(v, files, parent))
                entry.update(measured)
                self._check_health(entry, parent)
            except TorchtameError as exc:
                error = f"measuring failed: {exc}"
            except Exception as exc:
                log.debug("measuring %s failed:\n%s", v.name, traceback.format_exc())
                error = f"measuring failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
            if error:
                entry["status"] = "failed"
                self.variants.pop(v.name, None)
        if error:
            entry["error"] = error
            log.warning("variant %s failed: %s", v.name, first_line(error, 500))
        entry["duration_s"] = round(time.perf_counter() - t0, 3)
        if warns:
            entry["warnings_caught"] = sum(warns.values())
            self.warnings.update(warns)
            self.results["warnings"] = dict(self.warnings.most_common())
        self.store.add(entry)
        return entry

    def _check_health(self, entry: dict[str, Any], parent: dict[str, Any] | None) -> None:
        cfg = self.recipe.evaluate.health
        if not cfg.enabled:
            return
        thresholds = Thresholds(
            cfg.min_cosine,
            cfg.min_agreement,
            cfg.slower_tolerance,
            cfg.warn_cosine,
            cfg.warn_agreement,
            cfg.warn_accuracy_drop,
        )
        entry["health"] = check_health(entry, parent, self.task, thresholds)
        for f in entry["health"]:
            if f["level"] != "info":
                log.debug("%s: %s. Next: %s", entry["name"], f["message"], f["suggestion"])

    # ----------------------------------------------------------------- output

    def finish(self, status: str, error: str | None = None) -> None:
        assert self.store is not None
        if self.warnings:
            top = ", ".join(f"{k.split(': ', 1)[-1][:60]!r} x{n}" for k, n in self.warnings.most_common(3))
            log.info(
                "caught %d library warnings (%d distinct; most frequent: %s); all are in results.json",
                sum(self.warnings.values()),
                len(self.warnings),
                top,
            )
        self.results["health"] = health_summary(self.results)
        counts = self.results["health"]
        if counts["error"] or counts["warning"]:
            log.warning(
                "health: %d error(s), %d warning(s): %s (details and next steps in report.md)",
                counts["error"],
                counts["warning"],
                counts["line"],
            )
        self.store.finish(status, error)
        if status == "complete" or self.results["variants"]:
            from ..report import write_reports

            write_reports(self.store.run_dir, self.results, self.recipe.report.formats)

    def run(self) -> RunResult:
        self.setup()
        assert self.store is not None
        try:
            model, _ = self.load()
            self.build_variants(model)
            self.select()
        except KeyboardInterrupt:
            self.finish("interrupted", "interrupted by the user (Ctrl-C)")
            raise
        except TorchtameError as exc:
            self.finish("failed", str(exc))
            raise
        except Exception as exc:
            self.finish("failed", f"{type(exc).__name__}: {exc}")
            raise
        self.finish("complete")
        return RunResult(self.store.run_dir, self.results, dict(self.variants))


def run(
    recipe: str | Path | dict[str, Any] | Recipe | None = None,
    *,
    output_dir: str | Path | None = None,
    devices: list[str] | None = None,
    progress: Progress | None = None,
    resume: str | Path | None = None,
) -> RunResult:
    """Run a recipe end to end and return its results (the data ``results.json`` holds).

    ``resume`` names the directory of an earlier run that failed or was interrupted: variants it
    finished are reloaded from their artefacts, the rest are built, all in that directory. The
    recipe defaults to the one saved there.
    """
    resume_dir = check_run_dir(Path(resume)) if resume is not None else None
    if recipe is None and resume_dir is not None:
        recipe = resume_dir / "recipe.yaml"
    if recipe is None:
        raise RunError("no recipe given", hint="pass a recipe path, dict or Recipe")
    loaded = load_recipe(
        recipe,
        output_dir=str(output_dir) if output_dir is not None else None,
        devices=devices,
    )
    return Pipeline(loaded, progress, resume=resume_dir).run()


__all__ = ["Built", "Pipeline", "RunResult", "run"]
