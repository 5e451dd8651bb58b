"""The pipeline: recipe -> baseline + one variant per step -> measurements -> run directory.

Each variant is built, saved, measured and written to ``results.json`` before the next one, so an
interrupted or failed run leaves every finished variant intact. ``results.json`` is replaced
atomically and says ``complete`` only when the whole run finished.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import random
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import __version__
from ._warnings import caught
from .artifacts import load_module, save_module
from .data import DataBundle, load_data
from .devices import DeviceChoice, detect_environment, resolve_device, resolve_devices, training_device
from .errors import ModelLoadError, RunError, TorchtameError, first_line
from .evaluate import evaluate_accuracy, make_runner, measure_latency, predict
from .evaluate.size import module_params, onnx_params, size_report
from .models import load_model
from .passes import PASSES
from .passes.prune import count_macs_params
from .progress import NullProgress, Progress
from .recipe import Recipe, load_recipe
from .training import train
from .variant import PassContext, Variant, clone_module

log = logging.getLogger("torchtame")


@dataclass
class RunResult:
    """What ``run`` returns: the run directory and the same data ``results.json`` holds."""

    run_dir: Path
    results: dict[str, Any]
    variants: dict[str, Variant] = field(default_factory=dict, repr=False)

    @property
    def status(self) -> str:
        return self.results["status"]

    def variant(self, name: str) -> dict[str, Any]:
        """The results entry of one variant."""
        for v in self.results["variants"]:
            if v["name"] == name:
                return v
        raise KeyError(f"no variant {name!r}; variants: {[v['name'] for v in self.results['variants']]}")


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to a temporary file beside ``path`` and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2, default=_json_default)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, torch.dtype):
        return str(obj).removeprefix("torch.")
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _make_run_dir(recipe: Recipe) -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = recipe.output_dir / f"{recipe.name}-{stamp}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    try:
        run_dir.mkdir(parents=True)
    except OSError as exc:
        raise RunError(
            f"cannot create the run directory {str(run_dir)!r}: {exc.strerror}",
            hint="choose a writable `output_dir` (or --output-dir)",
        ) from exc
    return run_dir


class Pipeline:
    """Runs one recipe. Use :func:`run` unless you need the stages one by one."""

    def __init__(self, recipe: Recipe, progress: Progress | None = None, resume: Path | None = None) -> None:
        self.recipe = recipe
        self.resume_dir = resume
        self.previous: dict[str, dict[str, Any]] = {}
        self.progress = progress or NullProgress()
        self.variants: dict[str, Variant] = {}
        self.baseline_logits: torch.Tensor | None = None
        self.warnings: Counter[str] = Counter()
        self.run_dir: Path | None = None
        self.results: dict[str, Any] = {}

    # ----------------------------------------------------------------- stages

    def setup(self) -> None:
        r = self.recipe
        self.choices: list[DeviceChoice] = resolve_devices(r.devices)
        self.devices = [c.device for c in self.choices if c.device is not None]
        for c in self.choices:
            if c.reason:
                log.info("device %s: %s", c.requested, c.reason)
        if self.resume_dir is not None:
            self.run_dir = self.resume_dir
            self.previous = {v["name"]: v for v in _read_previous(self.resume_dir) if v.get("status") == "ok"}
        else:
            self.run_dir = _make_run_dir(r)
        (self.run_dir / "recipe.yaml").write_text(r.to_yaml(), encoding="utf-8")
        self.results = {
            "torchtame": __version__,
            "status": "running",
            "recipe": r.name,
            "run_dir": str(self.run_dir),
            "started": _now(),
            "finished": None,
            "environment": detect_environment().to_dict(),
            "devices": [
                {"requested": c.requested, "device": c.device, "available": c.available, "reason": c.reason}
                for c in self.choices
            ],
            "settings": {
                "seed": r.seed,
                "metrics": r.evaluate.metrics,
                "latency": r.evaluate.latency.model_dump(),
                "threads": r.evaluate.latency.threads or torch.get_num_threads(),
            },
            "data": None,
            "model": None,
            "variants": [],
            "warnings": {},
            "error": None,
        }
        self.save()

    def load(self) -> tuple[torch.nn.Module, DataBundle]:
        r = self.recipe
        seed_everything(r.seed)
        self.progress.status("loading data")
        self.data = load_data(r.data, r.seed)
        self.progress.status("loading model")
        model = load_model(r.model)
        self.example = self.data.example_input(1)
        expected = r.model.input_shape
        if expected is not None and list(self.example.shape[1:]) != list(expected[1:]):
            raise ModelLoadError(
                f"model.input_shape is {expected}, but the data's samples have shape "
                f"{list(self.example.shape[1:])}",
                hint="make `data` produce that shape (image_size, channels) or fix model.input_shape",
            )
        try:
            with torch.inference_mode():
                model(self.example)
        except Exception as exc:
            raise ModelLoadError(
                f"the model does not accept the data's inputs of shape {list(self.example.shape)}: "
                f"{first_line(exc)}",
                hint="make `data` produce what the model expects (shape, channels, image_size)",
            ) from exc
        info: dict[str, Any] = {"class": type(model).__name__, "input_shape": list(self.example.shape)}
        if r.model.train is not None:
            info["training"] = self._pretrain(model)
        self.results["data"] = {
            "description": self.data.description,
            "has_labels": self.data.has_labels,
            "num_classes": self.data.num_classes,
            "sample_shape": list(self.data.sample_shape),
            "evaluation_samples": len(self.data.evaluation.dataset),  # type: ignore[arg-type]
            "calibration_samples": len(self.data.calibration.dataset),  # type: ignore[arg-type]
        }
        self.results["model"] = info
        return model.eval(), self.data

    def _pretrain(self, model: torch.nn.Module) -> dict[str, Any]:
        r = self.recipe
        cfg = r.model.train
        key = json.dumps(
            {
                "model": r.model.model_dump(mode="json"),
                "data": r.data.model_dump(mode="json"),
                "seed": r.seed,
                "torch": torch.__version__.split("+")[0],
            },
            sort_keys=True,
        )
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        cache = r.output_dir / ".cache" / f"pretrained-{digest}.pt"
        if cfg.cache and cache.is_file():
            model.load_state_dict(torch.load(cache, map_location="cpu", weights_only=True))
            log.info("reusing the trained model cached at %s", cache)
            return {"cached": True, "cache": str(cache)}
        self.progress.status("training the model")
        t0 = time.perf_counter()
        stats = train(
            model,
            self.data.train,
            epochs=cfg.epochs,
            lr=cfg.lr,
            optimizer=cfg.optimizer,
            weight_decay=cfg.weight_decay,
            device=training_device(self.devices),
            seed=r.seed,
            progress=self.progress,
            description="train model",
        )
        stats["seconds"] = round(time.perf_counter() - t0, 2)
        if cfg.cache:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            torch.save(model.state_dict(), tmp)
            os.replace(tmp, cache)
        return {"cached": False, "cache": str(cache) if cfg.cache else None, **stats}

    def build_variants(self, model: torch.nn.Module) -> None:
        baseline = Variant(name="baseline", module=model, lineage=["baseline"])
        self.variants["baseline"] = baseline
        if "baseline" in self.previous:
            self._restore(baseline, self.previous["baseline"])
        else:
            self._finish(baseline, time.perf_counter(), None)
        if self.baseline_entry.get("status") == "failed":
            raise RunError(f"the baseline could not be measured: {self.baseline_entry['error']}")
        for i, step in enumerate(self.recipe.steps):
            self._run_step(step.name, step.pass_, step.from_, step.options, i)
        if self.recipe.strategy == "search":
            from .search import run_search

            self.results["search"] = run_search(self)
            self.save()
        ex = self.recipe.export
        if ex.onnx:
            from .passes.export import OnnxOptions

            options = OnnxOptions.model_validate(ex.options)  # checked when the recipe loaded
            names = ex.variants or [
                n for n, v in self.variants.items() if v.is_float and v.dtype == "float32"
            ]
            for n in names:
                if f"{n}-onnx" not in self.variants and n in self.variants:
                    self._run_step(f"{n}-onnx", "export.onnx", n, options, len(self.variants))

    def select(self) -> None:
        """Record which variant meets the recipe's constraints (when it has any)."""
        c = self.recipe.constraints
        if c.empty:
            return
        from .selection import select

        device = (resolve_device(c.device).device or c.device) if c.device else self.devices[0]
        batch = c.batch_size or self.recipe.evaluate.latency.batch_sizes[0]
        sel = select(self.results, c, device, batch)
        self.results["selection"] = sel
        if sel["chosen"]:
            log.info("chosen: %s, the fastest variant that meets every constraint", sel["chosen"])
        else:
            log.warning("no variant meets every constraint; the best found is %s", sel["best_found"])

    def _run_step(self, name: str, pass_name: str, parent_name: str, options: Any, index: int) -> None:
        t0 = time.perf_counter()
        parent = self.variants.get(parent_name)
        variant = Variant(name=name, pass_name=pass_name, parent=parent_name)
        options_json = options.model_dump(mode="json") if hasattr(options, "model_dump") else options
        variant.options = options_json
        if parent is None:
            self._finish(variant, t0, f"skipped: its source variant {parent_name!r} failed")
            return
        variant.lineage = [*parent.lineage, name]
        before = self.previous.get(name)
        same = (pass_name, parent_name, options_json)
        if before is not None and (before.get("pass"), before.get("from"), before.get("options")) == same:
            restored = self._load_previous(variant, before)
            if restored is not None:
                self.variants[name] = restored
                self._restore(restored, before)
                return
        self.progress.status(f"{name}: {pass_name}")
        seed_everything(self.recipe.seed + index + 1)
        ctx = PassContext(
            parent=parent,
            data=self.data,
            example_input=self.example,
            seed=self.recipe.seed + index + 1,
            work_dir=self._variant_dir(name),
            devices=self.devices,
            baseline=self.variants["baseline"],
            variants=self.variants,
            progress=self.progress,
        )
        entry = PASSES.get(pass_name)
        warns: Counter[str] = Counter()
        try:
            with caught(pass_name, warns):
                model = clone_module(parent.module) if parent.module is not None else None
                made = entry.fn(model, ctx, options)
        except TorchtameError as exc:
            self._finish(variant, t0, str(exc), warns)
            return
        except (MemoryError, torch.OutOfMemoryError) as exc:
            self._finish(
                variant,
                t0,
                f"out of memory in {pass_name}: {str(exc).strip()[:300]}; lower data.batch_size or "
                "evaluate.latency.batch_sizes, or run this step on a machine with more memory",
                warns,
            )
            return
        except Exception as exc:
            log.debug("step %s failed:\n%s", name, traceback.format_exc())
            self._finish(variant, t0, f"{type(exc).__name__}: {str(exc).strip()[:500]}", warns)
            return
        made.name, made.pass_name, made.parent, made.lineage = name, pass_name, parent_name, variant.lineage
        made.options = options_json
        self.variants[name] = made
        self._finish(made, t0, None, warns)

    # ----------------------------------------------------------------- measuring

    def _load_previous(self, variant: Variant, entry: dict[str, Any]) -> Variant | None:
        """The variant a previous (interrupted) run finished, loaded from its artefact."""
        assert self.run_dir is not None
        files = [self.run_dir / f for f in entry.get("artifact", [])]
        if not files or not all(f.is_file() for f in files):
            return None
        restored = Variant(
            name=variant.name,
            pass_name=variant.pass_name,
            parent=variant.parent,
            lineage=variant.lineage,
            dtype=entry.get("dtype", "float32"),
            input_dtype=getattr(torch, entry.get("input_dtype", "float32")),
            devices=entry.get("device_policy", "any"),
            quantized=entry.get("quantized", False),
            backend=entry.get("backend"),
            info=entry.get("info", {}),
        )
        if files[0].suffix == ".onnx":
            restored.onnx_path = files[0]
        else:
            try:
                restored.module = load_module(files[0]).eval()
            except Exception as exc:  # a broken artefact is rebuilt
                log.info("cannot reload %s (%s); rebuilding it", files[0], exc)
                return None
        return restored

    def _restore(self, v: Variant, entry: dict[str, Any]) -> None:
        """Reuse an earlier run's measurements of ``v``. The baseline's outputs are recomputed:
        the variants still to be built need them for fidelity."""
        if v.name == "baseline":
            device = (entry.get("accuracy") or {}).get("device", "cpu")
            with make_runner(v, device if device in self.devices else "cpu") as (run, prepare):
                self.baseline_logits, _ = predict(run, prepare, self.data.evaluation)
        log.info("resumed: %s was finished by the earlier run", v.name)
        self.results["variants"].append({**entry, "resumed": True})
        self.save()

    def _variant_dir(self, name: str) -> Path:
        assert self.run_dir is not None
        d = self.run_dir / "variants" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _save_artifact(self, v: Variant) -> list[Path]:
        if v.kind == "onnx":
            assert v.onnx_path is not None
            return [v.onnx_path, *[p for p in v.onnx_path.parent.glob(v.onnx_path.name + ".data")]]
        return [save_module(v, self._variant_dir(v.name), self.example)]

    def _finish(self, v: Variant, t0: float, error: str | None, warns: Counter[str] | None = None) -> None:
        entry: dict[str, Any] = {
            "name": v.name,
            "status": "failed" if error else "ok",
            "pass": v.pass_name,
            "from": v.parent,
            "lineage": v.lineage,
            "options": v.options,
        }
        if error is None:
            try:
                with caught("measure", warns if warns is not None else Counter()) as w:
                    entry.update(self._measure(v))
                warns = w
            except TorchtameError as exc:
                error = f"measuring failed: {exc}"
            except Exception as exc:
                log.debug("measuring %s failed:\n%s", v.name, traceback.format_exc())
                error = f"measuring failed: {type(exc).__name__}: {str(exc).strip()[:300]}"
            if error:
                entry["status"] = "failed"
                self.variants.pop(v.name, None)
        if error:
            entry["error"] = error
            log.warning("variant %s failed: %s", v.name, first_line(error, 500))
        entry["duration_s"] = round(time.perf_counter() - t0, 3)
        if warns:
            entry["warnings_caught"] = sum(warns.values())
            self.warnings.update(warns)
            self.results["warnings"] = dict(self.warnings.most_common())
        self.results["variants"].append(entry)
        self.save()

    @property
    def baseline_entry(self) -> dict[str, Any]:
        return self.results["variants"][0]

    def _measure(self, v: Variant) -> dict[str, Any]:
        r = self.recipe
        files = self._save_artifact(v)
        assert self.run_dir is not None
        out: dict[str, Any] = {
            "kind": v.kind,
            "dtype": v.dtype,
            "quantized": v.quantized,
            "backend": v.backend,
            "input_dtype": str(v.input_dtype).removeprefix("torch."),
            "device_policy": v.devices,
            "artifact": [str(p.relative_to(self.run_dir)) for p in files],
            "info": v.info,
        }
        # size and MACs
        if v.kind == "onnx":
            assert v.onnx_path is not None
            params = onnx_params(v.onnx_path)
        else:
            assert v.module is not None
            params = module_params(v.module)
        macs = None
        if r.evaluate.macs:
            if v.is_float and v.module is not None and v.dtype == "float32":
                try:
                    macs = count_macs_params(v.module, self.example)[0]
                except Exception as exc:
                    log.debug("MACs of %s not counted: %s", v.name, exc)
            elif v.parent is not None:
                macs = ((self.entry(v.parent) or {}).get("size") or {}).get("macs")
        out["size"] = size_report(params, files, macs)
        # where it can run
        runnable = [d for d in self.devices if v.runs_on(d)[0]]
        out["skipped_devices"] = [
            {"device": d, "reason": v.runs_on(d)[1]} for d in self.devices if d not in runnable
        ] + [{"device": c.requested, "reason": c.reason} for c in self.choices if not c.available]
        if not runnable:
            out["accuracy"] = None
            out["latency"] = []
            return out
        lat = r.evaluate.latency
        out["latency"] = []
        # one runner (one onnxruntime session) per device: accuracy on the first device the variant
        # runs on, then latency on every device, at every batch size
        for device in runnable:
            with make_runner(v, device, lat.threads, lat.inference_mode, lat.onnx_graph_optimization) as (
                run,
                prepare,
            ):
                if device == runnable[0]:
                    self.progress.status(f"{v.name}: accuracy on {device}")
                    out["accuracy"] = self._accuracy(v, *predict(run, prepare, self.data.evaluation), device)
                if not lat.enabled:
                    continue
                for bs in lat.batch_sizes:
                    self.progress.status(f"{v.name}: latency on {device}, batch {bs}")
                    x = prepare(self.data.example_input(bs))
                    stats = measure_latency(
                        run,
                        x,
                        device=device,
                        warmup=lat.warmup,
                        min_runs=lat.min_runs,
                        min_time_s=lat.min_time_s,
                        max_runs=lat.max_runs,
                        threads=lat.threads,
                        dtype=v.dtype,
                    )
                    d = stats.to_dict()
                    d["runtime"] = "onnxruntime" if v.kind == "onnx" else "pytorch"
                    if v.kind == "onnx":
                        d["graph_optimization"] = lat.onnx_graph_optimization
                    out["latency"].append(d)
        return out

    def _accuracy(
        self, v: Variant, logits: torch.Tensor, labels: torch.Tensor, device: str
    ) -> dict[str, Any]:
        """The recipe's metrics for one variant's outputs, with drops against the baseline."""
        if v.name == "baseline":
            self.baseline_logits = logits
        acc = evaluate_accuracy(
            logits,
            labels if self.data.has_labels else None,
            None if v.name == "baseline" else self.baseline_logits,
            self.recipe.evaluate.metrics,
        )
        base_acc = acc if v.name == "baseline" else (self.baseline_entry.get("accuracy") or {})
        for k in ("top1", "top5"):
            if k in acc and k in base_acc:
                acc[f"{k}_drop"] = round(base_acc[k] - acc[k], 3)
        acc["device"] = device
        return acc

    def entry(self, name: str) -> dict[str, Any] | None:
        """The results entry of variant ``name`` so far, if it has one."""
        return next((e for e in self.results["variants"] if e["name"] == name), None)

    # ----------------------------------------------------------------- output

    def save(self) -> None:
        if self.run_dir is not None:
            write_json_atomic(self.run_dir / "results.json", self.results)

    def finish(self, status: str, error: str | None = None) -> None:
        if self.warnings:
            top = ", ".join(f"{k.split(': ', 1)[-1][:60]!r} x{n}" for k, n in self.warnings.most_common(3))
            log.info(
                "caught %d library warnings (%d distinct; most frequent: %s); all are in results.json",
                sum(self.warnings.values()),
                len(self.warnings),
                top,
            )
        self.results["status"] = status
        self.results["error"] = error
        self.results["finished"] = _now()
        self.save()
        if status == "complete" or self.results["variants"]:
            from .report import write_reports

            assert self.run_dir is not None
            write_reports(self.run_dir, self.results, self.recipe.report.formats)

    def run(self) -> RunResult:
        self.setup()
        try:
            model, _ = self.load()
            self.build_variants(model)
            self.select()
        except KeyboardInterrupt:
            self.finish("interrupted", "interrupted by the user (Ctrl-C)")
            raise
        except TorchtameError as exc:
            self.finish("failed", str(exc))
            raise
        except Exception as exc:
            self.finish("failed", f"{type(exc).__name__}: {exc}")
            raise
        self.finish("complete")
        assert self.run_dir is not None
        return RunResult(self.run_dir, self.results, dict(self.variants))


def run(
    recipe: str | Path | dict[str, Any] | Recipe | None = None,
    *,
    output_dir: str | Path | None = None,
    devices: list[str] | None = None,
    progress: Progress | None = None,
    resume: str | Path | None = None,
) -> RunResult:
    """Run a recipe end to end and return its results (the data ``results.json`` holds).

    ``resume`` names the directory of an earlier run that failed or was interrupted: variants it
    finished are reloaded from their artefacts, the rest are built, all in that directory. The
    recipe defaults to the one saved there.
    """
    resume_dir = None
    if resume is not None:
        resume_dir = Path(resume)
        saved = resume_dir / "recipe.yaml"
        if not (resume_dir / "results.json").is_file() or not saved.is_file():
            raise RunError(
                f"{str(resume_dir)!r} is not a torchtame run directory (no results.json/recipe.yaml)",
                hint="pass the directory an earlier `optimize` run printed",
            )
        recipe = recipe if recipe is not None else saved
    if recipe is None:
        raise RunError("no recipe given", hint="pass a recipe path, dict or Recipe")
    loaded = load_recipe(
        recipe,
        output_dir=str(output_dir) if output_dir is not None else None,
        devices=devices,
    )
    return Pipeline(loaded, progress, resume=resume_dir).run()


def _read_previous(run_dir: Path) -> list[dict[str, Any]]:
    try:
        return json.loads((run_dir / "results.json").read_text(encoding="utf-8")).get("variants", [])
    except (OSError, json.JSONDecodeError) as exc:
        raise RunError(f"cannot read {str(run_dir / 'results.json')!r} to resume: {exc}") from exc


def apply_pass(
    name: str,
    model: torch.nn.Module | Variant,
    data: DataBundle,
    options: dict[str, Any] | None = None,
    *,
    work_dir: str | Path | None = None,
    seed: int = 0,
    devices: list[str] | None = None,
    progress: Progress | None = None,
) -> Variant:
    """Apply one registered pass outside a recipe; the input model is not changed.

    >>> v = apply_pass("quantize.static", model, data, {"backend": "x86"})  # doctest: +SKIP
    """
    import tempfile

    entry = PASSES.get(name)
    opts = entry.options.model_validate(options or {})
    parent = model if isinstance(model, Variant) else Variant(name="input", module=model, lineage=["input"])
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="torchtame-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = PassContext(
        parent=parent,
        data=data,
        example_input=data.example_input(1),
        seed=seed,
        work_dir=work,
        devices=devices or ["cpu"],
        baseline=parent,
        variants={parent.name: parent},
        progress=progress or NullProgress(),
    )
    seed_everything(seed)
    with caught(name):
        module = clone_module(parent.module) if parent.module is not None else None
        made = entry.fn(module, ctx, opts)
    made.name = made.name or name
    made.pass_name, made.parent, made.lineage = name, parent.name, [*parent.lineage, made.name]
    return made


__all__ = ["Pipeline", "RunResult", "apply_pass", "run", "write_json_atomic"]
