"""Engine configuration: frozen, validated dataclasses and the CLI flags that
build them.

Layers: ``EngineArgs`` is the flat, user-facing bag of flags (vLLM's names);
``EngineArgs.create_engine_config()`` resolves it into ``EngineConfig`` =
``ModelConfig`` + ``CacheConfig`` + ``SchedulerConfig`` + device. Every
derived value is resolved once here; nothing downstream re-reads flags or
environment variables.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.kv_cache_dtype import (FP8_E4M3, KV_CACHE_DTYPES, check_fp8_support, element_bytes, kv_torch_dtype,
                                   resolve_cache_dtype)
from engine.lora.config import LoRAConfig, parse_lora_module
from engine.speculative import SpeculativeConfig
from engine.runtime_config import RuntimeConfig
from engine.quantization.config import (GGUF_ACTIVATIONS, QUANTIZATION_CHOICES, QuantizationConfig,
                                       resolve_quantization, uses_fp8)

logger = logging.getLogger(__name__)
_DTYPES = ("auto", "float32", "float16", "bfloat16")
# RoPE variants engine/layers/rotary.py builds; activations engine/layers/activation.py runs.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "proportional")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'2GiB' / '512MiB' / '1.5G' / '1048576' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r}: use bytes or a unit such as 512MiB or 2GiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    scale = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(value * 1024**scale)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, read from its Hugging Face ``config.json``.

    What every family has is a field here; what only one family reads (Gemma's
    ``query_pre_attn_scalar``, Qwen3-MoE's ``mlp_only_layers``) stays in ``hf_config``
    and is read by that family's file. A config naming a feature pdserve does not
    implement is refused here, at load, rather than served wrong."""

    path: Path
    served_model_name: str
    architecture: str
    dtype: str  # resolved: float32 | float16 | bfloat16
    load_format: str  # auto | safetensors | dummy
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    # RoPE parameters per layer type ("full_attention", "sliding_attention"): rope_type,
    # rope_theta and the variant's own keys (factor, original_max_position_embeddings, ...)
    rope: dict[str, dict[str, Any]]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    seed: int = 0
    layer_types: tuple[str, ...] = ()  # per layer: full_attention | sliding_attention (empty: all full)
    sliding_window: int | None = None  # keys a sliding_attention layer's query sees, itself included
    partial_rotary_factor: float = 1.0
    hidden_act: str = "silu"
    num_experts: int = 0  # mixture of experts: experts per MoE layer (0: dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # --quantization and the checkpoint's quantization_config, resolved (None: 16/32-bit weights)
    quantization: QuantizationConfig | None = None
    # per layer, where a family varies them (empty: every layer has num_kv_heads x head_dim and
    # its own KV): (KV heads, head size) and the earlier layer whose KV it reads (Gemma 4)
    kv_shapes: tuple[tuple[int, int], ...] = ()
    kv_sources: tuple[int | None, ...] = ()
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_dir(path: Path, *, dtype: str, load_format: str, served_model_name: str,
                 seed: int = 0, quantization: str | None = None,
                 gguf_activations: str = "float32") -> "ModelConfig":
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} is not a Hugging Face model directory (no config.json)")
        cfg = json.loads(cfg_file.read_text())
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        from engine.models import ARCHITECTURES

        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if arch in GEMMA4_ARCHITECTURES:
            cfg = _gemma4_config(arch, cfg)
        elif arch in QWEN3_5_MULTIMODAL_ARCHITECTURES:
            cfg = _qwen3_5_text_config(arch, cfg)
        num_heads = cfg["num_attention_heads"]
        num_layers = cfg["num_hidden_layers"]
        _refuse_unsupported(arch, cfg)
        eos = cfg.get("eos_token_id")
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope = _rope_by_layer_type(cfg)
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"{arch}: unsupported activation {act!r} (supported: {', '.join(_ACTIVATIONS)})")
        num_experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        model = ModelConfig(
            path=path,
            served_model_name=served_model_name,
            architecture=arch,
            dtype=dtype,
            load_format=load_format,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # a MoE config with no dense layer may leave it out (Qwen3.5-MoE)
            intermediate_size=cfg.get("intermediate_size", 0) if num_experts else cfg["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "Gemma3ForCausalLM")),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            seed=seed,
            layer_types=_layer_types(arch, cfg, num_layers),
            sliding_window=cfg.get("sliding_window"),
            # else config.json's top level (older configs), else the family's default (transformers')
            partial_rotary_factor=float(rope["full_attention"].get("partial_rotary_factor", cfg.get(
                "partial_rotary_factor", 0.25 if arch in LINEAR_ATTENTION_ARCHS else 1.0))),
            hidden_act=act,
            num_experts=num_experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if num_experts else 0,
            quantization=resolve_quantization(quantization, cfg, load_format, gguf_activations),
            hf_config=cfg,
        )
        return dataclasses.replace(model, **_gemma4_fields(cfg)) if arch in GEMMA4_ARCHITECTURES else model

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention)."""
        if not self.layer_types:
            return (None,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def layer_kv_shapes(self) -> tuple[tuple[int, int], ...]:
        return self.kv_shapes or ((self.num_kv_heads, self.head_dim),) * self.num_layers

    @property
    def layer_kv_sources(self) -> tuple[int | None, ...]:
        return self.kv_sources or (None,) * self.num_layers

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def torch_dtype(self):  # -> torch.dtype
        import torch

        return getattr(torch, self.dtype)

    def kv_bytes_per_token(self, kv_dtype: str | None = None) -> int:
        """Bytes of one token's K and V over every layer, stored as ``kv_dtype`` (a torch dtype
        name; default the model's: ``EngineConfig.kv_dtype`` is the cache's)."""
        elem = element_bytes(kv_dtype or self.dtype)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


# Families with Gated DeltaNet linear-attention layers (engine/layers/gated_delta_net.py), and
# those whose MoE blocks may have a sigmoid-gated shared expert (engine/layers/moe.py).
LINEAR_ATTENTION_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                          "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
_SHARED_EXPERT_ARCHS = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
_LINEAR_ATTENTION_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                          "linear_value_head_dim")


def _refuse_unsupported(arch: str, cfg: dict[str, Any]) -> None:
    """Config fields that would change the model's arithmetic in ways not implemented."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{arch}: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch}: use_bidirectional_attention is not supported (decoder-only serving)")
    if cfg.get("shared_expert_intermediate_size") and arch not in _SHARED_EXPERT_ARCHS:
        raise ValueError(f"{arch}: shared experts are not supported")
    if arch in LINEAR_ATTENTION_ARCHS:
        missing = [k for k in _LINEAR_ATTENTION_KEYS if not cfg.get(k)]
        if missing:
            raise ValueError(f"{arch}: the config does not give {', '.join(missing)}")
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        if nv % nk:
            raise ValueError(f"{arch}: linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
        if (cfg.get("hidden_act") or "silu") != "silu":
            raise ValueError(f"{arch}: hidden_act {cfg['hidden_act']!r} is not supported (the linear-attention "
                             "convolution runs SiLU)")
        if cfg.get("attn_output_gate") is False:
            raise ValueError(f"{arch}: attn_output_gate false is not supported (full attention is gated)")


def _common_window(windows: tuple[int | None, ...]) -> int | None:
    """The window every layer shares, or None when some layer attends to the whole context
    (then no block ever leaves every layer's reach)."""
    return windows[0] if len(set(windows)) == 1 else None


def _rope_by_layer_type(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """RoPE parameters per layer type, from either transformers 5's ``rope_parameters``
    (flat, or nested by layer type as Gemma 3 writes it) or the older ``rope_theta`` +
    ``rope_scaling`` (+ Gemma 3's ``rope_local_base_freq``). Unknown variants are refused."""
    params = cfg.get("rope_parameters") or {}
    nested = bool(params) and all(isinstance(v, dict) for v in params.values())
    if nested:
        out = {t: dict(v) for t, v in params.items()}
    else:
        full = dict(params)
        scaling = cfg.get("rope_scaling") or {}
        full.update(scaling)
        full.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        out = {"full_attention": full}
        if "rope_local_base_freq" in cfg:
            out["sliding_attention"] = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
    out.setdefault("full_attention", {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)})
    out.setdefault("sliding_attention", out["full_attention"])
    for layer_type, r in out.items():
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"unsupported RoPE layer type {layer_type!r}")
        kind = r.get("rope_type", r.get("type")) or "default"
        if kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        r["rope_type"] = kind
        r.pop("type", None)
        r.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if kind in ("yarn", "longrope") and "original_max_position_embeddings" not in r:
            if "original_max_position_embeddings" not in cfg:
                raise ValueError(f"rope_type {kind!r} needs original_max_position_embeddings")
            r["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return out


def _layer_types(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Which layers attend within a sliding window: the config's ``layer_types`` when it
    has them; else every layer when it names a window (Mistral, Mixtral, Phi-3), from
    ``max_window_layers`` on where ``use_sliding_window`` says so (Qwen2), or Gemma 3's
    older ``sliding_window_pattern`` (every n-th layer full). Linear-attention families
    without ``layer_types``: every ``full_attention_interval``-th layer (4th) full, the rest
    linear_attention, as transformers fills them in."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None and arch in LINEAR_ATTENTION_ARCHS:  # transformers' default: every n-th layer full
        n = cfg.get("full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % n else "full_attention" for i in range(num_layers)]
    if types is not None:
        if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"{arch}: unsupported layer_types {types!r} (supported: {', '.join(LAYER_TYPES)})")
        if "linear_attention" in types and arch not in LINEAR_ATTENTION_ARCHS:
            raise ValueError(f"{arch}: linear_attention layers are not supported in this family (only in "
                             f"{', '.join(LINEAR_ATTENTION_ARCHS)})")
        if arch in LINEAR_ATTENTION_ARCHS and "sliding_attention" in types:
            raise ValueError(f"{arch}: sliding_attention layers are not supported (its layers are full_attention "
                             "or linear_attention)")
        if "sliding_attention" in types and not window:
            raise ValueError(f"{arch}: layer_types names sliding_attention but sliding_window is not set")
        return tuple(types)
    if not window or not cfg.get("use_sliding_window", True):
        return ("full_attention",) * num_layers
    if "sliding_window_pattern" in cfg:
        n = cfg["sliding_window_pattern"]
        return tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers))
    first = cfg.get("max_window_layers", 0) if "use_sliding_window" in cfg else 0
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))


# ---- Gemma 4 (engine/models/gemma4.py) -------------------------------------------------
GEMMA4_ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
# transformers 5.23's Gemma4TextConfig defaults, for what a config.json leaves out
_GEMMA4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    attention_bias=False, sliding_window=512, final_logit_softcapping=None, use_bidirectional_attention=None,
    vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, attention_k_eq_v=False,
    num_kv_shared_layers=0, enable_moe_block=False, use_double_wide_mlp=False, num_experts=None,
    top_k_experts=None, moe_intermediate_size=None)
_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
# what a per_layer_config entry may override (the full layers' head size and KV heads)
_GEMMA4_PER_LAYER = ("head_dim", "num_key_value_heads")


def _gemma4_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 4 config.json as transformers reads it: the defaults filled in, the last layer
    made full attention, and ``per_layer_config`` (the full layers' head size and KV heads)
    made from ``global_head_dim`` / ``num_global_key_value_heads`` where the file has none.
    A multimodal checkpoint (Gemma4ForConditionalGeneration) is served by its text model:
    its ``text_config``, beside which the vision and audio towers are left unread."""
    if arch == "Gemma4ForConditionalGeneration":
        if not isinstance(cfg.get("text_config"), dict):
            raise ValueError(f"{arch}: config.json has no text_config")
        text = dict(cfg["text_config"])
        for key in ("quantization_config", "tie_word_embeddings", "eos_token_id"):
            if key in cfg:
                text[key] = cfg[key]
        # image, video and audio placeholders: read as the pad token, as transformers does without media
        text["placeholder_token_ids"] = [cfg.get(k) or d for k, d in (("image_token_id", 258_880),
                                                                        ("video_token_id", 258_884),
                                                                        ("audio_token_id", 258_881))]
        cfg = text
    cfg = {**_GEMMA4_DEFAULTS, **cfg}
    n = cfg["num_hidden_layers"]
    types = list(cfg.get("layer_types") or
                 ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    if types and types[-1] != "full_attention":  # transformers forces it (with a warning)
        logger.warning("%s: the last layer must use full attention; it is made so, as transformers does", arch)
        types[-1] = "full_attention"
    cfg["layer_types"] = types
    cfg["rope_parameters"] = cfg.get("rope_parameters") or _GEMMA4_ROPE
    for layer_type, r in cfg["rope_parameters"].items():
        kind = (r or {}).get("rope_type", "default")
        if kind not in ("default", "proportional") and (r.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"{arch}: partial_rotary_factor with rope_type {kind!r} ({layer_type}) is not "
                             "supported (transformers runs it only with 'proportional' or 'default')")
    if cfg.get("use_bidirectional_attention") == "vision":
        cfg["use_bidirectional_attention"] = None  # only image tokens attend both ways: none among text
    if "per_layer_config" not in cfg:
        full = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg["attention_k_eq_v"] and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        cfg["per_layer_config"] = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    for layer, override in (cfg["per_layer_config"] or {}).items():
        unknown = sorted(set(override) - set(_GEMMA4_PER_LAYER))
        if unknown:
            raise ValueError(f"{arch}: per_layer_config overrides {unknown} (layer {layer}) are not supported "
                             f"(supported: {', '.join(_GEMMA4_PER_LAYER)})")
    if cfg["hidden_size_per_layer_input"] and cfg["vocab_size_per_layer_input"] < cfg["vocab_size"]:
        raise ValueError(f"{arch}: vocab_size_per_layer_input {cfg['vocab_size_per_layer_input']} below vocab_size "
                         f"{cfg['vocab_size']} is not supported (the per-layer embedding has no row for the ids "
                         "past it; transformers fails on them)")
    if cfg["enable_moe_block"] and not (cfg["num_experts"] and cfg["top_k_experts"] and cfg["moe_intermediate_size"]):
        raise ValueError(f"{arch}: enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
    return cfg


def _gemma4_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 4 config (``_gemma4_config``'s): each layer's KV shape
    and, for the last ``num_kv_shared_layers`` layers, the layer whose KV they read: the last
    layer of their type before them (transformers' kv_sharing_modes "reuse" and "store")."""
    n, types = cfg["num_hidden_layers"], cfg["layer_types"]
    overrides = {int(i): o for i, o in (cfg["per_layer_config"] or {}).items()}
    shapes = tuple((overrides.get(i, {}).get("num_key_value_heads", cfg["num_key_value_heads"]),
                    overrides.get(i, {}).get("head_dim", cfg["head_dim"])) for i in range(n))
    first_shared = n - (cfg["num_kv_shared_layers"] or 0)
    sources: list[int | None] = [None] * n
    for i in range(max(first_shared, 0), n):
        before = [j for j in range(max(first_shared, 0)) if types[j] == types[i]]
        if not before:
            raise ValueError(f"Gemma 4: layer {i} ({types[i]}) reads the KV of an earlier {types[i]} layer, but "
                             f"none comes before the {cfg['num_kv_shared_layers']} KV-sharing layers")
        sources[i] = before[-1]
        if shapes[i] != shapes[before[-1]]:
            raise ValueError(f"Gemma 4: layer {i} reads the KV of layer {before[-1]}, whose shape "
                             f"{shapes[before[-1]]} differs from its own {shapes[i]}")
    moe = bool(cfg["enable_moe_block"])
    return dict(kv_shapes=shapes, kv_sources=tuple(sources) if first_shared < n else (),
                partial_rotary_factor=1.0,  # "proportional" RoPE spans the whole head (its zeros turn nothing)
                num_experts=cfg["num_experts"] if moe else 0, num_experts_per_tok=cfg["top_k_experts"] if moe else 0,
                moe_intermediate_size=cfg["moe_intermediate_size"] if moe else 0)


# ---- Qwen3.5's multimodal checkpoints (engine/models/qwen3_5.py) -------------------------
QWEN3_5_MULTIMODAL_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
# a multimodal checkpoint's names of its text model (a name, a "re:" pattern), and the text model's
_LANGUAGE_MODEL_NAMES = (("model.language_model.", "model."), ("re:model.language_model.", "re:model."),
                         ("re:model\\.language_model\\.", "re:model\\."))
_QUANT_IGNORE_KEYS = ("ignore", "modules_to_not_convert", "ignored_layers")


def _qwen3_5_text_config(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Qwen3.5 checkpoint (Qwen3_5ForConditionalGeneration, or the MoE one) is
    served by its text model: its ``text_config``, with the top level's
    ``tie_word_embeddings`` (transformers ties the LM head by it; absent: False, as
    Qwen3_5Config's default), ``eos_token_id`` where it has one, and ``quantization_config``,
    whose ignore lists name ``model.language_model.*``: read as the text model's ``model.*``."""
    if not isinstance(cfg.get("text_config"), dict):
        raise ValueError(f"{arch}: config.json has no text_config")
    text = dict(cfg["text_config"])
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    if cfg.get("eos_token_id") is not None:
        text["eos_token_id"] = cfg["eos_token_id"]
    qc = cfg.get("quantization_config")
    if isinstance(qc, dict):
        qc = dict(qc)
        for key in _QUANT_IGNORE_KEYS:
            if isinstance(qc.get(key), list):
                qc[key] = [_text_model_name(rule) for rule in qc[key]]
        text["quantization_config"] = qc
    return text


def _text_model_name(rule: Any) -> Any:
    """An ignore-list entry naming ``model.language_model.X`` as ``model.X``; others unchanged."""
    for theirs, ours in _LANGUAGE_MODEL_NAMES:
        if isinstance(rule, str) and rule.startswith(theirs):
            return ours + rule[len(theirs):]
    return rule


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes; overrides the GPU budget when set
    num_gpu_blocks_override: int | None = None
    # Every layer of the model attends within this many keys: blocks that left the window
    # are released (engine/kv_cache_manager.py). None: a full-attention layer keeps them all.
    sliding_window: int | None = None
    cache_dtype: str = "auto"  # --kv-cache-dtype, resolved: auto (the model's) | fp8_e4m3
    # KV cache groups (engine/kv_cache_groups.py): each kind of layer keeps what it reads.
    # False (--disable-hybrid-kv-cache-manager): one table for every layer, as before groups.
    hybrid_kv_cache: bool = True
    # Linear-attention models' prefix cache (engine/linear_state_cache.py): state snapshots kept
    # (None: one per --max-num-seqs; 0: their prompts are computed whole) and their spacing.
    linear_state_snapshots: int | None = None
    linear_state_snapshot_interval: int = 256
    # --kv-offloading-size: GiB of host memory for KV blocks the device cache evicts (a second
    # tier, engine/kv_offload.py; pinned on CUDA). 0: off.
    kv_offloading_size: float = 0.0
    # --kv-offloading-path: a directory (possibly shared by several servers) where the host tier's
    # dropped blocks spill to files (engine/kv_disk_tier.py), at most kv_offloading_disk_size GiB.
    kv_offloading_path: str | None = None
    kv_offloading_disk_size: float = 10.0

    def __post_init__(self) -> None:
        if not self.kv_offloading_size >= 0:
            raise ValueError(f"--kv-offloading-size must be at least 0 (GiB), got {self.kv_offloading_size}")
        if self.kv_offloading_path is not None and not self.kv_offloading_size > 0:
            raise ValueError("--kv-offloading-path needs the host tier: set --kv-offloading-size (GiB) too")
        if not self.kv_offloading_disk_size > 0:
            raise ValueError(f"--kv-offloading-disk-size must be positive (GiB), got {self.kv_offloading_disk_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("--kv-cache-memory must be positive")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("--num-gpu-blocks-override must be at least 1")
        if self.linear_state_snapshots is not None and self.linear_state_snapshots < 0:
            raise ValueError(f"--linear-state-snapshots must be at least 0, got {self.linear_state_snapshots}")
        if self.linear_state_snapshot_interval < 1 or self.linear_state_snapshot_interval % self.block_size:
            raise ValueError(f"--linear-state-snapshot-interval must be a positive multiple of --block-size "
                             f"({self.block_size}), got {self.linear_state_snapshot_interval}")
        if self.cache_dtype not in ("auto", FP8_E4M3):
            raise ValueError(f"CacheConfig.cache_dtype must be auto or {FP8_E4M3}, got {self.cache_dtype!r}")


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    kv_transfer_timeout: float = 60.0  # seconds a KV hand-off step may take (see Scheduler.expire)
    max_queued_requests: int = 1024  # decode tier: reservations that may wait for blocks
    # --scheduling-policy: "fcfs" (arrival order) or "priority" (a request's priority, lower
    # first, then arrival; engine/scheduler.py). A request waiting longer than
    # priority_starvation_timeout seconds goes ahead of every priority (the starvation bound).
    scheduling_policy: str = "fcfs"
    priority_starvation_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if not self.priority_starvation_timeout > 0:
            raise ValueError(f"--priority-starvation-timeout must be positive, got {self.priority_starvation_timeout}")
        if self.kv_transfer_timeout <= 0:
            raise ValueError(f"--kv-transfer-timeout must be positive, got {self.kv_transfer_timeout}")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be at least 0, got {self.max_queued_requests}")
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be at least 2, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str  # "cpu" | "cuda" | "cuda:N"
    # Every switch of a step's path (graphs, overlap, kernels): engine/runtime_config.py.
    runtime: RuntimeConfig = RuntimeConfig()
    tensor_parallel_size: int = 1  # ranks of the model: this process and N - 1 workers
    enable_expert_parallel: bool = False  # MoE: each rank holds num_experts / N whole experts
    speculative: SpeculativeConfig | None = None  # --speculative-config (None: plain decoding)
    tokenizer: Path | None = None  # structured outputs' vocabulary (None: the model directory's)
    max_grammar_compile_seconds: float = 10.0  # a constraint that compiles longer fails its request
    lora: LoRAConfig | None = None  # --enable-lora (None: no adapters)
    # The prefill tier's engine: every request stops at its first token and holds its KV for
    # a send, so no step replays a CUDA graph and none is captured.
    prefill_only: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.max_grammar_compile_seconds <= 3600:
            raise ValueError(f"--max-grammar-compile-seconds must be in (0, 3600], got "
                             f"{self.max_grammar_compile_seconds}")
        if self.cache.kv_offloading_size > 0:  # (cache groups and linear state: the KV cache manager refuses)
            if self.tensor_parallel_size > 1:
                raise ValueError("--kv-offloading-size is not supported with --tensor-parallel-size > 1 yet "
                                 "(each rank would need its own host tier); serve without it")
            if self.speculative is not None and self.speculative.method == "draft_model":
                raise ValueError("--kv-offloading-size is not supported with a draft model yet (its KV cache "
                                 "would need a host tier too); serve without it")

    @property
    def kv_dtype(self) -> str:
        """The KV cache's torch dtype name: the model's, or float8_e4m3fn (--kv-cache-dtype fp8)."""
        return kv_torch_dtype(self.cache.cache_dtype, self.model.dtype)

    def describe(self) -> str:
        m, c, s = self.model, self.cache, self.scheduler
        quant = m.quantization.method if m.quantization is not None else None
        if m.quantization is not None and m.quantization.gguf_activations != "float32":
            quant += f" (activations {m.quantization.gguf_activations})"
        return (f"model={m.served_model_name} path={m.path} arch={m.architecture} dtype={m.dtype} "
                f"quantization={quant} "
                f"load_format={m.load_format} device={self.device} max_model_len={s.max_model_len} "
                f"block_size={c.block_size} kv_cache_dtype={c.cache_dtype} hybrid_kv_cache={c.hybrid_kv_cache} "
                f"max_num_seqs={s.max_num_seqs} "
                f"max_num_batched_tokens={s.max_num_batched_tokens} "
                f"enable_prefix_caching={c.enable_prefix_caching} kv_offloading_size={c.kv_offloading_size} "
                f"kv_offloading_path={c.kv_offloading_path} kv_offloading_disk_size={c.kv_offloading_disk_size} "
                f"{self.runtime.describe()} "
                f"tensor_parallel_size={self.tensor_parallel_size} "
                f"enable_expert_parallel={self.enable_expert_parallel} "
                f"speculative={self.speculative.describe() if self.speculative else None} "
                f"lora={self.lora.describe() if self.lora else None} prefill_only={self.prefill_only}")


@dataclass
class EngineArgs:
    """Flat engine flags, named as in vLLM where the meaning is the same."""

    model: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    gguf_activations: str = "float32"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    linear_state_snapshots: int | None = None
    linear_state_snapshot_interval: int = 256
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    num_gpu_blocks_override: int | None = None
    kv_offloading_size: float = 0.0
    kv_offloading_path: str | None = None
    kv_offloading_disk_size: float = 10.0
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    kv_transfer_timeout: float = 60.0
    max_queued_requests: int = 1024
    scheduling_policy: str = "fcfs"
    priority_starvation_timeout: float = 30.0
    enforce_eager: bool = False
    async_scheduling: bool = True
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    tokenizer: str | None = None
    max_grammar_compile_seconds: float = 10.0
    speculative_config: str | dict | None = None
    enable_lora: bool = False
    prefill_only: bool = False  # set by the prefill server, not a flag
    # Tests only (an engine server's hidden flag): the decode-graph path run eagerly.
    graphs_without_capture: bool = False
    # Tuning switches (engine/runtime_config.py); None: the environment's, else the default.
    mixed_graph_sizes: tuple[int, ...] | None = None
    overlap_mixed_steps: bool | None = None
    lora_modules: list[str] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None,
                       help="Hugging Face-format model directory (default: the embedded SmolLM2-135M-Instruct)")
        g.add_argument("--served-model-name", default=None, help="model name reported by the API")
        g.add_argument("--dtype", default="auto", choices=_DTYPES,
                       help="auto = float32 on CPU, bfloat16 on CUDA")
        g.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"),
                       help="dummy = random weights at the config's shape (benchmarks)")
        g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                       help="weight quantization. Default: the checkpoint's own (its quantization_config: fp8, "
                            "awq, gptq or compressed-tensors), else none. fp8 on a 16-bit checkpoint quantizes "
                            "it at load (W8A8: per-channel weight scales, dynamic per-token activations; the LM "
                            "head stays 16-bit); on CUDA it needs compute capability 8.9+")
        g.add_argument("--gguf-activations", default="float32", choices=GGUF_ACTIVATIONS,
                       help="GGUF weights only: the activations their GEMMs take. float32 (default): the "
                            "dequantized model's numbers. q8_0: each row quantized to int8 in blocks of 32, as "
                            "llama.cpp does, and the products summed as integers (decode GEMMs about 1.2x faster "
                            "on AVX2; logits change by about 0.5%% of their range)")
        g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the model's max_position_embeddings)")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
        g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="one block table for every layer: windowed layers keep every block of the context "
                            "as full ones do (default: each kind of layer keeps what it reads; "
                            "docs/architecture.md, KV cache groups)")
        g.add_argument("--linear-state-snapshots", type=int, default=None,
                       help="linear-attention models (Qwen3.5, Qwen3-Next): prefix-cache snapshots of the "
                            "recurrent state kept beside the running sequences' (default: --max-num-seqs; "
                            "0: prompts are computed whole); each holds one state of every linear layer")
        g.add_argument("--linear-state-snapshot-interval", type=int, default=256,
                       help="tokens between the state snapshots a prompt leaves (a multiple of --block-size); "
                            "a prefix hit resumes at the last one")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of GPU memory for weights, activations, CUDA graphs and KV cache; "
                            "it must be free when the engine starts (memory of other processes is not counted "
                            "on)")
        g.add_argument("--kv-cache-memory", default=None,
                       help="KV cache size in bytes, e.g. 2GiB (default on CPU: the blocks of max(--max-model-len, "
                            "8192) tokens, at most 1GiB; on GPU: what --gpu-memory-utilization leaves)")
        g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                       help="force the number of KV blocks (testing)")
        g.add_argument("--kv-offloading-size", type=float, default=0.0,
                       help="GiB of host memory (pinned on CUDA) for a second KV tier: blocks the device "
                            "cache evicts are copied there and a prefix hit on them loads them back "
                            "(default 0: off; one cache group only, no tensor parallel or draft model)")
        g.add_argument("--kv-offloading-path", default=None, metavar="DIR",
                       help="a third KV tier on disk (needs --kv-offloading-size): blocks the host tier drops "
                            "are written to files in DIR named by their prefix hash, and a prefix lookup that "
                            "misses the device and the host reads them back; on a filesystem several servers "
                            "share, any of them loads a prefix another computed (files of another model or KV "
                            "layout are never loaded; default: off)")
        g.add_argument("--kv-offloading-disk-size", type=float, default=10.0, metavar="GiB",
                       help="the most --kv-offloading-path DIR holds (every server's files): the least recently "
                            "used files are removed to stay under it; give every server sharing DIR the same "
                            "value (default 10)")
        g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache element type: auto = the model's dtype; fp8 (= fp8_e4m3) = "
                            "float8_e4m3fn with a per-layer k/v scale (the checkpoint's, else 1.0): twice "
                            "the blocks of bf16 in the same memory; on CUDA needs compute capability 8.9+")
        g.add_argument("--max-num-seqs", type=int, default=256, help="max sequences per step")
        g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget per step (chunked prefill)")
        g.add_argument("--kv-transfer-timeout", type=float, default=60.0,
                       help="seconds a KV hand-off step may take: a pair setup, one transfer, and a "
                            "decode-side wait for KV counted from the prefill's start (a reservation whose "
                            "prefill never starts waits at most 10x this when the caller set no deadline)")
        g.add_argument("--max-queued-requests", type=int, default=1024,
                       help="decode tier: requests that may wait for KV blocks before new ones get "
                            "RESOURCE_EXHAUSTED")
        g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                       help="fcfs: requests are admitted in arrival order; priority: by each request's "
                            "`priority` (lower first), then arrival, and preemption takes the lowest "
                            "priority first (a request's priority is refused under fcfs unless 0)")
        g.add_argument("--priority-starvation-timeout", type=float, default=30.0,
                       help="--scheduling-policy priority: a request that has waited this many seconds "
                            "goes ahead of every request that has not, whatever their priorities")
        g.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=False,
                       help="CUDA: run every step eagerly (no CUDA graphs for decode steps)")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                       help="overlap decode steps: schedule and queue step N+1 while step N runs, its "
                            "inputs taken from step N's sampled ids on the GPU (decode steps on CUDA "
                            "graphs; requests with penalties, new arrivals and preemptions run one step at a "
                            "time). --no-async-scheduling: every step waits for the one before")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="split the model over this many ranks: this process and N - 1 worker processes "
                            "(on CUDA one GPU each, from --device's index up; gloo on CPU)")
        g.add_argument("--enable-expert-parallel", action=argparse.BooleanOptionalAction, default=False,
                       help="mixture-of-experts models: place num_experts / --tensor-parallel-size whole experts "
                            "on each rank (each reads only its own experts' weights) instead of slicing every "
                            "expert over all ranks; attention stays tensor-parallel")
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                            '"prompt_lookup_min": 1, "prompt_lookup_max": 4} (prompt lookup: proposals copied from '
                            'where the sequence\'s last tokens occurred before, verified by the model in one step; '
                            'greedy output unchanged, sampled output keeps its distribution)')
        g.add_argument("--tokenizer", default=None,
                       help="the tokenizer's directory (default: the model's), which structured outputs "
                            "compile their grammars against")
        g.add_argument("--max-grammar-compile-seconds", type=float, default=10.0,
                       help="structured outputs: a JSON schema, regex or grammar that takes longer to compile "
                            "fails its request with INVALID_ARGUMENT (compiling runs off the engine loop; "
                            "compiled grammars are cached)")
        g.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                       help="serve LoRA adapters (PEFT directories) on the base model, chosen per request by "
                            "the adapter's name in the request's model field")
        g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help='adapters to load at start: name=path or {"name": ..., "path": ...} each '
                            "(more can be loaded at run time: POST /v1/load_lora_adapter)")
        g.add_argument("--max-loras", type=int, default=1,
                       help="adapters in device memory at once, and so in one step")
        g.add_argument("--max-lora-rank", type=int, default=16,
                       help="the largest adapter rank; adapters of a higher rank are refused")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters whose weights are kept in host memory (default: --max-loras); the rest "
                            "are read again from their directory when a request needs them")
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: getattr(ns, k) for k in names if hasattr(ns, k)})

    def resolve_device(self) -> str:
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device {device} requested but CUDA is not available")
        if device == "cuda":  # pin an index: set_device and memory queries need one
            return f"cuda:{torch.cuda.current_device()}"
        if device != "cpu" and not device.startswith("cuda"):
            raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
        return device

    def create_engine_config(self) -> EngineConfig:
        from engine.model_files import DEFAULT_MODEL, resolve_model_path

        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        device = self.resolve_device()
        dtype = self.dtype
        if dtype == "auto":
            dtype = "float32" if device == "cpu" else "bfloat16"
        path = resolve_model_path(self.model)
        is_default = self.model in (None, DEFAULT_MODEL)
        name = self.served_model_name or (DEFAULT_MODEL if is_default else Path(self.model).name)
        model = ModelConfig.from_dir(path, dtype=dtype, load_format=self.load_format,
                                     served_model_name=name, seed=self.seed, quantization=self.quantization,
                                     gguf_activations=self.gguf_activations)
        if device.startswith("cuda") and model.quantization is not None and uses_fp8(model.quantization):
            import torch

            check_fp8_support(device, torch.cuda.get_device_capability(device),
                              f"FP8 weights ({model.quantization.method})")
        max_len = self.max_model_len or model.max_position_embeddings
        if max_len > model.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                             f"{model.max_position_embeddings}")
        cache_dtype = resolve_cache_dtype(self.kv_cache_dtype)
        if cache_dtype != "auto" and device.startswith("cuda"):
            import torch

            check_fp8_support(device, torch.cuda.get_device_capability(device), "--kv-cache-dtype fp8")
        kv_mem = parse_size(self.kv_cache_memory) if self.kv_cache_memory is not None else None
        cache = CacheConfig(block_size=self.block_size, enable_prefix_caching=self.enable_prefix_caching,
                            gpu_memory_utilization=self.gpu_memory_utilization, kv_cache_memory=kv_mem,
                            num_gpu_blocks_override=self.num_gpu_blocks_override,
                            sliding_window=_common_window(model.layer_windows), cache_dtype=cache_dtype,
                            hybrid_kv_cache=not self.disable_hybrid_kv_cache_manager,
                            linear_state_snapshots=self.linear_state_snapshots,
                            linear_state_snapshot_interval=self.linear_state_snapshot_interval,
                            kv_offloading_size=self.kv_offloading_size,
                            kv_offloading_path=self.kv_offloading_path,
                            kv_offloading_disk_size=self.kv_offloading_disk_size)
        sched = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens,
                                max_model_len=max_len, kv_transfer_timeout=self.kv_transfer_timeout,
                                max_queued_requests=self.max_queued_requests,
                                scheduling_policy=self.scheduling_policy,
                                priority_starvation_timeout=self.priority_starvation_timeout)
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if self.enable_lora and "linear_attention" in model.layer_types:
            raise ValueError(f"--enable-lora: adapters on {model.architecture}'s linear-attention and gated "
                             "attention layers are not supported yet; serve it without --enable-lora")
        if speculative is not None and "linear_attention" in model.layer_types:
            raise ValueError(f"--speculative-config: {model.architecture} has linear-attention layers, whose "
                             "recurrent state cannot step back over rejected proposals; serve it without "
                             "speculative decoding")
        if speculative is not None and speculative.model is not None:
            from engine.model_files import resolve_model_path

            speculative = dataclasses.replace(speculative, model=resolve_model_path(str(speculative.model)))
        lora = None
        if self.enable_lora:
            lora = LoRAConfig(tuple(parse_lora_module(m) for m in self.lora_modules or ()), self.max_loras,
                              self.max_lora_rank, self.max_cpu_loras)
        elif self.lora_modules:
            raise ValueError("--lora-modules needs --enable-lora")
        from engine.parallel import check_tp_size

        check_tp_size(self.tensor_parallel_size, model.num_heads, model.num_kv_heads)
        if self.enable_expert_parallel:
            if not model.is_moe:
                raise ValueError(f"--enable-expert-parallel needs a mixture-of-experts model; {model.architecture} "
                                 "is dense")
            if model.num_experts % self.tensor_parallel_size:
                raise ValueError(f"--enable-expert-parallel: the model's {model.num_experts} experts do not divide "
                                 f"evenly over --tensor-parallel-size {self.tensor_parallel_size} ranks")
        split = [("intermediate size", model.intermediate_size)]
        if not self.enable_expert_parallel:  # expert parallelism keeps each expert whole
            split.append(("expert intermediate size", model.moe_intermediate_size))
        for what, n in split:
            if n % self.tensor_parallel_size:
                raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} does not divide the "
                                 f"model's {what} ({n})")
        if self.tensor_parallel_size > 1 and device.startswith("cuda"):
            import torch

            first = int(device.split(":")[1])
            if first + self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} from {device} needs "
                                 f"{first + self.tensor_parallel_size} GPUs; {torch.cuda.device_count()} visible")
        switches = {"enforce_eager": self.enforce_eager, "async_scheduling": self.async_scheduling,
                    "graphs_without_capture": self.graphs_without_capture}
        if self.mixed_graph_sizes is not None:
            switches["mixed_graph_sizes"] = tuple(sorted(set(self.mixed_graph_sizes)))
        if self.overlap_mixed_steps is not None:
            switches["overlap_mixed_steps"] = self.overlap_mixed_steps
        return EngineConfig(model=model, cache=cache, scheduler=sched, device=device,
                            runtime=RuntimeConfig.from_env(**switches),
                            tensor_parallel_size=self.tensor_parallel_size,
                            enable_expert_parallel=self.enable_expert_parallel,
                            speculative=speculative, lora=lora,
                            tokenizer=Path(self.tokenizer) if self.tokenizer else None,
                            max_grammar_compile_seconds=self.max_grammar_compile_seconds,
                            prefill_only=self.prefill_only)
