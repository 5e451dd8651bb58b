"""onnxruntime sessions and the PyTorch-vs-ONNX parity check shared by export and evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader


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


def run_session(sess: Any, x: torch.Tensor) -> torch.Tensor:
    """Run a single-input, single-output session on a torch tensor; returns a CPU tensor."""
    name = sess.get_inputs()[0].name
    out = sess.run(None, {name: x.detach().cpu().numpy()})[0]
    return torch.from_numpy(np.asarray(out))


def compare_outputs(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float]:
    """Max/mean absolute error, error relative to the reference's range, top-1 agreement."""
    ref, out = ref.float().reshape(ref.shape[0], -1), out.float().reshape(out.shape[0], -1)
    diff = (ref - out).abs()
    scale = ref.abs().max().item() or 1.0
    cos = torch.nn.functional.cosine_similarity(ref, out, dim=1).mean().item()
    return {
        "max_abs_error": diff.max().item(),
        "mean_abs_error": diff.mean().item(),
        "max_rel_error": diff.max().item() / scale,
        "top1_agreement": (ref.argmax(1) == out.argmax(1)).float().mean().item(),
        "cosine_similarity": cos,
        "reference_max_abs": scale,
    }


def parity(
    torch_fn: Any, sess: Any, loader: DataLoader, batches: int, input_dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    """Compare a torch callable and an onnxruntime session on up to ``batches`` real batches."""
    refs, outs = [], []
    with torch.inference_mode():
        for i, (x, *_) in enumerate(loader):
            if i >= batches:
                break
            x = x.to(input_dtype)
            refs.append(torch_fn(x).float())
            outs.append(run_session(sess, x).float())
    figures = compare_outputs(torch.cat(refs), torch.cat(outs))
    figures["samples"] = float(sum(len(r) for r in refs))
    return figures
