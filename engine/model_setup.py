"""What a runner sets on its model once it is loaded, before the KV cache is sized: an FP8
cache's per-layer scales, whether fresh prompts take the dense prefill kernel, and the fused
MoE kernel's tile configs for this GPU."""
from __future__ import annotations

import logging
from types import ModuleType

import torch

from engine.config import EngineConfig
from engine.kv_cache_dtype import KVScales, load_kv_scales
from engine.layers.attention import Attention

logger = logging.getLogger(__name__)


def set_kv_scales(model: torch.nn.Module, config: EngineConfig, log: bool = True) -> KVScales | None:
    """An FP8 cache: each attention layer's k_scale and v_scale, the checkpoint's or 1.0, said
    once in the log (``log``: rank 0). Other caches keep the layers' 1.0 (None)."""
    mc, cc = config.model, config.cache
    if cc.cache_dtype == "auto":
        return None
    scales = load_kv_scales(mc.path, mc.hf_config, mc.num_layers, mc.load_format)
    # per decoder layer; a layer reading another's KV takes that layer's scales, and layers
    # without attention (linear attention) none
    for i, layer in enumerate(model.model.layers):
        src = mc.layer_kv_sources[i]
        src = i if src is None else src
        for m in layer.modules():
            if isinstance(m, Attention):
                m.k_scale, m.v_scale = scales.k[src], scales.v[src]
    if log:
        logger.info("KV cache dtype %s (%s): %s", cc.cache_dtype, config.kv_dtype, scales.describe())
    return scales


def set_dense_prefill(model: torch.nn.Module, enabled: bool) -> None:
    """``RuntimeConfig.dense_prefill`` (PDSERVE_DENSE_PREFILL=0: fresh prompts on the paged kernel)."""
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.dense_prefill = enabled


def configure_moe(model: torch.nn.Module, device: torch.device, ops: ModuleType) -> None:
    """The fused-MoE kernel's tile configs for this model's expert shape on this GPU: tuned
    the first time (minutes at most), then read from the cache (engine/moe_configs.py)."""
    moe = model.moe_layers()
    if not moe or device.type != "cuda" or ops.__name__ != "kernels":
        return
    m = moe[0]
    kernel_config = m.method.tuned_tiles(m, device)  # the weight format's own tiles (16-bit, FP8, MXFP4)
    for layer in moe:
        layer.kernel_config = kernel_config
    torch.cuda.empty_cache()
