"""The seam between the pipeline and whatever builds and measures its steps.

The pipeline talks to *an* :class:`Engine`, chosen by name from the ``ENGINES`` registry
(``execution.engine`` in the recipe), and never asks which one it has. An engine sees the run
through a :class:`StepHost` (the run's inputs, the variants built so far, and the ways to record
an outcome), never the ``Pipeline`` object; it writes nothing of the pipeline's. The
:class:`LocalEngine` builds and measures in this process, one step after the other, and ends the
run with the side-by-side timing rounds; ``execution/ray_engine.py`` registers the Ray engine.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch

from ..devices import DeviceChoice
from ..recipe import ExecutionConfig, Recipe
from ..registry import register_engine
from ..results import VariantEntry
from ..variant import Variant
from .executor import Job, StepInputs, build_step, options_json
from .measure import Measurer
from .record import Recorder
from .rounds import retime
from .store import RunStore

log = logging.getLogger("torchtame")


class StepHost:
    """What an engine may use of a run. Every outcome goes through ``record`` / ``failed``, which
    save it at once; ``add_built`` and ``set_reference`` are the only ways to change the run's
    state besides them."""

    def __init__(
        self,
        recipe: Recipe,
        store: RunStore,
        recorder: Recorder,
        measurer: Measurer,
        inputs: StepInputs,
        choices: list[DeviceChoice],
    ) -> None:
        self.recipe = recipe
        self.store = store
        self.recorder = recorder
        self.measurer = measurer
        self.inputs = inputs
        self.choices = choices
        self._variants = inputs.variants

    # ---------------------------------------------------------------- what the run is

    @property
    def variants(self) -> Mapping[str, Variant]:
        """The variants built so far (read-only: engines add through :meth:`add_built`)."""
        return MappingProxyType(self._variants)

    @property
    def devices(self) -> list[str]:
        return self.inputs.devices

    @property
    def threads(self) -> int | None:
        return self.recipe.evaluate.latency.threads

    @property
    def baseline_outputs(self) -> torch.Tensor | None:
        return self.measurer.baseline_outputs

    @property
    def baseline_accuracy(self) -> dict[str, Any]:
        return self.measurer.baseline_accuracy

    def entry(self, name: str) -> VariantEntry | None:
        return self.store.entry(name)

    def seed(self, job: Job) -> int:
        return self.recipe.seed + job.index + 1

    # ---------------------------------------------------------------- steps

    def prepare(self, job: Job) -> tuple[Variant | None, VariantEntry | None]:
        """The variant ``job`` starts from; or, instead, its entry when there is nothing to build
        (its source failed, or an earlier run finished it: ``--resume``)."""
        source = self._variants.get(job.parent)
        if source is None:
            return None, self.recorder.failed(
                self.stub(job), time.perf_counter(), f"skipped: its source variant {job.parent!r} failed"
            )
        before = self.store.reusable(job.name, job.pass_name, job.parent, options_json(job.options))
        restored = self.store.load_variant(before) if before is not None else None
        if before is not None and restored is not None:
            self._variants[job.name] = restored
            return None, self.recorder.resumed(before)
        return source, None

    def stub(self, job: Job) -> Variant:
        """The variant a job would make, for recording it failed."""
        source = self._variants.get(job.parent)
        lineage = [*source.lineage, job.name] if source is not None else []
        return Variant(
            job.name,
            pass_name=job.pass_name,
            parent=job.parent,
            lineage=lineage,
            options=options_json(job.options),
        )

    def build_here(self, job: Job, source: Variant) -> VariantEntry:
        """Build ``job`` in this process, then measure and record it."""
        t0 = time.perf_counter()
        built = build_step(
            job.name,
            job.pass_name,
            source,
            job.options,
            self.inputs,
            self.seed(job),
            self.store.variant_dir(job.name),
        )
        if built.variant is None:
            return self.recorder.failed(self.stub(job), t0, built.error or "failed", built.warnings)
        return self.record(built.variant, t0, built.warnings)

    # ---------------------------------------------------------------- outcomes

    def add_built(self, v: Variant) -> None:
        """A variant built elsewhere: its children may start from it before it is measured."""
        self._variants[v.name] = v

    def set_reference(self, outputs: torch.Tensor | None, accuracy: dict[str, Any]) -> None:
        """The baseline's outputs and accuracy, measured elsewhere (fidelity is against them)."""
        self.measurer.baseline_outputs = outputs
        self.measurer.baseline_accuracy = accuracy

    def record(
        self,
        v: Variant,
        t0: float,
        warns: Counter[str] | None = None,
        figures: dict[str, Any] | None = None,
    ) -> VariantEntry:
        """Save ``v``'s artefact, measure it here (unless its ``figures`` were measured elsewhere)
        and record it."""
        self._variants[v.name] = v

        def measure() -> tuple[list[Path], dict[str, Any]]:
            files = self.store.save_artifact(v, self.inputs.example) if figures is None else self.files_of(v)
            parent = self.entry(v.parent) if v.parent else None
            if figures is None:
                return files, self.measurer.measure(v, files, parent)
            return files, {"size": self.measurer.size(v, files, parent), **figures}

        entry = self.recorder.measured(v, t0, warns, measure)
        if entry["status"] != "ok":
            self._variants.pop(v.name, None)
        return entry

    def failed(self, v: Variant, t0: float, error: str, warns: Counter[str] | None = None) -> VariantEntry:
        """Record that ``v`` could not be built or measured."""
        self._variants.pop(v.name, None)
        return self.recorder.failed(v, t0, error, warns)

    # ---------------------------------------------------------------- files

    def files_of(self, v: Variant) -> list[Path]:
        return self.store.files_of(v)

    def variant_dir(self, name: str) -> Path:
        return self.store.variant_dir(name)

    def save_artifact(self, v: Variant) -> list[Path]:
        return self.store.save_artifact(v, self.inputs.example)

    def note(self, key: str, value: Any) -> None:
        """Record a run-level setting (``results["settings"][key]``) and save."""
        self.store.results["settings"][key] = value
        self.store.save()


class Engine(Protocol):
    """Builds and measures a run's steps. ``parallel``: steps given together build at once."""

    parallel: bool

    def measure_baseline(self, host: StepHost, baseline: Variant) -> VariantEntry: ...

    def run_steps(self, host: StepHost, jobs: list[Job]) -> list[VariantEntry]: ...

    def retime(self, host: StepHost) -> None: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class LocalEngine:
    """Builds and measures every step in this process, in order; ends with the timing rounds."""

    parallel = False

    def measure_baseline(self, host: StepHost, baseline: Variant) -> VariantEntry:
        return host.record(baseline, time.perf_counter())

    def run_steps(self, host: StepHost, jobs: list[Job]) -> list[VariantEntry]:
        out = []
        for job in jobs:
            source, entry = host.prepare(job)
            if entry is None:
                assert source is not None
                entry = host.build_here(job, source)
            out.append(entry)
        return out

    def retime(self, host: StepHost) -> None:
        """Side-by-side rounds (``evaluate.latency.rounds`` > 1): see :mod:`.rounds`."""
        lat = host.recipe.evaluate.latency
        if not lat.enabled or lat.rounds < 2:
            return
        n = retime(
            dict(host.variants),
            host.store.results["variants"],
            host.measurer,
            lat.rounds,
            host.recipe.seed,
            host.inputs.progress,
        )
        host.note("latency_rounds", lat.rounds if n else 1)

    def describe(self) -> dict[str, Any]:
        return {"engine": "local"}

    def close(self) -> None:
        return None


@register_engine("local")
def local_engine(config: ExecutionConfig) -> LocalEngine:
    """Build and measure in this process."""
    return LocalEngine()


__all__ = ["Engine", "LocalEngine", "StepHost"]
