"""Run a recipe's builds and measurements as Ray tasks (`execution: {engine: ray}`, `--ray`).

- Every step's build (pass, calibration, fine-tuning, export) is a task with the CPUs (torch
  threads) and GPUs it needs; a step is submitted once its parent is built. The parent travels as
  its artefact's bytes and the built variant comes back the same way, into the head's run
  directory; only the head writes results.json (atomically, after every variant).
- Every measurement is a task that holds the node's measuring slot (the custom resource
  ``torchtame_measure``, one per node) and, by default, all of the node's CPUs: no two timings
  share a node, and nothing is built beside one. Every latency records its node; the baseline is
  timed on every measuring node, so each speed-up compares measurements of one node.
- A task whose worker is lost becomes a failed variant with the reason; the run goes on. Ctrl-C
  cancels every task in flight.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import RunError, first_line
from ..optional import require

log = logging.getLogger("torchtame")

MEASURE = "torchtame_measure"  # the custom resource of a node's one measuring slot
SLOT = "'{\"torchtame_measure\": 1}'"  # how `ray start --resources` declares it
LOCAL_IP = "127.0.0.2"  # a loopback address Ray does not rewrite to the machine's public IP


@dataclass
class Package:
    """A variant that travels between processes: its results.json description and its files."""

    entry: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)


def pack(variant: Any, paths: list[Path]) -> Package:
    return Package(variant.to_entry(), {p.name: p.read_bytes() for p in paths})


def unpack(package: Package, directory: Path | None = None) -> Any:
    """The variant again, its module loaded from the package's files."""
    from ..artifacts import load_module
    from ..variant import Variant

    v = Variant.from_entry(package.entry)
    if not package.files:
        return v
    directory = directory or Path(tempfile.mkdtemp(prefix="torchtame-task-"))
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in package.files.items():
        (directory / name).write_bytes(data)
    first = directory / next(iter(package.files))
    if first.suffix == ".onnx":
        v.onnx_path = first
    else:
        v.module = load_module(first).eval()
    return v


@functools.lru_cache(maxsize=2)
def _context(recipe_json: str, modules: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """The recipe and its data, loaded once per worker process; ``modules`` (the user's own
    modules that registered passes or sources the recipe names) are imported first."""
    import importlib

    from ..data import load_data
    from ..recipe import load_recipe

    for module in modules:
        importlib.import_module(module)
    recipe = load_recipe(recipe_json)
    return recipe, load_data(recipe.data, recipe.seed)


def user_modules() -> tuple[str, ...]:
    """Modules outside torchtame that registered items: workers import them to know the items."""
    from ..registry import DATA_SOURCES, METRICS, MODEL_SOURCES, PASSES

    found = {e.fn.__module__ for reg in (PASSES, MODEL_SOURCES, DATA_SOURCES, METRICS) for e in reg.entries()}
    return tuple(sorted(m for m in found if m and not m.startswith("torchtame")))


def _ensure_registered(pass_name: str, module: str | None) -> None:
    """A pass registered by the user's own module (not a plugin) is registered on the worker by
    importing that module, which must be importable there."""
    import importlib

    from ..registry import PASSES

    if pass_name not in PASSES and module:
        importlib.import_module(module)


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def build_task(
    recipe_json: str,
    job: dict[str, Any],
    parent: Package,
    baseline: Package | None,
    context: dict[str, Any],
) -> dict[str, Any]:
    """One step's build on a worker; returns the built variant's package, or the error."""
    import torch

    from ..pipeline.executor import StepInputs, build_step
    from ..progress import NullProgress

    torch.set_num_threads(context["threads"])
    t0 = time.perf_counter()
    _ensure_registered(job["pass"], job.get("module"))
    _, data = _context(recipe_json, tuple(context.get("modules", ())))
    work = Path(tempfile.mkdtemp(prefix="torchtame-build-"))
    source = unpack(parent, work / "parent")
    variants = {source.name: source}
    if baseline is not None:
        variants["baseline"] = (
            unpack(baseline, work / "baseline") if baseline.entry["name"] != source.name else source
        )
    inputs = StepInputs(
        data,
        data.example_input(1),
        context["devices"],
        variants,
        NullProgress(),
        context["output"],
        context["task"],
    )
    built = build_step(job["name"], job["pass"], source, job["options"], inputs, job["seed"], work / "out")
    result: dict[str, Any] = {
        "node": _node(),
        "warnings": dict(built.warnings),
        "seconds": time.perf_counter() - t0,
    }
    if built.variant is None:
        return {**result, "error": built.error}
    from ..pipeline.store import artifact_files

    files = artifact_files(built.variant, work / "artefact", data.example_input(1))
    return {**result, "package": pack(built.variant, files)}


def measure_task(
    recipe_json: str, package: Package, context: dict[str, Any], accuracy: bool
) -> dict[str, Any]:
    """Accuracy and latency of one variant on the worker's node (which this task holds alone)."""
    import torch

    from ..pipeline.measure import Measurer

    torch.set_num_threads(context["threads"])
    t0 = time.perf_counter()
    recipe, data = _context(recipe_json, tuple(context.get("modules", ())))
    directory = Path(tempfile.mkdtemp(prefix="torchtame-measure-"))
    v = unpack(package, directory)
    files = [directory / name for name in package.files]
    m = Measurer(
        recipe.evaluate,
        data,
        context["choices"],
        data.example_input(1),
        baseline_outputs=context.get("baseline_outputs"),
        baseline_accuracy=context.get("baseline_accuracy") or {},
        output=context["output"],
        task=context["task"],
    )
    try:
        out = m.run(v, node=_node(), accuracy=accuracy, files=files)
    finally:
        m.close()
        shutil.rmtree(directory, ignore_errors=True)
    if v.name == "baseline" and accuracy:
        out["_baseline_outputs"] = m.baseline_outputs
    out["measure_s"] = round(time.perf_counter() - t0, 3)
    return out


class RayEngine:
    """Connects to (or starts) a Ray cluster and runs build and measurement tasks on it."""

    def __init__(
        self, address: str | None, max_parallel: int | None, step_cpus: int, exclusive: bool
    ) -> None:
        self.ray = require("ray", "the ray execution engine", RunError)
        self.max_parallel = max_parallel
        self.step_cpus = step_cpus
        self.exclusive = exclusive
        self.started = False
        if not self.ray.is_initialized():
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            if address is None:  # a local Ray instance on a loopback address, for this run
                self.ray.init(
                    resources={MEASURE: 1},
                    _node_ip_address=LOCAL_IP,
                    include_dashboard=False,
                    log_to_driver=False,
                    configure_logging=False,
                )
                self.started = True
            else:
                try:
                    self.ray.init(address=address, log_to_driver=False, configure_logging=False)
                except Exception as exc:
                    raise RunError(
                        f"cannot connect to the Ray cluster at {address!r}: {first_line(exc, 200)}",
                        hint="start one (`ray start --head --resources '{\"torchtame_measure\": 1}'`) or "
                        "drop the address to start a local one",
                    ) from exc
        self.nodes = self.measuring_nodes()
        if not self.nodes:
            raise RunError(
                f"no node of the Ray cluster has the `{MEASURE}` resource, so nothing could be measured",
                hint=f"start each node with `ray start ... --resources {SLOT}`",
            )
        largest = max(n["Resources"].get("CPU", 0) for n in self.ray.nodes() if n.get("Alive"))
        if step_cpus > largest:  # such a task could never be scheduled: the run would wait forever
            raise RunError(
                f"execution.step_cpus is {step_cpus}, but no node of the Ray cluster has more than "
                f"{largest:g} CPUs",
                hint=f"set `execution.step_cpus` to at most {largest:g}",
            )
        self._build = self.ray.remote(max_retries=0)(build_task)
        self._measure = self.ray.remote(max_retries=0)(measure_task)

    def measuring_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self.ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(MEASURE, 0) >= 1]

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "ray",
            "ray": self.ray.__version__,
            "nodes": [
                {"node": n["NodeID"], "address": n["NodeManagerAddress"], "cpus": n["Resources"].get("CPU")}
                for n in self.nodes
            ],
            "started_local_cluster": self.started,
        }

    def submit_build(
        self,
        recipe_json: str,
        job: dict[str, Any],
        parent: Package,
        baseline: Package | None,
        context: dict[str, Any],
        gpus: float,
    ) -> Any:
        return self._build.options(num_cpus=self.step_cpus, num_gpus=gpus).remote(
            recipe_json, job, parent, baseline, {**context, "threads": self.step_cpus}
        )

    def submit_measure(
        self,
        recipe_json: str,
        package: Package,
        context: dict[str, Any],
        gpus: float,
        node: str | None = None,
        accuracy: bool = True,
    ) -> Any:
        cpus = self._cpus(node)
        options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "resources": {MEASURE: 1}}
        if node is not None:
            strategy = self.ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                node_id=node, soft=False
            )
            options["scheduling_strategy"] = strategy
        threads = context.get("threads") or int(cpus)
        return self._measure.options(**options).remote(
            recipe_json, package, {**context, "threads": threads}, accuracy
        )

    def _cpus(self, node: str | None) -> float:
        if not self.exclusive:
            return 1
        cpus = [n["Resources"].get("CPU", 1) for n in self.nodes if node is None or n["NodeID"] == node]
        return min(cpus) if cpus else 1

    def wait(self, refs: list[Any], timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        return self.ray.wait(refs, num_returns=1, timeout=timeout)

    def get(self, ref: Any) -> tuple[Any, str | None]:
        """The task's result, or (None, why there is none)."""
        errors = self.ray.exceptions
        try:
            return self.ray.get(ref), None
        except errors.RayTaskError as exc:  # the task itself raised
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            return None, f"failed on the Ray worker: {type(cause).__name__}: {first_line(cause, 200)}"
        except errors.RayError as exc:  # the worker or its node went away
            return None, f"the Ray worker was lost ({type(exc).__name__}): {first_line(exc, 200)}"

    def cancel(self, refs: list[Any]) -> None:
        for ref in refs:
            try:
                self.ray.cancel(ref, force=True)
            except Exception as exc:  # already finished, or its worker already gone
                log.debug("cancel: %s", exc)

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()


def make_engine(config: Any) -> RayEngine:
    return RayEngine(config.address, config.max_parallel, config.step_cpus, config.exclusive_measure)


Factory = Callable[[Any], RayEngine]
