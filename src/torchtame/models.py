"""Model sources: torchvision by name, ``module:callable``, checkpoints, TorchScript, local
Hugging Face directories (``transformers``; never the hub).

Each source is registered with its own options model; ``load_model`` dispatches on ``source``.
"""

from __future__ import annotations

import difflib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from .errors import ModelLoadError, first_line
from .optional import require
from .options import ModelSourceOptions, UserPath
from .registry import MODEL_SOURCES, register_model_source
from .registry import resolve_callable as _resolve

ModelFn = Callable[[Any], nn.Module]


def resolve_callable(target: str, what: str = "target") -> Callable[..., Any]:
    """Import ``package.module:attr`` or ``path/to/file.py:attr`` (errors are ModelLoadError)."""
    return _resolve(target, what, ModelLoadError)


class TorchvisionModel(ModelSourceOptions):
    source: Literal["torchvision"]
    name: str = Field(description="Architecture, e.g. resnet18, mobilenet_v3_small.")
    weights: UserPath | None = Field(None, description="Local state-dict file (no download).")
    num_classes: int | None = Field(None, ge=1)
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def declared_task(self) -> str | None:
        import torchvision

        return "classification" if self.name in torchvision.models.list_models(torchvision.models) else None


class PythonModel(ModelSourceOptions):
    source: Literal["python"]
    target: str = Field(description="'package.module:callable' or 'path/file.py:callable'.")
    kwargs: dict[str, Any] = Field(default_factory=dict)


class CheckpointModel(ModelSourceOptions):
    source: Literal["checkpoint"]
    path: UserPath
    architecture: str | None = Field(
        None,
        description="torchvision name or 'module:callable' building the model the state dict "
        "fits; omit for a checkpoint that holds a whole saved module.",
    )
    kwargs: dict[str, Any] = Field(default_factory=dict)
    key: str | None = Field(None, description="Key of the state dict inside the checkpoint dict.")
    trust_checkpoint: bool = Field(
        False, description="Allow pickled Python objects (only for checkpoints you trust)."
    )


class TorchScriptModel(ModelSourceOptions):
    source: Literal["torchscript"]
    path: UserPath


HF_TASKS = {
    "feature-extraction": ("AutoModel", "features", "last_hidden_state"),
    "sequence-classification": ("AutoModelForSequenceClassification", "classification", "logits"),
    "token-classification": ("AutoModelForTokenClassification", "classification", "logits"),
    "masked-lm": ("AutoModelForMaskedLM", "classification", "logits"),
    "causal-lm": ("AutoModelForCausalLM", "classification", "logits"),
}


class TransformersModel(ModelSourceOptions):
    source: Literal["transformers"]
    path: UserPath = Field(description="Local Hugging Face model directory (config.json + weights).")
    task: Literal[
        "feature-extraction", "sequence-classification", "token-classification", "masked-lm", "causal-lm"
    ] = Field(
        "feature-extraction",
        description="Which model head to load (AutoModel, ...ForSequenceClassification, ...).",
    )
    output: str | None = Field(
        None,
        description="Output to measure (default: logits, or last_hidden_state for feature-extraction); "
        "`evaluate.output` overrides it.",
    )
    attn_implementation: Literal["eager", "sdpa"] | None = Field(
        None, description="Attention kernel (default: the model's own choice)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="More from_pretrained keyword arguments."
    )

    def declared_task(self) -> str | None:
        return HF_TASKS[self.task][1]

    def declared_output(self) -> str | None:
        return self.output or HF_TASKS[self.task][2]


def load_model(spec: ModelSourceOptions) -> nn.Module:
    """Build the model the recipe's ``model`` section names, in eval mode."""
    entry = MODEL_SOURCES.get(spec.source)  # type: ignore[attr-defined]
    model = entry.fn(spec)
    if not isinstance(model, nn.Module):
        raise ModelLoadError(
            f"model source {entry.name!r} returned {type(model).__name__}, not a torch.nn.Module",
            hint="the callable must return an nn.Module instance",
        )
    return model.eval()


def _torchvision_builder(name: str) -> Callable[..., nn.Module]:
    import torchvision

    names = torchvision.models.list_models()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        raise ModelLoadError(
            f"torchvision has no model {name!r}",
            hint=f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()",
        )
    return lambda **kw: torchvision.models.get_model(name, weights=None, **kw)


def _load_file(path: Path, trust: bool) -> Any:
    if not path.is_file():
        raise ModelLoadError(f"checkpoint file {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as exc:
        if not trust and "Unsupported global" in str(exc):
            raise ModelLoadError(
                f"checkpoint {str(path)!r} holds pickled Python objects (e.g. a whole module), "
                "which are refused by default because unpickling can run arbitrary code",
                hint="save a state dict instead, or set `trust_checkpoint: true` if you trust it",
            ) from exc
        raise ModelLoadError(
            f"checkpoint {str(path)!r} is not a readable torch file: {first_line(exc)}"
        ) from exc
    except (RuntimeError, EOFError, OSError) as exc:
        raise ModelLoadError(
            f"checkpoint {str(path)!r} is not a readable torch file: {first_line(exc)}"
        ) from exc


def load_state_dict_into(model: nn.Module, state: Any, where: str, key: str | None = None) -> None:
    """Load a state dict (possibly nested under a key) with a readable error on mismatch."""
    if isinstance(state, dict) and key is not None:
        if key not in state:
            raise ModelLoadError(f"{where}: no key {key!r}; keys: {', '.join(map(str, state))}")
        state = state[key]
    elif isinstance(state, dict):
        for candidate in ("state_dict", "model_state_dict", "model"):
            if isinstance(state.get(candidate), dict):
                state = state[candidate]
                break
    if not isinstance(state, dict):
        raise ModelLoadError(f"{where} holds a {type(state).__name__}, not a state dict")
    result = model.load_state_dict(state, strict=False)
    problems = []
    if result.missing_keys:
        problems.append(f"{len(result.missing_keys)} missing (e.g. {result.missing_keys[0]})")
    if result.unexpected_keys:
        problems.append(f"{len(result.unexpected_keys)} unexpected (e.g. {result.unexpected_keys[0]})")
    if problems:
        raise ModelLoadError(
            f"{where} does not fit the architecture: keys {'; '.join(problems)}",
            hint="check that `architecture` (and its kwargs, e.g. num_classes) match the checkpoint",
        )


def _size_mismatch(exc: RuntimeError, where: str) -> ModelLoadError:
    first = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), str(exc))
    return ModelLoadError(
        f"{where} does not fit the architecture: {first}",
        hint="check `num_classes` and the architecture's kwargs",
    )


@register_model_source("torchvision", TorchvisionModel)
def _torchvision(spec: TorchvisionModel) -> nn.Module:
    """A torchvision architecture, with weights from a local file."""
    kwargs = dict(spec.kwargs)
    if spec.num_classes is not None:
        kwargs["num_classes"] = spec.num_classes
    model = _torchvision_builder(spec.name)(**kwargs)
    if spec.weights is not None:
        state = _load_file(spec.weights, trust=False)
        try:
            load_state_dict_into(model, state, f"weights file {str(spec.weights)!r}")
        except RuntimeError as exc:
            raise _size_mismatch(exc, f"weights file {str(spec.weights)!r}") from exc
    return model


@register_model_source("python", PythonModel)
def _python(spec: PythonModel) -> nn.Module:
    """Whatever ``package.module:callable(**kwargs)`` returns."""
    fn = resolve_callable(spec.target, "model.target")
    try:
        return fn(**spec.kwargs)
    except TypeError as exc:
        raise ModelLoadError(f"model.target {spec.target!r} rejected its kwargs: {exc}") from exc


@register_model_source("checkpoint", CheckpointModel)
def _checkpoint(spec: CheckpointModel) -> nn.Module:
    """A state dict for a given architecture, or a whole saved module (trusted only)."""
    obj = _load_file(spec.path, trust=spec.trust_checkpoint)
    where = f"checkpoint {str(spec.path)!r}"
    if isinstance(obj, nn.Module):
        return obj
    if spec.architecture is None:
        raise ModelLoadError(
            f"{where} holds a state dict, so the model's architecture is needed",
            hint="set `architecture:` to a torchvision name or 'module:callable'",
        )
    if ":" in spec.architecture:
        model = resolve_callable(spec.architecture, "model.architecture")(**spec.kwargs)
    else:
        model = _torchvision_builder(spec.architecture)(**spec.kwargs)
    try:
        load_state_dict_into(model, obj, where, spec.key)
    except RuntimeError as exc:
        raise _size_mismatch(exc, where) from exc
    return model


@register_model_source("torchscript", TorchScriptModel)
def _torchscript(spec: TorchScriptModel) -> nn.Module:
    """A TorchScript archive (torch.jit.save)."""
    if not spec.path.is_file():
        raise ModelLoadError(f"TorchScript file {str(spec.path)!r} does not exist")
    try:
        return torch.jit.load(str(spec.path), map_location="cpu")
    except RuntimeError as exc:
        raise ModelLoadError(
            f"{str(spec.path)!r} is not a TorchScript archive: {first_line(exc)}",
            hint="use `source: checkpoint` for torch.save files",
        ) from exc


@register_model_source("transformers", TransformersModel)
def _transformers(spec: TransformersModel) -> nn.Module:
    """A Hugging Face model from a local directory (local_files_only: the hub is never contacted)."""
    transformers = require("transformers", "the transformers model source", ModelLoadError)
    path = spec.path
    if not (path.is_dir() and (path / "config.json").is_file()):
        raise ModelLoadError(
            f"model.path: {str(path)!r} is not a Hugging Face model directory (no config.json)",
            hint="save one with model.save_pretrained(path) (and tokenizer.save_pretrained(path))",
        )
    cls = getattr(transformers, HF_TASKS[spec.task][0])
    kwargs = dict(spec.kwargs)
    if spec.attn_implementation is not None:
        kwargs["attn_implementation"] = spec.attn_implementation
    try:
        return cls.from_pretrained(str(path), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"model.path: cannot load a {spec.task} model from {str(path)!r}: {first_line(exc, 240)}",
            hint="check `task` matches the checkpoint (e.g. feature-extraction for a bare encoder)",
        ) from exc
