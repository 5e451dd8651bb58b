"""`optimize env`: the environment as a rich table."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def env_table(info: dict[str, Any]) -> Table:
    t = Table(title="torchtame environment", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")
    t.add_row("python", info["python"])
    t.add_row("platform", info["platform"])
    t.add_row("torch", info["torch"])
    cuda = info["cuda"]
    t.add_row("CUDA available", "yes" if info["cuda_available"] else "no")
    t.add_row("CUDA build / cuDNN", f"{cuda.get('built_with')} / {cuda.get('cudnn')}")
    for d in cuda.get("devices", []):
        t.add_row(
            f"cuda:{d['index']}",
            f"{d['name']}, {d['memory_gib']} GiB, capability {d['capability']}, "
            f"{d['multiprocessors']} SMs, bf16 {'yes' if d.get('bf16') else 'no'}",
        )
    cpu = info["cpu"]
    t.add_row("CPU", f"{cpu['processor']} ({cpu['machine']})")
    t.add_row("cores (logical / usable)", f"{cpu['logical_cores']} / {cpu['affinity_cores']}")
    if cpu.get("memory_total_mb"):
        t.add_row(
            "memory (total / available)",
            f"{cpu['memory_total_mb']:.0f} / {cpu['memory_available_mb']:.0f} MiB",
        )
    t.add_row("torch threads (intra / inter)", f"{cpu['torch_threads']} / {cpu['torch_interop_threads']}")
    t.add_row(
        "quantized engines", ", ".join(cpu["quantized_engines"]) + f" (current: {cpu['quantized_engine']})"
    )
    t.add_row(
        "MKL / MKLDNN / OpenMP", " / ".join("yes" if cpu[k] else "no" for k in ("mkl", "mkldnn", "openmp"))
    )
    ort = info["onnxruntime"]
    t.add_row("onnxruntime", f"{ort['version']}: {', '.join(ort['providers'])}")
    for name, ver in info.get("packages", {}).items():
        t.add_row(name, ver)
    return t
