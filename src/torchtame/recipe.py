"""The recipe: a pydantic schema, YAML loading, and errors that name the field and the line.

Model sources, data sources and passes each own the pydantic model of their options; the full
recipe model is assembled from the registries (a discriminated union on ``source`` / ``pass``),
so a plugin's options are validated and appear in ``optimize schema`` like the built-in ones.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from . import data, models, passes  # noqa: F401  (importing them registers the built-ins)
from .errors import RecipeError
from .evaluate.accuracy import METRICS
from .evaluate.health import HealthConfig
from .options import (
    NAME_PATTERN,
    DataSourceOptions,
    ModelSourceOptions,
    PretrainOptions,
    Strict,
    TrainOptions,
    UserPath,
)
from .passes.export import OnnxOptions
from .passes.finetune import FinetuneOptions
from .passes.onnx_quant import OnnxQuantOptions
from .passes.prune import PruneOptions
from .passes.qat import QatOptions
from .passes.static.fx import StaticOptions
from .recipe_errors import format_errors
from .registry import DATA_SOURCES, ENGINES, MODEL_SOURCES, PASSES

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")

__all__ = [
    "NAME_PATTERN",
    "Constraints",
    "DataSourceOptions",
    "ModelSourceOptions",
    "PretrainOptions",
    "Recipe",
    "Strict",
    "TrainOptions",
    "UserPath",
    "json_schema",
    "load_recipe",
    "recipe_model",
]


class StepBase(Strict):
    """One entry of ``steps``: a named pass applied to an earlier variant."""

    name: str = Field(pattern=NAME_PATTERN, description="Variant name this step produces.")
    from_: str = Field(
        "baseline", alias="from", description="Variant this step starts from (default baseline)."
    )


class LatencyConfig(Strict):
    enabled: bool = True
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1])
    warmup: int = Field(5, ge=0)
    min_runs: int = Field(20, ge=1)
    min_time_s: float = Field(0.5, ge=0)
    max_runs: int = Field(100_000, ge=1)
    threads: int | None = Field(
        None, ge=1, description="Threads while timing (torch.set_num_threads and onnxruntime intra-op)."
    )
    inference_mode: bool = True
    onnx_graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    rounds: int = Field(
        1,
        ge=1,
        le=20,
        description="At the end of the run, time every variant again (the baseline with them) in this "
        "many rounds per device and batch, in a new random order each round; each figure becomes its "
        "median round, so machine drift hits all variants alike. 1: each variant is timed once, "
        "when it is built (local engine; under Ray each variant is timed once on its node).",
    )

    @model_validator(mode="after")
    def _runs(self) -> LatencyConfig:
        if self.max_runs < self.min_runs:
            raise ValueError(f"max_runs ({self.max_runs}) must be >= min_runs ({self.min_runs})")
        return self


class EvaluateConfig(Strict):
    metrics: list[str] = Field(
        default_factory=lambda: ["top1", "top5", "fidelity"],
        description="Accuracy metrics: top1, top5, fidelity (agreement with the baseline), or "
        "'module:callable' taking (logits, labels|None, baseline_logits|None) and returning a dict.",
    )
    latency: LatencyConfig = Field(default_factory=LatencyConfig)
    macs: bool = True
    memory: bool = Field(
        True,
        description="Peak inference memory per device and batch (CPU: a fresh child process per reading).",
    )
    memory_repeats: int = Field(3, ge=1, le=20, description="CPU memory: median of this many readings.")
    health: HealthConfig = Field(default_factory=HealthConfig)
    output: str | int | None = Field(
        None,
        description="Which output of the model is measured: a dict/ModelOutput key or a tuple index "
        "(default: `logits` if the output has it, else the first tensor).",
    )
    task: Literal["auto", "classification", "features"] = Field(
        "auto",
        description="What the measured output is. classification: class scores (top-1, agreement); "
        "features: embeddings, hidden states, regression (cosine similarity and errors are the "
        "headline). auto: classification when the data has labels or the model source says so "
        "(torchvision classifiers, transformers *-classification), else features.",
    )

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        for name in value:
            if name not in METRICS and ":" not in name:
                raise ValueError(
                    f"unknown metric {name!r}; allowed: {', '.join(METRICS.names())} or 'module:callable'"
                )
        return value


class ExportConfig(Strict):
    onnx: bool = Field(False, description="Export every float variant to a verified ONNX twin.")
    variants: list[str] | None = Field(
        None, description="Which variants to export (default: every float variant)."
    )
    options: OnnxOptions = Field(
        default_factory=OnnxOptions, description="Options of the export.onnx pass used for each twin."
    )


class ReportConfig(Strict):
    formats: list[Literal["json", "md", "html"]] = Field(default_factory=lambda: ["json", "md", "html"])
    table: bool = True


class Constraints(Strict):
    """What a deployable variant must meet; the run picks the fastest variant that meets all."""

    max_accuracy_drop: float | None = Field(
        None,
        ge=0,
        description="Top-1 points below the baseline (agreement points where the optimizer has no labels).",
    )
    min_cosine: float | None = Field(
        None, ge=-1, le=1, description="Cosine similarity of the measured output to the baseline's."
    )
    min_agreement: float | None = Field(
        None, ge=0, le=100, description="Top-1 agreement with the baseline in % (class-score outputs)."
    )
    max_latency_ms: float | None = Field(None, gt=0, description="p50 at `device` and `batch_size`.")
    max_size_mb: float | None = Field(None, gt=0, description="Artefact size in MiB.")
    max_memory_mb: float | None = Field(
        None, gt=0, description="Peak inference memory in MiB at `device` and `batch_size`."
    )
    device: str | None = Field(None, description="Device of the latency constraint (default: the first).")
    batch_size: int | None = Field(
        None, ge=1, description="Batch of the latency constraint (default: first)."
    )

    @property
    def fidelity(self) -> bool:
        """Whether any constraint is on accuracy or fidelity."""
        return any(v is not None for v in (self.max_accuracy_drop, self.min_cosine, self.min_agreement))

    @property
    def empty(self) -> bool:
        return not self.fidelity and all(
            v is None for v in (self.max_latency_ms, self.max_size_mb, self.max_memory_mb)
        )


class SearchConfig(Strict):
    """`strategy: search`: sensitivity analysis, then candidates, then the fastest that fits."""

    sensitivity: bool = Field(True, description="Per-layer quantization and pruning sensitivity.")
    sensitivity_prune_ratio: float = Field(0.5, gt=0, lt=1)
    quantize: bool = Field(True, description="Static int8 candidates, keeping sensitive layers float.")
    quantize_options: StaticOptions = Field(
        default_factory=StaticOptions, description="quantize.static options."
    )
    max_float_layers: int = Field(3, ge=0, description="Keep at most this many layers in float.")
    prune: bool = Field(True, description="Pruning candidates.")
    prune_search: Literal["grid", "bisect"] = "grid"
    prune_ratios: list[Annotated[float, Field(gt=0, lt=1)]] = Field(default_factory=lambda: [0.25, 0.5, 0.75])
    bisect_steps: int = Field(4, ge=1, le=10)
    prune_options: PruneOptions = Field(default_factory=PruneOptions, description="prune.structured options.")
    protect_layers: int = Field(
        2,
        ge=0,
        description="Where a pruning ratio misses, retry it leaving this many most sensitive layers whole.",
    )
    finetune: FinetuneOptions | None = Field(
        None,
        description="finetune options applied to every pruning candidate (e.g. {epochs: 2}; "
        "{loss: distill} needs no labels).",
    )
    onnx: bool = Field(
        True,
        description="onnxruntime candidates: static int8 with each calibration method, then with the most "
        "sensitive nodes excluded.",
    )
    onnx_methods: list[Literal["MinMax", "Percentile", "Entropy", "RangeSearch"]] = Field(
        default_factory=lambda: ["MinMax", "Percentile", "Entropy", "RangeSearch"],
        description="Calibrations tried in order (the first that meets stops the rest); RangeSearch "
        "chooses each tensor's range by its int8 error.",
    )
    onnx_options: OnnxQuantOptions = Field(
        default_factory=OnnxQuantOptions, description="quantize.onnx options of the ONNX candidates."
    )
    combine: bool = Field(True, description="Also quantize the best pruning candidate.")
    recovery: bool = Field(
        True,
        description="When plain static int8 misses the constraints, try it with `recovery: auto` "
        "(range search, bias correction, equalization, AdaRound: the best on calibration batches) "
        "before keeping layers float.",
    )
    qat: bool = Field(
        True,
        description="When no post-training int8 candidate meets the constraints (even with "
        "`max_float_layers` kept float), try quantization-aware training (quantize.qat).",
    )
    qat_options: QatOptions = Field(default_factory=QatOptions, description="quantize.qat options.")


class ExecutionConfig(Strict):
    """Where the work runs: here (local), or as tasks on a Ray cluster."""

    engine: str = Field("local", description="A registered execution engine: local (here) or ray.")
    address: str | None = Field(
        None,
        description="ray: null starts a local Ray instance for the run; `auto` joins the running cluster; "
        "or `host:port` / `ray://host:port`.",
    )
    max_parallel: int | None = Field(None, ge=1, description="ray: at most this many builds at once.")
    step_cpus: int = Field(1, ge=1, description="ray: CPUs (torch threads) of each build task.")
    exclusive_measure: bool = Field(
        True, description="ray: a measurement holds all of its node's CPUs, so nothing runs beside it."
    )

    @field_validator("engine")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in ENGINES.names():
            raise ValueError(f"{value!r} is not an execution engine; allowed: {', '.join(ENGINES.names())}")
        return value


class Recipe(Strict):
    """A whole recipe. ``model``, ``data`` and ``steps`` are typed by the registries."""

    name: str = Field(pattern=NAME_PATTERN)
    description: str = ""
    seed: int = 0
    output_dir: UserPath = Path("runs")
    model: Any
    data: Any
    devices: list[str] = Field(default_factory=lambda: ["auto"])
    steps: list[Any] = Field(default_factory=list)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)
    strategy: Literal["steps", "search"] = Field(
        "steps", description="steps: run the listed steps; search: also search for candidates."
    )
    constraints: Constraints = Field(default_factory=Constraints)
    search: SearchConfig = Field(default_factory=SearchConfig)
    execution: ExecutionConfig = Field(default_factory=ExecutionConfig)

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            if not value:
                raise ValueError("at least one device is needed; allowed: auto, cpu, cuda, cuda:N")
            for item in value:
                if not isinstance(item, str) or not DEVICE_PATTERN.match(item):
                    raise ValueError(f"{item!r} is not a device; allowed: auto, cpu, cuda, cuda:N")
        return value

    @model_validator(mode="before")
    @classmethod
    def _tokenizer_from_model(cls, raw: Any) -> Any:
        """Text data without a tokenizer uses the `transformers` model's directory (a new dict:
        what the user wrote is not changed)."""
        if not isinstance(raw, dict):
            return raw
        data_, model = raw.get("data"), raw.get("model")
        if (
            isinstance(data_, dict)
            and data_.get("source") == "text"
            and data_.get("tokenizer") is None
            and isinstance(model, dict)
            and model.get("source") == "transformers"
            and model.get("path") is not None
        ):
            return {**raw, "data": {**data_, "tokenizer": model["path"]}}
        return raw

    def variant_names(self) -> list[str]:
        """Every variant the steps make, the baseline first."""
        return ["baseline", *(s.name for s in self.steps)]

    @model_validator(mode="after")
    def _step_lineage(self) -> Recipe:
        known = ["baseline"]
        for i, step in enumerate(self.steps):
            if step.name in known:
                raise ValueError(f"steps[{i}].name: variant name {step.name!r} is used twice")
            if step.from_ not in known:
                raise ValueError(
                    f"steps[{i}].from: {step.from_!r} is not an earlier variant; allowed: {', '.join(known)}"
                )
            known.append(step.name)
        return self

    @model_validator(mode="after")
    def _search_has_constraints(self) -> Recipe:
        if self.strategy == "search" and self.constraints.empty:
            raise ValueError(
                "constraints: `strategy: search` needs at least one of max_accuracy_drop, min_cosine, "
                "min_agreement, max_latency_ms, max_size_mb, max_memory_mb"
            )
        return self

    @model_validator(mode="after")
    def _constraints_measured(self) -> Recipe:
        c = self.constraints
        if c.batch_size is not None and c.batch_size not in self.evaluate.latency.batch_sizes:
            raise ValueError(
                f"constraints.batch_size: {c.batch_size} is not measured; allowed: "
                f"{', '.join(map(str, self.evaluate.latency.batch_sizes))} (evaluate.latency.batch_sizes)"
            )
        if c.device is not None and c.device not in self.devices and not DEVICE_PATTERN.match(c.device):
            raise ValueError(f"constraints.device: {c.device!r} is not a device; allowed: cpu, cuda, cuda:N")
        return self

    @model_validator(mode="after")
    def _text_has_tokenizer(self) -> Recipe:
        if getattr(self.data, "source", None) == "text" and self.data.tokenizer is None:
            raise ValueError(
                "data.tokenizer: required field is missing (only a `transformers` model's directory "
                "can stand in for it)"
            )
        return self

    @model_validator(mode="after")
    def _export_names(self) -> Recipe:
        known = self.variant_names()
        for name in self.export.variants or []:
            if name not in known:
                raise ValueError(f"export.variants: {name!r} is not a variant; allowed: {', '.join(known)}")
        return self

    def to_yaml(self) -> str:
        """The recipe as resolved (defaults filled in), in YAML."""
        return yaml.safe_dump(self.model_dump(mode="json", by_alias=True), sort_keys=False)


_cache: dict[tuple[int, int, int], type[Recipe]] = {}


def recipe_model() -> type[Recipe]:
    """The Recipe class with ``model``/``data``/``steps`` typed by what is registered now."""
    key = (MODEL_SOURCES.version, DATA_SOURCES.version, PASSES.version)
    if key in _cache:
        return _cache[key]

    def union(options: list[type[BaseModel]], tag: str) -> Any:
        if len(options) == 1:
            return options[0]
        return Annotated[Union[tuple(options)], Field(discriminator=tag)]  # noqa: UP007

    steps = []
    for entry in PASSES.entries():
        steps.append(
            create_model(
                "Step_" + re.sub(r"\W", "_", entry.name),
                __base__=StepBase,
                __doc__=entry.summary or None,
                pass_=(Literal[entry.name], Field(alias="pass")),  # type: ignore[valid-type]
                options=(entry.options, Field(default_factory=entry.options)),
            )
        )
    model_spec = union([e.options for e in MODEL_SOURCES.entries()], "source")
    data_spec = union([e.options for e in DATA_SOURCES.entries()], "source")
    cls = create_model(
        "Recipe",
        __base__=Recipe,
        model=(model_spec, ...),
        data=(data_spec, ...),
        steps=(list[union(steps, "pass_")], Field(default_factory=list)),  # type: ignore[misc]
    )
    _cache.clear()
    _cache[key] = cls
    return cls


def json_schema() -> dict[str, Any]:
    """The JSON schema of recipes, for editors (``optimize schema``)."""
    schema = recipe_model().model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "torchtame recipe"
    return schema


def load_recipe(source: str | Path | dict[str, Any] | Recipe, **overrides: Any) -> Recipe:
    """Load and validate a recipe from a YAML file, YAML text or a dict.

    ``overrides`` replace top-level fields (e.g. ``output_dir``, ``devices``) before validation.
    """
    if isinstance(source, Recipe):
        if not overrides:
            return source
        source = source.model_dump(mode="json", by_alias=True)
    where = "recipe"
    node = None
    if isinstance(source, dict):
        raw: Any = dict(source)
    else:
        text, where = _read_text(source)
        try:
            raw = yaml.safe_load(text)
            node = yaml.compose(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise RecipeError(
                f"{where}{line}: not valid YAML: {problem}",
                hint="check indentation and quoting near that line",
            ) from None
        if not isinstance(raw, dict):
            raise RecipeError(
                f"{where}: a recipe is a YAML mapping of keys (name, model, data, steps, ...), "
                f"got {type(raw).__name__}",
                hint="see `optimize schema` or recipes/quickstart.yaml",
            )
    for key, value in overrides.items():
        if value is not None:
            raw[key] = value
    cls = recipe_model()
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        raise RecipeError(format_errors(exc, raw, node, where, cls)) from None


def _read_text(source: str | Path) -> tuple[str, str]:
    path = Path(source)
    looks_like_path = isinstance(source, Path) or (
        "\n" not in str(source) and str(source).endswith((".yaml", ".yml"))
    )
    if looks_like_path:
        if not path.is_file():
            raise RecipeError(
                f"recipe file {str(path)!r} does not exist",
                hint="pass the path of a YAML recipe, e.g. recipes/quickstart.yaml",
            )
        return path.read_text(encoding="utf-8"), str(path)
    return str(source), "recipe"
