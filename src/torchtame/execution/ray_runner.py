"""Schedule a run's steps on Ray: builds as soon as their parent is built, measurements as soon as
a measuring slot is free, every outcome recorded by the head through the run's
:class:`~torchtame.pipeline.engine.StepHost` (never the pipeline itself)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..registry import PASSES
from .ray_tasks import Package, pack, unpack, user_modules

if TYPE_CHECKING:
    from ..pipeline.engine import StepHost
    from ..pipeline.executor import Job
    from ..results import SizeEntry, VariantEntry
    from ..variant import Variant
    from .ray_engine import RayEngine

log = logging.getLogger("torchtame")


@dataclass
class Building:
    """A build task in flight."""

    job: Job
    t0: float


@dataclass
class Measuring:
    """A measurement task in flight, and what its build left for the record."""

    job: Job
    variant: Variant
    t0: float
    warns: Counter[str]
    node: str
    size: SizeEntry
    build_s: float


class Schedule:
    """One run on the cluster: its packages in Ray's object store (each put once) and the steps
    in flight."""

    def __init__(self, cluster: RayEngine, host: StepHost) -> None:
        self.cluster, self.host = cluster, host
        self.recipe_json = host.recipe.model_dump_json(by_alias=True)
        self.refs: dict[str, Any] = {}

    # ---------------------------------------------------------------- what tasks get

    def context(self, **extra: Any) -> dict[str, Any]:
        h = self.host
        return {
            "modules": user_modules(),
            "devices": h.devices,
            "choices": h.choices,
            "output": h.inputs.output,
            "task": h.inputs.task,
            "threads": h.threads,
            **extra,
        }

    def gpus(self, wanted: bool) -> float:
        return 1.0 if wanted and any(d.startswith("cuda") for d in self.host.devices) else 0.0

    def put(self, name: str, package: Package) -> Any:
        self.refs[name] = self.cluster.ray.put(package)
        return self.refs[name]

    def package(self, name: str) -> Any:
        """The object-store reference of variant ``name``'s package (put on first use)."""
        if name not in self.refs:
            v = self.host.variants[name]
            self.put(name, pack(v, self.host.files_of(v)))
        return self.refs[name]

    # ---------------------------------------------------------------- the baseline

    def measure_baseline(self, baseline: Variant) -> VariantEntry:
        """Time the baseline on every measuring node (speed-ups compare one node's measurements);
        accuracy and the reference outputs come from the first."""
        t0 = time.perf_counter()
        ref = self.put("baseline", pack(baseline, self.host.save_artifact(baseline)))
        tasks = [
            self.cluster.submit_measure(
                self.recipe_json, ref, self.context(), self.gpus(True), node=n["NodeID"], accuracy=i == 0
            )
            for i, n in enumerate(self.cluster.nodes)
        ]
        results = [self.cluster.get(r) for r in tasks]
        (first, lost), others = results[0], results[1:]
        if lost is not None:
            return self.host.failed(baseline, t0, f"measuring failed: {lost}")
        self.host.set_reference(first.pop("_baseline_outputs"), first["accuracy"] or {})
        for out, why in others:
            if why is not None:
                log.warning("the baseline could not be timed on one node: %s", why)
                continue
            first["latency"] += out["latency"]
        return self.host.record(baseline, t0, None, first)

    # ---------------------------------------------------------------- steps

    def run(self, jobs: list[Job]) -> list[VariantEntry]:
        """Build and measure ``jobs`` on the cluster, respecting their lineage; their entries in order."""
        return _Batch(self, jobs).run()


@dataclass
class _Batch:
    """The steps of one ``run_steps`` call: waiting, building, measuring, done."""

    schedule: Schedule
    jobs: list[Job]
    waiting: list[Job] = field(default_factory=list)
    building: dict[Any, Building] = field(default_factory=dict)
    measuring: dict[Any, Measuring] = field(default_factory=dict)
    done: dict[str, VariantEntry] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.waiting = list(self.jobs)
        self.names = {j.name for j in self.jobs}
        self.host = self.schedule.host
        self.cluster = self.schedule.cluster
        self.sizes: dict[str, SizeEntry] = {}  # built here, measured later: children's MACs need them

    def run(self) -> list[VariantEntry]:
        try:
            self.submit_ready()
            while self.building or self.measuring or self.waiting:
                if not self.building and not self.measuring:
                    self.submit_ready()
                    if not self.building and not self.measuring:
                        self.give_up_waiting()
                    continue
                ready, _ = self.cluster.wait([*self.building, *self.measuring])
                for ref in ready:
                    if ref in self.building:
                        self.built(ref, self.building.pop(ref))
                    else:
                        self.measured(ref, self.measuring.pop(ref))
                self.submit_ready()
        except KeyboardInterrupt:
            self.cluster.cancel([*self.building, *self.measuring])
            raise
        return [self.done[j.name] for j in self.jobs]

    def parent_entry(self, job: Job) -> dict[str, Any] | None:
        entry = self.host.entry(job.parent)
        if entry is None and job.parent in self.sizes:
            return {"name": job.parent, "size": self.sizes[job.parent]}
        return dict(entry) if entry is not None else None

    def submit_ready(self) -> None:
        """Submit every waiting step whose parent is built (up to ``max_parallel`` builds)."""
        for job in list(self.waiting):
            limit = self.cluster.max_parallel
            if limit is not None and len(self.building) >= limit:
                return
            pending = job.parent in self.names and job.parent not in self.done
            if pending and job.parent not in self.host.variants:
                continue  # its parent is still being built
            self.waiting.remove(job)
            source, entry = self.host.prepare(job)
            if entry is not None:
                self.done[job.name] = entry
                continue
            assert source is not None
            spec = {
                "name": job.name,
                "pass": job.pass_name,
                "options": job.options,
                "seed": self.host.seed(job),
                "module": PASSES.get(job.pass_name).fn.__module__,
            }
            ref = self.cluster.submit_build(
                self.schedule.recipe_json,
                spec,
                self.schedule.package(job.parent),
                self.schedule.package("baseline"),
                self.schedule.context(),
                self.schedule.gpus(PASSES.has_trait(job.pass_name, "trains")),
            )
            self.building[ref] = Building(job, time.perf_counter())

    def give_up_waiting(self) -> None:
        """Nothing can start any more (their sources failed): record why."""
        for job in list(self.waiting):
            self.waiting.remove(job)
            _, entry = self.host.prepare(job)
            if entry is None:
                entry = self.host.failed(self.host.stub(job), time.perf_counter(), "not built")
            self.done[job.name] = entry

    def built(self, ref: Any, b: Building) -> None:
        out, lost = self.cluster.get(ref)
        warns = Counter(out.get("warnings", {}) if out else {})
        if lost is not None or "error" in out:
            why = lost or out["error"]
            self.done[b.job.name] = self.host.failed(self.host.stub(b.job), b.t0, why, warns)
            return
        v = unpack(out["package"], self.host.variant_dir(b.job.name))
        self.host.add_built(v)  # its children may start now
        size = self.host.measurer.size(v, self.host.files_of(v), self.parent_entry(b.job))
        self.sizes[b.job.name] = size
        context = self.schedule.context(
            baseline_outputs=self.host.baseline_outputs, baseline_accuracy=self.host.baseline_accuracy
        )
        mref = self.cluster.submit_measure(
            self.schedule.recipe_json,
            self.schedule.put(b.job.name, out["package"]),
            context,
            self.schedule.gpus(True),
        )
        self.measuring[mref] = Measuring(b.job, v, b.t0, warns, out["node"], size, round(out["seconds"], 3))

    def measured(self, ref: Any, m: Measuring) -> None:
        figures, lost = self.cluster.get(ref)
        if lost is not None:
            self.done[m.job.name] = self.host.failed(m.variant, m.t0, f"measuring failed: {lost}", m.warns)
            return
        figures.update({"size": m.size, "built_on": m.node, "build_s": m.build_s})
        self.done[m.job.name] = self.host.record(m.variant, m.t0, m.warns, figures)
