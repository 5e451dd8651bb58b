"""What a pass produces (:class:`Variant`) and what it is given (:class:`PassContext`)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from .devices import training_device
from .progress import NullProgress, Progress
from .runtime import cuda_provider_available

if TYPE_CHECKING:
    from .data import DataBundle

log = logging.getLogger("torchtame")

DevicePolicy = Literal["any", "cpu_only", "cuda_only"]


@dataclass
class Variant:
    """One version of the model: a torch module or an ONNX file, with where it came from."""

    name: str
    module: nn.Module | None = None
    onnx_path: Path | None = None
    pass_name: str = "baseline"
    parent: str | None = None
    lineage: list[str] = field(default_factory=list)
    dtype: str = "float32"
    input_dtype: torch.dtype = torch.float32
    devices: DevicePolicy = "any"
    quantized: bool = False
    backend: str | None = None  # torch quantized engine the variant's kernels need
    compiled: bool = False  # measured (and deployed) through torch.compile (PT2E, torchao)
    info: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] | None = None  # the pass options it was built with (JSON form)

    @property
    def kind(self) -> Literal["torch", "onnx"]:
        return "onnx" if self.onnx_path is not None else "torch"

    @property
    def is_float(self) -> bool:
        return self.kind == "torch" and not self.quantized

    def runs_on(self, device: str) -> tuple[bool, str]:
        """Whether this variant can be measured on ``device``, and why not."""
        on_cuda = device.startswith("cuda")
        if self.devices == "cpu_only" and on_cuda:
            return (
                False,
                f"cpu only ({self.info.get('cpu_only', 'torch.ao quantized kernels run on the CPU')})",
            )
        if self.devices == "cuda_only" and not on_cuda:
            return (
                False,
                f"cuda only ({self.info.get('cuda_only', 'float16 is slow or unsupported on the CPU')})",
            )
        if self.kind == "onnx" and on_cuda and not cuda_provider_available():
            return False, "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
        return True, ""

    def to_entry(self) -> dict[str, Any]:
        """What results.json records of how the variant was made (no measurements)."""
        return {
            "name": self.name,
            "pass": self.pass_name,
            "from": self.parent,
            "lineage": self.lineage,
            "options": self.options,
            "kind": self.kind,
            "dtype": self.dtype,
            "quantized": self.quantized,
            "backend": self.backend,
            "input_dtype": str(self.input_dtype).removeprefix("torch."),
            "device_policy": self.devices,
            "compiled": self.compiled,
            "info": self.info,
        }

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> Variant:
        """The variant a results.json entry describes, without its module or file."""
        return cls(
            name=entry["name"],
            pass_name=entry.get("pass", "baseline"),
            parent=entry.get("from"),
            lineage=list(entry.get("lineage", [])),
            dtype=entry.get("dtype", "float32"),
            input_dtype=getattr(torch, entry.get("input_dtype", "float32")),
            devices=entry.get("device_policy", "any"),
            quantized=entry.get("quantized", False),
            backend=entry.get("backend"),
            compiled=entry.get("compiled", False),
            info=entry.get("info", {}),
            options=entry.get("options"),
        )


@dataclass
class PassContext:
    """Everything a pass may use besides the model it transforms."""

    parent: Variant
    data: DataBundle
    example_input: Any
    seed: int
    work_dir: Path
    devices: list[str]
    baseline: Variant
    variants: dict[str, Variant]
    progress: Progress = field(default_factory=NullProgress)
    log: logging.Logger = log
    output: str | int | None = None  # which model output is measured (see inputs.select_output)
    task: str = "auto"  # classification | features | auto (decide from the output's shape)

    def variant(self, module: nn.Module | None = None, **kwargs: Any) -> Variant:
        """A new variant whose name, parent and lineage the pipeline fills in."""
        kwargs.setdefault("dtype", self.parent.dtype)
        kwargs.setdefault("input_dtype", self.parent.input_dtype)
        return Variant(name="", module=module, **kwargs)

    @property
    def train_device(self) -> str:
        """The device to train or fine-tune on: the first CUDA device if any, else the CPU."""
        return training_device(self.devices)


def clone_module(module: nn.Module) -> nn.Module:
    """A deep copy, so a pass never changes the variant it starts from."""
    return copy.deepcopy(module)


PassFn = Callable[[nn.Module | None, PassContext, Any], Variant]
