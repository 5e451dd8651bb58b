"""Measure one built variant: size, parameters and MACs, accuracy/fidelity, latency per device."""

from __future__ import annotations

import copy
import dataclasses
import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..data import DataBundle
from ..devices import DeviceChoice
from ..evaluate import evaluate_accuracy, make_runner, measure_latency, predict
from ..evaluate.latency import LatencyStats
from ..evaluate.macs import count_macs_params
from ..evaluate.memory import CpuMemoryProbe, cuda_peak
from ..evaluate.runner import Run, Timing
from ..evaluate.size import (
    SPARSE_ENOUGH,
    module_params,
    module_tensors,
    onnx_params,
    onnx_tensors,
    size_report,
)
from ..inputs import batch_size
from ..progress import NullProgress, Progress
from ..recipe import EvaluateConfig
from ..results import accuracy_of, size_of
from ..variant import Variant

log = logging.getLogger("torchtame")


def _copy(v: Variant) -> Variant:
    """The variant with a fresh copy of its module (fresh weight packing)."""
    return dataclasses.replace(v, module=copy.deepcopy(v.module))


def packs_per_shape(v: Variant) -> bool:
    """torch.ao's x86 int8 kernels pack their weights for the first input shape they see and run
    other shapes up to a third slower: such a variant is timed on a fresh copy per batch size (as
    a deployment at that batch size would run)."""
    return v.quantized and v.kind == "torch" and not v.compiled


def output_stats(outputs: torch.Tensor) -> dict[str, Any]:
    """How much the measured output varies between samples (nearly constant outputs make
    fidelity figures meaningless: random weights, a dead network), over its finite values, and
    how many values are not finite."""
    flat = outputs.float().reshape(outputs.shape[0], -1)
    finite = torch.isfinite(flat)
    bad = int((~finite).sum().item())
    clean = torch.where(finite, flat, torch.zeros_like(flat))
    spread = clean.std(dim=0).mean().item() if flat.shape[0] > 1 else None
    return {
        "shape": list(outputs.shape[1:]),
        "samples": flat.shape[0],
        "max_abs": clean.abs().max().item() if clean.numel() else 0.0,
        "mean_abs": clean.abs().mean().item() if clean.numel() else 0.0,
        "spread": spread,
        "non_finite": bad,
    }


@dataclass
class Measurer:
    """Measures every variant of a run the same way; keeps the baseline's outputs for fidelity."""

    config: EvaluateConfig
    data: DataBundle
    choices: list[DeviceChoice]
    example: Any
    progress: Progress = field(default_factory=NullProgress)
    baseline_outputs: torch.Tensor | None = None
    baseline_accuracy: dict[str, Any] = field(default_factory=dict)
    output: str | int | None = None
    task: str = "classification"
    node: str = field(default_factory=platform.node)
    probe: CpuMemoryProbe | None = None

    @property
    def devices(self) -> list[str]:
        return [c.device for c in self.choices if c.device is not None]

    def measure(self, v: Variant, files: list[Path], parent_entry: dict[str, Any] | None) -> dict[str, Any]:
        """Size, accuracy on the first device it runs on, latency on every device and batch."""
        return {"size": self.size(v, files, parent_entry), **self.run(v, files=files)}

    def run(
        self, v: Variant, node: str | None = None, accuracy: bool = True, files: list[Path] | None = None
    ) -> dict[str, Any]:
        """Accuracy (on the first device the variant runs on) and latency on every device and
        batch size; every latency records the ``node`` it was measured on."""
        out: dict[str, Any] = {}
        self.node = node or self.node
        runnable = [d for d in self.devices if v.runs_on(d)[0]]
        out["skipped_devices"] = [
            {"device": d, "reason": v.runs_on(d)[1]} for d in self.devices if d not in runnable
        ] + [{"device": c.requested, "reason": c.reason} for c in self.choices if not c.available]
        out["accuracy"] = None
        out["latency"] = []
        lat = self.config.latency
        opts = (lat.threads, lat.inference_mode, lat.onnx_graph_optimization)
        for device in runnable:
            # a fresh copy per batch size, and another for accuracy
            fresh = packs_per_shape(v)
            with make_runner(_copy(v) if fresh else v, device, *opts) as (run, prepare):
                if v.compiled:  # the first call compiles: its time is recorded, not timed as latency
                    self.progress.status(f"{v.name}: compiling for {device}")
                    t0 = time.perf_counter()
                    run(prepare(self.example))
                    out.setdefault("compile_s", {})[device] = round(time.perf_counter() - t0, 3)
                if device == runnable[0] and accuracy:
                    self.progress.status(f"{v.name}: accuracy on {device}")
                    loader = self.data.evaluation  # compiled: the last batch on the full batches' graph
                    fill = loader.batch_size if v.compiled else None
                    outputs, labels = predict(run, prepare, loader, self.output, fill)
                    out["accuracy"] = self.accuracy(v.name, outputs, labels, device)
                    out["outputs"] = output_stats(outputs)
                if not lat.enabled:
                    continue
                for bs in lat.batch_sizes:
                    self.progress.status(f"{v.name}: latency on {device}, batch {bs}")
                    x = self.data.example_input(bs)
                    if fresh:
                        with make_runner(_copy(v), device, *opts) as (run_bs, _):
                            entry = self._latency(v, run_bs, x, device)
                    else:
                        entry = self._latency(v, run, x, device)
                    if self.config.memory:
                        self.progress.status(f"{v.name}: memory on {device}, batch {bs}")
                        entry.update(self._memory(v, files, run, prepare, device, x))
                    out["latency"].append(entry)
        return out

    def _memory(
        self, v: Variant, files: list[Path] | None, run: Any, prepare: Any, device: str, x: Any
    ) -> dict[str, Any]:
        """Peak memory of one batch: the CUDA allocator's peak, or a fresh CPU process's."""
        try:
            if device.startswith("cuda"):
                if v.kind == "onnx":  # its CUDA allocator is not torch's: no honest reading here
                    return {"peak_memory_mb": None, "memory_error": "onnxruntime on CUDA: not measured"}
                return cuda_peak(run, prepare(x), device)
            if not files:
                return {"peak_memory_mb": None, "memory_error": "no saved artefact to load"}
            if self.probe is None:
                self.probe = CpuMemoryProbe(self.config.memory_repeats)
            threads = self.config.latency.threads or torch.get_num_threads()
            return self.probe.measure(v, files, x, threads)
        except Exception as exc:  # a reading that failed is reported, the variant is not lost
            log.debug("memory of %s on %s, batch %d: %s", v.name, device, batch_size(x), exc)
            return {"peak_memory_mb": None, "memory_error": str(exc)[:200]}

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()

    def size(self, v: Variant, files: list[Path], parent_entry: dict[str, Any] | None) -> dict[str, Any]:
        if v.kind == "onnx":
            assert v.onnx_path is not None
            params = onnx_params(v.onnx_path)
            tensors = lambda: onnx_tensors(v.onnx_path)  # noqa: E731
        else:
            assert v.module is not None
            params = module_params(v.module)
            tensors = lambda: module_tensors(v.module)  # noqa: E731
        macs, source = None, None
        if self.config.macs:
            if v.is_float and v.module is not None and v.dtype == "float32":
                try:
                    macs, source = count_macs_params(v.module, self.example)[0], "counted"
                except Exception as exc:
                    log.debug("MACs of %s not counted: %s", v.name, exc)
            elif parent_entry is not None:  # int8/ONNX graphs do the float parent's arithmetic
                macs = size_of(parent_entry).get("macs")
                source = f"inherited from {parent_entry['name']}" if macs is not None else None
        sparse = params[0] and 1 - params[1] / params[0] >= SPARSE_ENOUGH
        report = size_report(params, files, macs, tensors() if sparse else None)
        report["macs_source"] = source
        return report

    def timed(self, timing: Timing, prepared: Any, device: str, dtype: str, batch: int) -> LatencyStats:
        """One timing of ``timing.fn(prepared)`` with the recipe's latency settings."""
        lat = self.config.latency
        return measure_latency(
            timing.fn,
            prepared,
            device=device,
            warmup=lat.warmup,
            min_runs=lat.min_runs,
            min_time_s=lat.min_time_s,
            max_runs=lat.max_runs,
            threads=timing.threads,
            dtype=dtype,
            timer=timing.timer,
            batch=batch,
        )

    def _latency(self, v: Variant, run: Run, x: Any, device: str) -> dict[str, Any]:
        """One latency figure, timed the way ``run.timing`` says (recorded with the figure)."""
        timing = run.timing
        assert timing is not None
        d = self.timed(timing, timing.prepare(x), device, v.dtype, batch_size(x)).to_dict()
        d["io"] = timing.io
        if timing.mha_fastpath is not None:
            d["mha_fastpath"] = timing.mha_fastpath
        d["node"] = self.node
        d["runtime"] = "onnxruntime" if v.kind == "onnx" else "pytorch"
        if v.kind == "onnx":
            d["graph_optimization"] = self.config.latency.onnx_graph_optimization
        return d

    def accuracy(self, name: str, outputs: torch.Tensor, labels: torch.Tensor, device: str) -> dict[str, Any]:
        """The recipe's metrics for one variant's outputs, with drops against the baseline."""
        is_base = name == "baseline"
        if is_base:
            self.baseline_outputs = outputs
        acc = evaluate_accuracy(
            outputs,
            labels if self.data.has_labels and self.task == "classification" else None,
            None if is_base else self.baseline_outputs,
            self.config.metrics,
        )
        if self.task == "features":  # argmax over embedding dimensions means nothing
            acc.pop("top1_agreement", None)
        base_acc = acc if is_base else self.baseline_accuracy
        for k in ("top1", "top5"):
            if k in acc and k in base_acc:
                acc[f"{k}_drop"] = round(base_acc[k] - acc[k], 3)
        acc["device"] = device
        if is_base:
            self.baseline_accuracy = acc
        return acc

    def restore_baseline(self, baseline: Variant, entry: dict[str, Any]) -> None:
        """Recompute the baseline's outputs (fidelity of the variants still to build needs them)."""
        device = accuracy_of(entry).get("device", "cpu")
        with make_runner(baseline, device if device in self.devices else "cpu") as (run, prepare):
            self.baseline_outputs, _ = predict(run, prepare, self.data.evaluation, self.output)
        self.baseline_accuracy = accuracy_of(entry)
