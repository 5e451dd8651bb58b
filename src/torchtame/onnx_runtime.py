"""onnxruntime sessions and the PyTorch-vs-ONNX parity check shared by export and evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from .inputs import Inputs, call, cast_floating, select_output, stack_outputs, tensors


def session(path: Path, device: str = "cpu", threads: int | None = None, opt_level: str = "all") -> Any:
    """An onnxruntime InferenceSession on the CPU or, with onnxruntime-gpu, a CUDA device."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[opt_level]
    so.log_severity_level = 3
    if threads is not None:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    if device.startswith("cuda"):
        index = int(device.split(":")[1]) if ":" in device else 0
        providers: list[Any] = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    else:
        providers = ["CPUExecutionProvider"]
    return ort.InferenceSession(str(path), so, providers=providers)


def feed(sess: Any, x: Inputs) -> dict[str, np.ndarray]:
    """The session's inputs from an input structure: dict keys by name, tensors in order."""
    names = [i.name for i in sess.get_inputs()]
    if isinstance(x, dict):
        missing = [n for n in names if n not in x]
        if missing:
            raise ValueError(f"the ONNX model needs inputs {missing}; the data has {list(x)}")
        return {n: x[n].detach().cpu().numpy() for n in names}
    ts = tensors(x)
    if len(ts) != len(names):
        raise ValueError(f"the ONNX model takes {len(names)} inputs ({names}); the data has {len(ts)}")
    return {n: t.detach().cpu().numpy() for n, t in zip(names, ts, strict=True)}


def run_session(sess: Any, x: Inputs) -> dict[str, torch.Tensor]:
    """Run a session on an input structure; returns its outputs by name as CPU tensors."""
    outs = sess.run(None, feed(sess, x))
    return {o.name: torch.from_numpy(np.asarray(v)) for o, v in zip(sess.get_outputs(), outs, strict=True)}


def _named(sess: Any, x: Inputs) -> dict[str, torch.Tensor]:
    """The session's inputs as tensors by name (dict keys by name, tensors in order)."""
    names = [i.name for i in sess.get_inputs()]
    if isinstance(x, dict):
        return {n: x[n] for n in names}
    return dict(zip(names, tensors(x), strict=True))


class BoundSession:
    """A session run through IO binding: inputs bound from tensors already on the device and
    outputs left there, so a timed call has no host<->device copies (as a torch-on-CUDA timing
    has none). ``prepare`` binds once; each call then runs the bound graph only."""

    def __init__(self, sess: Any, device: str) -> None:
        self.sess = sess
        self.device_type = "cuda" if device.startswith("cuda") else "cpu"
        self.device_id = int(device.split(":")[1]) if ":" in device else 0
        self.torch_device = torch.device(device)

    def prepare(self, x: Inputs) -> tuple[Any, list[torch.Tensor]]:
        binding = self.sess.io_binding()
        keep = []  # the bound buffers must outlive the binding
        for name, t in _named(self.sess, x).items():
            t = t.detach().to(self.torch_device).contiguous()
            keep.append(t)
            binding.bind_input(
                name=name,
                device_type=self.device_type,
                device_id=self.device_id,
                element_type=np.dtype(str(t.dtype).removeprefix("torch.")),
                shape=tuple(t.shape),
                buffer_ptr=t.data_ptr(),
            )
        for o in self.sess.get_outputs():
            binding.bind_output(o.name, self.device_type, self.device_id)
        return binding, keep

    def __call__(self, prepared: tuple[Any, list[torch.Tensor]]) -> Any:
        self.sess.run_with_iobinding(prepared[0])
        return prepared[0]

    def outputs(self, prepared: tuple[Any, list[torch.Tensor]]) -> list[np.ndarray]:
        """The last run's outputs, copied to the host (for checks, not timed)."""
        return list(prepared[0].copy_outputs_to_cpu())


def session_output(sess: Any, x: Inputs, output: str | int | None = None) -> torch.Tensor:
    """The measured output tensor of a session run (see :func:`~torchtame.inputs.select_output`)."""
    return select_output(run_session(sess, x), output)


def class_scores(t: torch.Tensor) -> bool:
    """Whether an output is shaped like class scores: (batch, classes) or (batch, ..., classes)."""
    return t.dim() >= 2 and t.shape[-1] > 1


def compare_outputs(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """Max/mean absolute error, error relative to the reference's range, cosine similarity per
    sample, and (for class-score-shaped outputs) top-1 agreement over the last dimension."""
    ref, out = ref.float(), out.float()
    flat_ref, flat_out = ref.reshape(ref.shape[0], -1), out.reshape(out.shape[0], -1)
    diff = (flat_ref - flat_out).abs()
    scale = flat_ref.abs().max().item() or 1.0
    cos = torch.nn.functional.cosine_similarity(flat_ref, flat_out, dim=1).mean().item()
    figures = {
        "max_abs_error": diff.max().item(),
        "mean_abs_error": diff.mean().item(),
        "max_rel_error": diff.max().item() / scale,
        "cosine_similarity": cos,
        "reference_max_abs": scale,
    }
    if class_scores(ref):
        figures["top1_agreement"] = (ref.argmax(-1) == out.argmax(-1)).float().mean().item()
    return figures


def parity(
    torch_fn: Any,
    sess: Any,
    loader: DataLoader,
    batches: int,
    input_dtype: torch.dtype = torch.float32,
    output: str | int | None = None,
) -> dict[str, float]:
    """Compare a torch callable and an onnxruntime session on up to ``batches`` real batches."""
    refs, outs = [], []
    with torch.inference_mode():
        for i, (x, *_) in enumerate(loader):
            if i >= batches:
                break
            x = cast_floating(x, input_dtype)
            refs.append(select_output(call(torch_fn, x), output).float())
            outs.append(select_output(run_session(sess, x), output).float())
    figures = compare_outputs(stack_outputs(refs), stack_outputs(outs))
    figures["samples"] = float(sum(len(r) for r in refs))
    return figures
