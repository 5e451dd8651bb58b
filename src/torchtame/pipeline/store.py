"""The run directory: results.json (written atomically after every change), artefacts, resume."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._version import __version__
from ..artifacts import load_module, save_module
from ..devices import DeviceChoice, detect_environment
from ..errors import RunError
from ..recipe import Recipe
from ..variant import Variant

log = logging.getLogger("torchtame")


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


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def make_run_dir(recipe: Recipe) -> Path:
    """A new ``<output_dir>/<name>-<timestamp>[-N]`` directory."""
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


def read_previous(run_dir: Path) -> list[dict[str, Any]]:
    """The variant entries an earlier run in ``run_dir`` wrote."""
    try:
        return json.loads((run_dir / "results.json").read_text(encoding="utf-8")).get("variants", [])
    except (OSError, json.JSONDecodeError) as exc:
        raise RunError(f"cannot read {str(run_dir / 'results.json')!r} to resume: {exc}") from exc


def check_run_dir(run_dir: Path) -> Path:
    """``run_dir`` if it holds an earlier run (results.json and recipe.yaml), else a RunError."""
    if not (run_dir / "results.json").is_file() or not (run_dir / "recipe.yaml").is_file():
        raise RunError(
            f"{str(run_dir)!r} is not a torchtame run directory (no results.json/recipe.yaml)",
            hint="pass the directory an earlier `optimize` run printed",
        )
    return run_dir


def artifact_files(v: Variant, directory: Path, example: Any) -> list[Path]:
    """The variant's artefact files: its ONNX file (and side data), or its module saved into
    ``directory``."""
    if v.kind == "onnx":
        assert v.onnx_path is not None
        return [v.onnx_path, *v.onnx_path.parent.glob(v.onnx_path.name + ".data")]
    return [save_module(v, directory, example)]


class RunStore:
    """One run's directory and the results it holds; every change is saved at once."""

    def __init__(self, recipe: Recipe, resume: Path | None = None) -> None:
        self.previous: dict[str, dict[str, Any]] = {}
        if resume is not None:
            self.run_dir = resume
            self.previous = {v["name"]: v for v in read_previous(resume) if v.get("status") == "ok"}
        else:
            self.run_dir = make_run_dir(recipe)
        (self.run_dir / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")
        self.results: dict[str, Any] = {}

    def start(self, recipe: Recipe, choices: list[DeviceChoice], threads: int) -> None:
        """Write the header of results.json: environment, devices, settings; status running."""
        self.results = {
            "torchtame": __version__,
            "status": "running",
            "recipe": recipe.name,
            "run_dir": str(self.run_dir),
            "started": now(),
            "finished": None,
            "environment": detect_environment().to_dict(),
            "devices": [
                {"requested": c.requested, "device": c.device, "available": c.available, "reason": c.reason}
                for c in choices
            ],
            "settings": {
                "seed": recipe.seed,
                "metrics": recipe.evaluate.metrics,
                "latency": recipe.evaluate.latency.model_dump(),
                "threads": threads,
            },
            "data": None,
            "model": None,
            "variants": [],
            "warnings": {},
            "error": None,
        }
        self.save()

    def save(self) -> None:
        write_json_atomic(self.run_dir / "results.json", self.results)

    def add(self, entry: dict[str, Any]) -> None:
        """Record one variant's entry (built, failed or resumed) and save."""
        self.results["variants"].append(entry)
        self.save()

    def entry(self, name: str) -> dict[str, Any] | None:
        """The results entry of variant ``name`` so far, if it has one."""
        return next((e for e in self.results["variants"] if e["name"] == name), None)

    def variant_dir(self, name: str) -> Path:
        d = self.run_dir / "variants" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def save_artifact(self, v: Variant, example: Any) -> list[Path]:
        """Write the variant's artefact (ONNX variants already are files); returns its files."""
        return artifact_files(v, self.variant_dir(v.name), example)

    def files_of(self, v: Variant) -> list[Path]:
        """The artefact files already written for ``v`` (by an execution engine)."""
        if v.kind == "onnx":
            assert v.onnx_path is not None
            return [v.onnx_path, *v.onnx_path.parent.glob(v.onnx_path.name + ".data")]
        return sorted(p for p in self.variant_dir(v.name).iterdir() if p.is_file())

    def relative(self, files: list[Path]) -> list[str]:
        return [str(p.relative_to(self.run_dir)) for p in files]

    def reusable(self, name: str, pass_name: str, parent: str, options: Any) -> dict[str, Any] | None:
        """The earlier run's entry of this step if it was built the same way, else None."""
        before = self.previous.get(name)
        if before is None:
            return None
        same = (before.get("pass"), before.get("from"), before.get("options")) == (pass_name, parent, options)
        return before if same else None

    def load_variant(self, entry: dict[str, Any]) -> Variant | None:
        """The variant an earlier run finished, loaded from its artefact (None if unreadable)."""
        files = [self.run_dir / f for f in entry.get("artifact", [])]
        if not files or not all(f.is_file() for f in files):
            return None
        restored = Variant.from_entry(entry)
        if files[0].suffix == ".onnx":
            restored.onnx_path = files[0]
            return restored
        try:
            restored.module = load_module(files[0]).eval()
        except Exception as exc:  # a broken artefact is rebuilt
            log.info("cannot reload %s (%s); rebuilding it", files[0], exc)
            return None
        return restored

    def finish(self, status: str, error: str | None) -> None:
        self.results["status"] = status
        self.results["error"] = error
        self.results["finished"] = now()
        self.save()
