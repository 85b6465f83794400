"""Attention sinks (gpt-oss): a learned logit per query head that joins the softmax's
denominator and nothing else,

    out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink_h - m)),  m = max(max_j s_j, sink_h).

Every attention path (the reference, the compiled CPU attention, the Triton paged kernel
whole and split, the dense prefill kernel, alone and through ``paged_attention``'s
``new_k``/``new_v`` route) against that formula in float64, on paged batches of decode
rows, chunks over a cached prefix, fresh prompts, sliding windows and GQA. Each check
also asserts the result is far from the same formula with the sink dropped from the
denominator or counted twice (a split-K combine that adds it once per split counts it
several times). ``sinks=None`` runs the code that ran before, and a sink of -inf (no
weight) gives the kernels' sink-free results bit for bit. The attention layer's
``sinks`` parameter: float32, loaded split by query head, passed to the kernels."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.kernels._common import DEVICE, TOLERANCES
from tests.kernels.test_paged_attention import hidden_keys, make_batch
from tests.kernels.test_prefill_self_attention import new_kv

import kernels
from kernels import cpu_attention, prefill_attention, reference
from kernels.prefill_attention import PrefillConfig

# The dense prefill kernel's dtype: float32 under the interpreter, float16 on CUDA (where
# float32 keeps the paged kernel).
FP = torch.float16 if DEVICE == "cuda" else torch.float32
FP_TOL = TOLERANCES[FP][0]
SMALL = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)


def sink_attention(batch, sinks: torch.Tensor, window: int | None = None, sink_count: int = 1) -> torch.Tensor:
    """The formula above in float64, straight from the contiguous K/V; ``sink_count`` 0 drops
    the sink from the denominator, 2 counts it twice (the wrong answers)."""
    q = batch.q.double()
    out = torch.empty_like(q)
    group = q.shape[1] // batch.keys[0].shape[1]
    sink = sinks.double().view(-1, 1, 1)  # [Hq, 1, 1]
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        qb = q[starts[b]:starts[b + 1]]  # [L, Hq, D]
        if qb.shape[0] == 0:
            continue
        k = batch.keys[b].double().repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = batch.values[b].double().repeat_interleave(group, dim=1)
        s = torch.einsum("lhd,shd->hls", qb, k) * batch.scale  # [Hq, L, S]
        q_pos = torch.arange(seq_len - qb.shape[0], seq_len, device=q.device)
        s = s.masked_fill(hidden_keys(q_pos, seq_len, window), float("-inf"))
        m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
        p = (s - m).exp()
        den = p.sum(dim=-1, keepdim=True) + sink_count * (sink - m).exp()
        out[starts[b]:starts[b + 1]] = torch.einsum("hls,shd->lhd", p / den, v)
    return out


def check_sink_counted_once(got: torch.Tensor, batch, sinks, window=None, tol=2e-5, rows=None) -> None:
    """``got`` is the formula's answer, and far (> 10 x tol) from the answers with the sink
    dropped or doubled. ``rows``: a mask of the rows to compare (all by default)."""
    rows = slice(None) if rows is None else rows
    got = got[rows].double()
    want = sink_attention(batch, sinks, window)[rows]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for count, what in ((0, "dropped from the denominator"), (2, "counted twice")):
        wrong = sink_attention(batch, sinks, window, sink_count=count)[rows]
        assert (got - wrong).abs().max() > 10 * tol, f"indistinguishable from the sink {what}"


def make_sinks(num_q_heads: int, seed: int = 0) -> torch.Tensor:
    """Sinks about as heavy as the keys' softmax mass (~ log of a few dozen keys), one head
    far above every score and one far below (the softmax's max is the sink's, or a key's)."""
    gen = torch.Generator().manual_seed(seed)
    sinks = torch.randn(num_q_heads, generator=gen) + 2.5
    sinks[0] = 12.0
    if num_q_heads > 2:
        sinks[-1] = -15.0
    return sinks.to(DEVICE)


# (name, [(cached tokens, new tokens) per sequence], num_kv_heads, group, head_dim, block_size, window)
CASES = [
    ("decode_gqa", [(0, 1), (15, 1), (40, 1), (150, 1)], 2, 3, 16, 16, None),
    ("chunks_over_prefix", [(9, 13), (0, 7), (30, 1), (5, 20)], 1, 4, 32, 4, None),
    ("window_mixed", [(40, 1), (0, 9), (21, 12), (70, 1)], 2, 2, 16, 4, 6),
    ("mha_decode_window", [(3, 1), (90, 1), (33, 1)], 3, 1, 16, 8, 20),
]
IDS = [c[0] for c in CASES]


def _case(case, dtype=torch.float32, seed=0):
    _, seqs, num_kv_heads, group, head_dim, block_size, window = case
    batch = make_batch(seqs, num_kv_heads, group, head_dim, block_size, dtype, seed, sliding_window=window)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
            batch.scale)
    return batch, args, window, make_sinks(num_kv_heads * group, seed)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_matches_the_formula(case):
    batch, args, window, sinks = _case(case)
    got = reference.paged_attention(*args, sliding_window=window, sinks=sinks)
    check_sink_counted_once(got, batch, sinks, window, tol=1e-5)


def test_reference_decode_and_chunk_paths_agree():
    """A decode row takes the batched decode path beside other decode rows, the chunk path
    alone (one single-token row is not batched): the same sink either way."""
    batch, args, window, sinks = _case(CASES[0])
    batched = reference.paged_attention(*args, sinks=sinks)
    q, kc, vc, tables, starts, lens, scale = args
    one_row = torch.tensor([0, 1], dtype=torch.int32, device=q.device)
    for b in range(len(lens)):
        alone = reference.paged_attention(q[b:b + 1], kc, vc, tables[b:b + 1], one_row, lens[b:b + 1], scale,
                                          sinks=sinks)
        torch.testing.assert_close(alone[0], batched[b], atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def ext():
    cxx = os.environ.get("CXX", "c++").split()[0]
    if DEVICE != "cpu" or not any(os.access(os.path.join(d, cxx), os.X_OK) for d in os.get_exec_path()):
        pytest.skip("the compiled CPU attention needs the CPU and a C++ compiler")
    module = cpu_attention.extension()
    assert module is not None, f"the compiled CPU attention did not build: {cpu_attention.unavailable_reason()}"
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_attention_matches_the_formula(ext, case, dtype):
    batch, args, window, sinks = _case(case, dtype)
    got = cpu_attention.paged_attention(*args, sliding_window=window, sinks=sinks)
    check_sink_counted_once(got, batch, sinks, window, tol=TOLERANCES[dtype][0] if dtype != torch.float32 else 1e-5)
    want = reference.paged_attention(*args, sliding_window=window, sinks=sinks)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_cpu_attention_head_dims_of_every_loop(ext):
    """64 and 128 (their own loops), 80 (the run-time vector loop), 24 (the scalar loop);
    one long sequence split into an item per kv head."""
    for head_dim, seqs in ((64, [(20, 1), (7, 5)]), (128, [(30, 1), (0, 3)]), (80, [(11, 6)]), (24, [(300, 2)])):
        batch = make_batch(seqs, 2, 2, head_dim, 16, torch.float32, seed=head_dim)
        sinks = make_sinks(4, head_dim)
        args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                batch.scale)
        check_sink_counted_once(cpu_attention.paged_attention(*args, sinks=sinks), batch, sinks, tol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_triton_paged_matches_the_formula(case, num_splits):
    """Whole and split key ranges (three splits of a 150-key decode row each see keys: a
    sink added per split would count three times)."""
    batch, args, window, sinks = _case(case)
    got = kernels.paged_attention(*args, sliding_window=window, sinks=sinks, num_splits=num_splits)
    check_sink_counted_once(got, batch, sinks, window)


def test_triton_paged_fp16_matches_the_reference():
    batch, args, window, sinks = _case(CASES[2], torch.float16, seed=3)
    for splits in (1, 2):
        got = kernels.paged_attention(*args, sliding_window=window, sinks=sinks, num_splits=splits)
        want = reference.paged_attention(*args, sliding_window=window, sinks=sinks)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointers"])
def test_dense_prefill_kernel_matches_the_formula(use_tma):
    seqs = [(0, 37), (0, 5), (0, 20)]  # fresh prompts: the dense kernel's whole attention
    batch = make_batch(seqs, 2, 2, 64, 16, FP, seed=4)
    q, k, v = new_kv(batch, seqs, 4)
    batch.q = q
    sinks = make_sinks(4, 4)
    cfg = PrefillConfig(**{**SMALL.as_dict(), "use_tma": use_tma})
    got = prefill_attention.prefill_self_attention(q, k, v, batch.query_start_loc, batch.seq_lens, batch.scale,
                                                   config=cfg, sinks=sinks)
    check_sink_counted_once(got, batch, sinks, tol=FP_TOL)


def test_paged_attention_routes_fresh_prompts_to_the_dense_kernel_with_their_sinks(monkeypatch):
    """new_k/new_v: fresh prompts through the dense kernel, prefixes and decode rows through
    the paged one, each with the sinks."""
    calls = []
    real = prefill_attention.prefill_self_attention
    monkeypatch.setattr(prefill_attention, "prefill_self_attention",
                        lambda *a, **kw: calls.append(kw.get("sinks")) or real(*a, **kw))
    seqs = [(0, 21), (12, 9), (30, 1), (0, 6)]
    batch = make_batch(seqs, 1, 4, 64, 4, FP, seed=5)
    q, k, v = new_kv(batch, seqs, 4)
    batch.q = q
    sinks = make_sinks(4, 5)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale)
    got = kernels.paged_attention(*args, sinks=sinks, new_k=k, new_v=v, num_splits=1)
    assert len(calls) == 1 and calls[0] is sinks
    check_sink_counted_once(got, batch, sinks, tol=FP_TOL)


def test_no_sink_runs_the_code_without_sinks():
    """sinks=None is the call without them, bit for bit; a sink of -inf weighs nothing, and
    the kernels fold it in exactly (alpha = 1, + 0): their sink-free results bit for bit."""
    paths = [(reference.paged_attention, None), (kernels.paged_attention, 1), (kernels.paged_attention, 3)]
    if DEVICE == "cpu" and cpu_attention.extension() is not None:
        paths.append((cpu_attention.paged_attention, None))
    # a decode row and a chunk, a window
    batch, args, window, sinks = _case(("small", [(40, 1), (5, 6)], 1, 2, 16, 4, 6))
    none = torch.full_like(sinks, float("-inf"))
    for fn, splits in paths:
        plain = fn(*args, sliding_window=window, num_splits=splits)
        assert torch.equal(fn(*args, sliding_window=window, num_splits=splits, sinks=None), plain)
        weightless = fn(*args, sliding_window=window, num_splits=splits, sinks=none)
        if fn is reference.paged_attention:  # the softmax sums one more (zero) term: its own order
            torch.testing.assert_close(weightless, plain, atol=1e-6, rtol=1e-6)
        else:
            assert torch.equal(weightless, plain), fn
    seqs = [(0, 37), (0, 5)]
    batch = make_batch(seqs, 1, 2, 64, 16, FP, seed=4)
    q, k, v = new_kv(batch, seqs, 2)
    dense = [prefill_attention.prefill_self_attention(q, k, v, batch.query_start_loc, batch.seq_lens, batch.scale,
                                                      config=SMALL, **kw)
             for kw in ({}, {"sinks": None}, {"sinks": torch.full((2,), float("-inf"), device=q.device)})]
    assert torch.equal(dense[0], dense[1]) and torch.equal(dense[0], dense[2])


def test_rejects_bad_sinks():
    batch, args, window, sinks = _case(CASES[1])
    for bad, match in ((sinks.double(), "float32"), (sinks[:-1], r"\[num_q_heads\]"), (sinks[None], "num_q_heads"),
                       (torch.zeros(2 * len(sinks), device=sinks.device)[::2], "stride 1")):
        for fn in (reference.paged_attention, cpu_attention.paged_attention, kernels.paged_attention):
            with pytest.raises(ValueError, match=match):
                fn(*args, sinks=bad)


def test_attention_layer_loads_its_sinks_and_passes_them():
    """Attention(sinks=True): a float32 [this rank's heads] parameter that the model dtype
    cast leaves alone, loaded from the checkpoint's full [num_heads] by query head; attend()
    hands it to the kernels. o_bias=True gives o_proj a bias."""
    from engine.layers.attention import Attention, AttentionMetadata
    from engine.model_loader import cast_parameters
    from engine.parallel import Shard

    cfg = SimpleNamespace(head_dim=16, hidden_size=32, attention_bias=False, rms_norm_eps=1e-6)
    full = torch.arange(8, dtype=torch.bfloat16) - 3.5  # a checkpoint's sinks (gpt-oss stores bf16)
    for rank, size in ((0, 1), (1, 2)):
        layer = Attention(cfg, reference, Shard(rank, size, 8, 2, 64), None, None, sinks=True, o_bias=True)
        assert layer.sinks.shape == (8 // size,) and layer.o_proj.bias is not None
        cast_parameters(layer, torch.bfloat16)
        assert layer.sinks.dtype == torch.float32
        name = dict(layer.named_parameters())
        assert "sinks" in name and "o_proj.bias" in name
        layer.sinks.weight_loader(layer.sinks, full, None)
        lo = rank * 8 // size
        assert torch.equal(layer.sinks, full[lo:lo + 8 // size].float())
        assert layer.sinks.checkpoint_slice(None) == (None if size == 1 else (0, lo, lo + 4))
    assert Attention(cfg, reference, Shard(0, 1, 8, 2, 64), None, None).sinks is None

    layer = Attention(cfg, reference, Shard(0, 1, 4, 2, 64), None, None, sinks=True)
    layer.sinks.data.copy_(make_sinks(4, 6).cpu())
    seqs = [(5, 1), (0, 3)]
    batch = make_batch(seqs, 2, 2, 16, 4, torch.float32, seed=6)
    q, k, v = new_kv(batch, seqs, 4)
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    kv = torch.stack([batch.k_cache.cpu(), batch.v_cache.cpu()], dim=1)  # [blocks, 2, bs, H, D]
    slots = torch.full((1, q.shape[0]), -1, dtype=torch.int64)  # the cache already holds them
    meta = AttentionMetadata(slots, batch.block_tables.cpu()[None], batch.query_start_loc.cpu(),
                             batch.seq_lens.cpu())
    got = layer.attend(q, k, v, kv, meta)
    want = reference.paged_attention(q, kv[:, 0], kv[:, 1], batch.block_tables.cpu(), batch.query_start_loc.cpu(),
                                     batch.seq_lens.cpu(), layer.scale, sinks=layer.sinks)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    plain = reference.paged_attention(q, kv[:, 0], kv[:, 1], batch.block_tables.cpu(), batch.query_start_loc.cpu(),
                                      batch.seq_lens.cpu(), layer.scale)
    assert (got - plain).abs().max() > 1e-2
