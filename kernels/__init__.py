"""Triton kernels for the model runner, each with a PyTorch twin.

On CUDA the engine calls the launchers exported here; on CPU it calls the
functions of the same name in ``kernels.reference``. This package is a leaf:
it imports torch and triton only, never the engine or services.
"""
from __future__ import annotations

import torch

from kernels import reference
from kernels.activation import silu_and_mul
from kernels.causal_conv1d import causal_conv1d
from kernels.fp8_gemm import fp8_gemm, fp8_quantize
from kernels.fused_moe import fused_moe
from kernels.gated_delta import gated_delta_rule, gated_rms_norm, gdn_gating
from kernels.int4_gemm import int4_gemm
from kernels.kv_cache import store_kv_cache
from kernels.lora import lora_expand, lora_group, lora_shrink
from kernels.moe_routing import moe_route
from kernels.paged_attention import paged_attention
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rope import rotary_embedding


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
    "gated_delta_rule",
    "gated_rms_norm",
    "gdn_gating",
    "int4_gemm",
    "lora_expand",
    "lora_group",
    "lora_shrink",
    "moe_route",
    "paged_attention",
    "reference",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]
