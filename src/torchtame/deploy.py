"""Load a variant of a finished run in a later process, ready to serve.

``load_variant(run_dir)`` reads the run's results.json, picks the variant the run chose (or the
one named) and returns a callable that gives the outputs the run measured, whatever the
artefact: a pickled or TorchScript module (run in its quantized engine, on the plain attention
path where the run used it), an exported PT2E program (compiled by Inductor on the first call,
as the run measured it), or an ONNX file (an onnxruntime session that takes the model's own
input structure: a tensor, a tuple or a dict of named inputs).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from pathlib import Path
from typing import Any

from .artifacts import load_module
from .errors import RunError
from .evaluate.runner import make_runner
from .inputs import Inputs, select_output
from .results import VariantResult, chosen_name, find_entry, read_results, view
from .variant import Variant

log = logging.getLogger("torchtame")


class DeployedVariant:
    """A saved variant, loaded and ready: ``deployed(inputs)`` returns the model's raw outputs,
    ``deployed.predict(inputs)`` the output the run measured (``evaluate.output``).

    It holds its runtime (an onnxruntime session, the quantized engine, the thread count) until
    :meth:`close` or the end of a ``with`` block.
    """

    def __init__(
        self, variant: Variant, result: VariantResult, device: str, threads: int | None, output: Any
    ) -> None:
        self.name = variant.name
        self.result = result
        self.device = device
        self.output = output
        self._stack = contextlib.ExitStack()
        self._run, self._prepare = self._stack.enter_context(make_runner(variant, device, threads))

    def __call__(self, inputs: Inputs) -> Any:
        return self._run(self._prepare(inputs))

    def predict(self, inputs: Inputs) -> Any:
        """The measured output (class scores, features) as a tensor."""
        return select_output(self(inputs), self.output)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> DeployedVariant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DeployedVariant({self.name!r}, {self.result.dtype}, {self.result.kind}, on {self.device})"


def load_variant(
    run_dir: str | Path, name: str | None = None, device: str = "cpu", threads: int | None = None
) -> DeployedVariant:
    """The variant ``name`` of the run in ``run_dir`` (default: the one the run chose), loaded on
    ``device``; ``threads`` defaults to the thread count the run measured with."""
    run_dir = Path(run_dir)
    if not (run_dir / "results.json").is_file():
        raise RunError(
            f"{str(run_dir)!r} is not a torchtame run directory (no results.json)",
            hint="pass the directory an `optimize` run printed",
        )
    results = read_results(run_dir)
    ok = [v["name"] for v in results.get("variants", []) if v.get("status") == "ok"]
    if name is None:
        name = chosen_name(results)
        if name is None:
            raise RunError(
                f"the run in {str(run_dir)!r} chose no variant (its recipe has no constraints, or no "
                "variant met them)",
                hint=f"name one: load_variant(run_dir, name) with one of {', '.join(ok)}",
            )
    entry = find_entry(results, name)
    if entry is None or entry.get("status") != "ok":
        why = "failed in that run" if entry is not None else "is not in that run"
        raise RunError(f"variant {name!r} {why}", hint=f"variants you can load: {', '.join(ok)}")
    files = [run_dir / f for f in entry.get("artifact") or []]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise RunError(f"variant {name!r} has no artefact to load (missing: {', '.join(missing) or 'all'})")
    variant = Variant.from_entry(entry)
    if files[0].suffix == ".onnx":
        variant.onnx_path = files[0]
    elif files[0].name == "weights.pt":
        raise RunError(
            f"variant {name!r} was saved as a state dict only (its module could be neither pickled nor "
            "traced)",
            hint="build the model with your own code and load_state_dict() that file",
        )
    else:
        _import_model_package(results)
        variant.module = load_module(files[0]).eval()
    settings = results.get("settings") or {}
    base = find_entry(results, "baseline")
    return DeployedVariant(
        variant, view(entry, base), device, threads or settings.get("threads"), settings.get("output")
    )


def _import_model_package(results: Any) -> None:
    """An exported program names its output types (a transformers ``ModelOutput``): the package
    that registers them with torch's pytree must be imported before the program is loaded."""
    module = (results.get("model") or {}).get("module")
    if not module:
        return
    with contextlib.suppress(ImportError):
        importlib.import_module(module)


__all__ = ["DeployedVariant", "load_variant"]
