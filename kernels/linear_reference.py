"""Gated DeltaNet (Qwen3-Next, Qwen3.5 linear attention) in PyTorch: the CPU path and the
oracle of the Triton kernels (``causal_conv1d.py``, ``gated_delta.py``).

A step's batch is varlen: the tokens of every sequence concatenated, sequence ``b`` owning
rows ``query_start_loc[b]:query_start_loc[b+1]`` (decode rows are sequences of one token).
Each sequence carries a recurrent state in a slot of a per-layer state tensor:
``state_slots[b]`` names it; ``has_initial_state[b]`` False means the sequence starts from
zeros and the slot's old contents are ignored (then overwritten). A negative slot (a padding
row) starts from zeros and writes no state. The state tensors are updated in place.

- ``causal_conv1d``: the depthwise causal short convolution (kernel K, 4 in Qwen3-Next) over
  q|k|v, its state the last K-1 inputs of each sequence; transformers' ``causal_conv1d_fn`` /
  ``causal_conv1d_update`` (F.conv1d, then the activation).
- ``gated_delta_rule``: transformers' ``torch_recurrent_gated_delta_rule`` per sequence;
  sequences of ``CHUNK_MIN_TOKENS`` tokens or more take the chunked form
  (``gated_delta_rule_chunked``, transformers' ``torch_chunk_gated_delta_rule`` algorithm),
  the rest the token loop (``gated_delta_rule_recurrent``), all sequences' i-th tokens at once.
- ``gated_rms_norm``: ``Qwen3NextRMSNormGated`` / ``Qwen3_5RMSNormGated`` (the two forwards
  are the same code in transformers 5.23).
- ``gdn_gating``: the layer's decay ``g`` and write strength ``beta`` from ``in_proj_ba``'s
  outputs, as the two families' ``GatedDeltaNet.forward`` computes them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64
CHUNK_MIN_TOKENS = 64  # a sequence this long or longer runs the chunked form in gated_delta_rule


def _rows(query_start_loc: torch.Tensor, state_slots: torch.Tensor, has_initial_state: torch.Tensor):
    """Per sequence (host lists): start, end, slot, whether it starts from the slot's state."""
    qsl = query_start_loc.tolist()
    slots = state_slots.tolist()
    init = has_initial_state.tolist()
    if not len(qsl) == len(slots) + 1 == len(init) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries for {len(slots)} state_slots and "
                         f"{len(init)} has_initial_state (need B+1, B, B)")
    return [(qsl[b], qsl[b + 1], slots[b], bool(init[b]) and slots[b] >= 0) for b in range(len(slots))]


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d over a varlen batch, with per-sequence state.

    x: [T, C]; weight: [C, K]; bias: [C] or None; conv_state: [num_slots, C, K-1] (updated in
    place: conv_state[state_slots[b]] becomes the last K-1 inputs of (initial state ++ sequence
    b's tokens), the initial state being zeros unless has_initial_state[b]);
    state_slots: [B] int; query_start_loc: [B+1] int; has_initial_state: [B] bool.
    Returns [T, C] in x's dtype: out[t] = act(bias + sum_j weight[:, j] * xpad[t + j]) with
    xpad = (K-1 state inputs) ++ tokens. The sum runs in float32 and is rounded to x's dtype,
    then the activation ("silu" or None) runs on that (in float32) and is rounded again, as
    transformers' F.conv1d in the model dtype followed by ACT2FN does.
    """
    if activation not in ("silu", None):
        raise ValueError(f"causal_conv1d: activation must be 'silu' or None, got {activation!r}")
    T, C = x.shape
    K = weight.shape[1]
    out = torch.empty_like(x)
    w = weight.float()
    for start, end, slot, init in _rows(query_start_loc, state_slots, has_initial_state):
        L = end - start
        if init:
            prev = conv_state[slot].float()  # [C, K-1]
        else:
            prev = torch.zeros(C, K - 1, dtype=torch.float32, device=x.device)
        xpad = torch.cat([prev, x[start:end].float().t()], dim=1)  # [C, K-1+L]
        acc = bias.float()[:, None].expand(C, L) if bias is not None else torch.zeros(C, L, device=x.device)
        for j in range(K):
            acc = acc + w[:, j:j + 1] * xpad[:, j:j + L]
        y = acc.t().to(x.dtype)
        if activation == "silu":
            y = _silu(y.float()).to(x.dtype)
        out[start:end] = y
        if slot >= 0 and K > 1:
            conv_state[slot] = xpad[:, xpad.shape[1] - (K - 1):].to(conv_state.dtype)
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm over the last dim: x * rsqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q, k, num_v_heads, scale, use_qk_l2norm):
    """q, k in float32, l2-normalised, expanded to the v heads (each q/k head serves
    Hv/Hk consecutive v heads), q scaled: transformers' order of operations. With
    scale None, q is divided by sqrt(Dk) as transformers does; else multiplied by scale."""
    Hk, Dk = k.shape[1], k.shape[2]
    if num_v_heads % Hk:
        raise ValueError(f"gated_delta_rule: {num_v_heads} v heads are not a multiple of {Hk} k heads")
    q, k = q.float(), k.float()
    if num_v_heads != Hk:
        q = q.repeat_interleave(num_v_heads // Hk, dim=1)
        k = k.repeat_interleave(num_v_heads // Hk, dim=1)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q / (Dk ** 0.5) if scale is None else q * scale
    return q, k


def _initial_states(ssm_state, rows, Hv, Dk, Dv, device):
    states = torch.zeros(len(rows), Hv, Dk, Dv, dtype=torch.float32, device=device)
    for i, (_, _, slot, init) in enumerate(rows):
        if init:
            states[i] = ssm_state[slot]
    return states


def _store_states(ssm_state, rows, states):
    for i, (_, _, slot, _) in enumerate(rows):
        if slot >= 0:
            ssm_state[slot] = states[i]


def _recurrent_rows(q, k, v, g, beta, rows, states, out):
    """The token loop of transformers' torch_recurrent_gated_delta_rule, the i-th tokens of
    every sequence in ``rows`` at once. q, k: [T, Hv, Dk] float32 (prepared); v: [T, Hv, Dv]
    float32; g, beta: [T, Hv] float32; states: [len(rows), Hv, Dk, Dv], advanced in place;
    out: [T, Hv, Dv] float32, written at the rows' tokens."""
    lengths = [end - start for start, end, _, _ in rows]
    for i in range(max(lengths, default=0)):
        active = [n for n, length in enumerate(lengths) if length > i]
        tok = torch.tensor([rows[n][0] + i for n in active], device=q.device)
        sel = torch.tensor(active, device=q.device)
        S = states[sel]  # [A, Hv, Dk, Dv]
        q_t, k_t, v_t = q[tok], k[tok], v[tok]
        S = S * g[tok].exp()[..., None, None]
        kv_mem = (S * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[tok].unsqueeze(-1)
        S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[tok] = (S * q_t.unsqueeze(-1)).sum(dim=-2)
        states[sel] = S


def _chunked_sequence(q, k, v, g, beta, state, chunk_size):
    """transformers' torch_chunk_gated_delta_rule for one sequence from ``state``.
    q, k: [L, Hv, Dk] float32 (prepared); v: [L, Hv, Dv]; g, beta: [L, Hv]; state:
    [Hv, Dk, Dv] float32. Returns (out [L, Hv, Dv] float32, final state)."""
    L = q.shape[0]
    pad = (chunk_size - L % chunk_size) % chunk_size
    # [Hv, L, ...], padded to whole chunks (padded tokens: k = v = beta = g = 0, no effect).
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.t(), (0, pad)) for x in (g, beta))
    Hv, n = q.shape[0], q.shape[1] // chunk_size
    q, k, v = (x.reshape(Hv, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(Hv, n, chunk_size) for x in (g, beta))
    gc = g.cumsum(dim=-1)  # log decay from the chunk's start to each token, inclusive
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [i, j]: i >= j
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    # (I + A) with A = strict lower part of beta_i k_i.k_j decay_ij (unitriangular ignores the diagonal).
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp().unsqueeze(-1)
    k_decayed = k * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    chunk_decay = gc[..., -1].exp()[..., None, None]
    out = torch.empty_like(u)
    S = state
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ S
        out[:, c] = q_decayed[:, c] @ S + attn[:, c] @ v_new
        S = S * chunk_decay[:, c] + k_decayed[:, c].transpose(-1, -2) @ v_new
    out = out.reshape(Hv, n * chunk_size, -1)[:, :L].transpose(0, 1)
    return out, S


def _check_delta_args(q, k, v, g, beta, ssm_state):
    T, Hk, Dk = k.shape
    Tv, Hv, Dv = v.shape
    if q.shape != k.shape or Tv != T or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"gated_delta_rule: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} (need q, k [T, Hk, Dk], v [T, Hv, Dv], "
                         "g, beta [T, Hv])")
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (Hv, Dk, Dv) or ssm_state.dtype != torch.float32:
        raise ValueError(f"gated_delta_rule: ssm_state must be float32 [num_slots, {Hv}, {Dk}, {Dv}], got "
                         f"{ssm_state.dtype} {tuple(ssm_state.shape)}")


def gated_delta_rule_recurrent(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state,
                               scale=None, use_qk_l2norm=True):
    """``gated_delta_rule`` by the token loop alone (its definition): transformers'
    torch_recurrent_gated_delta_rule, step for step, per sequence."""
    return _gated_delta(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale,
                        use_qk_l2norm, chunk_min_tokens=None)


def gated_delta_rule_chunked(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state,
                             scale=None, use_qk_l2norm=True, chunk_size=CHUNK_SIZE):
    """``gated_delta_rule`` by the chunked form alone, every sequence: transformers'
    torch_chunk_gated_delta_rule algorithm (a UT transform per chunk of ``chunk_size``
    tokens, then a scan over chunks) from each sequence's state. Equals the token loop to
    float32 rounding."""
    return _gated_delta(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale,
                        use_qk_l2norm, chunk_min_tokens=0, chunk_size=chunk_size)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    state_slots: torch.Tensor,
    query_start_loc: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """Gated delta rule over a varlen batch, with per-sequence recurrent state.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv], Hv a multiple of Hk (q/k head h serves v heads
    h*Hv/Hk .. (h+1)*Hv/Hk - 1); g: [T, Hv] log-space decay (float32); beta: [T, Hv];
    ssm_state: [num_slots, Hv, Dk, Dv] float32, updated in place to each sequence's state after
    its last token; state_slots: [B] int; query_start_loc: [B+1] int; has_initial_state: [B]
    bool. scale: default Dk ** -0.5 (q / sqrt(Dk)); use_qk_l2norm: l2-normalise q and k (eps
    1e-6) in float32 first. Per token, in float32 (transformers' torch_recurrent_gated_delta_rule):

        S = S * exp(g_t);  delta = beta_t * (v_t - k_t^T S);  S = S + k_t delta^T;  o_t = q_t^T S

    Returns o: [T, Hv, Dv] in v's dtype. Sequences of CHUNK_MIN_TOKENS tokens or more run the
    chunked form (same result to float32 rounding), the rest the token loop.
    """
    return _gated_delta(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale,
                        use_qk_l2norm, chunk_min_tokens=CHUNK_MIN_TOKENS)


def _gated_delta(q, k, v, g, beta, ssm_state, state_slots, query_start_loc, has_initial_state, scale,
                 use_qk_l2norm, chunk_min_tokens, chunk_size=CHUNK_SIZE):
    _check_delta_args(q, k, v, g, beta, ssm_state)
    T, Hv, Dv = v.shape
    Dk = k.shape[2]
    rows = _rows(query_start_loc, state_slots, has_initial_state)
    qf, kf = _prepare_qk(q, k, Hv, scale, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.zeros(T, Hv, Dv, dtype=torch.float32, device=v.device)
    states = _initial_states(ssm_state, rows, Hv, Dk, Dv, v.device)
    chunked = [n for n, (start, end, _, _) in enumerate(rows)
               if chunk_min_tokens is not None and end - start >= max(chunk_min_tokens, 1)]
    looped = sorted(set(range(len(rows))) - set(chunked))
    if looped:
        sel = torch.tensor(looped, device=v.device)
        sub = states[sel]
        _recurrent_rows(qf, kf, vf, gf, bf, [rows[n] for n in looped], sub, out)
        states[sel] = sub
    for n in chunked:
        start, end, _, _ = rows[n]
        out[start:end], states[n] = _chunked_sequence(qf[start:end], kf[start:end], vf[start:end], gf[start:end],
                                                      bf[start:end], states[n], chunk_size)
    _store_states(ssm_state, rows, states)
    return out.to(v.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNormGated / Qwen3_5RMSNormGated (identical forwards in transformers 5.23):
    normalise x in float32, cast back to x's dtype, multiply by the weight (torch's type
    promotion of weight and x's dtype: the model dtype when they match), then by
    silu(gate) in float32, and round once to x's dtype.

    x, gate: [T, D] (any leading dims work); weight: [D]. Returns x's shape and dtype.
    """
    dtype = x.dtype
    h = x.float()
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(gate.float())
    return h.to(dtype)


def gdn_gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, Hv]; A_log, dt_bias: [Hv]. Returns (g, beta): g = -exp(A_log) * softplus(a +
    dt_bias) in float32 (torch's softplus: the identity above 20), beta = sigmoid(b) in b's
    dtype."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()
