"""The pipeline: recipe -> baseline + one variant per step -> measurements -> run directory.

Each variant is built, saved, measured and written to ``results.json`` before the next one, so an
interrupted or failed run leaves every finished variant intact. ``results.json`` is replaced
atomically and says ``complete`` only when the whole run finished.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from ..data import DataBundle
from ..devices import resolve_devices
from ..errors import RunError, TorchtameError
from ..passes.export import NAME as ONNX_EXPORT
from ..progress import NullProgress, Progress
from ..recipe import Recipe, load_recipe
from ..registry import ENGINES
from ..results import Results, VariantEntry, VariantResult, chosen_name, find_entry, views
from ..variant import Variant
from .engine import Engine, StepHost
from .executor import Built, Job, StepInputs
from .loading import load_inputs
from .measure import Measurer
from .record import Recorder
from .store import RunStore, check_run_dir

log = logging.getLogger("torchtame")


@dataclass
class RunResult:
    """What ``run`` returns: the run directory, the data ``results.json`` holds, and typed views.

    ``variants`` maps each variant's name to its :class:`~torchtame.results.VariantResult`
    (named fields for latency, fidelity, size and health); ``chosen`` is the variant the run
    chose (the fastest that meets the recipe's constraints; None without constraints or when
    none meets them); ``modules`` holds the built variants themselves (modules or ONNX files).
    """

    run_dir: Path
    results: Results
    modules: dict[str, Variant] = field(default_factory=dict, repr=False)

    @property
    def status(self) -> str:
        return self.results["status"]

    @property
    def variants(self) -> dict[str, VariantResult]:
        return views(self.results["variants"])

    @property
    def chosen(self) -> VariantResult | None:
        name = chosen_name(self.results)
        return self.variants[name] if name is not None else None

    def variant(self, name: str) -> VariantEntry:
        """The results.json entry of one variant."""
        entry = find_entry(self.results, name)
        if entry is None:
            raise KeyError(f"no variant {name!r}; variants: {[v['name'] for v in self.results['variants']]}")
        return entry


class Pipeline:
    """Runs one recipe. Use :func:`run` unless you need the stages one by one.

    Its public step interface (``run_step``/``run_steps``, ``entry``, ``variants``,
    ``baseline_outputs``, ``parallel``) is what the search builds its candidates through. Steps
    are built and measured by an :class:`~torchtame.pipeline.engine.Engine` (``execution.engine``)
    that sees the run through a :class:`~torchtame.pipeline.engine.StepHost`.
    """

    def __init__(self, recipe: Recipe, progress: Progress | None = None, resume: Path | None = None) -> None:
        self.recipe = recipe
        self.resume_dir = resume
        self.progress = progress or NullProgress()
        self.variants: dict[str, Variant] = {}
        self.store: RunStore | None = None
        self.recorder: Recorder | None = None
        self.measurer: Measurer | None = None
        self.engine: Engine | None = None
        self.host: StepHost | None = None

    @property
    def run_dir(self) -> Path | None:
        return self.store.run_dir if self.store is not None else None

    @property
    def results(self) -> Results:
        return self.store.results if self.store is not None else {}

    @property
    def baseline_outputs(self) -> torch.Tensor | None:
        return self.measurer.baseline_outputs if self.measurer is not None else None

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
        self.engine = ENGINES.get(r.execution.engine).fn(r.execution)
        self.results["execution"] = self.engine.describe()
        self.store.save()

    def load(self) -> tuple[torch.nn.Module, DataBundle]:
        assert self.store is not None and self.recorder is not None
        loaded = load_inputs(self.recipe, self.devices, self.progress)
        self.data, self.example, self.output, self.task = (
            loaded.data,
            loaded.example,
            loaded.output,
            loaded.task,
        )
        self.results["settings"].update({"task": self.task, "output": self.output})
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
        inputs = StepInputs(
            self.data, self.example, self.devices, self.variants, self.progress, self.output, self.task
        )
        self.host = StepHost(self.recipe, self.store, self.recorder, self.measurer, inputs, self.choices)
        return loaded.model, self.data

    def build_variants(self, model: torch.nn.Module) -> None:
        assert self.store is not None and self.recorder is not None and self.measurer is not None
        assert self.engine is not None and self.host is not None
        baseline = Variant(name="baseline", module=model, lineage=["baseline"])
        self.variants["baseline"] = baseline
        previous = self.store.previous.get("baseline")
        if previous is not None:
            self.measurer.restore_baseline(baseline, previous)
            base_entry = self.recorder.resumed(previous)
        else:
            base_entry = self.engine.measure_baseline(self.host, baseline)
        if base_entry.get("status") == "failed":
            raise RunError(f"the baseline could not be measured: {base_entry['error']}")
        steps = self.recipe.steps
        self.run_steps([Job(s.name, s.pass_, s.from_, s.options, i) for i, s in enumerate(steps)])
        if self.recipe.strategy == "search":
            from ..search import run_search

            self.results["search"] = run_search(self)
            self.store.save()
        self.run_steps(self.onnx_twins(len(steps)))

    def onnx_twins(self, first_index: int) -> list[Job]:
        """``export.onnx: true``: a verified ONNX twin of every float32 variant (or those named)."""
        ex = self.recipe.export
        if not ex.onnx:
            return []
        names = ex.variants or [n for n, v in self.variants.items() if v.is_float and v.dtype == "float32"]
        twins = [n for n in names if f"{n}-onnx" not in self.variants and n in self.variants]
        return [Job(f"{n}-onnx", ONNX_EXPORT, n, ex.options, first_index + i) for i, n in enumerate(twins)]

    def select(self) -> None:
        """Record which variant meets the recipe's constraints (when it has any)."""
        from ..search.selection import select_for

        selection = select_for(self.recipe, self.results, self.devices)
        if selection is not None:
            self.results["selection"] = selection

    # ----------------------------------------------------------------- the step interface

    def entry(self, name: str) -> VariantEntry | None:
        """The results entry of variant ``name`` so far, if it has one."""
        return self.store.entry(name) if self.store is not None else None

    @property
    def parallel(self) -> bool:
        """Whether steps given together to :meth:`run_steps` build at once (Ray)."""
        return self.engine is not None and self.engine.parallel

    def run_step(
        self, name: str, pass_name: str, parent: str, options: BaseModel, index: int | None = None
    ) -> VariantEntry:
        """Build variant ``name`` with ``pass_name`` from ``parent``, measure and record it; returns
        its results entry. ``index`` (default: the number of entries so far) seeds the step."""
        index = len(self.results["variants"]) if index is None else index
        return self.run_steps([Job(name, pass_name, parent, options, index)])[0]

    def run_steps(self, jobs: list[Job]) -> list[VariantEntry]:
        """Build, measure and record several steps (a step may start from an earlier one of the
        list); returns their entries in the order given."""
        assert self.engine is not None and self.host is not None
        return self.engine.run_steps(self.host, jobs) if jobs else []

    # ----------------------------------------------------------------- output

    def finish(self, status: str, error: str | None = None) -> None:
        assert self.store is not None
        if self.recorder is not None:
            self.recorder.close()
        if self.measurer is not None:
            self.measurer.close()
        self.store.finish(status, error)
        if self.engine is not None:
            self.engine.close()
        if status == "complete" or self.results["variants"]:
            from ..report import write_reports

            write_reports(self.store.run_dir, self.results, self.recipe.report.formats)

    def run(self) -> RunResult:
        try:
            self.setup()
            model, _ = self.load()
            assert self.engine is not None and self.host is not None
            self.build_variants(model)
            self.engine.retime(self.host)
            self.select()
        except KeyboardInterrupt:
            self._fail("interrupted", "interrupted by the user (Ctrl-C)")
            raise
        except TorchtameError as exc:
            self._fail("failed", str(exc))
            raise
        except Exception as exc:
            self._fail("failed", f"{type(exc).__name__}: {exc}")
            raise
        self.finish("complete")
        assert self.store is not None
        return RunResult(self.store.run_dir, self.results, dict(self.variants))

    def _fail(self, status: str, error: str) -> None:
        if self.store is not None:
            self.finish(status, error)
        elif self.engine is not None:
            self.engine.close()


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
