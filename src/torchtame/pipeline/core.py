"""The pipeline: recipe -> baseline + one variant per step -> measurements -> run directory.

Each variant is built, saved, measured and written to ``results.json`` before the next one, so an
interrupted or failed run leaves every finished variant intact. ``results.json`` is replaced
atomically and says ``complete`` only when the whole run finished.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from ..data import DataBundle
from ..devices import resolve_devices
from ..errors import RunError, TorchtameError
from ..progress import NullProgress, Progress
from ..recipe import Recipe, load_recipe
from ..variant import Variant
from .executor import Built, Job, StepInputs, build_step, options_json
from .loading import load_inputs
from .measure import Measurer
from .record import Recorder
from .rounds import retime_run
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

    Its public step interface (``run_step``/``run_steps``, ``entry``, ``variants``,
    ``baseline_outputs``) is what the search builds its candidates through; execution engines
    (Ray) use ``prepare``, ``stub``, ``record`` and ``recorder`` as well.
    """

    def __init__(self, recipe: Recipe, progress: Progress | None = None, resume: Path | None = None) -> None:
        self.recipe = recipe
        self.resume_dir = resume
        self.progress = progress or NullProgress()
        self.variants: dict[str, Variant] = {}
        self.store: RunStore | None = None
        self.recorder: Recorder | None = None
        self.engine: Any = None

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
        self.recorder = Recorder(self.store, r)
        if r.execution.engine == "ray":
            from ..execution.ray_engine import make_engine

            self.engine = make_engine(r.execution)
            self.results["execution"] = self.engine.describe()
            self.store.save()
        else:
            self.results["execution"] = {"engine": "local"}

    def load(self) -> tuple[torch.nn.Module, DataBundle]:
        loaded = load_inputs(self.recipe, self.devices, self.progress)
        self.data, self.example, self.output, self.task = (
            loaded.data,
            loaded.example,
            loaded.output,
            loaded.task,
        )
        self.results["settings"].update({"task": self.task, "output": self.output})
        assert self.recorder is not None
        self.recorder.task = self.task
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
        assert self.recorder is not None
        if previous is not None:
            self.measurer.restore_baseline(baseline, previous)
            base_entry = self.recorder.resumed(previous)
        elif self.engine is not None:
            from ..execution.ray_runner import measure_baseline

            base_entry = measure_baseline(self, self.engine, baseline)
        else:
            base_entry = self.record(baseline, time.perf_counter())
        if base_entry.get("status") == "failed":
            raise RunError(f"the baseline could not be measured: {base_entry['error']}")
        steps = self.recipe.steps
        self.run_steps([Job(s.name, s.pass_, s.from_, s.options, i) for i, s in enumerate(steps)])
        if self.recipe.strategy == "search":
            from ..search import run_search

            self.results["search"] = run_search(self)
            self.store.save()
        ex = self.recipe.export
        if ex.onnx:
            names = ex.variants or [
                n for n, v in self.variants.items() if v.is_float and v.dtype == "float32"
            ]
            twins = [n for n in names if f"{n}-onnx" not in self.variants and n in self.variants]
            jobs = [
                Job(f"{n}-onnx", "export.onnx", n, ex.options, len(steps) + i) for i, n in enumerate(twins)
            ]
            self.run_steps(jobs)

    def select(self) -> None:
        """Record which variant meets the recipe's constraints (when it has any)."""
        from ..search.selection import select_for

        selection = select_for(self.recipe, self.results, self.devices)
        if selection is not None:
            self.results["selection"] = selection

    # ----------------------------------------------------------------- the step interface

    def entry(self, name: str) -> dict[str, Any] | None:
        """The results entry of variant ``name`` so far, if it has one."""
        return self.store.entry(name) if self.store is not None else None

    @property
    def parallel(self) -> bool:
        """Whether steps given together to :meth:`run_steps` build in parallel (Ray)."""
        return self.engine is not None

    def run_step(
        self, name: str, pass_name: str, parent: str, options: BaseModel, index: int | None = None
    ) -> dict[str, Any]:
        """Build variant ``name`` with ``pass_name`` from ``parent``, measure and record it; returns
        its results entry. ``index`` (default: the number of entries so far) seeds the step."""
        index = len(self.results["variants"]) if index is None else index
        return self.run_steps([Job(name, pass_name, parent, options, index)])[0]

    def run_steps(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """Build, measure and record several steps (a step may start from an earlier one of the
        list); returns their entries in the order given. Ray builds them in parallel."""
        if self.engine is not None:
            from ..execution.ray_runner import run_jobs

            return run_jobs(self, self.engine, jobs)
        out = []
        for job in jobs:
            source, entry = self.prepare(job)
            if entry is None:
                assert source is not None
                entry = self._build_here(job, source)
            out.append(entry)
        return out

    def prepare(self, job: Job) -> tuple[Variant | None, dict[str, Any] | None]:
        """The variant ``job`` starts from; or, instead, its entry when there is nothing to build
        (its source failed, or an earlier run finished it: ``--resume``)."""
        assert self.store is not None
        source = self.variants.get(job.parent)
        if source is None:
            return None, self.recorder.failed(
                self.stub(job), time.perf_counter(), f"skipped: its source variant {job.parent!r} failed"
            )
        before = self.store.reusable(job.name, job.pass_name, job.parent, options_json(job.options))
        restored = self.store.load_variant(before) if before is not None else None
        if before is not None and restored is not None:
            self.variants[job.name] = restored
            return None, self.recorder.resumed(before)
        return source, None

    def stub(self, job: Job) -> Variant:
        """The variant a job would make, for recording it failed."""
        source = self.variants.get(job.parent)
        lineage = [*source.lineage, job.name] if source is not None else []
        return Variant(
            job.name,
            pass_name=job.pass_name,
            parent=job.parent,
            lineage=lineage,
            options=options_json(job.options),
        )

    def _build_here(self, job: Job, source: Variant) -> dict[str, Any]:
        assert self.store is not None
        t0 = time.perf_counter()
        seed = self.recipe.seed + job.index + 1
        built = build_step(
            job.name, job.pass_name, source, job.options, self.inputs, seed, self.store.variant_dir(job.name)
        )
        if built.variant is None:
            return self.recorder.failed(self.stub(job), t0, built.error or "failed", built.warnings)
        return self.record(built.variant, t0, built.warnings)

    def record(
        self, v: Variant, t0: float, warns: Any = None, figures: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Save ``v``'s artefact, measure it here (unless its ``figures`` were measured elsewhere)
        and record it."""
        assert self.store is not None
        self.variants[v.name] = v

        def measure() -> tuple[list[Path], dict[str, Any]]:
            files = self.store.save_artifact(v, self.example) if figures is None else self.store.files_of(v)
            parent = self.entry(v.parent) if v.parent else None
            if figures is None:
                return files, self.measurer.measure(v, files, parent)
            return files, {"size": self.measurer.size(v, files, parent), **figures}

        entry = self.recorder.measured(v, t0, warns, measure)
        if entry["status"] != "ok":
            self.variants.pop(v.name, None)
        return entry

    # ----------------------------------------------------------------- output

    def finish(self, status: str, error: str | None = None) -> None:
        assert self.store is not None
        if self.recorder is not None:
            self.recorder.close()
        if hasattr(self, "measurer"):
            self.measurer.close()
        self.store.finish(status, error)
        if self.engine is not None:
            self.engine.close()
        if status == "complete" or self.results["variants"]:
            from ..report import write_reports

            write_reports(self.store.run_dir, self.results, self.recipe.report.formats)

    def run(self) -> RunResult:
        self.setup()
        assert self.store is not None
        try:
            model, _ = self.load()
            self.build_variants(model)
            retime_run(self)
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
    execution: dict[str, Any] | None = None,
) -> RunResult:
    """Run a recipe end to end and return its results (the data ``results.json`` holds).

    ``resume`` names the directory of an earlier run that failed or was interrupted: variants it
    finished are reloaded from their artefacts, the rest are built, all in that directory. The
    recipe defaults to the one saved there. ``execution`` overrides the recipe's (e.g.
    ``{"engine": "ray", "address": "auto"}``).
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
        execution=execution,
    )
    return Pipeline(loaded, progress, resume=resume_dir).run()


__all__ = ["Built", "Pipeline", "RunResult", "run"]
