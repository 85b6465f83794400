"""What every family shares: the decoder stack (embed -> layers -> final norm -> LM
head), tensor-parallel shards, and loading a checkpoint into the fused, sharded
parameters. A family supplies its decoder layer (``make_layer``) and, where its
checkpoint names differ, the name map.

Tensor parallelism (``engine/parallel.py``): with a ``TPGroup`` every module holds its
rank's shard; without one, the same code with a single shard of everything.

Loading: each checkpoint tensor name maps to (parameter name, shard id); the
parameter's own ``weight_loader`` puts it in place (engine/layers/linear.py):

    model.layers.3.self_attn.q_proj.weight       -> ...self_attn.qkv_proj.weight, "q"
    model.layers.3.mlp.up_proj.weight            -> ...mlp.gate_up_proj.weight, 1
    model.layers.3.mlp.experts.7.down_proj.weight -> ...mlp.experts.down_proj, ("down", 7)
    model.layers.3.self_attn.qkv_proj.weight     -> itself, None (already stacked: Phi-3)
"""
from __future__ import annotations

import re
from types import ModuleType
from typing import Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn

from engine.config import ModelConfig
from engine.kv_cache_dtype import is_kv_scale_name
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.embedding import LMHead, VocabEmbedding
from engine.layers.linear_state import LinearState, LinearStateShape
from engine.layers.moe import FusedMoE, MoEMethod
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.mapped_checkpoint import fill
from engine.parallel import Shard, TPGroup
from engine.quantization.methods import QuantMethods

# experts.<e>.<projection>.<weight, or a quantized checkpoint's tensor beside it>
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|weight_scale|weight_scale_inv)$")


class CausalLM(nn.Module):
    # checkpoint name part -> (parameter name part, shard id)
    stacked_params: ClassVar[tuple[tuple[str, str, object], ...]] = (
        (".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"), (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1),
    )
    # per-expert checkpoint names -> which projection
    expert_projections: ClassVar[dict[str, str]] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    norm_offset: ClassVar[bool] = False  # Gemma's (1 + w) norms

    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None = None,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.config, self.ops, self.tp = cfg, ops, tp
        self.expert_parallel = expert_parallel  # MoE layers: whole experts per rank (engine/layers/moe.py)
        rank, size = (0, 1) if tp is None else (tp.rank, tp.size)
        self.shard = Shard(rank, size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size)
        # Quantized layers' methods, chosen by checkpoint name (engine/quantization/); None: 16-bit.
        self.quant = None if cfg.quantization is None else QuantMethods(cfg.quantization, ops)
        self.ropes = {t: RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope[t], cfg.max_position_embeddings, ops)
                      for t in sorted((set(cfg.layer_types) - {"linear_attention"}) or {"full_attention"})}
        self.model = nn.Module()
        vocab_type = self.quant.vocab_type if self.quant is not None else lambda name: None
        self.model.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, self.shard, tp,
                                                 qtype=vocab_type("model.embed_tokens"))
        self.model.layers = nn.ModuleList(self.make_layer(i) for i in range(cfg.num_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, offset=self.norm_offset)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, self.shard, tp,
                              tied=self.model.embed_tokens if cfg.tie_word_embeddings else None,
                              softcap=cfg.hf_config.get("final_logit_softcapping"), qtype=vocab_type("lm_head"),
                              activations=cfg.quantization.gguf_activations if cfg.quantization else "float32")
        moe = self.moe_layers()
        # the decoder layer each row of expert_load belongs to
        self.moe_layer_indices = [i for i, layer in enumerate(self.model.layers)
                                  if any(isinstance(m, FusedMoE) for m in layer.modules())]
        # [MoE layers, experts] tokens routed to each expert (see engine/layers/moe.py)
        self.expert_load = torch.zeros(len(moe), max((m.num_experts for m in moe), default=0), dtype=torch.int64)
        for i, m in enumerate(moe):
            m.expert_load = self.expert_load[i]

    # ---- what a family provides ---------------------------------------------
    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    def moe_method(self, prefix: str) -> MoEMethod | None:
        """The experts' method of the MoE block whose checkpoint name is ``prefix``."""
        if self.quant is None:
            return None
        return self.quant.moe(prefix, self.config.num_experts, list(self.expert_projections))

    def rope_for(self, index: int) -> RotaryEmbedding:
        types = self.config.layer_types
        return self.ropes[types[index] if types else "full_attention"]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    # ---- forward ------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; kv_cache: [L, num_blocks, 2, bs, H_kv, D].
        Returns the final hidden states [T, hidden] (logits via compute_logits).
        ``on_layer(s)`` is called once every write to slot s of the cache is queued (one group:
        slot s is layer s; see ``slot_done``)."""
        h, residual = self.embed(input_ids), None
        for i, layer in enumerate(self.model.layers):
            fused = layer.__dict__.get("fused")  # a CPU layer as direct kernel calls (llama_cpu.py)
            if fused is not None:
                h, residual = fused(positions, h, residual, self.layer_kv(kv_cache, i), meta)
            else:
                h, residual = layer(positions, h, residual, self.layer_kv(kv_cache, i), meta)
            if on_layer is not None:
                self.slot_done(i, on_layer)
        h, _ = self.model.norm(h, residual)
        return h

    # ---- the cache layout (engine/kv_cache_groups.py) -------------------------
    def set_cache_layout(self, layout) -> None:  # layout: engine.kv_cache_groups.KVCacheLayout
        """Point every attention layer at its group and slot, and at its group's view of the
        page (its block size, heads and head size). Without a call: layer i reads slot i."""
        views: list[tuple[int, tuple[int, int] | None] | None] = []
        for i, layer in enumerate(self.model.layers):
            place = layout.places[i]
            attn = [m for m in layer.modules() if isinstance(m, Attention)]
            if place is None or not attn:
                views.append(None)
                continue
            for m in attn:
                m.kv_group = place[0]
                m.store = m.store and layout.stores[i]
            shape = None if layout.is_simple else (attn[0].num_kv_heads, attn[0].head_dim)
            views.append((place[1], shape))
        self.__dict__["_kv_views"] = views
        # slot s is written once the last layer storing into it has run
        last: dict[int, int] = {}
        for i, place in enumerate(layout.places):
            if place is not None and layout.stores[i]:
                last[place[1]] = i
        self.__dict__["_slot_after"] = {i: s for s, i in last.items()}

    def slot_done(self, index: int, on_layer: Callable[[int], None]) -> None:
        """After layer ``index``: ``on_layer(slot)`` when it was the last layer writing that slot
        of the cache (what a layer-wise KV send waits for); without a layout, slot = layer."""
        after = self.__dict__.get("_slot_after")
        if after is None:
            on_layer(index)
        elif index in after:
            on_layer(after[index])

    def layer_kv(self, kv_cache: torch.Tensor, index: int) -> torch.Tensor | None:
        """Layer ``index``'s KV: its slot of ``kv_cache`` [num_slots, num_blocks, 2, block_size,
        H_kv, D], viewed at its group's shape. None for a layer without KV (linear attention)."""
        views = self.__dict__.get("_kv_views")
        if views is None:
            return kv_cache[index]
        view = views[index]
        if view is None:
            return None
        t = kv_cache[view[0]]
        return t if view[1] is None else t.view(t.shape[0], 2, -1, *view[1])

    def linear_layers(self) -> list[nn.Module]:
        """The linear-attention modules (those with a ``linear_state_shape``), in layer order."""
        return [m for m in self.modules() if callable(getattr(m, "linear_state_shape", None))]

    def linear_state_shapes(self) -> list[LinearStateShape]:
        """One state slot of each linear-attention layer on this rank (empty: none)."""
        return [m.linear_state_shape() for m in self.linear_layers()]

    def bind_linear_states(self, states: list[LinearState]) -> None:
        """Hand each linear-attention layer its state tensors (``linear_state``)."""
        layers = self.linear_layers()
        if len(states) != len(layers):
            raise ValueError(f"{len(states)} linear states for {len(layers)} linear-attention layers")
        for m, st in zip(layers, states):
            m.linear_state = st

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 on every rank (the ranks' column blocks gathered)."""
        return self.lm_head(hidden)

    def moe_layers(self) -> list[FusedMoE]:
        return [m for m in self.modules() if isinstance(m, FusedMoE)]

    # ---- weights ------------------------------------------------------------
    def map_name(self, name: str) -> tuple[str, object] | None:
        """(parameter name, shard id) a checkpoint tensor loads into; None: not a weight here."""
        if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
            return None
        if is_kv_scale_name(name):  # an FP8 KV cache's scales: engine/kv_cache_dtype.py reads them
            return None
        m = _EXPERT.match(name)
        if m and m.group(3) in self.expert_projections:
            which = self.expert_projections[m.group(3)]
            param = "gate_up_proj" if which in ("gate", "up") else "down_proj"
            suffix = "" if m.group(4) == "weight" else f"_{m.group(4)}"
            return f"{m.group(1)}.{param}{suffix}", (which, int(m.group(2)))
        for part, fused, shard_id in self.stacked_params:
            if part in name:
                return name.replace(part, fused), shard_id
        return name, None

    def params_by_name(self) -> dict[str, nn.Parameter]:
        """The parameters by name (made once: the model's structure is fixed when built)."""
        return self.__dict__.setdefault("_params_by_name", dict(self.named_parameters()))

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's part of checkpoint tensor ``name``; None: all of it.
        The loader reads only that part from the file."""
        mapped = self.map_name(name)
        if mapped is None:
            return None
        param = self.params_by_name().get(mapped[0])
        where = getattr(param, "checkpoint_slice", None)
        return where(mapped[1]) if where is not None else None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[tuple[str, object]] = set()
        for name, tensor in weights:
            mapped = self.map_name(name)
            if mapped is None:
                continue
            pname, shard_id = mapped
            if pname not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[pname]
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                try:
                    loader(param, tensor, shard_id)
                except ValueError as e:
                    raise ValueError(str(e) if name in str(e) else f"{name}: {e}") from e
            elif tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            else:
                fill(param, tensor)
            loaded.add((pname, shard_id))
        missing = [f"{n}" + ("" if s is None else f"[{s}]")
                   for n, p in params.items() if (n, None) not in loaded
                   for s in getattr(p, "shard_ids", (None,)) if (n, s) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))

    def process_weights_after_loading(self) -> None:
        """Let every layer's method finish its weights (quantize, repack) once all are loaded."""
        for module in self.modules():
            method = getattr(module, "method", None)
            if method is not None:
                method.process_weights_after_loading(module)

    def dummy_weights(self, seed: int, dtype: torch.dtype, device: torch.device
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """Random weights as a checkpoint of stacked tensors at their full (unsharded) shapes:
        norms at their neutral value, biases 0, the rest N(0, 0.02). Each tensor is drawn
        whole from one seeded generator in parameter order and each rank keeps its part, so
        a model is the same at every TP size."""
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, param in self.named_parameters():
            shape = getattr(param, "full_shape", tuple(param.shape))
            t = torch.empty(shape, dtype=dtype, device=device)
            if "norm" in name:
                t.fill_(0.0 if self.norm_offset else 1.0)
            elif name.endswith(".bias"):
                t.zero_()
            else:
                t.normal_(0.0, 0.02, generator=gen)
            yield name, t
