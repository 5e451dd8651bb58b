"""A uniform callable ``run(x) -> logits`` for torch and ONNX variants on one device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import PassError
from ..inputs import Inputs, call
from ..inputs import prepare as prepare_inputs
from ..onnx_runtime import BoundSession, run_session, session
from ..runtime import compiled, cuda_provider_available, variant_runtime
from ..variant import Variant

Runner = Callable[[Inputs], Any]


@dataclass(frozen=True)
class Timing:
    """How a variant is timed on one device, recorded with every latency figure.

    ``fn(prepare(x))`` is the timed call; ``threads`` is the runtime's own thread count (None:
    PyTorch's, read inside the timed calls); ``timer`` is ``auto`` (CUDA events for torch on CUDA)
    or ``wall`` (host clock up to a device synchronize); ``io`` says where inputs and outputs
    live during the timed calls (``device``: already there, no copies timed).
    """

    fn: Runner
    prepare: Callable[[Inputs], Any]
    threads: int | None
    timer: str
    io: str
    mha_fastpath: bool | None  # None: no torch attention layers in the model


ATTENTION = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer)


class Run:
    """``run(x)`` returns a variant's raw outputs; ``run.timing`` says how to time it."""

    def __init__(self, fn: Runner, timing: Timing | None = None) -> None:
        self.fn = fn
        self.timing = timing

    def __call__(self, x: Inputs) -> Any:
        return self.fn(x)


@contextmanager
def make_runner(
    variant: Variant,
    device: str,
    threads: int | None = None,
    inference_mode: bool = True,
    opt_level: str = "all",
) -> Iterator[tuple[Run, Callable[[Inputs], Inputs]]]:
    """Yield ``(run, prepare)``: ``prepare`` moves an input structure to the device and casts its
    floating tensors to the variant's input dtype; ``run`` returns the raw outputs and carries
    the :class:`Timing` of the variant on this device.

    Torch variants are moved to ``device`` for the duration and moved back to the CPU after;
    quantized variants run under their own quantized engine. ONNX variants on CUDA are timed
    through IO binding (inputs and outputs stay on the GPU, as torch-on-CUDA timings have them).
    """
    if variant.kind == "onnx":
        assert variant.onnx_path is not None
        if device.startswith("cuda") and not cuda_provider_available():
            raise PassError("onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)")
        # the same intra-op thread count as PyTorch, so both runtimes compare on equal terms
        sess = session(variant.onnx_path, device, threads or torch.get_num_threads(), opt_level)
        count = sess.get_session_options().intra_op_num_threads

        def prepare_onnx(x: Inputs) -> Inputs:
            return prepare_inputs(x, "cpu", variant.input_dtype)

        if device.startswith("cuda"):
            bound = BoundSession(sess, device)
            timing = Timing(bound, lambda x: bound.prepare(prepare_onnx(x)), count, "wall", "device", None)
        else:
            timing = Timing(lambda x: run_session(sess, x), prepare_onnx, count, "wall", "host", None)
        yield Run(lambda x: run_session(sess, x), timing), prepare_onnx
        return
    assert variant.module is not None
    module = variant.module
    _move(module, device)
    fn = compiled(module) if variant.compiled else module
    ctx = torch.inference_mode if inference_mode else torch.no_grad
    saved_threads = torch.get_num_threads()

    def prepare(x: Inputs) -> Inputs:
        return prepare_inputs(x, device, variant.input_dtype)

    def forward(x: Inputs) -> Any:
        with ctx():
            return call(fn, x)

    # quantized variants run on the plain attention path (runtime.variant_runtime)
    attention = any(isinstance(m, ATTENTION) for m in module.modules())
    fastpath = (not variant.quantized and torch.backends.mha.get_fastpath_enabled()) if attention else None
    io = "device" if device.startswith("cuda") else "host"
    run = Run(forward, Timing(forward, prepare, None, "auto", io, fastpath))

    try:
        if threads is not None:
            torch.set_num_threads(threads)
        with variant_runtime(variant.backend, variant.quantized):
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
