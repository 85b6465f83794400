"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the three layers of every four
that keep a fixed-size recurrent state per sequence instead of KV.

    x -> in_proj -> q, k, v (Hk, Hk, Hv heads), z (Hv heads, the output gate), b, a (one per v head)
      -> causal conv1d over [q | k | v] channels (kernel K, SiLU; its last K - 1 inputs are state)
      -> gated delta rule: per v head, S <- exp(g) S + k (beta (v - S^T k))^T, o = S^T q
         (q, k L2-normalised, q scaled by Dk^-0.5; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))
      -> gated RMSNorm per v head: w * norm(o) * silu(z)
      -> out_proj (all-reduced under tensor parallelism)

Each k head serves ``Hv / Hk`` consecutive v heads. The checkpoints store the input
projections two ways (``fused_qkvz``):

    Qwen3-Next   in_proj_qkvz [Hk * (2 Dk + 2 r Dv), hidden], grouped per k head: q_h, k_h, v_h (r heads), z_h (r heads)
                 in_proj_ba   [Hk * 2r, hidden], per k head: b (r), a (r)
    Qwen3.5      in_proj_qkv  [2 Hk Dk + Hv Dv, hidden]: every q head, every k head, every v head
                 in_proj_z    [Hv Dv, hidden]; in_proj_b, in_proj_a [Hv, hidden]

Qwen3.5's four load stacked into one ``in_proj`` [q | k | v | z | b | a], one GEMM whose
outputs the convolution, the gating and the gated norm read in place. Where the checkpoint
quantizes b and a otherwise than q, k, v and z (FP8 checkpoints often leave them 16-bit),
they stay apart: ``in_proj_qkvz`` [q | k | v | z] and ``in_proj_ba`` [b | a].

Tensor parallelism splits the k heads (and with them their v heads): a rank's rows of the
grouped Qwen3-Next projections are one contiguous range; of Qwen3.5's, one range per part.
The convolution's channels, A_log and dt_bias follow the heads; out_proj is row-parallel.

State (engine/layers/linear_state.py): ``self.linear_state``, bound by the engine, holds per
slot the conv inputs [conv_dim, K - 1] (model dtype) and S [Hv, Dk, Dv] (float32). A step's
row b uses slot ``meta.state_slots[b]``; it continues that slot's state when it has context
before this step (``seq_lens > its query length``), else starts from zeros, and leaves the
state after its last token in the slot (so chunked prefill continues exactly).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers.attention import AttentionMetadata
from engine.layers.linear import (ColumnParallelLinear, LinearMethods, Part, RowParallelLinear, attach_loader,
                                  method_for, split_range, tp_rank_size)
from engine.layers.linear_state import LinearState, LinearStateShape
from engine.parallel import TPGroup


def _split_param(parts: list[Part], *rest: int) -> nn.Parameter:
    """A parameter [this rank's rows of ``parts``, *rest] with the loader that picks them."""
    param = nn.Parameter(torch.empty(sum(p.size for p in parts), *rest), requires_grad=False)
    return attach_loader(param, (sum(p.full for p in parts), *rest), parts, 0)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModuleType, tp: TPGroup | None, *, fused_qkvz: bool,
                 methods: LinearMethods | None = None, prefix: str = "") -> None:
        super().__init__()
        hf = cfg.hf_config
        nk, nv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
        dk, dv = hf["linear_key_head_dim"], hf["linear_value_head_dim"]
        self.kernel_size = hf.get("linear_conv_kernel_dim", 4)
        r = nv // nk  # v heads per k head (engine/config.py refuses a remainder)
        rank, size = tp_rank_size(tp)
        k_lo, k_hi = split_range(nk, rank, size, "linear-attention key heads")
        v_lo, v_hi = k_lo * r, k_hi * r
        self.num_k_heads, self.num_v_heads = k_hi - k_lo, v_hi - v_lo  # this rank's
        self.head_k_dim, self.head_v_dim, self.ratio = dk, dv, r
        self.key_dim, self.value_dim = self.num_k_heads * dk, self.num_v_heads * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.fused_qkvz, self.ops, self.eps = fused_qkvz, ops, cfg.rms_norm_eps
        h = cfg.hidden_size
        qk_part, v_part = Part(nk * dk, k_lo * dk, k_hi * dk), Part(nv * dv, v_lo * dv, v_hi * dv)
        if fused_qkvz:
            group = 2 * dk + 2 * r * dv
            self.in_proj_qkvz = ColumnParallelLinear(h, [Part(nk * group, k_lo * group, k_hi * group)],
                                                     method=method_for(methods, prefix, "in_proj_qkvz"))
            self.in_proj_ba = ColumnParallelLinear(h, [Part(nk * 2 * r, k_lo * 2 * r, k_hi * 2 * r)],
                                                   method=method_for(methods, prefix, "in_proj_ba"))
        else:
            qkvz, ba = [qk_part, qk_part, v_part, v_part], [Part(nv, v_lo, v_hi)] * 2
            qkvz_ids, stored = ("qkv",) * 3 + ("z",), ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
            try:
                method = method_for(methods, prefix, "in_proj", stored)
            except ValueError:  # b and a quantized otherwise: two GEMMs
                self.in_proj_qkvz = ColumnParallelLinear(h, qkvz, shard_ids=qkvz_ids,
                                                         method=method_for(methods, prefix, "in_proj_qkvz", stored[:2]))
                self.in_proj_ba = ColumnParallelLinear(h, ba, shard_ids=("b", "a"),
                                                       method=method_for(methods, prefix, "in_proj_ba", stored[2:]))
            else:
                self.in_proj = ColumnParallelLinear(h, qkvz + ba, shard_ids=qkvz_ids + ("b", "a"), method=method)
        # depthwise conv over the [q | k | v] channels, as the checkpoint stores it: [C, 1, K]
        self.conv1d = nn.Module()
        self.conv1d.weight = _split_param([qk_part, qk_part, v_part], 1, self.kernel_size)
        self.A_log = _split_param([Part(nv, v_lo, v_hi)])
        self.dt_bias = _split_param([Part(nv, v_lo, v_hi)])
        self.norm = nn.Module()  # the gated RMSNorm's weight over one v head (w, not 1 + w), on every rank
        self.norm.weight = nn.Parameter(torch.ones(dv), requires_grad=False)
        self.out_proj = RowParallelLinear(nv * dv, h, tp, "linear-attention value heads",
                                          method=method_for(methods, prefix, "out_proj"))
        self.linear_state: LinearState | None = None  # bound by the engine (CausalLM.bind_linear_states)

    def linear_state_shape(self) -> LinearStateShape:
        return LinearStateShape(conv=(self.conv_dim, self.kernel_size - 1),
                                ssm=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
                                conv_dtype=self.conv1d.weight.dtype)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(conv input [T, conv_dim] = q | k | v, z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        t, hk, hv, dk, dv, r = x.shape[0], self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim, \
            self.ratio
        if self.fused_qkvz:
            q, k, v, z = self.in_proj_qkvz(x).view(t, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
            b, a = self.in_proj_ba(x).view(t, hk, 2 * r).split([r, r], dim=-1)
            mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
            return mixed, z.reshape(t, hv, dv), b.reshape(t, hv), a.reshape(t, hv)
        if hasattr(self, "in_proj"):  # views of one GEMM's output
            mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, hv, hv], dim=-1)
        else:
            mixed, z = self.in_proj_qkvz(x).split([self.conv_dim, self.value_dim], dim=-1)
            b, a = self.in_proj_ba(x).split([hv, hv], dim=-1)
        return mixed, z.view(t, hv, dv), b, a

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, state, ops = x.shape[0], self.linear_state, self.ops
        if state is None:
            raise RuntimeError("GatedDeltaNet: no state bound (CausalLM.bind_linear_states)")
        mixed, z, b, a = self._project(x)
        qsl, slots = meta.query_start_loc, meta.state_slots
        has_state = meta.seq_lens > (qsl[1:] - qsl[:-1])  # context before this step's tokens
        mixed = ops.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), None, state.conv, slots, qsl, has_state,
                                  activation="silu")
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = ops.gdn_gating(a, b, self.A_log, self.dt_bias)  # float32 log-decay, as transformers
        o = ops.gated_delta_rule(q.reshape(t, self.num_k_heads, self.head_k_dim),
                                 k.reshape(t, self.num_k_heads, self.head_k_dim),
                                 v.reshape(t, self.num_v_heads, self.head_v_dim), g, beta, state.ssm, slots, qsl,
                                 has_state, use_qk_l2norm=True)
        o = ops.gated_rms_norm(o, z, self.norm.weight, self.eps)  # [T, Hv, Dv] both
        return self.out_proj(o.reshape(t, self.value_dim))
