"""Multi-LoRA shrink/expand: lora_group's ordering, the Triton launchers against the
references (mixed slots with rows of no adapter, one slot, none, decode and prefill
batches, stacked parts of unequal widths, ranks 8/12/16/80, split K, strided views,
argument checks), and the references against a float64 loop over rows that reads
each row's slot from token_slots directly."""
from __future__ import annotations

import importlib
import re

import pytest
import torch

from tests.kernels._common import DEVICE, DTYPES, TOLERANCES

import kernels
from kernels import reference

lora = importlib.import_module("kernels.lora")

T_TOL = (2e-5, 2e-5)  # t is float32 in every dtype (16-bit products are exact in float32)


def make_slots(num_tokens: int, num_slots: int, pattern: str, seed: int) -> torch.Tensor:
    """[T] int32: "mixed" random slots in [-1, S) (at least one -1 and one slot 0 when T > 2),
    "one" every row slot S - 1, "none" every row -1."""
    gen = torch.Generator().manual_seed(seed)
    if pattern == "one":
        return torch.full((num_tokens,), num_slots - 1, dtype=torch.int32)
    if pattern == "none":
        return torch.full((num_tokens,), -1, dtype=torch.int32)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    if num_tokens > 2:
        slots[torch.randperm(num_tokens, generator=gen)[:2]] = torch.tensor([-1, 0], dtype=torch.int32)
    return slots


def make_inputs(num_tokens, k, num_slots, rank, widths, pattern, dtype, seed):
    """x, lora_a [S, P*R, K], lora_b [S, N, R], y, part_offsets, token_slots, of order-one values."""
    gen = torch.Generator().manual_seed(seed)
    parts, n = len(widths), sum(widths)
    offsets = tuple(sum(widths[:p]) for p in range(parts + 1))

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    return dict(
        x=rand(num_tokens, k),
        lora_a=rand(num_slots, parts * rank, k, scale=k ** -0.5),
        lora_b=rand(num_slots, n, rank, scale=rank ** -0.5),
        y=rand(num_tokens, n),
        part_offsets=offsets,
        token_slots=make_slots(num_tokens, num_slots, pattern, seed).to(DEVICE),
    )


def run_pair(mod, inp, y=None):
    """(t, y after the expand) from one module's lora_group, lora_shrink and lora_expand."""
    num_slots = inp["lora_a"].shape[0]
    slots = inp["token_slots"]
    sorted_ids, slot_starts = mod.lora_group(slots, num_slots)
    t = mod.lora_shrink(inp["x"], inp["lora_a"], slots, sorted_ids, slot_starts)
    y = inp["y"].clone() if y is None else y
    mod.lora_expand(y, t, inp["lora_b"], slots, sorted_ids, slot_starts, inp["part_offsets"])
    return t, y


def naive(inp):
    """float64, one row at a time, slots read from token_slots: (t [T, P*R], y + delta rounded)."""
    x, a, b, y = (inp[n].cpu().double() for n in ("x", "lora_a", "lora_b", "y"))
    offsets, rank = inp["part_offsets"], b.shape[2]
    t = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float64)
    out = y.clone()
    for i, s in enumerate(inp["token_slots"].tolist()):
        if s < 0:
            continue
        t[i] = a[s] @ x[i]
        for p in range(len(offsets) - 1):
            c0, c1 = offsets[p], offsets[p + 1]
            out[i, c0:c1] += b[s, c0:c1] @ t[i, p * rank:(p + 1) * rank]
    return t, out.to(inp["y"].dtype)


def assert_close(got, want, tol):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol[0], rtol=tol[1])


# (name, T, K, S, R, part widths, slot pattern)
CASES = [
    ("decode", 1, 64, 4, 16, (64,), "mixed"),
    ("decode_no_adapter", 1, 64, 4, 16, (64,), "none"),
    ("mixed_r8", 37, 48, 4, 8, (48,), "mixed"),
    ("prefill_qkv_gqa", 100, 64, 3, 16, (64, 16, 16), "mixed"),
    ("one_slot_r12_qkv_k40", 20, 40, 4, 12, (64, 16, 16), "one"),
    ("all_none_qkv", 9, 32, 2, 8, (32, 16, 16), "none"),
    ("gate_up_one_slot_table_r12", 33, 96, 1, 12, (40, 40), "mixed"),
    ("rank_80_two_r_blocks", 5, 32, 2, 80, (24,), "mixed"),
    ("eight_slots", 50, 32, 8, 16, (48,), "mixed"),
]
CASE_IDS = [c[0] for c in CASES]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_launchers_match_reference(case, dtype):
    _, num_tokens, k, num_slots, rank, widths, pattern = case
    inp = make_inputs(num_tokens, k, num_slots, rank, widths, pattern, dtype, seed=num_tokens + k + rank)
    t, y = run_pair(kernels, inp)
    t_ref, y_ref = run_pair(reference, inp)
    assert t.is_contiguous() and t.dtype == torch.float32
    assert_close(t, t_ref, T_TOL)
    assert_close(y, y_ref, TOLERANCES[dtype])
    # The expand alone, from the same t.
    slots = inp["token_slots"]
    sorted_ids, slot_starts = kernels.lora_group(slots, num_slots)
    y_same_t = inp["y"].clone()
    kernels.lora_expand(y_same_t, t_ref, inp["lora_b"], slots, sorted_ids, slot_starts, inp["part_offsets"])
    assert_close(y_same_t, y_ref, TOLERANCES[dtype])
    # Rows of no adapter: t is 0, y is untouched bit for bit.
    none = (slots < 0).cpu()
    assert torch.equal(t.cpu()[none], torch.zeros_like(t.cpu()[none]))
    assert torch.equal(y.cpu()[none], inp["y"].cpu()[none])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_matches_row_loop(case, dtype):
    _, num_tokens, k, num_slots, rank, widths, pattern = case
    inp = make_inputs(num_tokens, k, num_slots, rank, widths, pattern, dtype, seed=7 * num_tokens + rank)
    t_ref, y_ref = run_pair(reference, inp)
    t64, y_want = naive(inp)
    torch.testing.assert_close(t_ref.cpu().double(), t64, atol=1e-5, rtol=1e-5)
    assert_close(y_ref, y_want, TOLERANCES[dtype])


@pytest.mark.parametrize("num_tokens,num_slots", [(0, 3), (1, 1), (7, 4), (100, 3), (64, 8)])
def test_group_sorts_each_row_once_stably(num_tokens, num_slots):
    gen = torch.Generator().manual_seed(num_tokens)
    # -1 and values outside [0, S) mean no adapter.
    slots = torch.randint(-2, num_slots + 2, (num_tokens,), generator=gen, dtype=torch.int32)
    sorted_ids, slot_starts = kernels.lora_group(slots.to(DEVICE), num_slots)
    assert sorted_ids.dtype == slot_starts.dtype == torch.int32
    assert sorted_ids.device.type == slot_starts.device.type == torch.device(DEVICE).type
    assert sorted_ids.shape == (num_tokens,) and slot_starts.shape == (num_slots + 1,)
    ids, starts = sorted_ids.cpu().long(), slot_starts.cpu().tolist()
    assert sorted(ids.tolist()) == list(range(num_tokens))  # every row exactly once
    assert starts[0] == 0 and all(a <= b for a, b in zip(starts, starts[1:]))
    for s in range(num_slots):
        seg = ids[starts[s]:starts[s + 1]]
        assert seg.tolist() == [i for i in range(num_tokens) if slots[i] == s]  # its rows, ascending
    tail = ids[starts[-1]:]
    assert tail.tolist() == [i for i in range(num_tokens) if not 0 <= slots[i] < num_slots]
    ref_ids, ref_starts = reference.lora_group(slots, num_slots)
    assert torch.equal(ref_ids, sorted_ids.cpu()) and torch.equal(ref_starts, slot_starts.cpu())


def test_split_k_even_and_uneven(monkeypatch):
    inp = make_inputs(6, 96, 3, 8, (32, 16), "mixed", torch.float32, seed=11)
    t_ref, _ = run_pair(reference, inp)
    # 6 K tiles of 16: 3 splits of 2 (EVEN_K), then 2 splits of 4 (the last split's 2 tiles past K).
    for split, per_split in ((3, 2), (2, 4)):
        tiles = lora.ShrinkTiles(16, 16, 16, split, per_split)
        monkeypatch.setattr(lora, "shrink_tiles", lambda *args, tiles=tiles: tiles)
        t, _ = run_pair(kernels, inp)
        assert_close(t, t_ref, T_TOL)
        assert torch.equal(t, run_pair(kernels, inp)[0])  # splits summed in order: repeatable
        assert int(lora._counter_buffer(t.device).abs().sum()) == 0  # counters back at zero


def test_default_tiles(monkeypatch):
    monkeypatch.setattr(lora, "_num_sms", lambda device: 132)  # an H200's
    dev = torch.device(DEVICE)
    t = lora.shrink_tiles(1, 4, 48, 4096, torch.bfloat16, dev)
    assert t.block_m == 16 and t.block_n == 64 and t.split_k == 8  # splits keep >= 8 K tiles of 64
    assert t.split_k * t.tiles_per_split * t.block_k >= 4096 > (t.split_k - 1) * t.tiles_per_split * t.block_k
    assert lora.shrink_tiles(32768, 4, 48, 4096, torch.bfloat16, dev).split_k == 1
    assert lora.shrink_tiles(3, 4, 8, 32, torch.float32, dev).split_k == 1  # too few K tiles to split
    assert lora.expand_tiles(1, 8, torch.float16).block_r == 16
    assert lora.expand_tiles(100, 12, torch.float16) == lora.ExpandTiles(32, 64, 16)
    assert lora.expand_tiles(4096, 16, torch.bfloat16)[:2] == (32, 128)
    assert lora.expand_tiles(4096, 64, torch.bfloat16)[:2] == (64, 64)
    assert lora.expand_tiles(5, 80, torch.float32).block_r == 64


def test_row_tiles_bound_every_slot_split():
    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        num_tokens = int(torch.randint(1, 300, (), generator=gen))
        num_slots = int(torch.randint(1, 9, (), generator=gen))
        block_m = [16, 32, 64][int(torch.randint(0, 3, (), generator=gen))]
        counts = torch.bincount(torch.randint(-1, num_slots, (num_tokens,), generator=gen) + 1,
                                minlength=num_slots + 1)[1:]
        need = sum(-(-int(c) // block_m) for c in counts)
        assert need <= lora.row_tiles(num_tokens, num_slots, block_m)


def test_strided_views_and_empty_batch():
    dtype = torch.float16
    inp = make_inputs(13, 48, 3, 8, (32, 16, 16), "mixed", dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    wide_x = torch.randn(13, 80, generator=gen).to(dtype).to(DEVICE)
    wide_x[:, 16:64] = inp["x"]
    a_big = torch.randn(5, 40, 48, generator=gen).to(dtype).to(DEVICE)
    a_big[1:4, 8:32] = inp["lora_a"]
    b_big = torch.randn(3, 64, 24, generator=gen).to(dtype).to(DEVICE)
    b_big[:, :, 4:12] = inp["lora_b"]
    wide_y = torch.randn(13, 100, generator=gen).to(dtype).to(DEVICE)
    wide_y[:, 20:84] = inp["y"]
    views = dict(inp, x=wide_x[:, 16:64], lora_a=a_big[1:4, 8:32], lora_b=b_big[:, :, 4:12])
    assert not views["x"].is_contiguous() and not views["lora_b"].is_contiguous()
    before = wide_y.clone()
    t, _ = run_pair(kernels, views, y=wide_y[:, 20:84])
    t_ref, y_ref = run_pair(reference, inp)
    assert_close(t, t_ref, T_TOL)
    assert_close(wide_y[:, 20:84], y_ref, TOLERANCES[dtype])
    assert torch.equal(wide_y[:, :20], before[:, :20]) and torch.equal(wide_y[:, 84:], before[:, 84:])

    empty = make_inputs(0, 48, 3, 8, (32, 16, 16), "mixed", dtype, seed=5)
    t, y = run_pair(kernels, empty)
    assert t.shape == (0, 24) and t.dtype == torch.float32 and y.shape == (0, 64)


def test_warm_up_covers_row_counts():
    inp = make_inputs(1, 32, 2, 8, (16, 16), "mixed", torch.float32, seed=9)
    calls = lora.warm_up(inp["lora_a"], inp["lora_b"], inp["part_offsets"], 20)
    assert calls == 2  # BLOCK_M 16 for 1..16 rows, 32 for 17..20


@pytest.mark.parametrize("fn,bad,message", [
    ("group", "num_slots", "lora_group: num_slots must be an int >= 1"),
    ("group", "slots_dtype", "lora_group: token_slots must have dtype"),
    ("shrink", "x_dtype", "lora_shrink: x must have dtype"),
    ("shrink", "a_dtype", "lora_shrink: lora_a must have x's dtype"),
    ("shrink", "a_k", "lora_shrink: lora_a must have K = 32 columns"),
    ("shrink", "ids_dtype", "lora_shrink: sorted_ids must have dtype"),
    ("shrink", "starts_len", "lora_shrink: slot_starts must have S + 1 = 3 entries"),
    ("shrink", "slots_len", "lora_shrink: token_slots must have T = 4 rows"),
    ("shrink", "x_stride", "lora_shrink: x must have stride 1 in its last dim"),
    ("expand", "t_dtype", "lora_expand: t must have dtype"),
    ("expand", "t_cols", "lora_expand: t must be [T, P*R] = [4, 2 * 8]"),
    ("expand", "offsets_end", "lora_expand: part_offsets must increase strictly from 0 to N = 32"),
    ("expand", "offsets_order", "lora_expand: part_offsets must increase strictly"),
    ("expand", "offsets_type", "lora_expand: part_offsets must be a tuple of P + 1 >= 2 ints"),
    ("expand", "b_dtype", "lora_expand: lora_b must have y's dtype"),
    ("expand", "b_rows", "lora_expand: lora_b must have N = 32 rows"),
    ("expand", "starts_len", "lora_expand: slot_starts must have S + 1 = 3 entries"),
])
def test_argument_checks(fn, bad, message):
    inp = make_inputs(4, 32, 2, 8, (16, 16), "mixed", torch.float32, seed=12)
    slots, num_slots = inp["token_slots"], 2
    if fn == "group":
        args = (slots.long(), num_slots) if bad == "slots_dtype" else (slots, 0)
        with pytest.raises(ValueError, match=re.escape(message)):
            kernels.lora_group(*args)
        return
    sorted_ids, slot_starts = kernels.lora_group(slots, num_slots)
    t = torch.zeros(4, 16, device=DEVICE)
    x, a, b, y, offsets = inp["x"], inp["lora_a"], inp["lora_b"], inp["y"], inp["part_offsets"]
    if bad == "x_dtype":
        x = x.to(torch.int32)
    elif bad == "a_dtype":
        a = a.half()
    elif bad == "a_k":
        a = a[:, :, :16]
    elif bad == "ids_dtype":
        sorted_ids = sorted_ids.long()
    elif bad == "starts_len":
        slot_starts = slot_starts[:-1]
    elif bad == "slots_len":
        slots = slots[:3]
    elif bad == "x_stride":
        x = torch.zeros(32, 4, device=DEVICE).t()
    elif bad == "t_dtype":
        t = t.half()
    elif bad == "t_cols":
        t = t[:, :8]
    elif bad == "offsets_end":
        offsets = (0, 16, 30)
    elif bad == "offsets_order":
        offsets = (0, 16, 16, 32)
    elif bad == "offsets_type":
        offsets = (32,)
    elif bad == "b_dtype":
        b = b.half()
    elif bad == "b_rows":
        b = b[:, :16]
    with pytest.raises(ValueError, match=re.escape(message)):
        if fn == "shrink":
            kernels.lora_shrink(x, a, slots, sorted_ids, slot_starts)
        else:
            kernels.lora_expand(y, t, b, slots, sorted_ids, slot_starts, offsets)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_one_cuda_graph_serves_new_slots():
    # lora_group, shrink and expand captured once; replays with other slots (the grid and
    # every buffer fixed by shapes) give the eager reference's results.
    dtype = torch.bfloat16
    inp = make_inputs(24, 64, 4, 16, (64, 16, 16), "mixed", dtype, seed=13)
    slots, y0 = inp["token_slots"].clone(), inp["y"].clone()
    lora.warm_up(inp["lora_a"], inp["lora_b"], inp["part_offsets"], 24)
    y = y0.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_pair(kernels, dict(inp, token_slots=slots), y=y)  # allocator warm-up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t, _ = run_pair(kernels, dict(inp, token_slots=slots), y=y)
    for seed in range(3):
        slots.copy_(make_slots(24, 4, "mixed", 100 + seed).to(DEVICE))
        y.copy_(y0)
        graph.replay()
        t_ref, y_ref = run_pair(reference, dict(inp, token_slots=slots))
        assert_close(t, t_ref, T_TOL)
        assert_close(y, y_ref, TOLERANCES[dtype])
