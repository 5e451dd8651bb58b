"""Running recipes: the pipeline, its run store, the step executor and the measuring."""

from __future__ import annotations

from .core import Pipeline, RunResult, run
from .executor import apply_pass
from .store import write_json_atomic

__all__ = ["Pipeline", "RunResult", "apply_pass", "run", "write_json_atomic"]
