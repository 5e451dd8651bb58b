"""Torch runtime switches shared across the package: quantized engines, seeding, fast paths.

Nothing here imports the rest of the package except :mod:`torchtame.errors`.
"""

from __future__ import annotations

import contextvars
import platform
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import torch

from .errors import PassError


def default_backend() -> str:
    """The best quantized engine this PyTorch build offers (x86 first)."""
    engines = torch.backends.quantized.supported_engines
    for name in ("x86", "fbgemm", "qnnpack", "onednn"):
        if name in engines:
            return name
    raise PassError("this PyTorch build has no quantized engine", hint="install a standard build")


def has_vnni() -> bool:
    """Whether this CPU has a u8 x s8 dot-product instruction that sums in 32 bits (AVX512-VNNI,
    AVX-VNNI, AMX). Without one, int8 kernels (onednn's too) sum pairs of products in 16 bits,
    which saturates with 8-bit activations."""
    try:
        caps = torch.cpu.get_capabilities()
    except Exception:  # an older or unusual build: assume the safe 7-bit path
        return False
    return any(caps.get(k, False) for k in ("avx512_vnni", "avx_vnni", "amx_int8", "amx_tile"))


_WEIGHT_BITS: contextvars.ContextVar[int | None] = contextvars.ContextVar("weight_bits", default=None)


@contextmanager
def weight_bits(bits: int | None) -> Iterator[None]:
    """Within this block static int8 and QAT quantize weights to ``bits`` (7: -64..63, 8:
    -128..127) whatever this CPU and engine would take (None: :func:`weight_range`'s default).
    For a model built here for a CPU of the other kind."""
    token = _WEIGHT_BITS.set(bits)
    try:
        yield
    finally:
        _WEIGHT_BITS.reset(token)


def _forced() -> tuple[int, int] | None:
    bits = _WEIGHT_BITS.get()
    return None if bits is None else ((-64, 63) if bits == 7 else (-128, 127))


def pt2e_weight_range() -> tuple[int, int]:
    """The int8 weight grid of PT2E's kernels (onednn, through Inductor; activations are 8-bit):
    -128..127 with VNNI, -64..63 without.

    Without VNNI the kernels sum pairs of u8 x s8 products in 16 bits, which 8-bit activations
    and 8-bit weights overflow. Of the two ways out, torchao's documented one is 7-bit activations
    (``reduce_range``); 7-bit weights (onnxruntime's ``reduce_range``) keep more of float, because
    activation ranges are where post-training int8 loses most, and the compiled kernels then
    reproduce the simulated int8 graph. On an AVX2-only AMD EPYC, a mobilenetv3_large_100 trained
    here (64x64): compiled int8 cosine to float 0.98434 with 7-bit weights against 0.97741 with
    7-bit activations, compiled against simulated 0.99848 against 0.99015; on a digits MobileNetV2
    0.99816 against 0.99792 (8-bit both: 0.9790). Not on every model: a random-weight
    mobilenetv3_large_100 (0.92833 against 0.9433) and a digits mobilenet_v2 x0.5 (0.99353 against
    0.99517) lost more to 7-bit weights (benchmarks/recovery.py's machine notes). :func:`weight_bits`
    overrides it."""
    forced = _forced()
    if forced is not None:
        return forced
    return (-128, 127) if has_vnni() else (-64, 63)


def weight_range(mode: str, backend: str | None = None) -> tuple[int, int]:
    """The symmetric int8 weight grid static int8 and QAT quantize to, per graph mode and engine:
    PT2E :func:`pt2e_weight_range`; FX/eager on torch.ao's x86 and fbgemm engines -64..63 (their
    kernels sum pairs of u8 x s8 products in 16 bits on every CPU; 7-bit weights instead of
    torch.ao's 7-bit activations: a digits MobileNetV2 0.99858 against 0.99761, a random-weight
    BatchNorm-recalibrated mobilenet_v2 0.886 against 0.855, resnet18 0.99482 against 0.99522);
    onednn: as PT2E (7-bit without VNNI); others -128..127. :func:`weight_bits` overrides it."""
    forced = _forced()
    if forced is not None:
        return forced
    if mode == "pt2e" or backend == "onednn":
        return pt2e_weight_range()
    return (-64, 63) if backend in ("x86", "fbgemm") else (-128, 127)


def static_backend() -> str:
    """The engine for static int8 (FX, eager, FX QAT): onednn where this build has it on an x86
    CPU with VNNI (:func:`has_vnni`), else :func:`default_backend` (x86).

    fbgemm's kernels (torch.ao's x86 and fbgemm engines) sum pairs of u8 x s8 products in 16 bits
    and saturate with 8-bit activations and 8-bit weights: on a trained digits MobileNetV2, FX
    int8 reached cosine 0.936 to the int8 model simulated exactly (``convert_to_reference_fx``).
    torch.ao's configs calibrate 7-bit activations there; torchtame quantizes their weights to 7
    bits instead (:func:`weight_range`). onednn's kernels with VNNI reproduce the simulation with 8
    bits on both sides (0.99987) and keep the most of float. Speed: within 3% of x86 on
    mobilenet_v2 and resnet18 (batch 8, 224x224), 8% slower on the quickstart's 8x8 digits CNN
    (batch 1 and 64). All that on a CPU with AVX512-VNNI. On an AVX2-only CPU (AMD EPYC without
    VNNI) onednn's 8-bit kernels saturate too (cosine 0.9835 to float), so there x86 it is.
    """
    engines = torch.backends.quantized.supported_engines
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
    if "onednn" in engines and x86 and has_vnni():
        return "onednn"
    return default_backend()


def check_backend(backend: str | None, static: bool = False) -> str:
    """The engine to use, checked against what this PyTorch build supports (``static``: the
    default for static int8 is :func:`static_backend`)."""
    if backend is None:
        return static_backend() if static else default_backend()
    engines = [e for e in torch.backends.quantized.supported_engines if e != "none"]
    if backend not in engines:
        raise PassError(
            f"quantization backend {backend!r} is not supported by this PyTorch build",
            hint=f"use one of: {', '.join(engines)} (see `optimize env`)",
        )
    return backend


@contextmanager
def quantized_engine(name: str | None) -> Iterator[None]:
    """Set torch's quantized engine for the block (no change when ``name`` is None)."""
    saved = torch.backends.quantized.engine
    if name:
        torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = saved


@contextmanager
def no_mha_fastpath() -> Iterator[None]:
    """Run Transformer layers on their plain path (the fast path rejects quantized Linears)."""
    saved = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(saved)


@contextmanager
def variant_runtime(backend: str | None, quantized: bool) -> Iterator[None]:
    """What a variant's calls run under: its quantized engine and, for quantized variants, the
    plain Transformer path (the fused fast path reads Linear weights as tensors and crashes on
    dynamically quantized ones, whose weight is a method)."""
    with quantized_engine(backend), no_mha_fastpath() if quantized else nullcontext():
        yield


def compiled(module: torch.nn.Module) -> Callable[..., Any]:
    """``torch.compile`` for inference with Inductor's weight freezing, which int8 PT2E graphs need
    for their quantize/dequantize patterns to become int8 kernels. Compiles on the first call, one
    static graph per input shape: Inductor's dynamic-shape recompile of int8 convolutions fails
    a stride assertion in torch 2.14 (first batch 1, then 64), static graphs do not."""
    import torch._inductor.config as inductor_config

    fn = torch.compile(module, dynamic=False)

    def run(*args: Any, **kwargs: Any) -> Any:
        with inductor_config.patch(freezing=True):
            return fn(*args, **kwargs)

    return run


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cuda_provider_available() -> bool:
    """Whether onnxruntime can run on CUDA here (onnxruntime-gpu installed, a GPU present)."""
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()
