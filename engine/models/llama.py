"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 with QKV bias) over a
paged KV cache.

Parameter names follow the Hugging Face checkpoints except two fused
projections: ``qkv_proj`` (q, k, v stacked) and ``gate_up_proj`` (gate, up);
``load_weights`` maps checkpoint names onto them. The kernels come from
``ops``: ``kernels`` (Triton) on CUDA or ``kernels.reference`` on CPU, both
with the same function names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType
from typing import Callable, Iterable

import torch
from torch import nn

from engine.config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where this step's tokens live in the paged cache (see kernels/)."""

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    # Key-range splits of the Triton attention; None lets the launcher pick
    # from the shapes. A CUDA graph fixes it per captured batch size.
    num_splits: int | None = None


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / hi) & ~(wavelen > old_len / lo)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


def rope_cos_sin_cache(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos | sin of position * inv_freq."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: ModuleType) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5
        self.ops = ops

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata, cos_sin: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; kv: this layer's cache [num_blocks, 2, block_size, H_kv, D]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.ops.rotary_embedding(positions, q, k, cos_sin)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
        self.ops.store_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        extra = {} if meta.num_splits is None else {"num_splits": meta.num_splits}  # references take none
        o = self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                     meta.seq_lens, self.scale, **extra)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = LlamaMLP(cfg, ops)

    def forward(self, positions, h, residual, kv, meta, cos_sin):
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, kv, meta, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ops) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("cos_sin", rope_cos_sin_cache(cfg, cfg.max_position_embeddings),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, num_blocks, 2, bs, H_kv, D].
        Returns the final hidden states [T, hidden] (logits via compute_logits).
        ``on_layer(i)`` is called once layer i's work (its KV writes included) is queued."""
        h, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            h, residual = layer(positions, h, residual, kv_cache[i], meta, self.cos_sin)
            if on_layer is not None:
                on_layer(i)
        h, _ = self.model.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # ---- weights ---------------------------------------------------------
    _STACKED = {  # checkpoint name part -> (fused param part, shard index)
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def _shard_slice(self, fused: str, shard: int) -> slice:
        c = self.config
        if fused == ".qkv_proj.":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][shard]
        i = c.intermediate_size
        return [slice(0, i), slice(i, 2 * i)][shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for part, (fused, shard) in self._STACKED.items():
                if part in name:
                    target = name.replace(part, fused)
                    params[target].data[self._shard_slice(fused, shard)].copy_(tensor)
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                params[name].data.copy_(tensor)
                loaded.add(name)
        expected = set()
        for pname in params:
            fused = next((f for f in (".qkv_proj.", ".gate_up_proj.") if f in pname), None)
            shards = 3 if fused == ".qkv_proj." else 2 if fused else 0
            expected |= {f"{pname}#{s}" for s in range(shards)} if shards else {pname}
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
