"""What runs on a Ray worker: one step's build and one variant's measurement, and the packages
that carry variants between processes. :mod:`.ray_engine` schedules them.

- A build gets its parent as the artefact's bytes and sends the built variant back the same way;
  only the head writes the run directory and results.json.
- A measurement holds its node's measuring slot (the custom resource ``torchtame_measure``, one
  per node) and, by default, all of the node's CPUs, so no two timings share a node.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
