"""The KV cache's element type (``--kv-cache-dtype``, vLLM's flag and names) and the
per-layer scales of an FP8 cache.

    auto             the model's dtype (float32, float16 or bfloat16)
    fp8, fp8_e4m3    torch.float8_e4m3fn, one byte an element: each layer has a scale for K
                     and one for V; the cache holds e4m3(clamp(K / k_scale, -448, 448)) and
                     attention reads K = k8 * k_scale (V likewise; kernels/ does both)

Scales are taken from the checkpoint where it has them, else 1.0 (vLLM's default).
Checkpoint names, per layer N (all per-tensor scalars):

    model.layers.N.self_attn.k_scale / v_scale                     compressed-tensors' kv_cache_scheme
                                                                   (llm-compressor), also Quark
    model.layers.N.self_attn.k_proj.output_scale / v_proj...       older compressed-tensors exports
    model.layers.N.self_attn.k_proj.k_scale / v_proj.v_scale       NVIDIA ModelOpt
    model.layers.N.self_attn.kv_scale                              AutoFP8 (one scale for both)

Nothing here imports torch at module level (the gateway imports engine.config, which
imports this).
"""
from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_E4M3 = "fp8_e4m3"  # what "fp8" means, as in vLLM on CUDA
FP8_TORCH_DTYPE = "float8_e4m3fn"  # torch's name of the cache's element type
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: e4m3 conversions in hardware (Triton's fp8e4nv)
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, FP8_TORCH_DTYPE: 1}

# the checkpoint's scale names -> which scale ("kv": both)
_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                         r"v_proj\.output_scale|k_proj\.k_scale|v_proj\.v_scale)$")
_WHICH = {"k_scale": "k", "v_scale": "v", "kv_scale": "kv", "k_proj.output_scale": "k",
          "v_proj.output_scale": "v", "k_proj.k_scale": "k", "v_proj.v_scale": "v"}


def resolve_cache_dtype(name: str) -> str:
    """``auto`` or ``fp8_e4m3`` (``fp8`` is e4m3); ValueError naming the choices otherwise."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return "auto" if name == "auto" else FP8_E4M3


def kv_torch_dtype(cache_dtype: str, model_dtype: str) -> str:
    """The torch dtype name of the cache's elements: the model's for auto, float8_e4m3fn for FP8."""
    return model_dtype if resolve_cache_dtype(cache_dtype) == "auto" else FP8_TORCH_DTYPE


def element_bytes(torch_dtype: str) -> int:
    return _ELEMENT_BYTES[torch_dtype]


def check_fp8_support(device: str, capability: tuple[int, int] | None, what: str = "--kv-cache-dtype fp8") -> None:
    """FP8 on a CUDA device (``what``: an FP8 cache, or FP8 weights) needs compute capability
    >= 8.9 (the kernels convert e4m3 in hardware, and FP8 tensor cores start there);
    ``capability`` is None off CUDA (the CPU path runs torch's casts)."""
    if capability is not None and tuple(capability) < FP8_MIN_CAPABILITY:
        want = ".".join(map(str, FP8_MIN_CAPABILITY))
        instead = "use --kv-cache-dtype auto" if what.startswith("--kv-cache-dtype") else "serve 16-bit weights"
        raise ValueError(f"{what} needs a GPU of compute capability {want} or newer (Ada, Hopper); "
                         f"{device} has {capability[0]}.{capability[1]}: {instead}")


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (read by ``load_kv_scales``, not a weight)."""
    return _SCALE_NAME.search(name) is not None


@dataclass(frozen=True)
class KVScales:
    """Per layer: the cache holds K / k[layer] and V / v[layer]."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str  # where they came from, for the log line

    def describe(self) -> str:
        def span(xs: tuple[float, ...]) -> str:
            lo, hi = min(xs), max(xs)
            return f"{lo:g}" if lo == hi else f"{lo:g}..{hi:g}"
        return f"k_scale {span(self.k)}, v_scale {span(self.v)} ({self.source})"


def default_scales(num_layers: int, source: str) -> KVScales:
    return KVScales((1.0,) * num_layers, (1.0,) * num_layers, source)


def kv_cache_scheme(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's ``quantization_config.kv_cache_scheme`` (compressed-tensors), if any."""
    scheme = (hf_config.get("quantization_config") or {}).get("kv_cache_scheme")
    return scheme if isinstance(scheme, dict) else None


def scales_from_tensors(tensors: Iterable[tuple[str, Any]], num_layers: int, where: str) -> KVScales | None:
    """The scales among ``(name, tensor)`` pairs (see the module docstring); None if there are
    none. Every layer must have both (a partial set is refused), each one finite positive
    scalar (per-head scales are refused)."""
    found: dict[str, dict[int, float]] = {"k": {}, "v": {}}
    for name, tensor in tensors:
        m = _SCALE_NAME.search(name)
        if m is None:
            continue
        layer, which = int(m.group(1)), _WHICH[m.group(2)]
        if tensor.numel() != 1:
            raise ValueError(f"{where}: {name} has {tensor.numel()} values; only per-tensor KV cache scales "
                             "(one a layer) are supported")
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0) or not 0 <= layer < num_layers:
            raise ValueError(f"{where}: {name} = {value} is not a positive finite scale of a layer "
                             f"in [0, {num_layers})")
        for kind in ("k", "v") if which == "kv" else (which,):
            found[kind][layer] = value
    if not found["k"] and not found["v"]:
        return None
    for kind, got in found.items():
        missing = sorted(set(range(num_layers)) - set(got))
        if missing:
            raise ValueError(f"{where}: the checkpoint has KV cache scales but no {kind}_scale for layers {missing}")
    return KVScales(tuple(found["k"][i] for i in range(num_layers)), tuple(found["v"][i] for i in range(num_layers)),
                    f"from the checkpoint, {where}")


def load_kv_scales(path: Path, hf_config: dict[str, Any], num_layers: int, load_format: str) -> KVScales:
    """An FP8 cache's scales: the checkpoint's (safetensors in ``path``), else 1.0. Refuses a
    ``kv_cache_scheme`` that is not per-tensor 8-bit float."""
    scheme = kv_cache_scheme(hf_config)
    if scheme is not None:
        kind = (scheme.get("type"), scheme.get("num_bits"), scheme.get("strategy", "tensor"))
        if kind != ("float", 8, "tensor"):
            raise ValueError(f"{path}: kv_cache_scheme {json.dumps(scheme)} is not supported (per-tensor 8-bit "
                             "float only)")
    if load_format == "dummy":
        return default_scales(num_layers, "1.0: random (dummy) weights")
    from safetensors import safe_open

    tensors = []
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            tensors += [(name, fh.get_tensor(name)) for name in fh.keys() if is_kv_scale_name(name)]
    scales = scales_from_tensors(tensors, num_layers, path.name)
    if scales is not None:
        return scales
    if scheme is not None:
        logger.warning("%s: config.json has a kv_cache_scheme but the checkpoint holds no k_scale/v_scale: "
                       "using 1.0", path)
    return default_scales(num_layers, "1.0: the checkpoint has none")
