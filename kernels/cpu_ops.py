"""The kernel module of a CPU step: ``kernels.reference``'s functions, with the compiled ones where
they exist.

The model runner on CPU takes this module as its ``ops`` (``engine.model_runner.select_ops``), as
it takes ``kernels`` on CUDA. A decode step of a small model is mostly per-layer glue: RMSNorm,
the rotary embedding are about a dozen small PyTorch ops each in the references, each costing its
dispatch. Here they are one compiled call each (``cpu/elementwise.cpp``, built into the
compiled CPU attention's library, ``kernels/cpu_attention.py``), and the paged attention and the
KV-cache write are ``kernels.cpu_attention``'s. Every other name is the reference's.

A call the compiled code does not cover (a tensor not on the CPU, a dtype other than float32,
float64, float16 or bfloat16, a weight in another dtype than x, a last dim that is not contiguous:
its own checks raise), or a process where the library could not be built (no compiler: one log
line), goes to the reference. Results equal the references' up to the order of a row's sum of
squares (RMSNorm); the rotary embedding is bit-exact, and SiLU-and-mul calls ATen's own silu and
multiply as the reference does (its vectorized exp beats a scalar loop), in one call.
"""
from __future__ import annotations

from typing import Any

import torch

from kernels import cpu_attention, reference
from kernels.cpu_attention import paged_attention, store_kv_cache  # noqa: F401 - part of this module's API

_ops: Any = None  # torch.ops.pdserve_cpu once the library is loaded


def _compiled() -> Any:
    """torch.ops.pdserve_cpu once the library is loaded, else None (built or loaded on first use)."""
    global _ops
    if _ops is None and cpu_attention.extension() is not None:
        _ops = torch.ops.pdserve_cpu
    return _ops


def _run(name: str, reference_fn: Any, x: torch.Tensor, *args: Any) -> Any:
    """The compiled ``name`` where it takes these arguments (its checks raise otherwise), else
    ``reference_fn``."""
    ops = _compiled() if x.is_cpu else None
    if ops is not None:
        try:
            return getattr(ops, name)(*args)
        except RuntimeError:  # not covered: the reference takes it
            pass
    return reference_fn(*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             float32_weight: bool = False) -> torch.Tensor:
    """``kernels.reference.rms_norm``, compiled (the Gemma forms are the reference's)."""
    if offset or float32_weight:
        return reference.rms_norm(x, weight, eps, offset, float32_weight)
    return _run("rms_norm", reference.rms_norm, x, x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: bool = False, float32_weight: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.fused_add_rms_norm``, compiled (the Gemma forms are the reference's)."""
    if offset or float32_weight:
        return reference.fused_add_rms_norm(x, residual, weight, eps, offset, float32_weight)
    return _run("fused_add_rms_norm", reference.fused_add_rms_norm, x, x, residual, weight, eps)


rms_norm_add = reference.rms_norm_add


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.reference.rotary_embedding``, compiled (bit-exact)."""
    return _run("rotary_embedding", reference.rotary_embedding, q, positions, q, k, cos_sin_cache)


def qk_norm_rope(*args: Any, **kwargs: Any) -> Any:
    """``kernels.reference.qk_norm_rope`` over this module's norm and RoPE."""
    return reference.qk_norm_rope(*args, norm=rms_norm, rope=rotary_embedding, **kwargs)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``kernels.reference.silu_and_mul`` in one compiled call (ATen's same kernels: bit-exact)."""
    return _run("silu_and_mul", reference.silu_and_mul, x, x)


def describe_kernels(device: torch.device, dtype: torch.dtype, cpu_attention_build_timeout: float | None = None
                     ) -> str:
    """The runner's start-up line: the reference's, with the norms and RoPE this module compiles."""
    if device.type != "cpu" or _compiled() is None:
        return reference.describe_kernels(device, dtype, cpu_attention_build_timeout)
    return reference.describe_kernels(device, dtype, cpu_attention_build_timeout,
                                      glue="norms, RoPE and SiLU-and-mul compiled (kernels/cpu_ops.py)")


def __getattr__(name: str) -> Any:
    """Everything else: the reference's."""
    return getattr(reference, name)
