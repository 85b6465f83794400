"""Dense causal self-attention of a step's prefill chunks, read from the QKV projection.

Why. A prefill chunk attends to its cached prefix and to its own new tokens.
``paged_attention`` reads both out of the paged cache, one page lookup per key
and pointer loads, which on an H200 left a 4k causal prefill at 0.64x of torch
SDPA (docs/benchmarks.md). The new tokens' K and V are also in hand, contiguous,
as the QKV projection wrote them ([T, H_kv, D] views whose rows are tokens),
and a tile of them is one rectangle of memory: Hopper's bulk tensor copies
(TMA, through host-side ``TensorDescriptor``s) load it whole into shared
memory, with no address arithmetic in the kernel, and the key loop can be
software-pipelined. For a sequence with no cached prefix that is its whole
attention.

Layout. One program handles BLOCK_M consecutive query tokens of one sequence
and ONE query head (not the paged kernel's folded GQA rows: each row of a tile
then has its own token, so the Q tile and the causal mask are plain
rectangles); the G = num_q_heads // num_kv_heads heads of a group read the same
K/V tiles, which the grid makes them do at about the same time:

    grid = (num_q_heads, num_tiles)    axis 0 fastest: all heads of a tile start together,
                                       so a K/V tile is read from HBM about once per group
    row r of a tile  ->  token q_start + tok0 + r, query head program_id(0)
    key tile n       ->  tokens q_start + n * BLOCK_N + [0, BLOCK_N) of kv head h // G

Tiles are numbered as in ``paged_attention`` (sequence b's tiles start at
query_start_loc[b] // BLOCK_M + b, found by binary search, no host sync: the
helpers both kernels share are in kernels/_attention_common.py) and
taken last first, so a causal prefill's longest tiles start first.

Causality. Query i of a sequence sees its keys 0..i. A tile's key tiles below
(tok0 + 1) // BLOCK_N are seen whole by every row and run without a mask; the
rest, up to the tile's last query (clamped to the sequence's end), mask
k > i. That one compare is also the sequence's bounds: a valid row's keys
never pass its own token, so K/V tiles that run past the sequence (into the
next one, or past T where TMA fills zeros) are masked out. Rows past the
sequence's end compute garbage that is never stored (the output store is a
masked pointer store: a TMA store would clobber the next sequence's rows).

Loads. USE_TMA: Q, K and V tiles come through ``TensorDescriptor``s over the
2-D views [T, H*D] (row stride the projection's, heads side by side), which
needs each head's D elements contiguous and 16-byte aligned row strides;
otherwise (and as an option) the same kernel loads them with masked pointer
loads, the same math. Triton 3.6's interpreter runs both (it emulates the
descriptors), so the CPU tests check both. The key loop is a ``tl.range``
with ``num_stages`` (and optionally ``warp_specialize``) when compiled, a
``while`` loop when interpreted (see kernels/README.md: the interpreter's
range() cannot take tensor bounds under NumPy >= 2.4).

Which rows. ONLY_FRESH: programs of a sequence that has a cached prefix
(seq_len > q_len) exit at once and leave its rows to ``paged_attention``, which
then skips the sequences with no prefix (its SKIP_FRESH): two launches over
complementary rows of one output, chosen on the GPU without a host sync. A
decode row is a sequence with a prefix, so decode rows keep the paged kernel.

Numerics: as ``paged_attention`` (online softmax in float32, exp2 with the
scale folded into log2 units, one rounding to q's dtype at the end); dots in
q's dtype, IEEE float32 for float32 inputs. Attention sinks (``sinks``, SINK compiled
in) are folded in after the key loop as one more key of value zero, as in
``paged_attention``. The reference is ``kernels.reference.paged_attention`` over the
cache holding the same K/V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels._checks import check_sinks, next_pow2, require
from kernels._attention_common import (
    _INTERPRETED,
    _LOG2E,
    _LOG2E_C,
    _MAX_GRID_Y,
    _NEG_BIG,
    _fold_sink,
    _locate_tile,
)

try:  # host-side TMA descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

HEAD_DIMS = (64, 128)  # head sizes this kernel takes; others go to paged_attention alone
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # float32: the interpreter (tests); on CUDA it falls back


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int = 128  # query tokens (rows) per tile, of one head
    block_n: int = 128  # keys per inner step
    num_warps: int = 8
    num_stages: int = 2
    warp_specialize: bool = False  # tl.range(..., warp_specialize=True): compiled only
    use_tma: bool = True  # descriptors where the views allow them, else pointer loads

    def as_dict(self) -> dict:
        return dict(block_m=self.block_m, block_n=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages, warp_specialize=self.warp_specialize, use_tma=self.use_tma)


# The default tiles: bench/prefill_attention.py on an H200 (bf16, 32 q / 8 kv heads, D=128,
# 2026-12-02), dense kernel alone, us for 4k / 16k causal (SDPA 283 / 3876):
#   128x128 w8 s3 309 / 4540   128x128 w8 s2 323 / 5017   64x64 w4 s3 314 / 4770
#   128x64 w8 s3 329 / 4765    pointer loads (128x128 w8 s2) 363 / 5557
#   warp_specialize: w8 compiles and runs as fast as without; w4 fails to compile
#   (an assertion in Triton 3.6's Hopper warp-specialization pass); 128x128 w4: 868 us.
DEFAULT_CONFIG = PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
# float32 (interpreter) tiles: 64 x 64 would be 2 x 16 KiB per K/V stage on a GPU as well.
FLOAT32_CONFIG = PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)


def default_config(dtype: torch.dtype, head_dim: int) -> PrefillConfig:
    return FLOAT32_CONFIG if dtype == torch.float32 else DEFAULT_CONFIG


@triton.jit
def _load_kv_tile(ptr, stride_t, stride_h, q_start, q_len, n, key, kv_head, dims,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr):
    """Key tile ``n`` of K or V, [BLOCK_N, HEAD_DIM]: a TMA load through the descriptor, or
    masked pointer loads (keys past the sequence read as 0)."""
    if USE_TMA:
        tile = ptr.load([q_start + n * BLOCK_N, kv_head * HEAD_DIM])
    else:
        row = (q_start + key).to(tl.int64)
        tile = tl.load(ptr + row[:, None] * stride_t + kv_head * stride_h + dims[None, :],
                       mask=(key < q_len)[:, None], other=0.0)
    return tile


@triton.jit
def _attend_self_tile(
    q,  # [BLOCK_M, HEAD_DIM]
    m_i, l_i, acc,  # running max (log2 units), denominator, unnormalised output
    n,  # key tile: sequence tokens n * BLOCK_N + [0, BLOCK_N)
    tok,  # [BLOCK_M] each row's query token within the sequence (= its causal limit)
    q_start, q_len, kv_head,
    k_ptr, v_ptr,  # descriptors (USE_TMA) or the [T, Hkv, D] tensors' pointers
    stride_kt, stride_kh, stride_vt, stride_vh,
    dims, qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,  # False: every row sees every key of the tile
    USE_TMA: tl.constexpr,
):
    key = n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] key tokens within the sequence
    # (TMA: rows past T come back as zeros; rows of the next sequence are masked below.)
    k = _load_kv_tile(k_ptr, stride_kt, stride_kh, q_start, q_len, n, key, kv_head, dims, HEAD_DIM, BLOCK_N, USE_TMA)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if MASKED:
        s = tl.where(key[None, :] <= tok[:, None], s, float("-inf"))
    # The scale (> 0) is applied to the row max and then inside one multiply-add per score,
    # rather than in a pass of its own over the tile: the exponentials are the loop's
    # bottleneck next to the dots on Hopper, and every instruction less around them counts.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = _load_kv_tile(v_ptr, stride_vt, stride_vh, q_start, q_len, n, key, kv_head, dims, HEAD_DIM, BLOCK_N, USE_TMA)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_self_attention_kernel(
    out_ptr,  # [T, Hq, D], stride 1 in D
    q_ptr,  # descriptor over [T, Hq * D] (USE_TMA) or the [T, Hq, D] tensor
    k_ptr,  # descriptor over [T, Hkv * D] or the [T, Hkv, D] tensor
    v_ptr,
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    sinks_ptr,  # [Hq] float32 attention sinks; read only when SINK
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ONLY_FRESH: tl.constexpr,  # skip sequences with a cached prefix (paged_attention takes them)
    USE_TMA: tl.constexpr,
    SINK: tl.constexpr = False,  # attention sinks: one more key of value zero, logit sinks[head]
):
    head = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # last first: the longest causal tiles start first
    kv_head = head // GROUP

    seq, q_start, q_len, tok0 = _locate_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_M)
    if tok0 >= q_len:
        return
    if ONLY_FRESH:
        if tl.load(seq_lens_ptr + seq) != q_len:  # a cached prefix: the paged kernel's rows
            return

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows  # [BLOCK_M] query token within the sequence
    dims = tl.arange(0, HEAD_DIM)
    if USE_TMA:
        q = q_ptr.load([q_start + tok0, head * HEAD_DIM])  # [BLOCK_M, HEAD_DIM]
    else:
        qrow = (q_start + tok).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=(tok < q_len)[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Key tiles [0, n_full): below the first query, seen whole. [n_full, n_end): the diagonal,
    # up to the tile's last valid query.
    n_full = (tok0 + 1) // BLOCK_N
    n_end = tl.cdiv(tl.minimum(tok0 + BLOCK_M, q_len), BLOCK_N)
    if _INTERPRETED:  # while loops: see the module docstring
        n = 0
        while n < n_full:
            m_i, l_i, acc = _attend_self_tile(
                q, m_i, l_i, acc, n, tok, q_start, q_len, kv_head, k_ptr, v_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, dims, qk_scale,
                HEAD_DIM, BLOCK_N, DOT_PRECISION, False, USE_TMA,
            )
            n += 1
        n = n_full
        while n < n_end:
            m_i, l_i, acc = _attend_self_tile(
                q, m_i, l_i, acc, n, tok, q_start, q_len, kv_head, k_ptr, v_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, dims, qk_scale,
                HEAD_DIM, BLOCK_N, DOT_PRECISION, True, USE_TMA,
            )
            n += 1
    else:
        for n in tl.range(0, n_full, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
            m_i, l_i, acc = _attend_self_tile(
                q, m_i, l_i, acc, n, tok, q_start, q_len, kv_head, k_ptr, v_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, dims, qk_scale,
                HEAD_DIM, BLOCK_N, DOT_PRECISION, False, USE_TMA,
            )
        for n in tl.range(n_full, n_end, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
            m_i, l_i, acc = _attend_self_tile(
                q, m_i, l_i, acc, n, tok, q_start, q_len, kv_head, k_ptr, v_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, dims, qk_scale,
                HEAD_DIM, BLOCK_N, DOT_PRECISION, True, USE_TMA,
            )

    if SINK:
        alpha, l_i = _fold_sink(m_i, l_i, tl.load(sinks_ptr + head) * _LOG2E_C)
        acc = acc * alpha[:, None]
    out = acc / l_i[:, None]
    orow = (q_start + tok).to(tl.int64)
    tl.store(out_ptr + orow[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(tok < q_len)[:, None])


def supports(q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> bool:
    """Whether ``prefill_self_attention`` takes these tensors: 16-bit on CUDA (float32 too
    under the interpreter), head dim 64 or 128, [T, H, D] with stride 1 in D, one device."""
    if q.dtype not in DTYPES or new_k.dtype != q.dtype or new_v.dtype != q.dtype:
        return False
    if q.dtype == torch.float32 and q.device.type == "cuda":
        return False  # the paged kernel's float32 tiles: this one's would need other tiles
    if q.dim() != 3 or new_k.dim() != 3 or new_k.shape != new_v.shape:
        return False
    t, hq, d = q.shape
    if d not in HEAD_DIMS or new_k.shape[0] != t or new_k.shape[2] != d or hq % new_k.shape[1]:
        return False
    return all(x.stride(2) == 1 for x in (q, new_k, new_v)) and new_k.device == q.device == new_v.device


def _descriptor(x: torch.Tensor, block_rows: int):
    """A TMA descriptor over [T, H*D] (heads side by side in a row), or None where the view
    does not allow one (heads not adjacent, unaligned base or row stride)."""
    t, h, d = x.shape
    if TensorDescriptor is None or t == 0 or x.stride(1) != d:
        return None
    nbytes = x.element_size()
    if x.data_ptr() % 16 or (x.stride(0) * nbytes) % 16:
        return None
    return TensorDescriptor(x, [t, h * d], [x.stride(0), 1], [block_rows, d])


def prefill_self_attention(
    q: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    only_fresh: bool = True,
    config: PrefillConfig | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its new keys alone.

    q: [T, Hq, D]; new_k, new_v: [T, Hkv, D] (this step's K/V, e.g. views of the QKV
        projection), stride 1 in D; query_start_loc [B + 1], seq_lens [B] int32 as in
        ``paged_attention``.
    only_fresh: True writes only the rows of sequences with no cached prefix (seq_lens[b]
        == q_len_b), for which this is their whole attention, and leaves the others' rows
        of ``out`` as they are; False treats every sequence as if it had none.
    out: [T, Hq, D] to write into (stride 1 in D), else a new tensor.
    sinks: None, or float32 [Hq] on q's device: attention sinks (gpt-oss), a logit per
        query head in the softmax's denominator only (see ``paged_attention``).
    Returns ``out``. Rows past query_start_loc[B] are left unspecified.
    """
    require(scale > 0, "prefill_self_attention", f"scale must be > 0, got {scale}")
    require(supports(q, new_k, new_v), "prefill_self_attention",
            f"unsupported q {tuple(q.shape)} {q.dtype}, k {tuple(new_k.shape)} {new_k.dtype} (see supports())")
    check_sinks("prefill_self_attention", sinks, q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = new_k.shape[1]
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    cfg = config or default_config(q.dtype, head_dim)
    require(cfg.block_m >= 16 and cfg.block_n >= 16 and next_pow2(cfg.block_m) == cfg.block_m
            and next_pow2(cfg.block_n) == cfg.block_n, "prefill_self_attention", f"bad tiles {cfg}")
    num_tiles = num_tokens // cfg.block_m + num_seqs
    require(num_tiles <= _MAX_GRID_Y, "prefill_self_attention",
            f"{num_tokens} tokens of {num_seqs} sequences make {num_tiles} tiles, more than one launch takes")

    descs = None
    if cfg.use_tma:
        descs = (_descriptor(q, cfg.block_m), _descriptor(new_k, cfg.block_n), _descriptor(new_v, cfg.block_n))
        if any(d is None for d in descs):
            descs = None
    args = descs if descs is not None else (q, new_k, new_v)
    _prefill_self_attention_kernel[(num_q_heads, num_tiles)](
        out, *args, query_start_loc, seq_lens, q if sinks is None else sinks,  # (q: never read without SINK)
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1),
        new_k.stride(0), new_k.stride(1),
        new_v.stride(0), new_v.stride(1),
        out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        NUM_STAGES=cfg.num_stages,
        WARP_SPECIALIZE=cfg.warp_specialize,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        ONLY_FRESH=only_fresh,
        USE_TMA=descs is not None,
        SINK=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
