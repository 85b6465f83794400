"""Triton kernels for the model runner, each with a PyTorch twin.

On CUDA the engine calls the launchers exported here; on CPU it calls the
functions of the same name in ``kernels.reference``. This package is a leaf:
it imports torch and triton only, never the engine or services.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

# launcher -> its module. Imported on first use (PEP 562): importing ``kernels.reference`` or
# ``kernels.cpu_ops`` (a CPU step) imports this package first, and Triton is not needed there.
_LAUNCHERS = {
    "gated_activation": "activation", "silu_and_mul": "activation",
    "causal_conv1d": "causal_conv1d",
    "fp8_gemm": "fp8_gemm", "fp8_quantize": "fp8_gemm",
    "fused_moe": "fused_moe",
    "gated_delta_rule": "gated_delta", "gated_rms_norm": "gated_delta", "gdn_gating": "gated_delta",
    "int4_gemm": "int4_gemm",
    "store_kv_cache": "kv_cache",
    "lora_expand": "lora", "lora_group": "lora", "lora_shrink": "lora",
    "moe_route": "moe_routing",
    "paged_attention": "paged_attention",
    "fused_add_rms_norm": "rms_norm", "rms_norm": "rms_norm", "rms_norm_add": "rms_norm",
    "rms_norm_add_norm": "rms_norm", "qk_norm_rope": "rope",
    "rotary_embedding": "rope",
    "reference": None,  # the module kernels.reference itself
}


def __getattr__(name: str) -> Any:
    module = _LAUNCHERS.get(name, "")
    if module == "":
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = importlib.import_module(f"kernels.{module or name}")
    if module is not None:
        value = getattr(value, name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAUNCHERS))


class _Package(types.ModuleType):
    """Importing a submodule named as its launcher (``kernels.rms_norm``) makes the import system
    set that name on this package to the module: the launcher takes its place, as the eager
    ``from kernels.rms_norm import rms_norm`` of this package's first form did."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAUNCHERS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def describe_kernels(device: torch.device, dtype: torch.dtype,
                     cpu_attention_build_timeout: float | None = None) -> str:
    """What serves a step on these kernels, for the model runner's start-up log line
    (``kernels.reference.describe_kernels`` is the references' own)."""
    blas = " (cuBLAS)" if device.type == "cuda" else ""
    return (f"Triton (attention, norms, RoPE, activations, MoE, FP8 and int4 GEMMs; kernels/), "
            f"16-bit and float32 GEMMs torch's{blas}")


__all__ = [
    "causal_conv1d",
    "describe_kernels",
    "fp8_gemm",
    "fp8_quantize",
    "fused_add_rms_norm",
    "fused_moe",
    "gated_activation",
    "gated_delta_rule",
    "gated_rms_norm",
    "gdn_gating",
    "int4_gemm",
    "lora_expand",
    "lora_group",
    "lora_shrink",
    "moe_route",
    "paged_attention",
    "qk_norm_rope",
    "reference",
    "rms_norm",
    "rms_norm_add",
    "rms_norm_add_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]
