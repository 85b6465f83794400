"""The oracle of the FP8 KV cache tests: transformers' own model whose attention sees K
and V (after RoPE) round-tripped through e4m3 with the same per-layer scales pdserve
uses, written here independently of kernels/ (a custom attention function wrapping
transformers' SDPA one, registered under its own name); and a checkpoint copy that
carries such scales the way compressed-tensors writes them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

ATTENTION = "pdserve_fp8_kv_emulation"


def as_float32(xs: list[float]) -> list[float]:
    """The values a float32 checkpoint tensor gives back."""
    return [float(torch.tensor(x, dtype=torch.float32)) for x in xs]


# Per-layer scales for tests/conftest.py's tiny model (3 layers), near the amax / 448 of its
# K and V and none a power of two: each moves the e4m3 grid, so that dropping them shows.
TINY_K_SCALES = as_float32([0.0123, 0.0157, 0.0141])
TINY_V_SCALES = as_float32([0.0131, 0.0169, 0.0112])


def round_trip_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache gives it back: e4m3(clamp(x / scale, +-448)) * scale, in x's dtype."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float().mul(scale).to(x.dtype)


def _fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    key = round_trip_e4m3(key, module.fp8_k_scale)
    value = round_trip_e4m3(value, module.fp8_v_scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def hf_fp8_kv_model(path: Path, k_scales: list[float], v_scales: list[float]):
    """transformers' model at ``path`` (float32, CPU) with FP8-emulating attention."""
    from transformers import AttentionInterface, AttentionMaskInterface, AutoModelForCausalLM
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, _fp8_kv_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation=ATTENTION)
    for layer, k, v in zip(model.model.layers, k_scales, v_scales, strict=True):
        layer.self_attn.fp8_k_scale, layer.self_attn.fp8_v_scale = k, v
    return model.eval()


def copy_with_kv_scales(src: Path, dst: Path, k_scales: list[float], v_scales: list[float],
                        names: tuple[str, ...] = ("self_attn.k_scale", "self_attn.v_scale"),
                        kv_cache_scheme: bool = True) -> Path:
    """``src`` copied to ``dst`` with per-layer KV cache scales added as scalar float32 tensors
    ``model.layers.N.<names>`` (in a second safetensors file, as a sharded checkpoint has them);
    one name (AutoFP8's ``self_attn.kv_scale``) is one scale for K and V, and then the two
    lists must be equal. ``kv_cache_scheme``: config.json also names a compressed-tensors
    ``kv_cache_scheme`` (transformers then wants that package to load ``dst``: build the
    oracle from ``src``, which has the same weights)."""
    from safetensors.torch import save_file

    if len(names) == 1 and list(k_scales) != list(v_scales):
        raise ValueError(f"one scale name ({names[0]}) holds one scale for K and V: k and v scales must be equal")
    shutil.copytree(src, dst)
    tensors = {}
    for i, (k, v) in enumerate(zip(k_scales, v_scales, strict=True)):
        for name, value in zip(names, (k, v)):
            tensors[f"model.layers.{i}.{name}"] = torch.tensor(value, dtype=torch.float32)
    save_file(tensors, str(dst / "model-kv-scales.safetensors"))
    if kv_cache_scheme:
        cfg = json.loads((dst / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
        (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst
