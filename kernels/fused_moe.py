"""Fused mixture-of-experts MLP: align, two grouped GEMMs, a sum over the slots.

Each token t picks K experts (topk_ids[t, :]); the T*K (token, slot) pairs are
numbered p = t * K + k. Three steps, all on the device and without a host sync
(the whole launcher can be captured in a CUDA graph):

1. Align. The pairs are sorted by expert and each expert's run is padded to a
   multiple of BLOCK_M, so a tile of BLOCK_M sorted rows belongs to one
   expert::

       sorted_ids:   [max_blocks * BLOCK_M] int32, pair ids; padding = T*K (the sentinel)
       block_expert: [max_blocks] int32, the expert of each tile; -1 past the last tile

   Expert e's rows start at the sum of the padded counts of experts < e, and
   within an expert the pairs keep ascending p. The bound on the number of
   tiles, sum_e cdiv(n_e, BLOCK_M) <= min(E, T*K) + T*K // BLOCK_M, depends on
   shapes alone, so the buffers and grids are sized without reading the counts.
   One program does it all when the pairs fit one chunk (decode); otherwise a
   histogram per chunk (_count_kernel), a scan over chunks per expert
   (_scan_kernel), and one program per chunk places its pairs (_place_kernel).
   Ids outside [0, E) are left out (they contribute nothing, as HF's
   sentinel expert E).

2. Grouped GEMM 1 (_expert_gemm_kernel, GATED): a program takes one tile of
   sorted rows and BLOCK_N intermediate columns, gathers the tile's x rows
   (token = p // K), multiplies by the expert's gate rows and up rows in two
   float32 accumulators and writes act(gate) * up to ``inter[p]``, [T*K, I].

3. Grouped GEMM 2 (the same kernel, not GATED): inter rows times w2[e]^T, the
   routing weight topk_weights[t, k] multiplied in the float32 epilogue,
   written to ``y[p]``, [T*K, H]; then _sum_slots_kernel adds each token's K
   rows in slot order in float32: deterministic, no atomics.

Padding rows (p = T*K) are masked out of every load and store. Tiles are
ordered in groups of GROUP_M along M (as in Triton's matmul tutorial) so
consecutive programs share weight tiles in L2.

Tile configs (BLOCK_M, and per GEMM BLOCK_N, BLOCK_K, GROUP_M, warps,
stages) matter on the GPU: decode-sized batches are bound by reading each hit
expert's weights once, large prefills by the tensor cores. ``tune`` times a
small grid per token count; ``engine.moe_configs`` keeps its result on disk and
passes it as ``config``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    check_dim,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    next_pow2,
    require,
)

logger = logging.getLogger(__name__)

ACTIVATIONS = ("silu", "gelu_tanh")
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
# The align step's one-hot tile (pairs of a chunk x experts) stays at or under
# this many elements: one chunk takes min(T*K, _ALIGN_ELEMS / E) pairs.
_ALIGN_ELEMS = 32768
_SUM_BLOCK_H = 1024


# ---- align ------------------------------------------------------------------------------------------


@triton.jit
def _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, stride_it, stride_ik,
                   TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    # The chunk's pairs and a [BLOCK_P, BLOCK_E] int32 one-hot of their experts
    # (an all-zero row for padding and for ids outside [0, E)).
    pair = chunk * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    ok = pair < num_pairs
    expert = tl.load(ids_ptr + (pair // TOP_K).to(tl.int64) * stride_it + (pair % TOP_K) * stride_ik,
                     mask=ok, other=-1)
    # Compared in the ids' own dtype: a wild int64 id must not wrap into range.
    expert = tl.where(ok & (expert >= 0) & (expert < num_experts), expert, -1).to(tl.int32)
    cols = tl.arange(0, BLOCK_E)
    return pair, (expert[:, None] == cols[None, :]).to(tl.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr,  # [T, K] int32/int64
    counts_ptr,  # [num_chunks, BLOCK_E] int32: pairs of each expert in each chunk
    num_pairs, num_experts, stride_it, stride_ik,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
):
    chunk = tl.program_id(0)
    _, hot = _chunk_one_hot(ids_ptr, chunk, num_pairs, num_experts, stride_it, stride_ik, TOP_K, BLOCK_P, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(hot, axis=0))


@triton.jit(do_not_specialize=["num_chunks"])
def _scan_kernel(
    counts_ptr,  # [num_chunks, BLOCK_E] int32, in place: becomes the exclusive prefix over chunks
    totals_ptr,  # [BLOCK_E] int32: pairs of each expert
    num_chunks,
    BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr,  # BLOCK_C >= num_chunks
):
    # One program per expert: an exclusive scan of its column over the chunks.
    expert = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ptrs = counts_ptr + c * BLOCK_E + expert
    n = tl.load(ptrs, mask=c < num_chunks, other=0)
    tl.store(ptrs, tl.cumsum(n, axis=0) - n, mask=c < num_chunks)
    tl.store(totals_ptr + expert, tl.sum(n, axis=0))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _place_kernel(
    ids_ptr,  # [T, K] int32/int64
    prefix_ptr,  # [num_chunks, BLOCK_E] int32: pairs of each expert in earlier chunks (unused if ONE_CHUNK)
    totals_ptr,  # [BLOCK_E] int32 (unused if ONE_CHUNK)
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out: pair ids by expert, padded with num_pairs
    block_expert_ptr,  # [max_blocks] int32 out: expert of each tile, -1 past the last
    num_pairs, num_experts, stride_it, stride_ik, num_chunks, max_blocks,
    TOP_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_B: tl.constexpr, ONE_CHUNK: tl.constexpr,
):
    # Program c places chunk c's pairs (c < num_chunks) and sets the experts of
    # tiles [c * BLOCK_B, (c + 1) * BLOCK_B); with ONE_CHUNK every program reads
    # chunk 0 for the counts and only program 0 places it.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    if ONE_CHUNK:
        pair, hot = _chunk_one_hot(ids_ptr, 0, num_pairs, num_experts, stride_it, stride_ik, TOP_K, BLOCK_P, BLOCK_E)
        counts = tl.sum(hot, axis=0)  # [BLOCK_E]
        before = tl.zeros([BLOCK_E], dtype=tl.int32)
    else:
        # past the last chunk every pair is masked: hot is all zero
        pair, hot = _chunk_one_hot(ids_ptr, pid, num_pairs, num_experts, stride_it, stride_ik, TOP_K, BLOCK_P,
                                   BLOCK_E)
        # _scan_kernel wrote columns [0, num_experts) only
        counts = tl.load(totals_ptr + cols, mask=cols < num_experts, other=0)
        before = tl.load(prefix_ptr + pid * BLOCK_E + cols, mask=(cols < num_experts) & (pid < num_chunks), other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M  # [BLOCK_E]
    start = tl.cumsum(padded, axis=0) - padded  # [BLOCK_E] each expert's first sorted row
    end = start + padded

    if pid < num_chunks:
        # A pair's row: its expert's start + pairs of that expert in earlier chunks
        # + pairs of that expert earlier in this chunk (exclusive scan of the one-hot).
        rank = tl.cumsum(hot, axis=0) - hot  # [BLOCK_P, BLOCK_E]
        dest = tl.sum(hot * (rank + (start + before)[None, :]), axis=1)  # [BLOCK_P]
        tl.store(sorted_ptr + dest, pair, mask=tl.sum(hot, axis=1) > 0)

    if pid == 0:
        # Padding rows of each expert's last tile point at the sentinel.
        j = tl.arange(0, BLOCK_M)
        pad_row = (start + counts)[:, None] + j[None, :]  # [BLOCK_E, BLOCK_M]
        tl.store(sorted_ptr + pad_row, tl.zeros([BLOCK_E, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=j[None, :] < (padded - counts)[:, None])

    # Tile b belongs to the expert whose rows [start, end) hold b * BLOCK_M: the
    # number of experts ending at or before it (empty experts included).
    b = pid * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B]
    row = b * BLOCK_M
    owner = tl.sum(((end[None, :] <= row[:, None]) & (cols[None, :] < num_experts)).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.where(row < tl.sum(padded, axis=0), owner, -1), mask=b < max_blocks)


# ---- grouped GEMMs --------------------------------------------------------------------------------------


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    # g: float32. silu(g) = g * sigmoid(g); gelu_tanh(g) = g * sigmoid(2u) with
    # u = sqrt(2/pi) (g + 0.044715 g^3), since 0.5 (1 + tanh(u)) = sigmoid(2u).
    if ACTIVATION == "silu":
        return g / (1.0 + tl.exp(-g))
    else:
        u = _SQRT_2_OVER_PI * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * u))


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _expert_gemm_kernel(
    a_ptr,  # GATED: x [T, KDIM]; else inter [T*K, KDIM]
    w_ptr,  # GATED: w13 [E, 2*N, KDIM]; else w2 [E, N, KDIM]
    out_ptr,  # GATED: inter [T*K, N]; else y [T*K, N]
    sorted_ptr,  # [num_m_blocks * BLOCK_M] int32 pair ids, num_pairs = padding
    block_expert_ptr,  # [num_m_blocks] int32, -1 = no tile
    topk_weights_ptr,  # [T, K] float32 (not GATED only)
    num_pairs, num_m_blocks, N,
    stride_am, stride_we, stride_wn, stride_om, stride_rt, stride_rk,
    KDIM: tl.constexpr,  # the reduced dim (H for GEMM 1, I for GEMM 2): fixed per model
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,  # GEMM 1: A rows are tokens, gate and up accumulators, activation epilogue
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    # Groups of GROUP_M tiles along M walk N together (L2 reuse of weight and A tiles).
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pair < num_pairs
    if GATED:
        a_row = (pair // TOP_K).to(tl.int64)  # the token
    else:
        a_row = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = n < N
    k = tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + k[None, :]  # [BLOCK_M, BLOCK_K]
    # int64: expert * stride_we passes 2^31 for large models.
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + n.to(tl.int64)[None, :] * stride_wn + k[:, None]
    # w_ptrs: [BLOCK_K, BLOCK_N], the expert's rows n read along K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if GATED:
        up_ptrs = w_ptrs + N * stride_wn  # up rows follow the N gate rows
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, KDIM, BLOCK_K):
        if KDIM % BLOCK_K == 0:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k < KDIM - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            if KDIM % BLOCK_K == 0:
                wu = tl.load(up_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                wu = tl.load(up_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, wu, acc_up, input_precision=DOT_PRECISION)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATED:
        acc = _activation(acc, ACTIVATION) * acc_up
    else:
        token = pair // TOP_K
        weight = tl.load(topk_weights_ptr + token.to(tl.int64) * stride_rt + (pair % TOP_K) * stride_rk,
                         mask=row_ok, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # [T*K, H]
    ids_ptr,  # [T, K]
    out_ptr,  # [T, H]
    hidden, num_experts, stride_it, stride_ik, stride_ot,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # out[t] = sum over slots k = 0..K-1, in that order, of y[t*K + k], in float32.
    # Slots with an id outside [0, E) were never written and are skipped.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * stride_it + k * stride_ik)
        used = (expert >= 0) & (expert < num_experts)
        y = tl.load(y_ptr + (token * TOP_K + k) * hidden + cols, mask=col_ok & used, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * stride_ot + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# ---- configs ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTiles:
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return {"block_n": self.block_n, "block_k": self.block_k, "group_m": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclass(frozen=True)
class MoeTiles:
    """One token count's tiles: the align step's BLOCK_M (shared by both GEMMs) and each GEMM's own."""
    block_m: int
    gemm1: GemmTiles
    gemm2: GemmTiles

    def as_dict(self) -> dict:
        return {"block_m": self.block_m, "gemm1": self.gemm1.as_dict(), "gemm2": self.gemm2.as_dict()}

    @staticmethod
    def from_dict(d: dict) -> MoeTiles:
        """Raises ValueError (naming ``config``) on anything that is not a valid entry."""
        where = "fused_moe"
        require(isinstance(d, dict) and {"block_m", "gemm1", "gemm2"} <= set(d), where,
                f"config entries need block_m, gemm1 and gemm2, got {d!r}")
        gemms = []
        for name in ("gemm1", "gemm2"):
            g = d[name]
            keys = ("block_n", "block_k", "group_m", "num_warps", "num_stages")
            require(isinstance(g, dict) and all(isinstance(g.get(key), int) for key in keys), where,
                    f"config {name} needs integer {', '.join(keys)}, got {g!r}")
            gemms.append(GemmTiles(*(g[key] for key in keys)))
        tiles = MoeTiles(d["block_m"], *gemms)
        for value in (tiles.block_m, tiles.gemm1.block_n, tiles.gemm1.block_k, tiles.gemm2.block_n,
                      tiles.gemm2.block_k):
            require(isinstance(value, int) and value >= 16 and value & (value - 1) == 0, where,
                    f"config block sizes must be powers of two >= 16, got {d!r}")
        for g in gemms:
            require(g.group_m >= 1 and g.num_warps in (1, 2, 4, 8, 16) and g.num_stages >= 1, where,
                    f"config has a bad group_m, num_warps or num_stages: {d!r}")
        return tiles


def default_tiles(num_tokens: int, num_experts: int, top_k: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles from shapes alone, used when no tuned config is given."""
    rows = num_tokens * top_k / max(1, min(num_experts, num_tokens * top_k))  # pairs per hit expert
    if dtype == torch.float32:  # exact fp32 dots: small tiles (shared memory, registers)
        tiles = GemmTiles(32, 32, 8, 4, 2)
        return MoeTiles(16 if rows <= 16 else 32, tiles, tiles)
    if rows <= 16:  # decode: read each hit expert's weights once, many programs in flight
        return MoeTiles(16, GemmTiles(64, 128, 1, 4, 4), GemmTiles(64, 128, 1, 4, 4))
    if rows <= 64:
        return MoeTiles(32, GemmTiles(64, 64, 8, 4, 4), GemmTiles(64, 64, 8, 4, 4))
    if rows <= 256:
        return MoeTiles(64, GemmTiles(64, 64, 8, 4, 4), GemmTiles(128, 64, 8, 4, 4))
    return MoeTiles(128, GemmTiles(64, 64, 8, 8, 4), GemmTiles(128, 64, 8, 8, 4))


# Parsed configs by id(config), holding the dict so its id stays its own: the
# launcher runs once per MoE layer per step, and parsing each time costs ~10 us
# of host time. A config is taken as immutable once passed.
_parsed_configs: dict[int, tuple[dict, list[tuple[int, MoeTiles]]]] = {}


def _parse_config(config: dict) -> list[tuple[int, MoeTiles]]:
    hit = _parsed_configs.get(id(config))
    if hit is not None and hit[0] is config:
        return hit[1]
    require(isinstance(config, dict) and len(config) > 0, "fused_moe",
            "config must be None or a non-empty dict {token count: tiles}")
    try:
        counts = sorted((int(c), c) for c in config)
    except (TypeError, ValueError):
        raise ValueError(f"fused_moe: config keys must be token counts, got {sorted(map(str, config))}") from None
    parsed = [(n, MoeTiles.from_dict(config[c])) for n, c in counts]
    if len(_parsed_configs) >= 64:
        _parsed_configs.clear()
    _parsed_configs[id(config)] = (config, parsed)
    return parsed


def pick_tiles(config: dict | None, num_tokens: int, num_experts: int, top_k: int,
               dtype: torch.dtype) -> MoeTiles:
    """The tiles ``fused_moe`` runs T tokens with: the config's entry for the
    smallest count >= T (else the largest), or ``default_tiles`` without a config."""
    if config is None:
        return default_tiles(num_tokens, num_experts, top_k, dtype)
    parsed = _parse_config(config)
    return next((tiles for n, tiles in parsed if n >= num_tokens), parsed[-1][1])


# ---- launcher ---------------------------------------------------------------------------------------------


def _check_args(x, w13, w2, topk_weights, topk_ids, activation) -> None:
    where = "fused_moe"
    check_runnable(where, x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    check_dim(where, "x", x, 2, "[num_tokens, hidden]")
    check_dim(where, "w13", w13, 3, "[num_experts, 2 * intermediate, hidden]")
    check_dim(where, "w2", w2, 3, "[num_experts, hidden, intermediate]")
    check_dim(where, "topk_weights", topk_weights, 2, "[num_tokens, top_k]")
    check_dim(where, "topk_ids", topk_ids, 2, "[num_tokens, top_k]")
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    require(num_experts > 0, where, "w13 has no experts")
    require(two_inter > 0 and two_inter % 2 == 0, where, f"w13's dim 1 must be 2 * intermediate, got {two_inter}")
    require(w13.shape[2] == hidden, where, f"w13 hidden {w13.shape[2]} != x hidden {hidden}")
    want = (num_experts, hidden, two_inter // 2)
    require(tuple(w2.shape) == want, where, f"w2 must be [num_experts, hidden, intermediate] = {want}, "
            f"got {tuple(w2.shape)}")
    require(topk_ids.shape[0] == num_tokens and topk_ids.shape[1] > 0, where,
            f"topk_ids must be [num_tokens={num_tokens}, top_k >= 1], got {tuple(topk_ids.shape)}")
    require(topk_weights.shape == topk_ids.shape, where,
            f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}")
    check_dtype(where, "x", x, FLOAT_DTYPES)
    for name, t in (("w13", w13), ("w2", w2)):
        require(t.dtype == x.dtype, where, f"{name} dtype {t.dtype} != x dtype {x.dtype}")
    check_dtype(where, "topk_weights", topk_weights, (torch.float32,))
    check_dtype(where, "topk_ids", topk_ids, (torch.int32, torch.int64))
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        check_inner_contiguous(where, name, t)
    require(activation in ACTIVATIONS, where, f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    config: dict | None = None,
) -> torch.Tensor:
    """Mixture-of-experts MLP over the experts each token picked.

    x: [T, H] float32/float16/bfloat16, any row stride (stride 1 in H)
    w13: [E, 2*I, H] in x's dtype; rows [:I] gate, rows [I:] up (stride 1 in H)
    w2: [E, H, I] in x's dtype (stride 1 in I)
    topk_weights: [T, K] float32 routing weights, any strides
    topk_ids: [T, K] int32/int64 expert ids, any strides; ids outside [0, E)
        contribute nothing (an expert-parallel rank's foreign experts)
    activation: "silu" (silu(gate) * up) or "gelu_tanh" (gelu(gate, approximate="tanh") * up)
    config: None (tiles from shapes) or {token count: tiles} as ``tune`` (and
        engine.moe_configs) returns: the entry of the smallest count >= T, else the largest

    Returns a new contiguous [T, H] in x's dtype:
    out[t] = sum_k topk_weights[t, k] * (act(x[t] @ w13[e, :I].T) * (x[t] @ w13[e, I:].T)) @ w2[e].T,
    e = topk_ids[t, k]. Accumulates in float32; the intermediate and each
    slot's output are rounded to x's dtype, the sum over slots is float32.
    No host sync, so it can be captured in a CUDA graph. Modifies nothing.
    """
    _check_args(x, w13, w2, topk_weights, topk_ids, activation)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter, top_k = two_inter // 2, topk_ids.shape[1]
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    tiles = pick_tiles(config, num_tokens, num_experts, top_k, x.dtype)
    sorted_ids, block_expert = _align(topk_ids, num_experts, tiles.block_m)
    inter_out = _gemm(x, w13, sorted_ids, block_expert, topk_weights, top_k, inter, tiles.block_m, tiles.gemm1,
                      gated=True, activation=activation)  # [T*K, I]
    y = _gemm(inter_out, w2, sorted_ids, block_expert, topk_weights, top_k, hidden, tiles.block_m, tiles.gemm2,
              gated=False, activation=activation)  # [T*K, H]
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, _SUM_BLOCK_H))](
        y, topk_ids, out, hidden, num_experts, topk_ids.stride(0), topk_ids.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_H=min(_SUM_BLOCK_H, max(16, next_pow2(hidden))),
    )
    return out


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the aligned tiles: sum_e cdiv(n_e, block_m) over the hit experts."""
    return min(num_experts, num_pairs) + num_pairs // block_m


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sorted_ids [max_blocks * block_m] int32, block_expert [max_blocks] int32); see the docstring."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    dev = topk_ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    block_e, block_p, num_chunks = _align_shape(num_pairs, num_experts)
    block_b = 64
    grid = (max(num_chunks, triton.cdiv(blocks, block_b)),)
    args = (num_pairs, num_experts, topk_ids.stride(0), topk_ids.stride(1))
    if num_chunks == 1:
        prefix = totals = block_expert  # unused
    else:
        prefix = torch.empty((num_chunks, block_e), dtype=torch.int32, device=dev)
        totals = torch.empty(block_e, dtype=torch.int32, device=dev)
        _count_kernel[(num_chunks,)](topk_ids, prefix, *args, TOP_K=top_k, BLOCK_P=block_p, BLOCK_E=block_e)
        _scan_kernel[(num_experts,)](prefix, totals, num_chunks, BLOCK_E=block_e, BLOCK_C=next_pow2(num_chunks))
    _place_kernel[grid](
        topk_ids, prefix, totals, sorted_ids, block_expert, *args, num_chunks, blocks,
        TOP_K=top_k, BLOCK_P=block_p, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_B=block_b,
        ONE_CHUNK=num_chunks == 1, num_warps=8 if block_p * block_e >= 8192 else 4,
    )
    return sorted_ids, block_expert


def _gemm(a, w, sorted_ids, block_expert, topk_weights, top_k, n, block_m, tiles: GemmTiles, *, gated: bool,
          activation: str) -> torch.Tensor:
    num_pairs = topk_weights.shape[0] * top_k
    kdim = a.shape[1]
    out = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    num_m_blocks = block_expert.shape[0]
    grid = (num_m_blocks * triton.cdiv(n, tiles.block_n),)
    _expert_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, topk_weights,
        num_pairs, num_m_blocks, n,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), topk_weights.stride(0), topk_weights.stride(1),
        KDIM=kdim, TOP_K=top_k, GATED=gated, ACTIVATION=activation,
        BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
        # float32 models get exact float32 products, not TF32's 10-bit mantissa.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    return out


def _align_shape(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_E, BLOCK_P, number of chunks) of the align step."""
    block_e = max(16, next_pow2(num_experts))
    block_p = max(16, min(next_pow2(num_pairs), _ALIGN_ELEMS // block_e))
    return block_e, block_p, triton.cdiv(num_pairs, block_p)


def warm_up(w13: torch.Tensor, w2: torch.Tensor, top_k: int, max_tokens: int, *, activation: str = "silu",
            config: dict | None = None, ids_dtypes: tuple[torch.dtype, ...] = (torch.int32, torch.int64)) -> int:
    """Compile every kernel variant ``fused_moe`` can meet for 1..max_tokens tokens
    with these weights and config (a compile met while serving stalls a step for
    about a second): one call per distinct set of compile-time choices (the
    config entry, the align chunking) and ids dtype (the align and sum kernels
    read the ids: pass the one the layer uses to halve the calls). Results are
    thrown away. Returns the number of calls."""
    num_experts, hidden = w13.shape[0], w13.shape[2]
    seen = set()
    calls = 0
    for num_tokens in range(1, max_tokens + 1):
        block_e, block_p, chunks = _align_shape(num_tokens * top_k, num_experts)
        key = (pick_tiles(config, num_tokens, num_experts, top_k, w13.dtype), block_p,
               chunks == 1 or next_pow2(chunks))
        if key in seen:
            continue
        seen.add(key)
        x = torch.zeros(num_tokens, hidden, dtype=w13.dtype, device=w13.device)
        ids = (torch.arange(num_tokens * top_k, device=w13.device) % num_experts).view(num_tokens, top_k)
        weights = torch.zeros(num_tokens, top_k, dtype=torch.float32, device=w13.device)
        for ids_dtype in ids_dtypes:
            fused_moe(x, w13, w2, weights, ids.to(ids_dtype), activation=activation, config=config)
            calls += 1
    return calls


# ---- tuning -----------------------------------------------------------------------------------------------

TOKEN_COUNTS = tuple(1 << i for i in range(14))  # 1, 2, 4, ..., 8192

# (block_n, block_k, num_warps, num_stages) candidates per BLOCK_M. Small tiles
# (decode) are bound by reading the weights: narrow N tiles give many programs
# and deep K tiles long loads in flight. Large ones want the biggest tiles the
# registers hold (GEMM 1 keeps two accumulators).
_GEMM_CANDIDATES = {
    16: [(32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (64, 64, 4, 5), (128, 128, 4, 3),
         (128, 64, 4, 4), (32, 64, 4, 5)],
    32: [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (64, 64, 4, 3), (32, 128, 4, 4)],
    64: [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 8, 4), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 8, 3)],
}
_GEMM_CANDIDATES_FP32 = [(32, 32, 4, 3), (64, 32, 4, 3), (32, 64, 4, 2), (64, 64, 4, 2)]


def _candidate_block_ms(num_tokens: int, num_experts: int, top_k: int) -> list[int]:
    """Up to three BLOCK_M around twice the pairs per hit expert (padding wastes the rest)."""
    rows = num_tokens * top_k / max(1, min(num_experts, num_tokens * top_k))
    fit = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * next_pow2(int(rows + 0.999)))]
    return fit[-3:]


def _candidate_tiles(block_m: int, dtype: torch.dtype, num_m_tiles: int) -> list[GemmTiles]:
    group_m = 1 if num_m_tiles <= 1 or block_m == 16 else 8
    table = _GEMM_CANDIDATES_FP32 if dtype == torch.float32 else _GEMM_CANDIDATES[block_m]
    return [GemmTiles(bn, bk, group_m, warps, stages) for bn, bk, warps, stages in table]


def _fastest(run, candidates: list[GemmTiles], rep_ms: int) -> tuple[float, GemmTiles | None]:
    """(median ms, tiles) of the fastest candidate of ``run(tiles)``; (inf, None) if none ran."""
    import triton.testing

    best: tuple[float, GemmTiles | None] = (float("inf"), None)
    for tiles in candidates:
        try:
            ms = triton.testing.do_bench(lambda: run(tiles), warmup=5, rep=rep_ms, return_mode="median")
        except Exception as e:  # noqa: BLE001 - e.g. OutOfResources: the candidate does not fit
            logger.debug("fused_moe.tune: skipping %s: %s", tiles, e)
            continue
        if ms < best[0]:
            best = (ms, tiles)
    return best


def _tune_one(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, gen: torch.Generator,
              rep_ms: int, max_candidates: int | None) -> dict:
    """The best tiles for x's token count, with uniform random routing."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    ids = torch.rand(num_tokens, num_experts, device=x.device, generator=gen).topk(top_k, dim=-1).indices
    ids = ids.to(torch.int32)
    weights = torch.rand(num_tokens, top_k, device=x.device, generator=gen)
    best: tuple[float, MoeTiles | None] = (float("inf"), None)
    for block_m in _candidate_block_ms(num_tokens, num_experts, top_k):
        sorted_ids, block_expert = _align(ids, num_experts, block_m)
        cands = _candidate_tiles(block_m, x.dtype, block_expert.shape[0])[:max_candidates]

        def gemm1(tiles: GemmTiles) -> torch.Tensor:
            return _gemm(x, w13, sorted_ids, block_expert, weights, top_k, inter, block_m, tiles, gated=True,
                         activation="silu")

        ms1, g1 = _fastest(gemm1, cands, rep_ms)
        if g1 is None:
            continue
        h = gemm1(g1)
        ms2, g2 = _fastest(lambda tiles: _gemm(h, w2, sorted_ids, block_expert, weights, top_k, hidden, block_m,
                                               tiles, gated=False, activation="silu"), cands, rep_ms)
        if g2 is not None and ms1 + ms2 < best[0]:
            best = (ms1 + ms2, MoeTiles(block_m, g1, g2))
    require(best[1] is not None, "fused_moe.tune", f"no candidate tile config ran for {num_tokens} tokens")
    logger.info("fused_moe.tune: %d tokens: %.1f us with %s", num_tokens, best[0] * 1e3, best[1])
    return best[1].as_dict()


def tune(
    num_experts: int,
    hidden: int,
    intermediate: int,
    top_k: int,
    dtype: torch.dtype,
    device: torch.device | str,
    token_counts: tuple[int, ...] = TOKEN_COUNTS,
    *,
    rep_ms: int = 25,
    max_candidates: int | None = None,
) -> dict[int, dict]:
    """Time a small grid of tiles per token count on this GPU; {count: tiles} for ``fused_moe(config=...)``.

    ``intermediate`` is a rank's share of the experts' intermediate dim. Inputs
    are random with uniform routing. For each count, every candidate BLOCK_M
    aligns once, then GEMM 1's and GEMM 2's candidates are timed separately
    (``triton.testing.do_bench``, L2 flushed between runs); the BLOCK_M with
    the least GEMM 1 + GEMM 2 time wins. Candidates that fail to compile or
    launch (shared memory) are skipped. Takes a minute or two, mostly compiles;
    ``max_candidates`` keeps only the first few per BLOCK_M (for tests).
    """
    device = torch.device(device)
    require(device.type == "cuda", "fused_moe.tune", f"tuning needs a CUDA device, got {device}")
    require(len(token_counts) > 0 and all(n >= 1 for n in token_counts), "fused_moe.tune",
            f"token_counts must be positive, got {token_counts}")
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    # Made in the model dtype: the engine tunes before it allocates the KV cache, but beside the weights.
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, device=device, dtype=dtype, generator=gen)
    w13 *= hidden**-0.5
    w2 = torch.randn(num_experts, hidden, intermediate, device=device, dtype=dtype, generator=gen)
    w2 *= intermediate**-0.5
    xs = torch.randn(max(token_counts), hidden, device=device, dtype=dtype, generator=gen)
    result: dict[int, dict] = {}
    with torch.cuda.device(device):  # do_bench times and flushes L2 on the current device
        for num_tokens in sorted(set(token_counts)):
            result[num_tokens] = _tune_one(xs[:num_tokens], w13, w2, top_k, gen, rep_ms, max_candidates)
    logger.info("fused_moe.tune: E=%d H=%d I=%d K=%d %s: %d token counts in %.1f s", num_experts, hidden,
                intermediate, top_k, dtype, len(result), time.perf_counter() - started)
    return result
