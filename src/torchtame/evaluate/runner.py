"""A uniform callable ``run(x) -> logits`` for torch and ONNX variants on one device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import PassError
from ..inputs import Inputs, call
from ..inputs import prepare as prepare_inputs
from ..onnx_runtime import run_session, session
from ..runtime import compiled, cuda_provider_available, no_mha_fastpath, quantized_engine
from ..variant import Variant

Runner = Callable[[Inputs], Any]


@contextmanager
def make_runner(
    variant: Variant,
    device: str,
    threads: int | None = None,
    inference_mode: bool = True,
    opt_level: str = "all",
) -> Iterator[tuple[Runner, Callable[[Inputs], Inputs]]]:
    """Yield ``(run, prepare)``: ``prepare`` moves an input structure to the device and casts its
    floating tensors to the variant's input dtype; ``run`` returns the raw outputs.

    Torch variants are moved to ``device`` for the duration and moved back to the CPU after;
    quantized variants run under their own quantized engine.
    """
    if variant.kind == "onnx":
        assert variant.onnx_path is not None
        if device.startswith("cuda") and not cuda_provider_available():
            raise PassError("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
        # the same intra-op thread count as PyTorch, so both runtimes compare on equal terms
        sess = session(variant.onnx_path, device, threads or torch.get_num_threads(), opt_level)
        yield (lambda x: run_session(sess, x)), (lambda x: prepare_inputs(x, "cpu", variant.input_dtype))
        return
    assert variant.module is not None
    module = variant.module
    _move(module, device)
    fn = compiled(module) if variant.compiled else module
    ctx = torch.inference_mode if inference_mode else torch.no_grad
    saved_threads = torch.get_num_threads()

    def prepare(x: Inputs) -> Inputs:
        return prepare_inputs(x, device, variant.input_dtype)

    def run(x: Inputs) -> Any:
        with ctx():
            return call(fn, x)

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        # the fused Transformer fast path reads Linear weights as tensors and crashes on
        # dynamically quantized ones (whose weight is a method); their plain path runs them
        slow = no_mha_fastpath() if variant.quantized else contextlib.nullcontext()
        with quantized_engine(variant.backend), slow:
            yield run, prepare
    finally:
        torch.set_num_threads(saved_threads)
        _move(module, "cpu")
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _move(module: torch.nn.Module, device: str) -> None:
    """Move a module only where it is not there yet (tensor subclasses, such as torchao's, refuse
    a parameter swap even onto their own device)."""
    target = torch.device(device)
    tensors = [*module.parameters(), *module.buffers()]
    if any(
        t.device.type != target.type or (target.index is not None and t.device != target) for t in tensors
    ):
        module.to(device)
