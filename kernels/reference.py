"""Pure-PyTorch versions of every kernel: the CPU serving path and the oracle
the Triton kernels are tested against.

Each function has the same signature and contract as the Triton launcher of
the same name and follows Hugging Face Llama's arithmetic (which dtype each
step runs in), so a model served on CPU matches ``transformers`` in float32.
They are vectorized over tokens; paged attention loops over sequences only.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from kernels._checks import check_sinks
from kernels._checks import FP8_E4M3_MAX, FP8_KV_DTYPE, check_window  # an FP8 KV cache: e4m3, per-tensor scales
# The quantized GEMMs and multi-LoRA keep their references in their own modules (the layouts are documented there).
from kernels.fp8_reference import FP8_DTYPE, dequantize_fp8, fp8_gemm, fp8_quantize  # noqa: F401
from kernels.int4_reference import dequantize_int4, int4_gemm  # noqa: F401
from kernels.mxfp4_reference import dequantize_mxfp4, dequantize_mxfp4_packed, quantize_mxfp4  # noqa: F401
from kernels.lora_reference import lora_expand, lora_group, lora_shrink  # noqa: F401
from kernels.linear_reference import causal_conv1d, gated_delta_rule, gated_rms_norm, gdn_gating  # noqa: F401


def describe_kernels(device: torch.device, dtype: torch.dtype,
                     cpu_attention_build_timeout: float | None = None,
                     glue: str = "norms, RoPE and activations PyTorch (kernels.reference)") -> str:
    """What serves a step on these references, for the model runner's start-up log line.
    On the CPU, attention is the compiled CPU attention (built or loaded here, as the
    runner's warm-up would, so the line says which runs) and float32 GEMMs oneDNN's;
    ``glue`` names what runs the rest (kernels.cpu_ops names its own)."""
    if device.type != "cpu":
        return "PyTorch references (kernels.reference), GEMMs torch's"
    from kernels import cpu_gemm

    # The engine's attention layer calls kernels.cpu_attention on the CPU and has imported it
    # before a runner exists; it imports this module, so it is looked up rather than imported.
    cpu_attention = sys.modules.get("kernels.cpu_attention")
    if cpu_attention is not None and cpu_attention.extension(cpu_attention_build_timeout) is not None:
        attention = "compiled (kernels/cpu_attention.py)"
    else:
        why = cpu_attention.unavailable_reason() if cpu_attention is not None else "not in use"
        attention = f"PyTorch reference ({why})"
    gemms = "oneDNN's" if dtype == torch.float32 and cpu_gemm.onednn_available() else "torch's F.linear"
    return f"attention {attention}, GEMMs {gemms}, {glue}"


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What an FP8 cache holds for ``x``: e4m3(clamp(x / scale, -448, 448)), the division in
    float32, the cast rounding to nearest even."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K/V into its cache slot, in place.

    key, value: [num_tokens, num_kv_heads, head_dim]
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] (views allowed), in
        key's dtype, or float8_e4m3fn: then keys are stored as ``quantize_fp8(key, k_scale)``
        and values as ``quantize_fp8(value, v_scale)`` (scales are 1.0 for other caches)
    slot_mapping: [num_tokens] int, slot = block_id * block_size + offset; < 0 skips the token
    """
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    keep = slots >= 0  # [num_tokens]
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key, value = key[keep], value[keep]
    if k_cache.dtype == FP8_KV_DTYPE:
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    # Advanced-index assignment writes through the (non-contiguous) views.
    k_cache[blocks, offsets] = key
    v_cache[blocks, offsets] = value


def _dequantize(kv: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache values as float32: an FP8 cache's times its scale."""
    return kv.float() * scale if kv.dtype == FP8_KV_DTYPE else kv.float()


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    step_cache: dict | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context.
    (``num_splits``, the Triton kernel's split-K count, changes nothing here.)
    ``step_cache``: a dict the layers of one step share (the same block tables and
    lengths), where the work of finding each row's keys is kept after the first
    (per window: layers with and without one may share it).
    ``sliding_window``: None, or W >= 1: the query at position p sees only keys
    p - W < k <= p (Hugging Face's sliding window); keys before every window of a
    sequence's queries are never read.
    ``sinks``: None, or float32 [num_q_heads]: attention sinks (gpt-oss), one logit per
    query head that joins the softmax and is dropped from it, as transformers' GptOss
    eager attention does: probs = softmax([q.k * scale ..., sink_h])[:-1], out = probs @ V.

    q: [num_tokens, num_q_heads, head_dim]; rows query_start_loc[b]:query_start_loc[b+1]
       belong to sequence b
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], in q's dtype or
       float8_e4m3fn: then K = k_cache * k_scale and V = v_cache * v_scale, in float32
    block_tables: [B, max_blocks_per_seq]; query_start_loc: [B+1]; seq_lens: [B]
       (seq_lens counts the new tokens, whose K/V are already in the cache)
    returns [num_tokens, num_q_heads, head_dim] in q's dtype, computed in float32.
    """
    check_window(sliding_window)
    check_sinks("paged_attention", sinks, q)
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    starts, lens, decode, chunks = _step_rows(query_start_loc, seq_lens, block_tables, k_cache.shape[1],
                                              step_cache, sliding_window)
    if decode:  # one batched pass for all single-token rows
        _decode_attention(q, k_cache, v_cache, block_tables, starts, lens, decode, scale, out, step_cache,
                          sliding_window, k_scale, v_scale, sinks)
    for q_lo, q_hi, k_off, num_keys, blocks, visible in chunks:
        # [num_keys, num_kv_heads, head_dim] -> [num_kv_heads, num_keys, head_dim]
        k = _dequantize(k_cache[blocks].flatten(0, 1)[k_off:k_off + num_keys].transpose(0, 1), k_scale)
        v = _dequantize(v_cache[blocks].flatten(0, 1)[k_off:k_off + num_keys].transpose(0, 1), v_scale)
        qb = q[q_lo:q_hi].transpose(0, 1).float()  # [num_q_heads, q_len, head_dim]
        if sinks is None:
            o = F.scaled_dot_product_attention(
                qb, k, v, attn_mask=visible, scale=scale, enable_gqa=num_q_heads != num_kv_heads
            )  # [num_q_heads, q_len, head_dim]
        else:  # SDPA has no sink: the matmuls, the sink's column joined to the softmax
            q_len, head_dim = qb.shape[1:]
            qg = qb.reshape(num_kv_heads, -1, q_len, head_dim)  # [num_kv_heads, G, q_len, head_dim]
            scores = torch.matmul(qg, k[:, None].transpose(-1, -2)) * scale  # [num_kv_heads, G, q_len, keys]
            probs = _softmax_with_sink(scores.masked_fill(~visible, float("-inf")),
                                       sinks.view(num_kv_heads, -1, 1, 1))
            o = torch.matmul(probs, v[:, None]).reshape(num_q_heads, q_len, head_dim)
        out[q_lo:q_hi] = o.transpose(0, 1).to(q.dtype)
    return out


def _softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """softmax over each row of ``scores`` [..., L] with one more column, ``sink`` (broadcast
    to [..., 1]), that is then dropped: the rows sum to less than 1 (GptOss's eager attention)."""
    logits = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return logits.softmax(dim=-1)[..., :-1]


def _step_rows(query_start_loc, seq_lens, block_tables, block_size, step_cache, window=None):
    """(starts, lens, the single-token rows batched together, and per other sequence: its
    query rows, the offset of its first key in its first block, the key count, the blocks
    and the causal (and window) mask); the same in every layer of a step with this window.

    A chunk's keys are [k_lo, seq_len), k_lo being where its first query's window starts
    (0 without a window): blocks wholly before k_lo are not gathered."""
    key = ("rows", block_size, window)
    if step_cache is not None and key in step_cache:
        return step_cache[key]
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if len(decode) < 2:
        decode = []
    batched = set(decode)
    chunks = []
    dev = block_tables.device
    for b, seq_len in enumerate(lens):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0 or b in batched:
            continue
        k_lo = 0 if window is None else max(0, seq_len - q_len - window + 1)
        blocks = block_tables[b, k_lo // block_size:-(-seq_len // block_size)].long()
        # Query i sits at position seq_len - q_len + i: the mask is causal
        # aligned to the bottom-right corner, not SDPA's top-left is_causal.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=dev)
        k_pos = torch.arange(k_lo, seq_len, device=dev)
        visible = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len - k_lo]
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        chunks.append((q_lo, q_hi, k_lo % block_size, seq_len - k_lo, blocks, visible))
    rows = (starts, lens, decode, chunks)
    if step_cache is not None:
        step_cache[key] = rows
    return rows


_DECODE_GROUP = 8  # rows per batched pass: sorted by length, so little padding


def _decode_attention(q, k_cache, v_cache, block_tables, starts, lens, rows, scale, out, step_cache,
                      window=None, k_scale=1.0, v_scale=1.0, sinks=None) -> None:
    """Single-query rows of ``paged_attention``, batched.

    Rows are sorted by context length and taken in groups; each group's
    contexts are gathered straight into [R, H_kv, L, D] (the layout matmul
    wants, so no further copy), a whole head vector at a time where the
    cache's strides allow (``_as_vector_rows``). Padding positions re-read the
    row's last valid slot (never a stale or foreign one) and are masked out
    of the softmax. With a window W a row reads only its last min(len, W) keys.
    Which slots to read is the same in every layer of a step with the same
    window (``_decode_plan``), so it is worked out once a step. ``sinks`` [num_q_heads]
    join each row's softmax as one more column (``_softmax_with_sink``).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_rows, v_rows = _as_vector_rows(k_cache), _as_vector_rows(v_cache)
    by_rows = k_rows is not None and v_rows is not None and k_cache.stride() == v_cache.stride()
    plan = _decode_plan(k_cache, block_tables, starts, lens, rows, by_rows, step_cache, window)
    for token_rows, valid, where in plan:
        if by_rows:
            k = _dequantize(_gather_rows(k_rows, where), k_scale)  # [R, H_kv, L, D]
            v = _dequantize(_gather_rows(v_rows, where), v_scale)
        else:
            blocks, heads, offsets = where
            k = _dequantize(k_cache.permute(0, 2, 1, 3)[blocks, heads, offsets], k_scale)
            v = _dequantize(v_cache.permute(0, 2, 1, 3)[blocks, heads, offsets], v_scale)
        r = token_rows.shape[0]
        qg = q[token_rows].float().view(r, num_kv_heads, -1, head_dim)  # [R, H_kv, G, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [R, H_kv, G, L]
        scores = scores.masked_fill(~valid, float("-inf"))
        if sinks is None:
            probs = scores.softmax(dim=-1)
        else:
            probs = _softmax_with_sink(scores, sinks.view(1, num_kv_heads, -1, 1))
        o = torch.matmul(probs, v)  # [R, H_kv, G, D]
        out[token_rows] = o.reshape(r, -1, head_dim).to(q.dtype)


def _decode_plan(cache, block_tables, starts, lens, rows, by_rows, step_cache, window=None):
    """Per group of decode rows: (their rows in q, the valid keys [R, 1, 1, L], where their
    keys are: head-vector rows [R, H_kv, L], or (blocks, heads, offsets) to index with).
    Row b reads keys [lo_b, lens[b]), lo_b = max(0, lens[b] - window) (0 without one).
    The same in every layer of a step with this window (the layers' cache views share
    their strides), so it is kept in ``step_cache`` (one dict a step, shared by the
    layers) when one is given."""
    key = ("decode plan", by_rows, cache.stride(), tuple(cache.shape[1:]), window)
    if step_cache is not None and key in step_cache:
        return step_cache[key]
    block_size, num_kv_heads = cache.shape[1], cache.shape[2]
    dev = block_tables.device
    heads = torch.arange(num_kv_heads, device=dev)[None, :, None]
    plan = []
    lo = {b: 0 if window is None else max(0, lens[b] - window) for b in rows}
    ordered = sorted(rows, key=lambda b: lens[b] - lo[b])
    for i in range(0, len(ordered), _DECODE_GROUP):
        group = ordered[i:i + _DECODE_GROUP]
        seq = torch.tensor([lens[b] for b in group], device=dev)  # [R]
        first = torch.tensor([lo[b] for b in group], device=dev)  # [R]
        span = torch.arange(int((seq - first).max()), device=dev)[None, :]  # [1, L]
        valid = span < (seq - first)[:, None]  # [R, L]
        pos = torch.minimum(first[:, None] + span, (seq - 1)[:, None])
        table = block_tables[torch.tensor(group, device=dev)].long()
        blocks = torch.gather(table, 1, pos // block_size)[:, None, :]  # [R, 1, L]
        offsets = (pos % block_size)[:, None, :]
        where = _vector_index(cache, blocks, heads, offsets) if by_rows else (blocks, heads, offsets)
        token_rows = torch.tensor([starts[b] for b in group], device=dev)
        plan.append((token_rows, valid[:, None, None, :], where))
    if step_cache is not None:
        step_cache[key] = plan
    return plan


def _as_vector_rows(cache: torch.Tensor) -> torch.Tensor | None:
    """[num_blocks, block_size, heads, head_dim] whose head vectors are contiguous and aligned
    (a view of the engine's cache is) -> every head vector of its storage as a row of a
    [rows, head_dim] view, so a gather is one index_select of whole rows (memcpy-like on CPU,
    ~2.7x faster than advanced indexing over three index tensors); None otherwise."""
    d = cache.shape[3]
    strides = cache.stride()
    if strides[3] != 1 or any(st % d for st in strides[:3]):
        return None
    last = sum((n - 1) * st for n, st in zip(cache.shape[:3], strides[:3])) // d
    return cache.as_strided((last + 1, d), (d, 1))


def _vector_index(cache: torch.Tensor, blocks: torch.Tensor, heads: torch.Tensor,
                  offsets: torch.Tensor) -> torch.Tensor:
    """Rows of ``_as_vector_rows(cache)`` holding cache[blocks, offsets, heads] ([R, H_kv, L])."""
    s_block, s_slot, s_head = cache.stride()[:3]
    return (blocks * s_block + offsets * s_slot + heads * s_head) // cache.shape[3]


def _gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.index_select(rows, 0, index.reshape(-1)).view(*index.shape, rows.shape[1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
             float32_weight: bool = False) -> torch.Tensor:
    """HF LlamaRMSNorm. x: [T, H], weight: [H] -> [T, H] in x's dtype. ``offset``: Gemma's
    form (Gemma3RMSNorm, Qwen3NextRMSNorm): times ``1 + weight`` in float32, then cast back.
    ``float32_weight`` (Gemma4RMSNorm): times ``weight`` in float32, then cast back."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (1.0 + weight.float())).to(x.dtype)
    if float32_weight:
        return (h * weight.float()).to(x.dtype)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
    float32_weight: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual (in x's dtype); returns (rms_norm(residual_out), residual_out)."""
    residual_out = x + residual
    return rms_norm(residual_out, weight, eps, offset, float32_weight), residual_out


def rms_norm_add(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool = False,
    float32_weight: bool = False, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """residual + rms_norm(x), the add in x's dtype after the norm's cast (h + norm(x)); with
    ``scale`` (one value in x's dtype) that sum times it, in x's dtype."""
    out = residual + rms_norm(x, weight, eps, offset, float32_weight)
    return out if scale is None else out * scale


def rms_norm_add_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, next_weight: torch.Tensor, eps: float,
    offset: bool = False, float32_weight: bool = False, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """h = rms_norm_add(x, residual, weight, eps, offset, float32_weight, scale); returns
    (rms_norm(h, next_weight, eps, offset, float32_weight), h)."""
    h = rms_norm_add(x, residual, weight, eps, offset, float32_weight, scale)
    return rms_norm(h, next_weight, eps, offset, float32_weight), h


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (HF ``rotate_half``) rotary embedding, out of place.

    positions: [T]; q: [T, Hq, D]; k: [T, Hk, D]
    cos_sin_cache: [max_positions, D] float32, [:, :D/2] = cos, [:, D/2:] = sin
    returns contiguous (q_out, k_out) in the input dtypes.
    """
    cos, sin = cos_sin_cache[positions.long()][:, None, :].chunk(2, dim=-1)  # [T, 1, D/2] each

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # x * [cos, cos] + rotate_half(x) * [sin, sin], with rotate_half(x) = [-x2, x1], one
        # half at a time into one output (no concatenated temporaries: on CPU a large fresh
        # temporary costs more than the arithmetic)
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        h = x1.shape[-1]
        torch.mul(x1, c, out=out[..., :h]).sub_(x2 * s)
        torch.mul(x2, c, out=out[..., h:]).add_(x1 * s)
        return out

    return rotate(q), rotate(k)


def qk_norm_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
    q_weight: torch.Tensor, k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor, eps: float,
    offset: bool = False, float32_weight: bool = False, *, norm=None, rope=None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per-head rms_norm of q and k (their weights, the form of ``offset`` / ``float32_weight``),
    then rotary_embedding; v (if given) normed with no weight. q: [T, Hq, D]; k, v: [T, Hk, D] or
    None (k None: q alone). Returns (q', k', v'), contiguous, None where not given. ``norm``,
    ``rope``: the rms_norm and rotary_embedding to compose (a kernel module's; default these)."""
    norm, rope = norm or rms_norm, rope or rotary_embedding

    def heads(x: torch.Tensor, w: torch.Tensor, **form) -> torch.Tensor:
        return norm(x.reshape(-1, x.shape[-1]), w, eps, **form).view(x.shape)

    form = dict(offset=offset, float32_weight=float32_weight)
    q = heads(q, q_weight, **form)
    if v is not None:  # no weight: the norm cast back
        v = heads(v, _unit_weight(v.shape[-1], v.dtype, v.device), float32_weight=True)
    if k is None:  # the rotation of q alone (a one-head slice of q stands in for k)
        return rotate_partial(rope, positions, q, q[:, :1], cos_sin_cache)[0], None, v
    q, k = rotate_partial(rope, positions, q, heads(k, k_weight, **form), cos_sin_cache)
    return q, k, v


@functools.lru_cache(maxsize=None)
def _unit_weight(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A norm's weight of ones (a weightless norm in the float32-weight form), made once."""
    return torch.ones(size, dtype=dtype, device=device)


def rotate_partial(rope, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope`` (a kernel module's rotary_embedding) on the first ``cos_sin_cache.shape[1]`` dims
    of each head of q and k (partial rotary), the rest passed through."""
    rd = cos_sin_cache.shape[1]
    if rd == q.shape[-1]:
        return rope(positions, q, k, cos_sin_cache)
    q_rot, k_rot = rope(positions, q[..., :rd].contiguous(), k[..., :rd].contiguous(), cos_sin_cache)
    return torch.cat([q_rot, q[..., rd:]], dim=-1), torch.cat([k_rot, k[..., rd:]], dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] -> silu(x[:, :I]) * x[:, I:], [T, I] in x's dtype."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]).mul_(x[..., inter:])  # in place: one [T, I] temporary, not two


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The activations fused_moe takes, named as in kernels.fused_moe (HF: "silu", "gelu_pytorch_tanh"),
# each act(gate) * up; "swigluoai" (gpt-oss's clamped SwiGLU) is gated on its own: _gated.
MOE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": _gelu_tanh}
MOE_GATED_ACTIVATIONS = (*MOE_ACTIVATIONS, "swigluoai")
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up in the inputs' dtype, act "silu", "gelu_tanh" or "sigmoid" (gated
    attention's output gate); gate, up: [T, I] or [T, H, I] (per head: taken as transformers
    takes them, the heads flattened into one contiguous row a token)."""
    act = torch.sigmoid if activation == "sigmoid" else MOE_ACTIVATIONS[activation]
    if gate.dim() == 3:
        return (act(gate.reshape(gate.shape[0], -1)) * up.reshape(up.shape[0], -1)).view(gate.shape)
    return act(gate) * up


def swigluoai(gate: torch.Tensor, up: torch.Tensor, alpha: float = SWIGLU_ALPHA,
              limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, transformers' ``GptOssExperts._apply_gate`` step for step (in the
    inputs' dtype): g = min(gate, limit), u = clamp(up, -limit, limit), (u + 1) * g * sigmoid(alpha g)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _gated(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """h [n, 2I] (gate columns, then up) -> the gated intermediate [n, I] in h's dtype."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "swigluoai":
        return swigluoai(gate, up, alpha, limit)
    return MOE_ACTIVATIONS[activation](gate) * up


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    config: dict | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_alpha: float = SWIGLU_ALPHA,
    swiglu_limit: float = SWIGLU_LIMIT,
    float32_weights: bool = False,
) -> torch.Tensor:
    """Mixture-of-experts MLP, HF transformers 5's ``Qwen3MoeExperts.forward`` step for step
    (``GptOssExperts.forward`` with biases and "swigluoai").

    x: [T, H]; w13: [E, 2*I, H] (rows [:I] gate, [I:] up); w2: [E, H, I]
    topk_weights: [T, K] float32; topk_ids: [T, K] int, expert ids (ids outside
    [0, E) contribute nothing, like HF's sentinel expert E)
    activation: "silu", "gelu_tanh" (act(gate) * up) or "swigluoai" (gpt-oss's clamped SwiGLU,
    ``swigluoai``: g = min(gate, swiglu_limit), u = clamp(up, -swiglu_limit, swiglu_limit),
    (u + 1) * g * sigmoid(swiglu_alpha * g)); ``config`` (the Triton kernel's tiles) changes nothing here.
    w13_bias: [E, 2I] (gate part, then up part), added to the gate/up projections before the
    activation; w2_bias: [E, H], added to each expert's down projection before the routing
    weight multiplies it (as gpt-oss does); both in x's dtype, any strides, or None.
    returns [T, H] in x's dtype:
    out[t] = sum_k w[t,k] * ((gated(x[t] W13^T + b13)) W2^T + b2), e = ids[t, k].

    For each expert hit, in ascending expert order: its (slot, token) pairs in
    HF's order (slot-major), one linear for gate and up together (then its bias), the
    activation and the product in x's dtype, the down projection (then its bias) times the
    routing weight cast to x's dtype, then ``index_add_`` into the output.
    The same order of operations as HF, so float32 results are equal bit for bit.
    ``float32_weights`` (Gemma 4, whose experts multiply by the float32 weight): each expert's
    output times the float32 routing weight in float32, rounded once to x's dtype, as
    transformers' ``Gemma4TextExperts`` does (16-bit results then equal its bit for bit too).

    float8_e4m3fn weights (W8A8; w13 and w2 both, with float32 scales as for
    ``kernels.fused_moe``: per channel w13_scale [E, 2I], w2_scale [E, H]; with
    ``block_size`` (bn, bk) [E, cdiv(2I, bn), cdiv(H, bk)], [E, cdiv(H, bn), cdiv(I, bk)]).
    The same loop, each hit expert e with its n pairs (token rows ``x_e = x[tokens]``)
    in these steps, g = bk with blocks, None per channel:

      1. ``q, s = fp8_quantize(x_e, g)`` (kernels.fp8_reference); ``a = q.float() * s``,
         s broadcast per row ([n, 1]) or expanded over its g columns (the last group cut at H)
      2. ``W13 = w13[e].float() * w13_scale[e]``, the scale per row ([2I, 1]) or each
         [bn, bk] block's (cut at 2I and H); ``W2`` likewise from w2[e], w2_scale[e]
      3. ``h = F.linear(a, W13)`` in float32, rounded to x's dtype (+ its bias); gate, up = h[:, :I], h[:, I:]
      4. ``inter = act(gate) * up`` in x's dtype (both ops rounded, as the 16-bit path)
      5. ``q, s = fp8_quantize(inter, g)``; ``b = q.float() * s`` as in step 1
      6. ``y = F.linear(b, W2)`` in float32, rounded to x's dtype (+ its bias), times the routing
         weight cast to x's dtype (a product in x's dtype)
      7. ``out.index_add_(0, tokens, y)`` in x's dtype, experts in ascending order
    Quantizing x per expert equals quantizing it once: scales are per token (and group).

    uint8 weights are MXFP4 (weight-only, kernels/mxfp4_reference.py): w13 [E, 2I, H/2] and
    w2 [E, H, I/2], two e2m1 codes a byte (the checkpoint's blocks flattened), with uint8 e8m0
    scales w13_scale [E, 2I, H/32], w2_scale [E, H, I/32] (H and I multiples of 32, no
    block_size). Each hit expert's weights are dequantized (exact, float32) and rounded to x's
    dtype, then run as 16-bit weights.
    """
    if activation not in MOE_GATED_ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {sorted(MOE_GATED_ACTIVATIONS)}, got {activation!r}")
    if w13.dtype == torch.uint8 or w2.dtype == torch.uint8:
        _check_mxfp4_moe_args(x, w13, w2, w13_scale, w2_scale, block_size)
        mxfp4, fp8 = True, False
    else:
        mxfp4, fp8 = False, _check_fp8_moe_args(w13, w2, w13_scale, w2_scale, block_size)
    if fp8:
        from kernels.fp8_reference import dequantize_fp8
    num_tokens = topk_ids.shape[0]
    num_experts = w13.shape[0]
    _check_moe_biases(w13_bias, w2_bias, num_experts, w13.shape[1], w2.shape[1], x.dtype)
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    weights = topk_weights.to(x.dtype)  # HF casts the routing weights to the model dtype
    # Pair j = k * T + t ([K, T] flattened, as HF's torch.where over the [K, T] mask):
    # a stable sort by expert keeps each expert's pairs in HF's (slot, token) order.
    ids = topk_ids.t().reshape(-1).long()  # [K*T]
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = torch.argsort(ids, stable=True)  # [K*T]
    counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts].tolist()  # the one host sync
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        token_idx, slot = pairs % num_tokens, pairs // num_tokens
        if fp8:
            group = None if block_size is None else block_size[1]
            w13_e = dequantize_fp8(w13[expert], w13_scale[expert], block_size)  # [2I, H] float32
            w2_e = dequantize_fp8(w2[expert], w2_scale[expert], block_size)  # [H, I] float32
            h = F.linear(_fp8_round_trip(x[token_idx], group), w13_e).to(x.dtype)
            if w13_bias is not None:
                h = h + w13_bias[expert]
            inter = _fp8_round_trip(_gated(h, activation, swiglu_alpha, swiglu_limit), group)
            y = F.linear(inter, w2_e).to(x.dtype)
        else:
            if mxfp4:
                w13_e = dequantize_mxfp4_packed(w13[expert], w13_scale[expert]).to(x.dtype)  # [2I, H]
                w2_e = dequantize_mxfp4_packed(w2[expert], w2_scale[expert]).to(x.dtype)  # [H, I]
            else:
                w13_e, w2_e = w13[expert], w2[expert]
            h = F.linear(x[token_idx], w13_e)
            if w13_bias is not None:
                h = h + w13_bias[expert]
            y = F.linear(_gated(h, activation, swiglu_alpha, swiglu_limit), w2_e)
        if w2_bias is not None:
            y = y + w2_bias[expert]
        if float32_weights:  # Gemma 4: the product in float32, rounded once
            out.index_add_(0, token_idx, (y * topk_weights[token_idx, slot, None]).to(x.dtype))
        else:
            out.index_add_(0, token_idx, y * weights[token_idx, slot, None])
    return out


def _check_moe_biases(w13_bias, w2_bias, num_experts: int, two_inter: int, hidden: int,
                      dtype: torch.dtype) -> None:
    for name, t, want in (("w13_bias", w13_bias, (num_experts, two_inter)), ("w2_bias", w2_bias, (num_experts, hidden))):
        if t is not None and (t.dtype != dtype or tuple(t.shape) != want):
            raise ValueError(f"fused_moe: {name} must be {dtype} {list(want)}, got {t.dtype} {list(t.shape)}")


def _check_mxfp4_moe_args(x, w13, w2, w13_scale, w2_scale, block_size) -> None:
    """ValueError unless w13, w2 and their scales are the MXFP4 layout for x's hidden size."""
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"fused_moe: w13 and w2 are both uint8 (MXFP4) or neither, got {w13.dtype} and {w2.dtype}")
    if block_size is not None:
        raise ValueError("fused_moe: block_size is for float8_e4m3fn weights, not MXFP4 (uint8)")
    num_experts, two_inter, hidden = w13.shape[0], w13.shape[1], x.shape[-1]
    inter = two_inter // 2
    if hidden % 32 or inter % 32 or two_inter % 2 or w13.shape[2] * 2 != hidden:
        raise ValueError(f"fused_moe: MXFP4 w13 must be [E, 2I, H/2] uint8 with H ({hidden}) and I multiples of 32, "
                         f"got {list(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, inter // 2):
        raise ValueError(f"fused_moe: MXFP4 w2 must be [E, H, I/2] = {[num_experts, hidden, inter // 2]}, "
                         f"got {list(w2.shape)}")
    for name, t, want in (("w13_scale", w13_scale, (num_experts, two_inter, hidden // 32)),
                          ("w2_scale", w2_scale, (num_experts, hidden, inter // 32))):
        if t is None or t.dtype != torch.uint8 or tuple(t.shape) != want:
            got = None if t is None else (t.dtype, tuple(t.shape))
            raise ValueError(f"fused_moe: {name} must be uint8 (e8m0) {list(want)} for MXFP4 weights, got {got}")


def _check_fp8_moe_args(w13, w2, w13_scale, w2_scale, block_size) -> bool:
    """Whether the experts are e4m3 (W8A8); ValueError on missing or misshapen scales."""
    fp8 = torch.float8_e4m3fn
    if w13.dtype != fp8 and w2.dtype != fp8:
        if w13_scale is not None or w2_scale is not None or block_size is not None:
            raise ValueError(f"fused_moe: w13_scale, w2_scale and block_size are for {fp8} weights")
        return False
    if w13.dtype != w2.dtype:
        raise ValueError(f"fused_moe: w13 and w2 are both {fp8} or neither, got {w13.dtype} and {w2.dtype}")
    num_experts, two_inter, hidden = w13.shape
    if block_size is None:
        want13, want2 = (num_experts, two_inter), (num_experts, hidden)
    else:
        bn, bk = block_size
        want13 = (num_experts, -(-two_inter // bn), -(-hidden // bk))
        want2 = (num_experts, -(-hidden // bn), -(-(two_inter // 2) // bk))
    for name, t, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
        if t is None or t.dtype != torch.float32 or tuple(t.shape) != want:
            got = None if t is None else (t.dtype, tuple(t.shape))
            raise ValueError(f"fused_moe: {name} must be float32 {list(want)} for block_size {block_size}, got {got}")
    return True


def _fp8_round_trip(a: torch.Tensor, group: int | None) -> torch.Tensor:
    """[M, C] -> q.float() * s for (q, s) = fp8_quantize(a, group): what the fp8 GEMM reads, in float32."""
    q, s = fp8_quantize(a, group)
    return dequantize_fp8(q, s, None if group is None else (1, group))


def moe_route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool, weight_dtype: torch.dtype,
              expert_counts: torch.Tensor | None = None, num_tokens: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' MoE routing: softmax in float32, top-k, renormalised when asked, the
    weights rounded to ``weight_dtype``; returns (weights [T, K] float32, ids [T, K] int64).
    ``expert_counts`` [E] int64 gains each routed (token, slot) of the tokens below
    ``num_tokens[0]`` (all when None)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_counts is not None:
        rows = torch.ones(ids.shape[0], dtype=torch.int64, device=ids.device)
        if num_tokens is not None:
            rows = (torch.arange(ids.shape[0], device=ids.device) < num_tokens.reshape(())).long()
        expert_counts.index_add_(0, ids.flatten(), rows.repeat_interleave(top_k))
    return weights.to(weight_dtype).float(), ids

