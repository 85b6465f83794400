"""KV cache groups (engine/kv_cache_groups.py, engine/kv_cache_manager.py): the layout of each
kind of model, a windowed group freeing its blocks behind the window while the full group keeps
its own, and Gemma 3 served token for token with few blocks (a block freed one step early is
handed out again and overwritten)."""
from __future__ import annotations

import pytest

from engine.kv_cache_groups import FULL, SLIDING, build_layout
from engine.kv_cache_manager import KVCacheManager
from engine.llm import LLM
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine.families import (WINDOW, assert_greedy_match, hf_greedy, hf_model, make_family_model,
                                   random_prompts)


def _gemma3_kinds(num_layers: int, pattern: int = 6) -> list[str]:
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def test_gemma3_12b_layout_and_what_a_long_request_holds():
    """48 layers, every sixth full: six groups of eight (one full, five windowed). At 32k tokens
    a request holds its whole context in one group and a window's worth in five: about 1.15x the
    full layers' need plus the windows', where one table for every layer holds six times the
    full layers' need."""
    kinds = _gemma3_kinds(48)
    window, bs, ctx = 1024, 16, 32 * 1024
    layout = build_layout(kinds, [window if k == "sliding_attention" else None for k in kinds], bs)
    assert layout.num_slots == 8 and [g.kind for g in layout.groups] == [FULL] + [SLIDING] * 5
    assert layout.groups[0].layers == (5, 11, 17, 23, 29, 35, 41, 47)
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(48))
    for gi, g in enumerate(layout.groups):
        for s, layer in enumerate(g.layers):
            assert layout.places[layer] == (gi, s) and layout.stores[layer]
    # pages held at 32k (a windowed group: the window's blocks and the one in progress)
    held = ctx // bs + 5 * (window // bs + 1)
    need = (8 * ctx + 40 * window) // bs // 8  # the floor, in pages of eight layers
    assert held / need < 1.2
    one_table = 6 * ctx // bs  # every layer keeps the whole context
    assert one_table / held > 5


def test_layouts_of_the_other_kinds():
    # one kind: one group of every layer, slot = layer
    simple = build_layout(["full_attention"] * 4, [None] * 4, 16)
    assert simple.is_simple and simple.num_slots == 4 and simple.places == tuple((0, i) for i in range(4))
    # a remainder group: 26 layers, 4 full -> slots of 4; the last windowed group has 2 layers
    kinds = _gemma3_kinds(26)
    odd = build_layout(kinds, [512 if k == "sliding_attention" else None for k in kinds], 16)
    assert odd.num_slots == 4 and [len(g.layers) for g in odd.groups] == [4, 4, 4, 4, 4, 4, 2]
    # hybrid linear attention: three of four layers hold a state slot, no KV
    hybrid = build_layout(["linear_attention"] * 3 + ["full_attention"], [None] * 4, 16)
    assert hybrid.linear_layers == (0, 1, 2) and hybrid.places == (None, None, None, (0, 0))
    assert len(hybrid.groups) == 1 and hybrid.has_linear and not hybrid.is_simple
    # layers of another KV shape: a token of half the elements, blocks of twice the tokens
    shaped = build_layout(["sliding_attention", "full_attention"], [8, None], 16,
                          kv_shapes=[(8, 256), (2, 512)])
    assert {g.kind: g.block_size for g in shaped.groups} == {FULL: 32, SLIDING: 16}
    # a layer reading an earlier layer's KV stores none and takes its place
    shared = build_layout(["full_attention"] * 3, [None] * 3, 16, kv_sources=[None, None, 0])
    assert shared.places[2] == shared.places[0] and shared.stores == (True, True, False)
    assert shared.num_slots == 2
    with pytest.raises(ValueError, match="does not divide"):
        build_layout(["sliding_attention", "full_attention"], [8, None], 16, kv_shapes=[(3, 64), (2, 64)])


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=64))


@pytest.mark.parametrize("caching", [True, False])
def test_a_windowed_group_frees_behind_its_window_while_the_full_group_keeps(caching):
    """Full + windowed group, blocks of 4, window 8: computing a token at a time, the full group
    holds every block and the windowed one exactly the blocks the next query can see."""
    layout = build_layout(["sliding_attention", "full_attention"], [WINDOW, None], 4)
    kv = KVCacheManager(64, 4, caching, layout=layout)
    full, window = kv.groups
    req = _req("r", 40)
    for n in range(1, 41):
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens = n
        kv.cache_blocks(req, n)
        kv.free_dead_blocks(req)
        # the next query (position n) sees keys n - WINDOW + 1 .. n
        live_from = max(0, n - WINDOW + 1) // 4
        dead = min(live_from, len(window.req_blocks["r"]) - 1)
        assert window.num_dead_blocks.get("r", 0) == dead
        assert all(b.ref_cnt == 1 for b in window.req_blocks["r"][dead:])
        assert all(b.ref_cnt == 1 for b in full.req_blocks["r"])  # the full group keeps every block
        assert kv.num_held_blocks("r") == len(full.req_blocks["r"]) + len(window.req_blocks["r"]) - dead
        assert kv.num_used_blocks == kv.num_held_blocks("r")
    assert len(full.req_blocks["r"]) == 10 and kv.num_held_blocks("r") <= 10 + WINDOW // 4 + 1
    kv.forget(req)
    assert kv.num_used_blocks == 0


def test_a_prefix_hit_needs_every_group():
    layout = build_layout(["sliding_attention", "full_attention"], [WINDOW, None], 4)
    kv = KVCacheManager(64, 4, True, layout=layout)
    a = _req("a", 20)
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.cache_blocks(a, 20)
    b = _req("b", 20)
    hits, n = kv.get_computed_blocks(b)
    assert n == 16 and [len(h) for h in hits] == [4, 4]
    assert [x.block_id for x in hits[0]] == kv.get_block_table("a")[0][:4]
    kv.free_dead_blocks(a)  # the windowed group's early blocks go back to the free queue, still cached
    kv.forget(a)
    # evict the windowed group's first block: the hit stops before it in every group
    first_window_block = hits[1][0]
    kv.pool.free_queue.remove(first_window_block)
    kv.pool._evict(first_window_block)
    kv.pool.free_queue.append(first_window_block)
    hits, n = kv.get_computed_blocks(b)
    assert n == 0 and hits == [[], []]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("groups") / "gemma3", "gemma3", seed=4)


def test_gemma3_tokens_hold_while_windowed_groups_free_their_blocks(gemma3):
    """Prompts of several windows and several chunks, two at once, on so few blocks that a block
    freed early is handed to the other request at once: tokens stay transformers', the windowed
    groups hold at most a window's blocks (and the chunk in progress), nothing leaks."""
    prompts = random_prompts([45, 38], seed=12)
    m = hf_model(gemma3)
    want = hf_greedy(m, prompts, 16)
    llm = LLM(str(gemma3), num_gpu_blocks_override=34, block_size=4, max_num_batched_tokens=8,
              enable_prefix_caching=False)
    e, kv = llm.engine, llm.engine.scheduler.kv
    assert [g.kind for g in kv.layout.groups] == [FULL, SLIDING, SLIDING]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reqs = [e.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    most_window = 0
    while e.has_unfinished_requests():
        e.step()
        for r in reqs:
            if r.is_finished:
                continue
            for g in kv.groups[1:]:
                held = len(g.req_blocks.get(r.request_id, ())) - g.num_dead_blocks.get(r.request_id, 0)
                most_window = max(most_window, held)
    assert_greedy_match(m, prompts, want, [r.output_token_ids for r in reqs])
    assert most_window <= WINDOW // 4 + 1 + 8 // 4  # the window, the block in progress, a chunk
    assert kv.num_used_blocks == 0


def test_every_groups_hits_are_taken_before_any_new_block():
    """A later group's hit still in the free queue must not be handed out as an earlier group's
    new block (its KV would be overwritten while the request reads it as cached)."""
    layout = build_layout(["sliding_attention", "full_attention"], [WINDOW, None], 4)
    kv = KVCacheManager(8, 4, True, layout=layout)
    a, c, d = _req("a", 8), _req("c", 4), _req("d", 4)
    kv.allocate_slots(a, 8)  # group 0 (full): blocks 0, 1; group 1 (windowed): 2, 3
    a.num_computed_tokens = 8
    kv.cache_blocks(a, 8)
    kv.allocate_slots(c, 4)  # 4, 5
    kv.forget(a)
    kv.forget(c)
    kv.allocate_slots(d, 4)  # 6, 7: the free queue now starts with a's blocks, group 0's first
    b = _req("b", 9)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    kv.allocate_slots(b, 1, hits)
    table = kv.get_block_table("b")
    assert len(set(table[0]) | set(table[1])) == 6  # no block in two places
    assert all(blk.ref_cnt == 1 for g in kv.groups for blk in g.req_blocks["b"])


def test_what_a_send_leaves_out_of_each_groups_table():
    """A decode server's prefix hit is whole blocks of every group (blocks of 4 and of 8 tokens
    here: layers of two KV shapes); a transfer into it leaves out each group's blocks of that
    prefix, windowed groups alike (the decode server holds them as cached blocks, and registers
    every block it receives: none may arrive empty)."""
    layout = build_layout(["sliding_attention", "full_attention", "sliding_attention"], [WINDOW, None, WINDOW], 4,
                          kv_shapes=[(2, 16), (2, 32), (2, 16)])
    assert [(g.kind, g.block_size) for g in layout.groups] == [(FULL, 4), (SLIDING, 8), (SLIDING, 8)]
    kv = KVCacheManager(64, 4, True, layout=layout)
    assert kv.hit_unit == 8
    r = _req("r", 37)
    kv.allocate_slots(r, 37)  # full: 10 blocks of 4, each windowed group: 5 of 8
    full, w1, w2 = kv.get_block_table("r")
    flat = kv.get_block_ids("r")
    assert flat == full + w1 + w2 and (len(full), len(w1), len(w2)) == (10, 5, 5)
    for skip in (0, 8, 16, 32):
        want = full[skip // 4:] + w1[skip // 8:] + w2[skip // 8:]
        assert kv.get_block_ids("r", skip) == layout.blocks_past(flat, 37, skip) == want
        assert kv.skipped_tokens("r", want) == skip
    assert kv.skipped_tokens("r", full[2:] + w1 + w2) is None  # one group's prefix only
    assert kv.skipped_tokens("r", flat + [60]) is None
    for bad in (4, 12, 40, -8):  # not whole blocks of every group, or past the prompt
        with pytest.raises(ValueError, match="whole number of every cache group's blocks"):
            layout.blocks_past(flat, 37, bad)
    with pytest.raises(ValueError, match=r"20 block ids, but the cache groups' tables of 41 tokens hold 11 \+ 6 \+ 6"):
        layout.blocks_past(flat, 41, 8)
    kv.skip_on_send(r, 16)
    assert kv.send_block_ids("r") == full[4:] + w1[2:] + w2[2:]
    with pytest.raises(ValueError, match="request r: the decode server's cached prefix: a prefix of 12 tokens"):
        kv.skip_on_send(r, 12)
    kv.forget(r)
    assert not kv.send_skip and kv.num_used_blocks == 0


def test_a_reservation_takes_a_hybrid_prefix_without_a_state_snapshot():
    """A hybrid model's hit on a computing request restores the linear state from a snapshot,
    so it stops at the last boundary that has one (here: none). A decode tier's reservation
    receives the state after the whole prompt with the KV: its hit is the attention blocks,
    and it restores no snapshot."""
    layout = build_layout(["linear_attention", "full_attention"], [None, None], 4)
    kv = KVCacheManager(64, 4, True, layout=layout, num_state_slots=4, num_state_snapshots=2, snapshot_interval=16)
    a = _req("a", 14)
    kv.allocate_slots(a, 14)
    a.num_computed_tokens = 14
    kv.cache_blocks(a, 14)  # three full blocks cached; no chunk ended on a boundary: no snapshot
    kv.forget(a)
    b = _req("b", 20)
    assert kv.get_computed_blocks(b) == ([[]], 0)
    hits, n = kv.get_computed_blocks(b, with_state=False)
    assert n == 12 and len(hits[0]) == 3 and kv.take_restore(b) is None
    kv.allocate_slots(b, 8, hits)
    assert kv.state_slot("b") >= 0  # where the state will land
