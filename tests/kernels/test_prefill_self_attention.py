"""The dense prefill self-attention (kernels/prefill_attention.py) against the reference.

Batches of several sequences of random lengths, GQA, the new K/V given as views of a
fused [T, Hq + 2 Hkv, D] projection output (as the engine's attention layer has them)
and stored in a paged cache whose unowned blocks are NaN. Under the interpreter
(CPU) float32 and float16 run, through the TMA descriptors (which the interpreter
emulates) and through the pointer loads; on CUDA bf16 and fp16 add the model's shape.
Sequences with a cached prefix (and decode rows) must come out of the paged kernel;
windows and FP8 caches must not take the new path at all.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES
from tests.kernels.test_paged_attention import make_batch

import kernels
from kernels import prefill_attention, reference
from kernels.prefill_attention import PrefillConfig

# The dtype of the tests below: float32 under the interpreter, float16 on CUDA (where float32
# keeps the paged kernel).
FP = torch.float16 if DEVICE == "cuda" else torch.float32
FP_TOL = TOLERANCES[FP][0]
# Small tiles keep the interpreter quick and put many tiles (and sequence edges) in a batch.
SMALL = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
SMALL_WIDE_N = PrefillConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)  # BLOCK_N > BLOCK_M


def new_kv(batch, seqs, num_q_heads: int):
    """This step's K/V ([T, Hkv, D] views of one fused qkv buffer, q copied in too),
    the same values the cache holds for the new tokens."""
    k = torch.cat([batch.keys[b][ctx:] for b, (ctx, _) in enumerate(seqs)])
    v = torch.cat([batch.values[b][ctx:] for b, (ctx, _) in enumerate(seqs)])
    hkv = k.shape[1]
    fused = torch.empty(k.shape[0], num_q_heads + 2 * hkv, k.shape[2], dtype=k.dtype, device=k.device)
    fused[:, :num_q_heads], fused[:, num_q_heads:num_q_heads + hkv], fused[:, num_q_heads + hkv:] = batch.q, k, v
    return fused[:, :num_q_heads], fused[:, num_q_heads:num_q_heads + hkv], fused[:, num_q_heads + hkv:]


def random_case(seed: int, *, prefixes: bool, max_len: int = 150):
    rng = random.Random(seed)
    num_seqs = rng.randint(2, 5)
    seqs = []
    for _ in range(num_seqs):
        ctx = rng.choice([0, 0, rng.randint(1, 70)]) if prefixes else 0
        q_len = rng.choice([1, rng.randint(2, max_len)])
        seqs.append((ctx, q_len))
    if prefixes:
        seqs.append((rng.randint(1, 40), 1))  # a decode row
        seqs.append((0, rng.randint(2, 40)))  # at least one sequence with no prefix
    rng.shuffle(seqs)
    num_kv_heads, group = rng.choice([(1, 4), (2, 2), (2, 1), (1, 3)])
    head_dim = rng.choice([64, 128])
    block_size = rng.choice([4, 16])
    return seqs, num_kv_heads, group, head_dim, block_size


def run_case(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed, **kw):
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed=seed)
    q, k, v = new_kv(batch, seqs, num_kv_heads * group)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens)
    want = reference.paged_attention(*args, batch.scale)
    return batch, (q, k, v), args, want


# float32 runs under the interpreter only (on CUDA it keeps the paged kernel); bfloat16 on CUDA only.
KERNEL_DTYPES = [pytest.param(torch.float32, marks=pytest.mark.skipif(DEVICE == "cuda", reason="CPU only")),
                 torch.float16,
                 pytest.param(torch.bfloat16, marks=pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA"))]


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("config", [SMALL, SMALL_WIDE_N, None], ids=["32x16", "16x32", "default"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dense_kernel_matches_reference(seed, dtype, config, use_tma):
    seqs, hkv, group, d, bs = random_case(seed, prefixes=False)
    batch, (q, k, v), args, want = run_case(seqs, hkv, group, d, bs, dtype, seed)
    cfg = prefill_attention.default_config(dtype, d) if config is None else config
    cfg = PrefillConfig(**{**cfg.as_dict(), "use_tma": use_tma})
    got = prefill_attention.prefill_self_attention(q, k, v, batch.query_start_loc, batch.seq_lens, batch.scale,
                                                   config=cfg)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("seed", [2, 3, 4])
def test_paged_attention_with_new_kv_matches_reference(seed, dtype):
    """Through the engine's entry point: fresh sequences, prefixes, decode rows in one step."""
    seqs, hkv, group, d, bs = random_case(seed, prefixes=True)
    batch, (q, k, v), args, want = run_case(seqs, hkv, group, d, bs, dtype, seed)
    got = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_only_fresh_rows_are_written_and_the_paged_kernel_skips_them():
    seqs = [(0, 37), (20, 9), (0, 1), (33, 1), (0, 70)]
    batch, (q, k, v), args, want = run_case(seqs, 2, 2, 64, 16, FP, seed=5)
    out = torch.full_like(q, float("nan"))
    prefill_attention.prefill_self_attention(q, k, v, batch.query_start_loc, batch.seq_lens, batch.scale,
                                             out=out, config=SMALL)
    starts = batch.query_start_loc.tolist()
    for b, (ctx, _) in enumerate(seqs):
        rows = out[starts[b]:starts[b + 1]]
        if ctx:
            assert rows.isnan().all(), f"sequence {b} has a prefix: its rows are the paged kernel's"
        else:
            torch.testing.assert_close(rows, want[starts[b]:starts[b + 1]], atol=FP_TOL, rtol=FP_TOL)
    # and the whole step, both kernels: equal to the paged kernel alone up to rounding
    alone = kernels.paged_attention(*args, batch.scale)
    both = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v)
    torch.testing.assert_close(both, alone, atol=FP_TOL, rtol=FP_TOL)
    torch.testing.assert_close(both, want, atol=FP_TOL, rtol=FP_TOL)


def test_windows_splits_and_decode_batches_keep_the_paged_kernel(monkeypatch):
    calls = []
    real = prefill_attention.prefill_self_attention
    monkeypatch.setattr(prefill_attention, "prefill_self_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seqs = [(0, 20), (0, 9)]
    batch, (q, k, v), args, want = run_case(seqs, 1, 2, 64, 4, FP, seed=6)
    for kw in ({"sliding_window": 8}, {"num_splits": 2}):
        got = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v, **kw)
        torch.testing.assert_close(got, kernels.paged_attention(*args, batch.scale, **kw), atol=0, rtol=0)
    assert not calls
    decode = [(5, 1), (0, 1), (9, 1)]
    d_batch, (d_q, d_k, d_v), d_args, d_want = run_case(decode, 1, 2, 64, 4, FP, seed=7)
    got = kernels.paged_attention(*d_args, d_batch.scale, new_k=d_k, new_v=d_v)
    torch.testing.assert_close(got, d_want, atol=FP_TOL, rtol=FP_TOL)
    assert not calls
    kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v, num_splits=1)
    assert calls  # the same prefill without a window or splits does take it


def test_fp8_cache_keeps_the_paged_kernel():
    seqs = [(0, 20), (3, 9)]
    batch, (q, k, v), args, want = run_case(seqs, 1, 2, 64, 4, torch.float16, seed=8)
    k8 = (batch.k_cache.float() / 0.5).to(torch.float8_e4m3fn)
    v8 = (batch.v_cache.float() / 0.25).to(torch.float8_e4m3fn)
    fp8_args = (q, k8, v8, *args[3:])
    kw = dict(k_scale=0.5, v_scale=0.25)
    got = kernels.paged_attention(*fp8_args, batch.scale, new_k=k, new_v=v, **kw)
    alone = kernels.paged_attention(*fp8_args, batch.scale, **kw)
    assert torch.equal(got.nan_to_num(), alone.nan_to_num())


def test_unsupported_head_dims_fall_back():
    seqs = [(0, 20), (0, 9)]
    batch, (q, k, v), args, want = run_case(seqs, 1, 2, 32, 4, FP, seed=9)
    assert not prefill_attention.supports(q, k, v)
    got = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v)
    torch.testing.assert_close(got, want, atol=FP_TOL, rtol=FP_TOL)


def test_rejects_new_kv_of_the_wrong_shape():
    seqs = [(0, 20), (0, 9)]
    batch, (q, k, v), args, want = run_case(seqs, 1, 2, 64, 4, FP, seed=10)
    with pytest.raises(ValueError):
        kernels.paged_attention(*args, batch.scale, new_k=k[:-1], new_v=v[:-1])


# ---- on the GPU: the model's shape, bf16 and fp16, the default (TMA, pipelined) tiles ----

GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("prefixes", [False, True], ids=["fresh", "with_prefixes"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_model_shape_matches_reference(seed, prefixes, dtype):
    rng = random.Random(seed)
    seqs = [(rng.choice([0, rng.randint(1, 3000)]) if prefixes else 0, rng.randint(1, 1500)) for _ in range(5)]
    seqs += [(0, 2048)] + ([(700, 1)] if prefixes else [])
    batch, (q, k, v), args, want = run_case(seqs, 8, 4, 128, 16, dtype, seed)
    got = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    dense = prefill_attention.prefill_self_attention(q, k, v, batch.query_start_loc, batch.seq_lens, batch.scale,
                                                     config=PrefillConfig(use_tma=False))
    fresh = torch.tensor([ctx == 0 for ctx, n in seqs for _ in range(n)], device=q.device)
    torch.testing.assert_close(dense[fresh], want[fresh], atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_random_batches_match_reference(dtype, head_dim):
    for seed in range(3):
        seqs, hkv, group, _, bs = random_case(seed, prefixes=seed > 0, max_len=600)
        batch, (q, k, v), args, want = run_case(seqs, hkv, group, head_dim, bs, dtype, seed)
        got = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_gpu_graph_capture_keeps_the_paged_kernel(monkeypatch):
    """Inside a CUDA-graph capture (multi-token speculative decode graphs) the dense path
    is not taken: the captured step is the one it was before."""
    calls = []
    real = prefill_attention.prefill_self_attention
    monkeypatch.setattr(prefill_attention, "prefill_self_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    seqs = [(0, 40), (30, 4)]
    batch, (q, k, v), args, want = run_case(seqs, 8, 4, 128, 16, torch.bfloat16, seed=3)
    kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v, num_splits=1)  # compiled outside the capture
    calls.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.paged_attention(*args, batch.scale, new_k=k, new_v=v, num_splits=1)
    graph.replay()
    torch.cuda.synchronize()
    assert not calls
    torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="compiles for CUDA")
def test_gpu_after_warm_up_no_prefill_step_compiles():
    import logging

    from kernels import compiles
    from kernels.paged_attention import warm_up

    dev = torch.device("cuda")
    heads, kv_heads, d, bs = 24, 6, 128, 16  # a shape no other test compiles
    warm_up(torch.bfloat16, heads, kv_heads, d, bs, dev)
    compiles.watch(logging.getLogger("pdserve-test"))
    n = compiles.count
    cache = torch.randn(80, bs, kv_heads, d, dtype=torch.bfloat16, device=dev)
    for tokens, ctxs in ((9, [0, 0]), (130, [0, 40, 0]), (700, [0]), (300, [5, 0, 1])):
        seqs = len(ctxs)
        starts = torch.linspace(0, tokens, seqs + 1).round().to(torch.int32)
        lens = (starts[1:] - starts[:-1]) + torch.tensor(ctxs, dtype=torch.int32)
        tables = torch.randint(0, 80, (seqs, 80), dtype=torch.int32, device=dev)
        fused = torch.randn(tokens, heads + 2 * kv_heads, d, dtype=torch.bfloat16, device=dev)
        q, k, v = fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]
        kernels.paged_attention(q, cache, cache, tables, starts.to(dev), lens.to(dev), d ** -0.5, new_k=k, new_v=v)
    torch.cuda.synchronize()
    assert compiles.count == n
