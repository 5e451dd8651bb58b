"""Peak memory of inference: what a deployment needs to run one batch.

- **CUDA**: ``torch.cuda.reset_peak_memory_stats`` before one call and ``max_memory_allocated``
  after it (weights, activations and workspace the allocator handed out), plus the reserved
  figure (what the caching allocator holds from the driver).
- **CPU** (torch and onnxruntime): measured in a fresh process that loads the saved artefact and
  runs the batch, as a deployment would: the peak resident memory (``VmHWM``) minus the same
  process's resident memory just before the load. Importing torch costs seconds, so a helper
  process (one per calling process, kept until it exits) imports it once, imports the modules
  the artefact needs (its layers' packages, registered output types) and forks one child per
  reading; the child starts with its own high-water mark. Compiled variants compile and run once
  first (that peak is ``compile_peak_memory_mb``, and what the process holds after it is
  ``resident_after_compile_mb``), then the high-water mark is reset (``/proc/self/clear_refs``)
  and a second call is measured: their ``peak_memory_mb`` is steady-state inference, the loaded
  artefact plus one call's peak above what the process held before it, as ``compile_s`` is kept
  apart from latency. Each figure is the median of
  ``repeats`` children; allocator behaviour makes single readings vary by a few MiB, which is
  noise next to anything but the smallest models.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

MIB = 1024 * 1024


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def cuda_peak(run: Any, x: Any, device: str) -> dict[str, float]:
    """Peak CUDA memory of one call of ``run(x)`` (allocated and reserved), in MiB."""
    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    run(x)
    torch.cuda.synchronize(dev)
    return {
        "peak_memory_mb": round(torch.cuda.max_memory_allocated(dev) / MIB, 3),
        "reserved_memory_mb": round(torch.cuda.max_memory_reserved(dev) / MIB, 3),
    }


# --------------------------------------------------------------------------- the child's side


def _measure(request: dict[str, Any]) -> dict[str, Any]:
    """In a forked child: load the inputs, then the artefact, run once; the memory it took."""
    import gc

    from ..inputs import call, cast_floating
    from ..runtime import compiled, variant_runtime

    torch.set_num_threads(request["threads"])
    x = torch.load(request["inputs"], weights_only=False)
    gc.collect()
    before = _status("VmRSS")
    if request["kind"] == "onnx":
        from ..onnx_runtime import run_session, session

        sess = session(Path(request["path"]), "cpu", request["threads"])

        def run() -> Any:
            return run_session(sess, x)

    else:
        from ..artifacts import load_module

        module = load_module(request["path"])
        if not request["path"].endswith(".pt2"):  # an exported program's module has no eval()
            module.eval()
        x = cast_floating(x, getattr(torch, request["input_dtype"]))
        fn = compiled(module) if request["compiled"] else module

        def run() -> Any:
            return call(fn, x)

    loaded = _status("VmRSS") - before
    with torch.inference_mode(), variant_runtime(request.get("backend"), bool(request.get("quantized"))):
        if not request["compiled"]:
            run()
            return {"peak_bytes": _status("VmHWM") - before, "resident_before_bytes": before}
        run()  # compiles: that peak and what the compiler leaves resident are recorded apart
        gc.collect()
        compile_peak, after_compile = _status("VmHWM") - before, _status("VmRSS") - before
        Path("/proc/self/clear_refs").write_text("5")
        start = _status("VmRSS")
        run()
        call_peak = _status("VmHWM") - start
    return {
        "peak_bytes": loaded + call_peak,
        "compile_peak_bytes": compile_peak,
        "resident_after_compile_bytes": after_compile,
        "resident_before_bytes": before,
    }


def serve() -> None:
    """The helper process: import once, then fork a child per request line on stdin."""
    import torch  # noqa: F401  (imported once, shared with every child)

    from .. import artifacts, onnx_runtime  # noqa: F401

    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.path.extend(p for p in request.get("sys_path", []) if p not in sys.path)
        for name in request.get("preload", []):  # imported once here, not in every child
            with contextlib.suppress(Exception):  # else the child fails to load and says why
                importlib.import_module(name)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: measure, report, exit without running the parent's cleanup
            os.close(read)
            try:
                result = _measure(request)
            except Exception as exc:
                result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            os.write(write, json.dumps(result).encode())
            os._exit(0)
        os.close(write)
        chunks = []
        while chunk := os.read(read, 65536):
            chunks.append(chunk)
        os.close(read)
        os.waitpid(pid, 0)
        print((b"".join(chunks) or b'{"error": "the child died"}').decode(), flush=True)


# --------------------------------------------------------------------------- the caller's side


def _packages(variant: Any) -> list[str]:
    """The modules the artefact needs besides torch: its layers' classes (transformers, timm, the
    user's code) and the output types torch's pytree knows here (a ``.pt2`` program's outputs,
    such as transformers' ModelOutput classes, load only where they are registered). The helper
    imports them once, so a child's reading starts after imports a deployment would also have
    done and counts the model, not the import."""
    from torch.utils import _pytree

    names = {t.__module__ for t in _pytree.SUPPORTED_NODES}
    module = getattr(variant, "module", None)
    if module is not None:
        names |= {type(m).__module__ for m in module.modules()}
    skip = ("torch", "builtins", "collections", "__main__", "typing")
    found = sorted(n for n in names if n and n.split(".")[0] not in skip)
    if getattr(variant, "compiled", False):  # loading a program and compiling it import these
        found += ["torch.export", "torch._dynamo", "torch._inductor.compile_fx", "torchao.quantization.pt2e"]
    return found


class _Helper:
    """The helper process, shared by every probe of this process (importing torch in it costs
    seconds, so it is started once and closed at exit)."""

    lock = threading.Lock()
    proc: subprocess.Popen[str] | None = None

    @classmethod
    def ask(cls, request: dict[str, Any]) -> dict[str, Any]:
        with cls.lock:
            proc = cls._start()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps(request) + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
            except (BrokenPipeError, OSError):
                line = ""
            if not line:
                cls.close()
                return {"error": "the helper process died"}
            return json.loads(line)

    @classmethod
    def _start(cls) -> subprocess.Popen[str]:
        if cls.proc is None or cls.proc.poll() is not None:
            cls.proc = subprocess.Popen(
                [sys.executable, "-m", "torchtame.evaluate.memory"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            assert cls.proc.stdout is not None
            if cls.proc.stdout.readline().strip() != "ready":
                cls.close()
                raise RuntimeError("the memory probe's helper process did not start")
            if not cls._registered:
                atexit.register(cls.close)
                cls._registered = True
        return cls.proc

    _registered = False

    @classmethod
    def close(cls) -> None:
        proc, cls.proc = cls.proc, None
        if proc is not None and proc.poll() is None:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


class CpuMemoryProbe:
    """Measures CPU inference memory of saved artefacts through the shared helper process."""

    def __init__(self, repeats: int = 3) -> None:
        self.repeats = repeats
        self.tmp = Path(tempfile.mkdtemp(prefix="torchtame-memory-"))

    def measure(self, variant: Any, files: list[Path], x: Any, threads: int) -> dict[str, Any]:
        """Median peak memory (MiB) of loading ``variant``'s artefact and running batch ``x``."""
        inputs = self.tmp / "inputs.pt"
        torch.save(x, inputs)
        request = {
            "kind": variant.kind,
            "path": str(Path(files[0]).resolve()),
            "inputs": str(inputs),
            "threads": threads,
            "backend": variant.backend,
            "quantized": variant.quantized,
            "compiled": variant.compiled,
            "input_dtype": str(variant.input_dtype).removeprefix("torch."),
            "preload": _packages(variant),
            "sys_path": [str(Path(p).resolve()) for p in sys.path],
        }
        samples, answer = [], {}
        for _ in range(1 if variant.compiled else self.repeats):  # a compile per sample is costly
            answer = _Helper.ask(request)
            if "error" in answer:
                raise RuntimeError(f"memory measurement failed: {answer['error']}")
            samples.append(answer["peak_bytes"] / MIB)
        out = {
            "peak_memory_mb": round(statistics.median(samples), 3),
            "memory_samples_mb": [round(s, 3) for s in samples],
        }
        if variant.compiled:
            out["memory_method"] = "steady state after compile: loaded artefact + one call's peak"
            out["compile_peak_memory_mb"] = round(answer["compile_peak_bytes"] / MIB, 3)
            out["resident_after_compile_mb"] = round(answer["resident_after_compile_bytes"] / MIB, 3)
        return out

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


if __name__ == "__main__":
    serve()
