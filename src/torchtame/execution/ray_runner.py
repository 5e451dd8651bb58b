"""Schedule a pipeline's steps on Ray: builds as soon as their parent is built, measurements as
soon as a measuring slot is free, every result recorded by the head (see :mod:`.ray_engine`).

It talks to the pipeline through its public engine interface only: ``prepare`` (resume, skipped
steps), ``stub``, ``record``, ``recorder``, ``variants``, ``store``, ``measurer``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from ..registry import PASSES
from .ray_engine import Package, RayEngine, pack, unpack, user_modules

if TYPE_CHECKING:
    from ..pipeline.core import Pipeline
    from ..pipeline.executor import Job
    from ..variant import Variant

log = logging.getLogger("torchtame")
TRAINING_PASSES = {"finetune", "prune.structured", "quantize.torchao"}


def _recipe_json(pipe: Pipeline) -> str:
    return pipe.recipe.model_dump_json(by_alias=True)


def _context(pipe: Pipeline) -> dict[str, Any]:
    return {
        "modules": user_modules(),
        "devices": pipe.devices,
        "choices": pipe.choices,
        "output": pipe.output,
        "task": pipe.task,
        "threads": pipe.recipe.evaluate.latency.threads,
    }


def _gpus(pipe: Pipeline, training: bool) -> float:
    cuda = any(d.startswith("cuda") for d in pipe.devices)
    return 1.0 if cuda and training else 0.0


class _Packages:
    """Each variant's package, put in Ray's object store once."""

    def __init__(self, pipe: Pipeline, engine: RayEngine) -> None:
        self.pipe, self.engine = pipe, engine
        self.refs: dict[str, Any] = {}

    def put(self, name: str, package: Package) -> Any:
        self.refs[name] = self.engine.ray.put(package)
        return self.refs[name]

    def get(self, name: str) -> Any:
        if name not in self.refs:
            v = self.pipe.variants[name]
            assert self.pipe.store is not None
            self.put(name, pack(v, self.pipe.store.files_of(v)))
        return self.refs[name]


def _packages(pipe: Pipeline, engine: RayEngine) -> _Packages:
    if not hasattr(engine, "packages"):
        engine.packages = _Packages(pipe, engine)  # type: ignore[attr-defined]
    return engine.packages  # type: ignore[attr-defined,no-any-return]


def measure_baseline(pipe: Pipeline, engine: RayEngine, baseline: Variant) -> dict[str, Any]:
    """Time the baseline on every measuring node (speed-ups compare one node's measurements);
    accuracy and the reference outputs come from the first."""
    assert pipe.store is not None
    t0 = time.perf_counter()
    files = pipe.store.save_artifact(baseline, pipe.example)
    ref = _packages(pipe, engine).put("baseline", pack(baseline, files))
    gpus = _gpus(pipe, True)
    tasks = [
        engine.submit_measure(
            _recipe_json(pipe), ref, _context(pipe), gpus, node=n["NodeID"], accuracy=i == 0
        )
        for i, n in enumerate(engine.nodes)
    ]
    results = [engine.get(r) for r in tasks]
    (first, lost), others = results[0], results[1:]
    if lost is not None:
        assert pipe.recorder is not None
        return pipe.recorder.failed(baseline, t0, f"measuring failed: {lost}")
    pipe.measurer.baseline_outputs = first.pop("_baseline_outputs")
    pipe.measurer.baseline_accuracy = first["accuracy"] or {}
    for out, why in others:
        if why is not None:
            log.warning("the baseline could not be timed on one node: %s", why)
            continue
        first["latency"] += out["latency"]
    return pipe.record(baseline, t0, None, first)


def run_jobs(pipe: Pipeline, engine: RayEngine, jobs: list[Job]) -> list[dict[str, Any]]:
    """Build and measure ``jobs`` on the cluster, respecting their lineage; their entries in order."""
    assert pipe.store is not None and pipe.recorder is not None
    packages = _packages(pipe, engine)
    recipe_json = _recipe_json(pipe)
    waiting = list(jobs)
    names = {j.name for j in jobs}
    entries: dict[str, dict[str, Any]] = {}
    sizes: dict[str, dict[str, Any]] = {}
    builds: dict[Any, tuple[Job, float]] = {}
    measures: dict[Any, tuple[Job, Variant, float, Counter[str], str]] = {}

    def parent_of(job: Job) -> dict[str, Any] | None:
        entry = pipe.entry(job.parent)
        return entry or ({"name": job.parent, "size": sizes[job.parent]} if job.parent in sizes else None)

    def submit_ready() -> None:
        for job in list(waiting):
            if engine.max_parallel is not None and len(builds) >= engine.max_parallel:
                return
            if job.parent in names and job.parent not in pipe.variants and job.parent not in entries:
                continue  # its parent is still being built
            waiting.remove(job)
            source, entry = pipe.prepare(job)
            if entry is not None:
                entries[job.name] = entry
                continue
            assert source is not None
            spec = {
                "name": job.name,
                "pass": job.pass_name,
                "options": job.options,
                "seed": pipe.recipe.seed + job.index + 1,
                "module": PASSES.get(job.pass_name).fn.__module__,
            }
            ref = engine.submit_build(
                recipe_json,
                spec,
                packages.get(job.parent),
                packages.get("baseline"),
                _context(pipe),
                _gpus(pipe, job.pass_name in TRAINING_PASSES),
            )
            builds[ref] = (job, time.perf_counter())

    def built(ref: Any) -> None:
        job, t0 = builds.pop(ref)
        out, lost = engine.get(ref)
        warns = Counter(out.get("warnings", {}) if out else {})
        if lost is not None or "error" in out:
            entries[job.name] = pipe.recorder.failed(pipe.stub(job), t0, lost or out["error"], warns)
            return
        assert pipe.store is not None
        v = unpack(out["package"], pipe.store.variant_dir(job.name))
        pipe.variants[job.name] = v  # its children may start now
        sizes[job.name] = pipe.measurer.size(v, pipe.store.files_of(v), parent_of(job))
        mref = engine.submit_measure(
            recipe_json,
            packages.put(job.name, out["package"]),
            {
                **_context(pipe),
                "baseline_outputs": pipe.measurer.baseline_outputs,
                "baseline_accuracy": pipe.measurer.baseline_accuracy,
            },
            _gpus(pipe, any(d.startswith("cuda") for d in pipe.devices)),
        )
        measures[mref] = (job, v, t0, warns, out["node"])
        sizes[job.name]["_build_s"] = round(out["seconds"], 3)

    def measured(ref: Any) -> None:
        job, v, t0, warns, node = measures.pop(ref)
        figures, lost = engine.get(ref)
        if lost is not None:
            pipe.variants.pop(job.name, None)
            entries[job.name] = pipe.recorder.failed(v, t0, f"measuring failed: {lost}", warns)
            return
        size = sizes[job.name]
        figures.update({"size": size, "built_on": node, "build_s": size.pop("_build_s", None)})
        entries[job.name] = pipe.record(v, t0, warns, figures)

    try:
        submit_ready()
        while builds or measures or waiting:
            if not builds and not measures:
                submit_ready()
                if not builds and not measures and waiting:  # nothing can start: sources failed
                    for job in list(waiting):
                        waiting.remove(job)
                        _, entry = pipe.prepare(job)
                        entries[job.name] = entry or pipe.recorder.failed(
                            pipe.stub(job), time.perf_counter(), "not built"
                        )
                continue
            ready, _ = engine.wait([*builds, *measures])
            for ref in ready:
                if ref in builds:
                    built(ref)
                else:
                    measured(ref)
            submit_ready()
    except KeyboardInterrupt:
        engine.cancel([*builds, *measures])
        raise
    return [entries[j.name] for j in jobs]
