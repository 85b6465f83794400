"""Gated DeltaNet's ops (Qwen3-Next, Qwen3.5 linear attention): causal_conv1d,
gated_delta_rule, gated_rms_norm.

The references (kernels.linear_reference) against transformers' own functions and modules
and against independent float64 loops written here; the Triton launchers (kernels.causal_conv1d,
kernels.gated_delta) against the references, under the interpreter on CPU.
"""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels import linear_reference as ref
from tests.kernels._common import DEVICE, DTYPES
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

# kernels.causal_conv1d is the launcher (the package re-exports it), so the modules by name.
conv_kernels = importlib.import_module("kernels.causal_conv1d")
delta_kernels = importlib.import_module("kernels.gated_delta")

# Launcher vs reference, (atol, rtol) per dtype. 16-bit chunked dots run in TF32 on a GPU.
TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}
STATE_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (4e-3, 4e-3)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(lens, num_slots, init, gen, slots=None):
    """query_start_loc, distinct random state slots and has_initial_state for sequences of `lens` tokens."""
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    if slots is None:
        slots = torch.randperm(num_slots, generator=gen)[:len(lens)]
    return (qsl.to(DEVICE), torch.as_tensor(slots, dtype=torch.int32).to(DEVICE),
            torch.tensor(init, dtype=torch.bool).to(DEVICE))


def _state_args(lens, num_slots, init, gen, slots):
    """state_slots, query_start_loc, has_initial_state in the ops' argument order."""
    qsl, slots, init = _batch(lens, num_slots, init, gen, slots)
    return slots, qsl, init


# ---------------------------------------------------------------------------------------------
# causal_conv1d
# ---------------------------------------------------------------------------------------------


def _conv_inputs(lens, C, K, dtype, num_slots, seed, bias=True):
    gen = _gen(seed)
    T = sum(lens)
    x = torch.randn(T, C, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(C, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    b = torch.randn(C, generator=gen).to(dtype).to(DEVICE) if bias else None
    state = torch.randn(num_slots, C, K - 1, generator=gen).to(dtype).to(DEVICE)
    return x, w, b, state, gen


def _conv_oracle(x, w, bias, state, slots, qsl, init, activation):
    """Float64 loops over tokens and taps, per sequence: (out, {slot: new state})."""
    C, K = w.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    states = {}
    for b in range(len(slots)):
        s, e, slot = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
        prev = state[slot].double().cpu() if bool(init[b]) and slot >= 0 else torch.zeros(C, K - 1, dtype=torch.float64)
        inputs = [prev[:, j] for j in range(K - 1)] + [x[t].double().cpu() for t in range(s, e)]
        for i in range(e - s):
            acc = bias.double().cpu().clone() if bias is not None else torch.zeros(C, dtype=torch.float64)
            for j in range(K):
                acc += w[:, j].double().cpu() * inputs[i + j]
            out[s + i] = F.silu(acc) if activation == "silu" else acc
        if slot >= 0:
            states[slot] = torch.stack(inputs[len(inputs) - (K - 1):], dim=1)
    return out, states


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [True, False])
def test_conv_reference_matches_float64_loop(activation, bias):
    # Short sequences (1, 2 < K-1 = 3 tokens) with and without state, an empty one, a padding row.
    lens, K = [5, 1, 2, 9, 0, 2, 3], 4
    x, w, b, state, gen = _conv_inputs(lens, 6, K, torch.float32, 10, seed=1, bias=bias)
    init = [True, False, True, False, True, True, False]
    qsl, slots, init_t = _batch(lens, 10, init, gen)
    slots[5] = -1  # a padding row: starts from zeros, writes no state
    state[slots[[1, 3, 6]].long()] = float("nan")  # has_initial_state False: the slot's contents are never read
    before = state.clone()
    out = ref.causal_conv1d(x, w, b, state, slots, qsl, init_t, activation=activation)
    expect, new_states = _conv_oracle(x, w, b, before, slots, qsl, init_t, activation)
    torch.testing.assert_close(out.double().cpu(), expect, atol=1e-5, rtol=1e-5)
    for slot in range(10):
        if slot in new_states:
            torch.testing.assert_close(state[slot].double().cpu(), new_states[slot], atol=0, rtol=0)
        else:
            torch.testing.assert_close(state[slot], before[slot], atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_reference_matches_transformers(dtype):
    """transformers' causal_conv1d_update (cached steps: F.conv1d over state ++ tokens) and its
    causal_conv1d_fn (a fresh prompt: F.conv1d with K-1 zeros of padding)."""
    lens, C, K = [6, 1, 2, 11], 16, 4
    x, w, b, state, gen = _conv_inputs(lens, C, K, dtype, 6, seed=2)
    init = [True, True, False, False]
    qsl, slots, init_t = _batch(lens, 6, init, gen)
    new_state = state.clone()
    out = ref.causal_conv1d(x, w, b, new_state, slots, qsl, init_t)
    # F.conv1d sums the taps in its own order: float32 rounding apart, or one bfloat16 ulp.
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (8e-3, 8e-3)
    for i in range(len(lens)):
        s, e, slot = int(qsl[i]), int(qsl[i + 1]), int(slots[i])
        seq = x[s:e].t().unsqueeze(0)  # [1, C, L]
        hf_state = state[slot:slot + 1].clone() if init[i] else torch.zeros_like(state[slot:slot + 1])
        expect = hf_next.causal_conv1d_update(seq, hf_state, w, b, "silu")[0].t()
        torch.testing.assert_close(out[s:e], expect, atol=atol, rtol=rtol)
        torch.testing.assert_close(new_state[slot], hf_state[0], atol=0, rtol=0)
        if not init[i]:
            torch.testing.assert_close(out[s:e], hf_next.causal_conv1d_fn(seq, w, b, "silu")[0].t(), atol=atol,
                                       rtol=rtol)


@pytest.mark.parametrize("split", [1, 2, 3, 7])
def test_conv_state_continuation(split):
    """A sequence run in two calls (the second starting from the first's state) equals one call."""
    C, K, L = 5, 4, 10
    x, w, b, state, gen = _conv_inputs([L], C, K, torch.float32, 3, seed=3)
    one = state.clone()
    whole = ref.causal_conv1d(x, w, b, one, *_state_args([L], 3, [False], gen, slots=[1]))
    two = state.clone()
    first = ref.causal_conv1d(x[:split], w, b, two, *_state_args([split], 3, [False], gen, slots=[1]))
    second = ref.causal_conv1d(x[split:], w, b, two, *_state_args([L - split], 3, [True], gen, slots=[1]))
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(two, one, atol=0, rtol=0)


_CONV_CASES = [
    # (lens, C, K): decode-shaped, mixed prefill with several tiles and short/empty rows, K = 2, 3
    ([1, 1, 1, 1, 1], 40, 4),
    ([70, 1, 2, 0, 131, 3], 24, 4),
    ([4, 9, 1], 10, 3),
    ([3, 1], 7, 2),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,C,K", _CONV_CASES)
@pytest.mark.parametrize("activation,bias", [("silu", True), (None, False)])
def test_triton_causal_conv1d(dtype, lens, C, K, activation, bias):
    x, w, b, state, gen = _conv_inputs(lens, C, K, dtype, len(lens) + 3, seed=4)
    init = [i % 2 == 0 for i in range(len(lens))]
    qsl, slots, init_t = _batch(lens, len(lens) + 3, init, gen)
    if len(lens) > 2:
        slots[1] = -1
    wide = torch.randn(x.shape[0], C + 5, generator=gen).to(dtype).to(DEVICE)
    wide[:, 3:3 + C] = x
    xs = wide[:, 3:3 + C]  # a strided view, as a split of the fused projection is
    expect_state, got_state = state.clone(), state.clone()
    expect = ref.causal_conv1d(x, w, b, expect_state, slots, qsl, init_t, activation=activation)
    got = conv_kernels.causal_conv1d(xs, w, b, got_state, slots, qsl, init_t, activation=activation)
    assert got.dtype == dtype and got.shape == x.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, expect, atol=atol, rtol=rtol)
    torch.testing.assert_close(got_state, expect_state, atol=0, rtol=0)


def test_triton_conv_rejects_bad_arguments():
    x, w, b, state, gen = _conv_inputs([3], 8, 4, torch.float32, 2, seed=5)
    qsl, slots, init = _batch([3], 2, [True], gen)
    with pytest.raises(ValueError, match="conv_state"):
        conv_kernels.causal_conv1d(x, w, b, state[:, :, :2], slots, qsl, init)
    with pytest.raises(ValueError, match="has_initial_state"):
        conv_kernels.causal_conv1d(x, w, b, state, slots, qsl, init.int())
    with pytest.raises(ValueError, match="activation"):
        conv_kernels.causal_conv1d(x, w, b, state, slots, qsl, init, activation="gelu")


# ---------------------------------------------------------------------------------------------
# gated_delta_rule
# ---------------------------------------------------------------------------------------------


def _delta_inputs(lens, Hk, Hv, Dk, Dv, dtype, num_slots, seed, strong_decay=False):
    """Random q, k, v, g, beta as the model makes them (beta = sigmoid, g = -exp(A_log) * softplus)."""
    gen = _gen(seed)
    T = sum(lens)
    q = torch.randn(T, Hk, Dk, generator=gen)
    k = torch.randn(T, Hk, Dk, generator=gen)
    v = torch.randn(T, Hv, Dv, generator=gen)
    beta = torch.sigmoid(torch.randn(T, Hv, generator=gen))
    A = torch.empty(Hv).uniform_(1.0 if strong_decay else 0.01, 16.0 if strong_decay else 1.0, generator=gen)
    g = -A * F.softplus(torch.randn(T, Hv, generator=gen) - (0.0 if strong_decay else 2.0))
    state = torch.randn(num_slots, Hv, Dk, Dv, generator=gen) * 0.5
    to = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    return to(q), to(k), to(v), g.to(DEVICE), to(beta), state.to(DEVICE), gen


def _delta_oracle(q, k, v, g, beta, state, slots, qsl, init, scale=None, l2norm=True):
    """Float64, per sequence and v head, token by token, written with matrix products:
    S <- exp(g) S;  S <- S + beta k (v - S^T k)^T;  o = S^T (scale q). Head hv reads q/k head hv // (Hv/Hk)."""
    T, Hk, Dk = k.shape
    Hv = v.shape[1]
    group = Hv // Hk
    scale = Dk ** -0.5 if scale is None else scale
    out = torch.zeros(v.shape, dtype=torch.float64)
    states = {}
    for b in range(len(slots)):
        s, e, slot = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
        for hv in range(Hv):
            h = hv // group
            S = state[slot, hv].double().cpu() if bool(init[b]) and slot >= 0 else torch.zeros(Dk, v.shape[2],
                                                                                                 dtype=torch.float64)
            for t in range(s, e):
                qt, kt = q[t, h].double().cpu(), k[t, h].double().cpu()
                if l2norm:
                    qt, kt = qt / torch.sqrt(qt @ qt + 1e-6), kt / torch.sqrt(kt @ kt + 1e-6)
                S = S * torch.exp(g[t, hv].double().cpu())
                S = S + float(beta[t, hv]) * torch.outer(kt, v[t, hv].double().cpu() - S.t() @ kt)
                out[t, hv] = S.t() @ (scale * qt)
            if slot >= 0:
                states.setdefault(slot, torch.zeros(Hv, Dk, v.shape[2], dtype=torch.float64))[hv] = S
    return out, states


@pytest.mark.parametrize("form", ["dispatch", "recurrent", "chunked"])
@pytest.mark.parametrize("Hk,Hv", [(2, 2), (2, 4)])
def test_delta_reference_matches_float64_loop(form, Hk, Hv):
    # Mixed has_initial_state, sequences shorter and longer than a chunk (64), an empty one, a padding row.
    lens = [5, 70, 1, 0, 130, 2]
    fn = {"dispatch": ref.gated_delta_rule, "recurrent": ref.gated_delta_rule_recurrent,
          "chunked": ref.gated_delta_rule_chunked}[form]
    q, k, v, g, beta, state, gen = _delta_inputs(lens, Hk, Hv, 16, 8, torch.float32, 9, seed=6)
    init = [True, False, True, True, True, False]
    qsl, slots, init_t = _batch(lens, 9, init, gen)
    slots[5] = -1
    state[slots[[1]].long()] = float("nan")  # never read: has_initial_state False
    before = state.clone()
    out = fn(q, k, v, g, beta, state, slots, qsl, init_t)
    expect, new_states = _delta_oracle(q, k, v, g, beta, before, slots, qsl, init_t)
    assert out.dtype == v.dtype
    torch.testing.assert_close(out.double().cpu(), expect, atol=2e-5, rtol=2e-5)
    for slot in range(9):
        if slot in new_states:
            torch.testing.assert_close(state[slot].double().cpu(), new_states[slot], atol=2e-5, rtol=2e-5)
        else:
            torch.testing.assert_close(state[slot], before[slot], atol=0, rtol=0, equal_nan=True)


def test_delta_reference_scale_and_no_l2norm():
    lens = [7, 66]
    q, k, v, g, beta, state, gen = _delta_inputs(lens, 1, 2, 8, 8, torch.float32, 3, seed=7)
    q, k = q * 0.3, k * 0.3  # unnormalised keys keep the recurrence stable at this size
    for fn in (ref.gated_delta_rule_recurrent, ref.gated_delta_rule_chunked):
        qsl, slots, init = _batch(lens, 3, [True, True], gen, slots=[2, 0])
        new = state.clone()
        out = fn(q, k, v, g, beta, new, slots, qsl, init, scale=0.7, use_qk_l2norm=False)
        expect, states = _delta_oracle(q, k, v, g, beta, state, slots, qsl, init, scale=0.7, l2norm=False)
        torch.testing.assert_close(out.double().cpu(), expect, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(new[2].double().cpu(), states[2], atol=2e-5, rtol=2e-5)


def _hf_per_sequence(fn, q, k, v, g, beta, state, slots, qsl, init, **kw):
    if "repeat_interleave" not in inspect.getsource(fn):  # transformers before GQA support (5.17 had none)
        q = q.repeat_interleave(v.shape[1] // q.shape[1], dim=1)
        k = k.repeat_interleave(v.shape[1] // k.shape[1], dim=1)
    outs, states = [], {}
    for b in range(len(slots)):
        s, e, slot = int(qsl[b]), int(qsl[b + 1]), int(slots[b])
        h0 = state[slot:slot + 1].clone() if init[b] else None
        o, st = fn(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e], initial_state=h0,
                   output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
        outs.append(o[0])
        states[slot] = st[0]
    return torch.cat(outs), states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_reference_matches_transformers(dtype):
    """Per sequence: the token loop equals transformers' torch_recurrent_gated_delta_rule bit
    for bit; the chunked form equals its torch_chunk_gated_delta_rule to float32 rounding."""
    lens = [3, 1, 80, 64, 17]
    q, k, v, g, beta, state, gen = _delta_inputs(lens, 2, 4, 16, 8, dtype, 6, seed=8)
    init = [True, False, True, False, True]
    qsl, slots, init_t = _batch(lens, 6, init, gen)
    expect, hf_states = _hf_per_sequence(hf_next.torch_recurrent_gated_delta_rule, q, k, v, g, beta, state,
                                         slots, qsl, init)
    new = state.clone()
    out = ref.gated_delta_rule_recurrent(q, k, v, g, beta, new, slots, qsl, init_t)
    exact = 0.0 if DEVICE == "cpu" else 1e-6  # the same torch ops; on CUDA the reductions' order may differ
    torch.testing.assert_close(out, expect, atol=exact, rtol=exact)
    for slot, st in hf_states.items():
        torch.testing.assert_close(new[slot], st, atol=exact, rtol=exact)

    expect, hf_states = _hf_per_sequence(hf_next.torch_chunk_gated_delta_rule, q, k, v, g, beta, state,
                                         slots, qsl, init, chunk_size=64)
    new = state.clone()
    out = ref.gated_delta_rule_chunked(q, k, v, g, beta, new, slots, qsl, init_t)
    atol, rtol = (2e-5, 2e-5) if dtype == torch.float32 else (1.6e-2, 1.6e-2)  # one bf16 ulp
    torch.testing.assert_close(out, expect, atol=atol, rtol=rtol)
    for slot, st in hf_states.items():
        torch.testing.assert_close(new[slot], st, atol=2e-5, rtol=2e-5)
    # Qwen3.5 uses the same functions.
    assert hf_qwen3_5.torch_recurrent_gated_delta_rule.__code__.co_code == \
        hf_next.torch_recurrent_gated_delta_rule.__code__.co_code


@pytest.mark.parametrize("strong_decay", [False, True])
def test_delta_chunked_matches_loop(strong_decay):
    """The chunked form (any chunk size) against the token loop, decays up to the model's
    strongest (exp(g) underflowing within a chunk)."""
    lens = [200, 64, 65, 1, 130]
    q, k, v, g, beta, state, gen = _delta_inputs(lens, 2, 4, 16, 16, torch.float32, 5, seed=9,
                                                 strong_decay=strong_decay)
    qsl, slots, init = _batch(lens, 5, [True, False, True, True, False], gen)
    loop_state = state.clone()
    loop = ref.gated_delta_rule_recurrent(q, k, v, g, beta, loop_state, slots, qsl, init)
    for chunk in (16, 64):
        chunk_state = state.clone()
        out = ref.gated_delta_rule_chunked(q, k, v, g, beta, chunk_state, slots, qsl, init, chunk_size=chunk)
        torch.testing.assert_close(out, loop, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(chunk_state, loop_state, atol=2e-5, rtol=2e-5)


def test_delta_state_continuation():
    """A sequence run as a 70-token prefill (chunked), then 5 tokens, then one (decode) equals one call."""
    lens = [76]
    q, k, v, g, beta, state, gen = _delta_inputs(lens, 2, 4, 16, 8, torch.float32, 4, seed=10)
    whole_state = state.clone()
    whole = ref.gated_delta_rule(q, k, v, g, beta, whole_state, *_state_args(lens, 4, [True], gen, slots=[3]))
    parts_state = state.clone()
    outs = []
    for i, (s, e) in enumerate([(0, 70), (70, 75), (75, 76)]):
        outs.append(ref.gated_delta_rule(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], parts_state,
                                         *_state_args([e - s], 4, [True], gen, slots=[3])))
    torch.testing.assert_close(torch.cat(outs), whole, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(parts_state, whole_state, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(parts_state[[0, 1, 2]], state[[0, 1, 2]], atol=0, rtol=0)


_DELTA_CASES = [
    # (lens, Hk, Hv, Dk, Dv)
    ([1, 1, 1, 1], 2, 4, 16, 16),  # decode
    ([3, 1, 2], 1, 2, 32, 16),  # short rows (speculative)
    ([70, 1, 0, 65, 2], 2, 4, 16, 16),  # prefill chunks beside decode rows, a partial last chunk, an empty row
    ([130], 1, 1, 16, 32),
    pytest.param([1, 100, 3], 2, 4, 128, 128,
                 marks=pytest.mark.skipif(DEVICE != "cuda", reason="the model's head dims: CUDA only")),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,Hk,Hv,Dk,Dv", _DELTA_CASES)
@pytest.mark.parametrize("form", ["dispatch", "recurrent", "chunked"])
def test_triton_gated_delta_rule(dtype, lens, Hk, Hv, Dk, Dv, form):
    if form == "recurrent" and max(lens) > 64 and DEVICE == "cpu":
        pytest.skip("long sequences through the interpreted recurrent kernel are slow; the chunked form covers them")
    if DEVICE == "cpu" and form == "chunked" and len(lens) > 2 and max(lens) > 64:
        pytest.skip("the dispatching form runs these rows through the chunked kernels: once is enough in the "
                    "interpreter (CUDA runs both)")
    if DEVICE == "cpu" and dtype != torch.float32 and len(lens) > 2 and max(lens) > 64:
        pytest.skip("the interpreter's bfloat16 of several long rows is slow: float32 covers the chunked path on "
                    "the CPU, both dtypes on CUDA")
    fn = {"dispatch": delta_kernels.gated_delta_rule, "recurrent": delta_kernels.gated_delta_rule_recurrent,
          "chunked": delta_kernels.gated_delta_rule_chunked}[form]
    B = len(lens)
    q, k, v, g, beta, state, gen = _delta_inputs(lens, Hk, Hv, Dk, Dv, dtype, B + 2, seed=11)
    init = [i % 3 != 1 for i in range(B)]
    qsl, slots, init_t = _batch(lens, B + 2, init, gen)
    if B > 2:
        slots[2] = -1
    state[slots[[i for i in range(B) if not init[i]]].long()] = float("nan")
    # q, k, v as views of one [T, 2*Hk*Dk + Hv*Dv] tensor, as the model splits its convolved projection.
    T = sum(lens)
    fused = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=1)
    qv = fused[:, :Hk * Dk].view(T, Hk, Dk)
    kv = fused[:, Hk * Dk:2 * Hk * Dk].view(T, Hk, Dk)
    vv = fused[:, 2 * Hk * Dk:].view(T, Hv, Dv)
    expect_state, got_state = state.clone(), state.clone()
    expect = ref.gated_delta_rule(q, k, v, g, beta, expect_state, slots, qsl, init_t)
    got = fn(qv, kv, vv, g, beta, got_state, slots, qsl, init_t)
    assert got.dtype == dtype and got.shape == v.shape
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, expect, atol=atol, rtol=rtol)
    atol, rtol = STATE_TOL[dtype]
    torch.testing.assert_close(got_state, expect_state, atol=atol, rtol=rtol, equal_nan=True)


def test_triton_gated_delta_scale_no_l2norm_and_continuation():
    lens = [70]
    q, k, v, g, beta, state, gen = _delta_inputs(lens, 1, 2, 16, 16, torch.float32, 2, seed=12)
    q, k = q * 0.3, k * 0.3
    expect_state = state.clone()
    expect = ref.gated_delta_rule(q, k, v, g, beta, expect_state, *_state_args(lens, 2, [True], gen, slots=[1]),
                                  scale=0.5, use_qk_l2norm=False)
    got_state = state.clone()
    outs = []
    parts = [(0, 66, delta_kernels.gated_delta_rule_chunked), (66, 70, delta_kernels.gated_delta_rule_recurrent)]
    for s, e, fn in parts:
        outs.append(fn(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], got_state,
                       *_state_args([e - s], 2, [True], gen, slots=[1]), scale=0.5, use_qk_l2norm=False))
    torch.testing.assert_close(torch.cat(outs), expect, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(got_state, expect_state, atol=5e-5, rtol=5e-5)


def test_triton_delta_dispatch_and_checks():
    # The chunked kernels are launched when a sequence of 64 tokens fits the batch (each sequence has a token).
    assert not delta_kernels.launches_chunked(1, 1)
    assert not delta_kernels.launches_chunked(128, 128)  # decode
    assert not delta_kernels.launches_chunked(190, 128)  # no room for 64 tokens beside 127 rows
    assert not delta_kernels.launches_chunked(63, 1)
    assert delta_kernels.launches_chunked(64, 1)
    assert delta_kernels.launches_chunked(8192, 1)
    assert delta_kernels.launches_chunked(96, 33)  # a 64-token prefill beside 32 decode rows
    q, k, v, g, beta, state, gen = _delta_inputs([3], 2, 3, 16, 16, torch.float32, 2, seed=13)
    qsl, slots, init = _batch([3], 2, [True], gen)
    with pytest.raises(ValueError, match="multiple"):
        delta_kernels.gated_delta_rule(q, k, v, g[:, :3], beta[:, :3], state, slots, qsl, init)
    q, k, v, g, beta, state, gen = _delta_inputs([3], 2, 4, 16, 16, torch.float32, 2, seed=13)
    with pytest.raises(ValueError, match="float32"):
        delta_kernels.gated_delta_rule(q, k, v, g, beta, state.half(), slots, qsl, init)


# ---------------------------------------------------------------------------------------------
# gated_rms_norm
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("module", [hf_next.Qwen3NextRMSNormGated, hf_qwen3_5.Qwen3_5RMSNormGated])
def test_gated_rms_norm_reference_matches_transformers(dtype, module):
    gen = _gen(14)
    x = torch.randn(23, 32, generator=gen).to(dtype)
    gate = torch.randn(23, 32, generator=gen).to(dtype)
    norm = module(32, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=gen))
        expect = norm(x, gate)
    got = ref.gated_rms_norm(x, gate, norm.weight.detach(), 1e-6)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expect, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_float32", [False, True])
def test_triton_gated_rms_norm(dtype, weight_float32):
    gen = _gen(15)
    x2 = torch.randn(27, 40, generator=gen).to(dtype).to(DEVICE)[:, 5:37]  # rows strided
    gate2 = torch.randn(27, 32, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(32, generator=gen).to(torch.float32 if weight_float32 else dtype).to(DEVICE)
    x, gate = x2.reshape(9, 3, 32), gate2.view(9, 3, 32)
    expect = ref.gated_rms_norm(x2, gate2, weight, 1e-6)
    got = delta_kernels.gated_rms_norm(x2, gate2, weight, 1e-6)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, expect, atol=atol, rtol=rtol)
    torch.testing.assert_close(delta_kernels.gated_rms_norm(x, gate, weight, 1e-6), expect.view(9, 3, 32),
                               atol=atol, rtol=rtol)
    # [T, H, D] read where it lies: the gate a view of a wider GEMM output (token stride 116,
    # head stride 32), x with heads 40 apart; neither flattens to rows without a copy.
    wide = torch.randn(9, 116, generator=gen).to(dtype).to(DEVICE)
    gate3 = wide[:, 7:7 + 96].view(9, 3, 32)
    x3 = torch.randn(9, 3, 40, generator=gen).to(dtype).to(DEVICE)[..., 3:35]
    got = delta_kernels.gated_rms_norm(x3, gate3, weight, 1e-6)
    assert got.is_contiguous() and got.shape == (9, 3, 32)
    torch.testing.assert_close(got, ref.gated_rms_norm(x3, gate3, weight, 1e-6), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------------
# gdn_gating
# ---------------------------------------------------------------------------------------------


def test_gdn_gating_reference_is_the_layers_formula_in_float64():
    """g = -exp(A_log) * softplus(a + dt_bias) (identity above 20), beta = sigmoid(b)."""
    gen = _gen(16)
    a = torch.randn(11, 6, generator=gen) * 12  # past the softplus threshold both ways
    a[0, :2] = torch.tensor([100.0, -100.0])  # exp would overflow / underflow
    b, a_log, dt = (torch.randn(11, 6, generator=gen), torch.randn(6, generator=gen), torch.randn(6, generator=gen))
    g, beta = ref.gdn_gating(a, b, a_log, dt)
    x = a.double() + dt.double()
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(g.double(), -a_log.double().exp() * softplus, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta.double(), torch.sigmoid(b.double()), atol=1e-6, rtol=1e-6)
    assert g.dtype == torch.float32 and beta.dtype == b.dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads", [(1, 32), (5, 6), (70, 48)])
def test_triton_gdn_gating(dtype, rows, heads):
    gen = _gen(17)
    ba = torch.randn(rows, 2 * heads + 3, generator=gen) * 8
    ba[0, heads:heads + 2] = torch.tensor([100.0, -100.0])  # a far past the softplus threshold both ways
    ba = ba.to(dtype).to(DEVICE)  # strided rows
    b, a = ba[:, :heads], ba[:, heads:2 * heads]
    a_log = torch.randn(heads, generator=gen).to(DEVICE)  # float32, as checkpoints keep it
    dt = torch.randn(heads, generator=gen).to(dtype).to(DEVICE)
    g, beta = delta_kernels.gdn_gating(a, b, a_log, dt)
    want_g, want_beta = ref.gdn_gating(a, b, a_log, dt)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.is_contiguous() and beta.is_contiguous()
    torch.testing.assert_close(g, want_g, atol=2e-5, rtol=2e-5)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(beta, want_beta, atol=atol, rtol=rtol)
    with pytest.raises(ValueError, match="one \\[T, Hv\\] shape"):
        delta_kernels.gdn_gating(a, b[:, :-1], a_log, dt)


def test_namespaces():
    """The model calls ops.<name>: Triton launchers in kernels, references in kernels.reference."""
    assert kernels.causal_conv1d is conv_kernels.causal_conv1d
    assert kernels.gated_delta_rule is delta_kernels.gated_delta_rule
    assert kernels.gated_rms_norm is delta_kernels.gated_rms_norm
    assert kernels.gdn_gating is delta_kernels.gdn_gating
    assert kernels.reference.causal_conv1d is ref.causal_conv1d
    assert kernels.reference.gated_delta_rule is ref.gated_delta_rule
    assert kernels.reference.gated_rms_norm is ref.gated_rms_norm
    assert kernels.reference.gdn_gating is ref.gdn_gating
