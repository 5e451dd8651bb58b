"""Load a recipe's model and data, check that they fit, and decide what is measured."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..data import DataBundle, load_data
from ..errors import ModelLoadError, first_line
from ..inputs import (
    call,
    describe,
    first_tensor,
    forward_parameters,
    output_items,
    select_output,
    unknown_keys,
)
from ..models import load_model
from ..onnx_runtime import class_scores
from ..progress import Progress
from ..recipe import Recipe
from ..runtime import seed_everything
from .pretrain import pretrain

log = logging.getLogger("torchtame")


@dataclass
class Loaded:
    """The model (trained if the recipe says so), its data, and what is measured of its output."""

    model: torch.nn.Module
    data: DataBundle
    example: Any
    output: str | int | None
    task: str
    data_info: dict[str, Any]
    model_info: dict[str, Any]


def load_inputs(recipe: Recipe, devices: list[str], progress: Progress) -> Loaded:
    """Load data and model, check the model runs on the data, pre-train if asked."""
    seed_everything(recipe.seed)
    progress.status("loading data")
    data = load_data(recipe.data, recipe.seed)
    progress.status("loading model")
    model = load_model(recipe.model)
    example = data.example_input(1)
    output = recipe.evaluate.output if recipe.evaluate.output is not None else recipe.model.declared_output()
    out = check_inputs(model, example, recipe.model.input_shape, output)
    task = resolve_task(recipe, data, select_output(out, output))
    model_info: dict[str, Any] = {
        "class": type(model).__name__,
        "module": type(model).__module__,
        "input_shape": list(first_tensor(example).shape),
        "inputs": describe(example),
        "outputs": [f"{n}: {list(t.shape)}" for n, t in output_items(out)],
    }
    if recipe.model.train is not None:
        model_info["training"] = pretrain(model, recipe, data, devices, progress)
    data_info = {
        "description": data.description,
        "has_labels": data.has_labels,
        "labels": data.labels_mode,
        "num_classes": data.num_classes,
        "sample_shape": list(data.sample_shape),
        "evaluation_samples": len(data.evaluation.dataset),  # type: ignore[arg-type]
        "calibration_samples": len(data.calibration.dataset),  # type: ignore[arg-type]
    }
    return Loaded(model.eval(), data, example, output, task, data_info, model_info)


def check_inputs(model: torch.nn.Module, example: Any, input_shape: list[int] | None, output: Any) -> Any:
    """Run the model once on the data's example (errors name the mismatch); returns its output."""
    first = first_tensor(example)
    if input_shape is not None and list(first.shape[1:]) != list(input_shape[1:]):
        raise ModelLoadError(
            f"model.input_shape is {input_shape}, but the data's samples have shape {list(first.shape[1:])}",
            hint="make `data` produce that shape (image_size, channels) or fix model.input_shape",
        )
    unknown = unknown_keys(model, example)
    if unknown:
        params, _ = forward_parameters(model)
        raise ModelLoadError(
            f"the data's samples have keys {unknown} that {type(model).__name__}.forward() does not "
            f"take (it takes {', '.join(params)})",
            hint="drop those keys from the samples, or rename them to forward()'s arguments",
        )
    try:
        with torch.inference_mode():
            out = call(model, example)
    except Exception as exc:
        shape = f"of shape {list(first.shape)}" if isinstance(example, torch.Tensor) else describe(example)
        raise ModelLoadError(
            f"the model does not accept the data's inputs {shape}: {first_line(exc)}",
            hint="make `data` produce what the model expects (shape, channels, image_size, keys)",
        ) from exc
    try:
        select_output(out, output)
    except KeyError as exc:
        raise ModelLoadError(
            f"evaluate.output: {exc.args[0]}", hint="name one of the model's outputs (a key or an index)"
        ) from None
    return out


def resolve_task(recipe: Recipe, data: DataBundle, measured: torch.Tensor) -> str:
    """classification or features: the recipe's choice, else the model source's, else the data's."""
    task = recipe.evaluate.task
    if task == "auto":
        task = recipe.model.declared_task() or ("classification" if data.has_labels else "features")
    if task == "classification" and not class_scores(measured):
        log.info("the measured output is not shaped like class scores; fidelity headlines cosine")
        task = "features"
    classes = data.num_classes
    if (
        recipe.evaluate.task == "auto"
        and task == "classification"
        and classes
        and measured.shape[-1] != classes
    ):
        log.info(
            "the measured output has %d values per sample, the data %d classes: measuring it as features",
            measured.shape[-1],
            classes,
        )
        task = "features"
    return task
