"""Build one variant from a pass: :func:`build_step` is the one step build that the engines (for
the pipeline and the search) and :func:`apply_pass` share."""

from __future__ import annotations

import logging
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from .._warnings import caught
from ..data import DataBundle
from ..errors import TorchtameError
from ..progress import NullProgress, Progress
from ..registry import PASSES
from ..runtime import seed_everything
from ..variant import PassContext, Variant, clone_module

log = logging.getLogger("torchtame")


def options_json(options: Any) -> Any:
    """Pass options in the JSON form results.json records (and resume compares)."""
    return options.model_dump(mode="json") if isinstance(options, BaseModel) else options


@dataclass(frozen=True)
class Job:
    """One step to build: a pass applied to an earlier variant (``index`` seeds it)."""

    name: str
    pass_name: str
    parent: str
    options: Any
    index: int


@dataclass
class StepInputs:
    """What every step of a run shares: data, example input, devices, the variants built so far."""

    data: DataBundle
    example: Any
    devices: list[str]
    variants: dict[str, Variant]
    progress: Progress = field(default_factory=NullProgress)
    output: str | int | None = None
    task: str = "auto"


@dataclass
class Built:
    """The outcome of one step: a variant, or the error that stopped it."""

    variant: Variant | None
    error: str | None
    warnings: Counter[str]
    exception: BaseException | None = None


def describe_failure(exc: BaseException, pass_name: str) -> str:
    """The message results.json records for a pass that raised ``exc``."""
    if isinstance(exc, TorchtameError):
        return str(exc)
    if isinstance(exc, MemoryError | torch.OutOfMemoryError):
        return (
            f"out of memory in {pass_name}: {str(exc).strip()[:300]}; lower data.batch_size or "
            "evaluate.latency.batch_sizes, or run this step on a machine with more memory"
        )
    log.debug("%s failed:\n%s", pass_name, traceback.format_exc())
    return f"{type(exc).__name__}: {str(exc).strip()[:500]}"


def build_step(
    name: str, pass_name: str, parent: Variant, options: Any, inputs: StepInputs, seed: int, work_dir: Path
) -> Built:
    """Apply the registered pass ``pass_name`` to a copy of ``parent`` and name the result ``name``.

    Library warnings are counted into the result; every failure but Ctrl-C is returned as its
    message (what results.json records) and the exception (what :func:`apply_pass` raises).
    """
    inputs.progress.status(f"{name}: {pass_name}")
    warns: Counter[str] = Counter()
    try:
        entry = PASSES.get(pass_name)
        seed_everything(seed)
        ctx = PassContext(
            parent=parent,
            data=inputs.data,
            example_input=inputs.example,
            seed=seed,
            work_dir=work_dir,
            devices=inputs.devices,
            baseline=inputs.variants.get("baseline", parent),
            variants=inputs.variants,
            progress=inputs.progress,
            output=inputs.output,
            task=inputs.task,
        )
        with caught(pass_name, warns):
            model = clone_module(parent.module) if parent.module is not None else None
            made = entry.fn(model, ctx, options)
    except Exception as exc:
        return Built(None, describe_failure(exc, pass_name), warns, exc)
    made.name = name
    made.pass_name, made.parent, made.lineage = pass_name, parent.name, [*parent.lineage, name]
    made.options = options_json(options)
    return Built(made, None, warns)


def apply_pass(
    name: str,
    model: torch.nn.Module | Variant,
    data: DataBundle,
    options: dict[str, Any] | BaseModel | None = None,
    *,
    work_dir: str | Path | None = None,
    seed: int = 0,
    devices: list[str] | None = None,
    progress: Progress | None = None,
    output: str | int | None = None,
    baseline: torch.nn.Module | Variant | None = None,
    task: str = "auto",
) -> Variant:
    """Apply one registered pass outside a recipe; the input model is not changed. ``output``
    names the model output that is measured (default: ``logits`` or the first tensor);
    ``baseline`` is the original model (the teacher of ``loss: distill``); ``task`` says whether
    the output is class scores (``classification``) or ``features`` (auto: class scores when the
    data has labels).

    >>> v = apply_pass("quantize.static", model, data, {"backend": "x86"})  # doctest: +SKIP
    """
    entry = PASSES.get(name)
    opts = options if isinstance(options, BaseModel) else entry.options.model_validate(options or {})
    parent = model if isinstance(model, Variant) else Variant(name="input", module=model, lineage=["input"])
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="torchtame-"))
    work.mkdir(parents=True, exist_ok=True)
    variants = {parent.name: parent}
    if baseline is not None:
        variants["baseline"] = (
            baseline
            if isinstance(baseline, Variant)
            else Variant(name="baseline", module=baseline, lineage=["baseline"])
        )
    if task == "auto":
        task = "classification" if data.has_labels else "features"
    inputs = StepInputs(
        data=data,
        example=data.example_input(1),
        devices=devices or ["cpu"],
        variants=variants,
        progress=progress or NullProgress(),
        output=output,
        task=task,
    )
    built = build_step(name, name, parent, opts, inputs, seed, work)
    if built.exception is not None:
        raise built.exception
    assert built.variant is not None
    return built.variant


__all__ = ["Built", "Job", "StepInputs", "apply_pass", "build_step"]
