"""Hardware detection and device selection (``auto``, ``cpu``, ``cuda``, ``cuda:N``)."""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import DeviceError


@dataclass(frozen=True)
class DeviceChoice:
    """A device as the recipe asked for it and what it resolved to on this machine."""

    requested: str
    device: str | None  # torch device string, None when unavailable
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.device is not None


@dataclass
class Environment:
    """What the machine offers; embedded in every results.json."""

    python: str
    platform: str
    torch: str
    cuda_available: bool
    cuda: dict[str, Any]
    cpu: dict[str, Any]
    onnxruntime: dict[str, Any]
    packages: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "python": self.python,
            "platform": self.platform,
            "torch": self.torch,
            "cuda_available": self.cuda_available,
            "cuda": self.cuda,
            "cpu": self.cpu,
            "onnxruntime": self.onnxruntime,
            "packages": self.packages,
        }


def cuda_info() -> dict[str, Any]:
    """CUDA devices with name, memory and compute capability; empty lists without a GPU."""
    info: dict[str, Any] = {
        "built_with": torch.version.cuda,
        "cudnn": None,
        "device_count": 0,
        "devices": [],
    }
    if not torch.cuda.is_available():
        return info
    info["cudnn"] = torch.backends.cudnn.version()
    info["device_count"] = torch.cuda.device_count()
    for i in range(info["device_count"]):
        props = torch.cuda.get_device_properties(i)
        info["devices"].append(
            {
                "index": i,
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 2),
                "capability": f"{props.major}.{props.minor}",
                "multiprocessors": props.multi_processor_count,
                "bf16": bool(torch.cuda.is_bf16_supported()) if i == 0 else None,
            }
        )
    return info


def cpu_info() -> dict[str, Any]:
    return {
        "processor": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "logical_cores": os.cpu_count(),
        "affinity_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "quantized_engines": [e for e in torch.backends.quantized.supported_engines if e != "none"],
        "quantized_engine": torch.backends.quantized.engine,
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
        "openmp": torch.backends.openmp.is_available(),
        "memory_total_mb": _meminfo("MemTotal"),
        "memory_available_mb": _meminfo("MemAvailable"),
    }


def _meminfo(field: str) -> float | None:
    """A /proc/meminfo figure in MiB (None where there is no /proc)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def onnxruntime_info() -> dict[str, Any]:
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a declared dependency
        return {"version": None, "providers": []}
    return {"version": ort.__version__, "providers": ort.get_available_providers()}


def detect_environment() -> Environment:
    """Capture the hardware and software this run sees."""
    from importlib.metadata import PackageNotFoundError, version

    packages = {}
    for name in ("torchtame", "torchvision", "torch-pruning", "onnx", "onnxruntime", "onnxscript"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = "not installed"
    return Environment(
        python=sys.version.split()[0],
        platform=platform.platform(),
        torch=torch.__version__,
        cuda_available=torch.cuda.is_available(),
        cuda=cuda_info(),
        cpu=cpu_info(),
        onnxruntime=onnxruntime_info(),
        packages=packages,
    )


def cuda_count() -> int:
    """How many CUDA devices this process can use (0 without a driver or a CUDA build)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def resolve_device(requested: str) -> DeviceChoice:
    """Map one recipe device to a torch device string, or say why it is unavailable."""
    if requested == "cpu":
        return DeviceChoice(requested, "cpu")
    count = cuda_count()
    if requested == "auto":
        if count:
            return DeviceChoice(requested, "cuda:0", f"auto: CUDA found ({cuda_name(0)})")
        return DeviceChoice(requested, "cpu", "auto: no CUDA device, using the CPU")
    index = int(requested.split(":")[1]) if ":" in requested else 0
    if count == 0:
        return DeviceChoice(requested, None, "CUDA is not available on this machine")
    if index >= count:
        return DeviceChoice(requested, None, f"only {count} CUDA device(s): cuda:0..cuda:{count - 1}")
    return DeviceChoice(requested, f"cuda:{index}")


def _expand(requested: str) -> list[DeviceChoice]:
    """``auto`` in a device list is the CPU plus the first CUDA GPU when there is one: int8
    variants (CPU kernels only) are then still measured, and the GPU is measured beside them."""
    if requested != "auto":
        return [resolve_device(requested)]
    if cuda_count():
        name = cuda_name(0)
        return [
            DeviceChoice("auto", "cpu", f"auto: the CPU, and CUDA found ({name})"),
            DeviceChoice("auto", "cuda:0", f"auto: CUDA found ({name})"),
        ]
    return [DeviceChoice("auto", "cpu", "auto: no CUDA device, using the CPU")]


def training_device(devices: list[str]) -> str:
    """Where to train or fine-tune: the first CUDA device of the run, else the CPU."""
    return next((d for d in devices if d.startswith("cuda")), "cpu")


def resolve_devices(requested: list[str]) -> list[DeviceChoice]:
    """Resolve the recipe's devices, without duplicates; ``auto`` is the CPU plus the first
    CUDA GPU when present (a single ``auto`` passed to :func:`resolve_device` is one device).

    A single unavailable device, or a list where none is available, is an error before any work;
    in a list with at least one available device the unavailable ones are reported, not measured.
    """
    choices: list[DeviceChoice] = []
    seen: set[str] = set()
    for choice in (c for item in requested for c in _expand(item)):
        key = choice.device or f"unavailable:{choice.requested}"
        if key not in seen:
            seen.add(key)
            choices.append(choice)
    if not any(c.available for c in choices):
        reasons = "; ".join(f"{c.requested}: {c.reason}" for c in choices)
        raise DeviceError(
            f"no requested device is available ({reasons})",
            hint="use `devices: [auto]` or `--device cpu`; `optimize env` lists what this machine has",
        )
    return choices
