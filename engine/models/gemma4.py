"""Gemma 4 (text; and a multimodal checkpoint's text model): Gemma 3's layer with its own
twists, each as transformers 5.23's ``Gemma4TextModel`` computes it.

    h = embed(ids) * sqrt(hidden)
    ple = per-layer inputs [T, L, P]: (norm(W_p h / sqrt(hidden)) + embed_pl(ids) * sqrt(P)) / sqrt(2)
    per layer i:
        h += post_attention_layernorm(self_attn(input_layernorm(h)))
        x  = mlp(pre_feedforward_layernorm(h))
        [experts: x = post_ffn_norm_1(x) + post_ffn_norm_2(experts(pre_ffn_norm_2(h)), routed from h)]
        h += post_feedforward_layernorm(x)
        [ple: h += post_per_layer_input_norm(W_up(gelu(W_gate h) * ple[:, i]))]
        h *= layer_scalar
    logits = softcap(lm_head(norm(h)))

Each post-norm, its add and what follows it (the layer scalar; the norm that reads the sum,
the next layer's input norm or the final norm) is one kernel call (``rms_norm_add``,
``rms_norm_add_norm``), the per-layer input's gate one more (``gated_activation``).

- Norms multiply by ``w`` (not Gemma 3's ``1 + w``), in float32 (``Gemma4Norm``); V and
  the router's input get a norm without weight.
- Attention has no softmax scale (1.0: q_norm and k_norm set the size of the logits).
- Sliding layers: ``head_dim``, the default RoPE. Full layers: their own head size
  (``global_head_dim``, in ``per_layer_config``) and KV heads (``num_global_key_value_heads``,
  with ``attention_k_eq_v``, which also makes V the K projection before k_norm and RoPE),
  "proportional" RoPE over the whole head (engine/layers/rotary.py). The KV cache groups
  (engine/kv_cache_groups.py) give the two shapes their own block sizes.
- The last ``num_kv_shared_layers`` layers compute no K/V: each reads the cache of the last
  earlier layer of its type (``ModelConfig.kv_sources``), and with ``use_double_wide_mlp``
  has an MLP twice as wide.
- ``enable_moe_block``: experts beside the MLP on every layer (``Gemma4MoE``).
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from types import ModuleType
from typing import Callable, Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.activation import activation_name
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.embedding import VocabEmbedding
from engine.layers.linear import ReplicatedLinear
from engine.layers.moe import FusedMoE, MoEMethod
from engine.layers.rotary import RotaryEmbedding
from engine.models.base import CausalLM
from engine.models.llama import GatedMLP
from engine.parallel import TPGroup, check_tp_size, kv_head_range

_STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+)\.experts\.(gate_up_proj|down_proj)$")
_ROUTER = ((".router.proj.", ".moe.gate."), (".router.scale", ".moe.router_scale"),
           (".router.per_expert_scale", ".moe.per_expert_scale"))


def _ones(size: int) -> nn.Parameter:
    p = nn.Parameter(torch.ones(size))
    p.full_shape = (size,)
    return p


class Gemma4Norm(nn.Module):
    """Gemma 4's RMSNorm over the last dim: x * (mean(x^2) + eps) ** -0.5 * w, all in float32,
    then cast back: one call of the step's kernel module (``rms_norm``, ``float32_weight``).
    ``with_scale=False``: no weight (the router's): a unit one that is no parameter. (V's norm,
    also weightless, runs inside the q/k norms' call: ``Attention(v_norm=True)``.)"""

    offset, float32_weight = False, True  # the form's flags as kernels take them

    def __init__(self, size: int, eps: float, ops: ModuleType, with_scale: bool = True) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        if with_scale:
            self.weight = _ones(size)
        else:
            self.register_buffer("weight", torch.ones(size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., size] -> the same shape."""
        if self.weight.dtype != x.dtype:  # the unit buffer (load casts parameters only): once
            self.weight = self.weight.to(x.dtype)
        flat = self.ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps, float32_weight=True)
        return flat.view(x.shape)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)

    def add_to(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """h + norm(x), one kernel call (h, x: [T, size])."""
        return self.ops.rms_norm_add(x, h, self.weight, self.eps, float32_weight=True)

    def add_and_norm(self, h: torch.Tensor, x: torch.Tensor, next_norm: Gemma4Norm,
                     scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(next_norm(s), s) for s = ``add_to(h, x, scale)``, one kernel call."""
        return self.ops.rms_norm_add_norm(x, h, self.weight, next_norm.weight, self.eps, float32_weight=True,
                                          scale=scale)


class Gemma4MoE(FusedMoE):
    """The experts beside a layer's MLP. Routed from the residual stream h (not the MLP's
    normed input): logits = W_r (norm(h) * router_scale / sqrt(hidden)), softmax in float32,
    top-k, renormalised, each weight times its expert's ``per_expert_scale``. The float32 weight
    multiplies each expert's output in float32 (``Gemma4TextExperts``)."""

    float32_weights = True

    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None, expert_parallel: bool,
                 method: MoEMethod | None) -> None:
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         renormalize=True, activation=activation_name(cfg.hidden_act), ops=ops, tp=tp,
                         expert_parallel=expert_parallel, method=method)
        self.router_norm = Gemma4Norm(cfg.hidden_size, cfg.rms_norm_eps, ops, with_scale=False)
        self.router_scale = _ones(cfg.hidden_size)
        self.per_expert_scale = _ones(cfg.num_experts)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None,
                routed: torch.Tensor | None = None) -> torch.Tensor:
        """x: the experts' input [T, hidden]; routed: what the router reads (default x)."""
        r = self.router_norm(x if routed is None else routed) * self.router_scale * self.hidden_size ** -0.5
        num_tokens = None if meta is None else meta.query_start_loc[-1:]
        weights, ids = self.ops.moe_route(self.gate(r), self.top_k, renormalize=True, weight_dtype=torch.float32,
                                          expert_counts=self.expert_load, num_tokens=num_tokens)
        weights = weights * self.per_expert_scale[ids].float()
        if self.num_local_experts != self.num_experts:  # expert parallel: see FusedMoE.forward
            ids = ids - self.first_expert
        out = self.method.apply(self, x, weights, ids)
        return out if self.tp is None else self.tp.all_reduce(out)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, attn: Attention, mlp: GatedMLP, moe: Gemma4MoE | None,
                 per_layer_size: int) -> None:
        super().__init__()
        self.ops = ops
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = Gemma4Norm(size, eps, ops)
        self.self_attn = attn
        self.post_attention_layernorm = Gemma4Norm(size, eps, ops)
        self.pre_feedforward_layernorm = Gemma4Norm(size, eps, ops)
        self.mlp = mlp
        self.post_feedforward_layernorm = Gemma4Norm(size, eps, ops)
        self.moe = moe
        if moe is not None:
            self.post_feedforward_layernorm_1 = Gemma4Norm(size, eps, ops)
            self.pre_feedforward_layernorm_2 = Gemma4Norm(size, eps, ops)
            self.post_feedforward_layernorm_2 = Gemma4Norm(size, eps, ops)
        self.per_layer_size = per_layer_size
        if per_layer_size:
            self.per_layer_input_gate = ReplicatedLinear(size, per_layer_size)
            self.per_layer_projection = ReplicatedLinear(per_layer_size, size)
            self.post_per_layer_input_norm = Gemma4Norm(size, eps, ops)
        self.layer_scalar = _ones(1)

    def forward(self, positions, h, normed, kv, meta, per_layer_input, next_norm):
        """h: the whole residual stream (Gemma 4 scales it per layer: no residual is carried
        beside it); normed: input_layernorm(h) when the layer before computed it (None: here);
        per_layer_input: [T, P] of this layer (None without); next_norm: the norm that reads
        this layer's output (the next layer's input norm, the model's final one), applied in
        the layer's last kernel. Returns (h, next_norm(h))."""
        x = self.input_layernorm(h) if normed is None else normed
        attn = self.self_attn(positions, x, kv, meta)
        x, h = self.post_attention_layernorm.add_and_norm(h, attn, self.pre_feedforward_layernorm)
        x = self.mlp(x)
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(h), meta, routed=h)
            x = self.post_feedforward_layernorm_2.add_to(self.post_feedforward_layernorm_1(x), experts)
        last = self.post_feedforward_layernorm
        if self.per_layer_size:
            h = last.add_to(h, x)
            x = self.ops.gated_activation(self.per_layer_input_gate(h), per_layer_input, "gelu_tanh")
            x, last = self.per_layer_projection(x), self.post_per_layer_input_norm
        normed, h = last.add_and_norm(h, x, next_norm, scale=self.layer_scalar)
        return h, normed


def _check_tp(cfg: ModelConfig, size: int) -> None:
    """Every layer's KV heads split over ``size`` ranks, and each rank keeping the same share of
    every layer's KV: the cache groups' block sizes come from the whole model's shapes, so a
    layer whose KV heads are replicated (fewer than ranks) beside one whose are split would
    not fit its rank's pages."""
    shares = set()
    for heads, _ in set(cfg.layer_kv_shapes):
        check_tp_size(size, cfg.num_heads, heads)
        lo, hi = kv_head_range(0, size, heads)
        shares.add((hi - lo) / heads)
    if len(shares) > 1:
        raise ValueError(f"Gemma 4 at --tensor-parallel-size {size}: KV heads "
                         f"{sorted({h for h, _ in cfg.layer_kv_shapes})} per layer type; a rank would keep "
                         "a larger share of some layers' KV (replicated heads) than of others', which the KV "
                         "cache groups cannot lay out: choose a size no larger than the fewest KV heads")


class Gemma4ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None = None,
                 expert_parallel: bool = False) -> None:
        hf = cfg.hf_config
        if tp is not None:
            _check_tp(cfg, tp.size)
        super().__init__(cfg, ops, tp, expert_parallel)
        self.model.norm = Gemma4Norm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.per_layer_size = p = hf.get("hidden_size_per_layer_input") or 0
        if p:
            vocab = hf["vocab_size_per_layer_input"]
            self.model.embed_tokens_per_layer = VocabEmbedding(vocab, cfg.num_layers * p,
                                                               replace(self.shard, vocab_size=vocab), tp)
            self.model.per_layer_model_projection = ReplicatedLinear(cfg.hidden_size, cfg.num_layers * p)
            self.model.per_layer_projection_norm = Gemma4Norm(p, cfg.rms_norm_eps, ops)

    def rope_for(self, index: int) -> RotaryEmbedding:
        """The table of the layer's type at the layer's head size (full layers' differs)."""
        cfg = self.config
        kind, head_dim = cfg.layer_types[index], cfg.layer_kv_shapes[index][1]
        if self.ropes[kind].head_dim != head_dim:
            self.ropes[kind] = RotaryEmbedding(head_dim, head_dim, cfg.rope[kind], cfg.max_position_embeddings,
                                               self.ops)
        return self.ropes[kind]

    def make_layer(self, index: int) -> nn.Module:
        cfg, hf, eps = self.config, self.config.hf_config, self.config.rms_norm_eps
        prefix = f"model.layers.{index}"
        kv_heads, head_dim = cfg.layer_kv_shapes[index]
        shared = cfg.layer_kv_sources[index] is not None
        full = cfg.layer_types[index] == "full_attention"
        attn = Attention(cfg, self.ops, self.shard, self.tp, self.rope_for(index),
                         sliding_window=cfg.layer_windows[index], scale=1.0,
                         qk_norm=partial(Gemma4Norm, eps=eps, ops=self.ops), v_norm=True, head_dim=head_dim,
                         num_kv_heads=kv_heads, k_eq_v=bool(hf["attention_k_eq_v"]) and full, store=not shared,
                         methods=self.quant, prefix=f"{prefix}.self_attn")
        wide = 2 if hf["use_double_wide_mlp"] and shared else 1
        mlp = GatedMLP(cfg, self.ops, self.tp, cfg.intermediate_size * wide, methods=self.quant, prefix=f"{prefix}.mlp")
        moe = None
        if hf["enable_moe_block"]:
            moe = Gemma4MoE(cfg, self.ops, self.tp, self.expert_parallel, self.moe_method(f"{prefix}.experts"))
        return Gemma4DecoderLayer(cfg, self.ops, attn, mlp, moe, hf.get("hidden_size_per_layer_input") or 0)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        # transformers keeps sqrt(hidden) as a float32 scalar and rounds it to the model dtype
        return h * torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(h.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """[T, num_layers, P]: each layer's input from the token's own embedding and from h."""
        p = self.per_layer_size
        if not p:
            return None
        shape = (h.shape[0], self.config.num_layers, p)
        tokens = self.model.embed_tokens_per_layer(input_ids)
        tokens = tokens * torch.tensor(p ** 0.5, dtype=torch.float32).to(tokens.dtype)
        proj = self.model.per_layer_model_projection(h) * self.config.hidden_size ** -0.5
        proj = self.model.per_layer_projection_norm(proj.reshape(shape))
        return (proj + tokens.reshape(shape)) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """As CausalLM.forward, each layer also given its per-layer input; ``on_layer(s)`` once
        the last layer writing slot s has run (``slot_done``)."""
        h = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, h)
        layers = self.model.layers
        normed = None  # each layer's last kernel norms its output for the next layer (the last: the final norm)
        for i, layer in enumerate(layers):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, normed = layer(positions, h, normed, self.layer_kv(kv_cache, i), meta,
                              None if per_layer is None else per_layer[:, i], next_norm)
            if on_layer is not None:
                self.slot_done(i, on_layer)
        return normed

    def map_name(self, name: str) -> tuple[str, object] | None:
        """The router's tensors and the stacked experts under ``moe``; the rest as CausalLM's."""
        for part, ours in _ROUTER:
            name = name.replace(part, ours)
        m = _STACKED_EXPERTS.match(name)
        if m:
            return f"{m.group(1)}.moe.experts.{m.group(2)}", None
        return super().map_name(name)

    def dummy_weights(self, seed: int, dtype: torch.dtype, device: torch.device
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """CausalLM's, with the per-layer and per-expert scales at 1 (neutral) as norms are."""
        for name, t in super().dummy_weights(seed, dtype, device):
            if name.endswith(("layer_scalar", "router_scale", "per_expert_scale")):
                t.fill_(1.0)
            yield name, t


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """A multimodal Gemma 4 checkpoint served as its text model (ModelConfig reads its
    text_config): ``model.language_model.*`` is the text model's ``model.*``; the vision and
    audio towers and their embedders are not read, and their placeholder tokens in a prompt
    read as the pad token, as transformers' Gemma4Model reads them when no media comes."""

    _TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None = None,
                 expert_parallel: bool = False) -> None:
        super().__init__(cfg, ops, tp, expert_parallel)
        self.placeholders = torch.tensor(cfg.hf_config["placeholder_token_ids"])  # not a weight: no parameter
        self.pad_token_id = cfg.hf_config["pad_token_id"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Image, video and audio placeholders read as the pad token (no media is served)."""
        input_ids = torch.where(torch.isin(input_ids, self.placeholders), self.pad_token_id, input_ids)
        return super().forward(input_ids, positions, kv_cache, meta, on_layer)

    def map_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith(self._TOWERS):
            return None
        return super().map_name(name.replace("model.language_model.", "model.", 1))
