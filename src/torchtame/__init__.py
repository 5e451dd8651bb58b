"""torchtame: make PyTorch models smaller and faster, and measure every variant honestly."""

from __future__ import annotations

from ._version import __version__
from .data import DataBundle, load_data
from .devices import detect_environment, resolve_devices
from .errors import (
    DataError,
    DeviceError,
    ModelLoadError,
    PassError,
    RecipeError,
    RunError,
    TorchtameError,
)
from .models import load_model
from .pipeline import Pipeline, RunResult, apply_pass, run
from .recipe import Recipe, json_schema, load_recipe
from .registry import register_data_source, register_metric, register_model_source, register_pass
from .variant import PassContext, Variant

__all__ = [
    "DataBundle",
    "DataError",
    "DeviceError",
    "ModelLoadError",
    "PassContext",
    "PassError",
    "Pipeline",
    "Recipe",
    "RecipeError",
    "RunError",
    "RunResult",
    "TorchtameError",
    "Variant",
    "__version__",
    "apply_pass",
    "detect_environment",
    "json_schema",
    "load_data",
    "load_model",
    "load_recipe",
    "register_data_source",
    "register_metric",
    "register_model_source",
    "register_pass",
    "resolve_devices",
    "run",
]
