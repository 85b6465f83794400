"""Llama-family decoder (Llama, Mistral, SmolLM, Qwen2 with QKV bias) over a
paged KV cache.

Parameter names follow the Hugging Face checkpoints except two fused
projections: ``qkv_proj`` (q, k, v stacked) and ``gate_up_proj`` (gate, up);
``load_weights`` maps checkpoint names onto them. The kernels come from
``ops``: ``kernels`` (Triton) on CUDA or ``kernels.reference`` on CPU, both
with the same function names.

Tensor parallelism (``engine/parallel.py``): with a ``TPGroup`` every module
holds its rank's shard (``Shard``): column-parallel qkv and gate/up, row-
parallel o and down (one all-reduce each), a vocabulary-parallel embedding
(all-reduce) and LM head (logits gathered). Without one, the same code with
a single shard of everything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.parallel import Shard, TPGroup


def full_shard(cfg: ModelConfig) -> Shard:
    return Shard(0, 1, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size)


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
    # Work the layers of one step share (the CPU attention's key positions): new each step.
    step_cache: dict = field(default_factory=dict, compare=False, repr=False)


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
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = shard.num_local_heads, shard.num_local_kv_heads
        self.head_dim, self.tp = cfg.head_dim, tp
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
        o = self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                     meta.seq_lens, self.scale, num_splits=meta.num_splits,
                                     step_cache=meta.step_cache)
        out = self.o_proj(o.reshape(t, self.q_size))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        lo, hi = shard.intermediate
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * (hi - lo), bias=False)
        self.down_proj = nn.Linear(hi - lo, cfg.hidden_size, bias=False)
        self.ops, self.tp = ops, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, ops, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = LlamaMLP(cfg, ops, shard, tp)

    def forward(self, positions, h, residual, kv, meta, cos_sin):
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, kv, meta, cos_sin)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class VocabEmbedding(nn.Module):
    """The embedding's rows of this rank's share of the vocabulary; other ids give zeros
    here and their rows come from the all-reduce."""

    def __init__(self, cfg: ModelConfig, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        self.lo, self.hi = shard.vocab
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, cfg.hidden_size))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return nn.functional.embedding(ids, self.weight)
        mine = (ids >= self.lo) & (ids < self.hi)
        h = nn.functional.embedding((ids - self.lo).clamp(0, self.hi - self.lo - 1), self.weight)
        return self.tp.all_reduce(h * mine[:, None].to(h.dtype))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, shard, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, ops, shard, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.shard = full_shard(cfg) if tp is None else Shard(tp.rank, tp.size, cfg.num_heads, cfg.num_kv_heads,
                                                               cfg.intermediate_size, cfg.vocab_size)
        self.model = LlamaModel(cfg, ops, self.shard, tp)
        lo, hi = self.shard.vocab
        self.lm_head = nn.Linear(cfg.hidden_size, hi - lo, bias=False)
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
        """[n, vocab] float32 on every rank (the ranks' column blocks gathered)."""
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]

    # ---- weights ---------------------------------------------------------
    _STACKED = {  # checkpoint name part -> (fused param part, shard index)
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    def _shard_slice(self, fused: str, shard: int) -> slice:
        """Where checkpoint part ``shard`` of a fused parameter goes in this rank's parameter."""
        d, s = self.config.head_dim, self.shard
        if fused == ".qkv_proj.":
            q, kv = s.num_local_heads * d, s.num_local_kv_heads * d
            return [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)][shard]
        lo, hi = s.intermediate
        return [slice(0, hi - lo), slice(hi - lo, 2 * (hi - lo))][shard]

    def checkpoint_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor of this model's checkpoint with its full (unsharded) shape,
        in checkpoint order."""
        c, d = self.config, self.config.head_dim
        h, q, kv, i = c.hidden_size, c.num_heads * d, c.num_kv_heads * d, c.intermediate_size
        yield "model.embed_tokens.weight", (c.vocab_size, h)
        for n in range(c.num_layers):
            pre = f"model.layers.{n}."
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield f"{pre}self_attn.{proj}.weight", (rows, h)
                if c.attention_bias:
                    yield f"{pre}self_attn.{proj}.bias", (rows,)
            yield f"{pre}self_attn.o_proj.weight", (h, q)
            yield f"{pre}mlp.gate_proj.weight", (i, h)
            yield f"{pre}mlp.up_proj.weight", (i, h)
            yield f"{pre}mlp.down_proj.weight", (h, i)
            yield f"{pre}input_layernorm.weight", (h,)
            yield f"{pre}post_attention_layernorm.weight", (h,)
        yield "model.norm.weight", (h,)
        if not c.tie_word_embeddings:
            yield "lm_head.weight", (c.vocab_size, h)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of checkpoint tensor ``name``; None: all of it.
        The loader reads only that part from the file."""
        s, d = self.shard, self.config.head_dim
        if s.size == 1:
            return None
        if ".q_proj." in name:
            lo, hi = s.q_heads
            return 0, lo * d, hi * d
        if ".k_proj." in name or ".v_proj." in name:
            lo, hi = s.kv_heads
            return 0, lo * d, hi * d
        if ".o_proj." in name:
            lo, hi = s.q_heads
            return 1, lo * d, hi * d
        if ".gate_proj." in name or ".up_proj." in name:
            return (0, *s.intermediate)
        if ".down_proj." in name:
            return (1, *s.intermediate)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            lo, hi = s.vocab
            return 0, lo, min(hi, self.config.vocab_size)
        return None

    def _part(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor, unless the loader already read only that.
        (qkv bias: 1-d, sliced like the weight's rows.)"""
        where = self.checkpoint_slice(name)
        if where is None:
            return tensor
        dim, lo, hi = where
        if tensor.shape[dim] == hi - lo:  # the loader read only this part
            return tensor
        return tensor.narrow(dim, lo, hi - lo)

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
                    params[target].data[self._shard_slice(fused, shard)].copy_(self._part(name, tensor))
                    loaded.add(f"{target}#{shard}")
                    break
            else:
                if name not in params:
                    raise ValueError(f"unexpected weight {name!r} in checkpoint")
                part = self._part(name, tensor)
                if part.shape != params[name].shape:  # the last rank's vocabulary rows run past the end
                    params[name].data.zero_()
                params[name].data[:part.shape[0]].copy_(part)
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
