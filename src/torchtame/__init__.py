"""torchtame: make PyTorch models smaller and faster, and measure every variant honestly."""

from __future__ import annotations

from . import execution  # noqa: F401  (registers the execution engines besides the local one)
from ._version import __version__
from .data import DataBundle, load_data
from .deploy import DeployedVariant, load_variant
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
from .registry import (
    register_data_source,
    register_engine,
    register_metric,
    register_model_source,
    register_pass,
)
from .results import Fidelity, Latency, Size, VariantResult
from .variant import PassContext, Variant

__all__ = [
    "DataBundle",
    "DataError",
    "DeployedVariant",
    "DeviceError",
    "Fidelity",
    "Latency",
    "ModelLoadError",
    "PassContext",
    "PassError",
    "Pipeline",
    "Recipe",
    "RecipeError",
    "RunError",
    "RunResult",
    "Size",
    "TorchtameError",
    "Variant",
    "VariantResult",
    "__version__",
    "apply_pass",
    "detect_environment",
    "json_schema",
    "load_data",
    "load_model",
    "load_recipe",
    "load_variant",
    "register_data_source",
    "register_engine",
    "register_metric",
    "register_model_source",
    "register_pass",
    "resolve_devices",
    "run",
]
