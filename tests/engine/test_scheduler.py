"""Scheduler invariants with a tiny cache and no model: token budgets,
decode-first order, chunked prefill, preemption by recompute, no leaks."""
from __future__ import annotations

import random

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def make(num_blocks=16, block_size=4, budget=8, max_seqs=8, max_len=256, caching=True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)


def req(rid, n, max_tokens=4, start=0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_model_len=256)


def step(s: Scheduler, token=7):
    out = s.schedule()
    sampled = [token if x.samples else None for x in out.scheduled]
    s.update_from_output(out, sampled)
    return out


def run_to_end(s: Scheduler, limit=500):
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return
        step(s)
    raise AssertionError("did not finish")


def assert_no_leak(s: Scheduler):
    pool = s.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not s.kv.groups[0].req_blocks and not s.requests


def test_chunked_prefill_respects_budget():
    s = make(budget=8)
    r = req("a", 20)
    s.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        out = step(s)
        chunks.append([(x.request.request_id, x.num_new_tokens) for x in out.scheduled])
    assert chunks == [[("a", 8)], [("a", 8)], [("a", 4)]]
    assert r.num_computed_tokens == 20 and r.output_token_ids == [7]


def test_decode_first_then_prefill_chunk():
    s = make(budget=8)
    a, b = req("a", 4, max_tokens=10), req("b", 30, start=100)
    s.add_request(a)
    step(s)  # a prefilled (4 tokens), first token sampled
    s.add_request(b)
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]


def test_max_num_seqs():
    s = make(budget=64, max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 3, start=10 * i))
    out = step(s)
    assert sorted(x.request.request_id for x in out.scheduled) == ["0", "1"]
    assert s.num_waiting == 1


def test_preemption_by_recompute_and_no_leak():
    # 6 blocks of 4 tokens: two requests growing to 4+12 tokens cannot both fit.
    s = make(num_blocks=6, block_size=4, budget=64, caching=False)
    a, b = req("a", 4, max_tokens=12), req("b", 4, max_tokens=12, start=50)
    s.add_request(a)
    s.add_request(b)
    run_to_end(s)
    assert s.num_preemptions_total >= 1
    assert b.num_preemptions >= 1 and a.num_preemptions == 0  # the newest is the victim
    assert a.num_output_tokens == 12 and b.num_output_tokens == 12
    assert_no_leak(s)


def test_request_too_big_for_cache_is_refused_or_capped():
    s = make(num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(req("big", 9))
    r = req("grow", 6, max_tokens=10)
    s.add_request(r)
    run_to_end(s)
    # 8 KV slots: 6 prompt tokens + 2 outputs computed, the 3rd output sampled
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 9
    assert_no_leak(s)


def test_abort_in_every_state_frees_blocks():
    s = make(num_blocks=8, budget=4)
    a, b, c = req("a", 10, max_tokens=8), req("b", 3, start=40), req("c", 3, start=80)
    for r in (a, b, c):
        s.add_request(r)
    step(s)  # a mid-prefill, b/c waiting
    s.finish_request("a")
    s.finish_request("b")
    assert a.status == RequestStatus.FINISHED_ABORTED and b.is_finished
    run_to_end(s)
    assert c.num_output_tokens == 4
    assert_no_leak(s)


def test_random_workload_never_leaks():
    rng = random.Random(0)
    s = make(num_blocks=12, block_size=4, budget=10, max_seqs=5)
    live = []
    for i in range(60):
        if rng.random() < 0.5:
            r = req(f"r{i}", rng.randint(1, 20), max_tokens=rng.randint(1, 12), start=rng.choice([0, 100]))
            s.add_request(r)
            live.append(r)
        if rng.random() < 0.1 and live:
            s.finish_request(rng.choice(live).request_id)
        step(s)
        held = {b.block_id for v in s.kv.groups[0].req_blocks.values() for b in v}
        assert s.kv.pool.num_used_blocks == len(held)
        # the block tables kept as ids follow the blocks through allocation, preemption and frees
        assert s.kv.groups[0].req_block_ids == {rid: [b.block_id for b in v] for rid, v in s.kv.groups[0].req_blocks.items()}
        for b in s.kv.pool.blocks:
            assert b.ref_cnt == sum(b in v for v in s.kv.groups[0].req_blocks.values())
            assert (b.ref_cnt == 0) == (b.prev_free is not None)
    run_to_end(s)
    assert_no_leak(s)


def _decoding(s: Scheduler, r: Request) -> None:
    """Run ``r`` until it has one token to compute per step (it decodes)."""
    s.add_request(r)
    while r.num_tokens - r.num_computed_tokens != 1 or r.num_output_tokens == 0:
        step(s)


def test_a_step_ahead_admits_waiting_requests_with_room():
    """A request added while a step is in flight starts in the step scheduled ahead, as
    schedule() would start it once the tokens are read (nothing about it depends on them).
    Without room (max_num_seqs) it waits."""
    s = make(num_blocks=32, budget=8, max_seqs=2)
    a = req("a", 5, max_tokens=20)
    _decoding(s, a)
    in_flight = s.schedule()
    assert [x.request.request_id for x in in_flight.scheduled] == ["a"]
    b = req("b", 3, start=40)
    s.add_request(b)
    ahead = s.schedule_ahead(in_flight)
    assert [(x.request.request_id, x.num_new_tokens, x.lookahead, x.computed_ahead) for x in ahead.scheduled] == \
        [("a", 1, 1, 1), ("b", 3, 0, 0)]
    assert ahead.started == [b] and b.status == RequestStatus.RUNNING and all(x.samples for x in ahead.scheduled)

    full = make(num_blocks=32, budget=8, max_seqs=1)
    _decoding(full, req("a", 5, max_tokens=20))
    in_flight = full.schedule()
    full.add_request(req("b", 3, start=40))
    ahead = full.schedule_ahead(in_flight)  # no room for b
    assert ahead is not None and [(x.request.request_id, x.lookahead) for x in ahead.scheduled] == [("a", 1)]
    assert not ahead.started


def _take(s: Scheduler, in_flight, ahead, tokens) -> None:
    """What the engine does once a step ahead is queued: read the step in flight, land the
    rows ahead."""
    s.update_from_output(in_flight, [tokens.pop(0) if x.samples else None for x in in_flight.scheduled])
    for x in ahead.scheduled:
        x.landed()


def test_steps_ahead_carry_prefill_chunks_to_the_prompts_end():
    """A chunk in flight goes on past its positions in the step ahead; the chunk that ends
    the prompt samples, and the step after it decodes that token a step ahead, leading the
    batch. Every step is the one schedule() makes once the tokens are read."""
    s = make(num_blocks=32, budget=8, max_seqs=4)
    a = req("a", 5, max_tokens=20)
    _decoding(s, a)
    b = req("b", 20, start=40, max_tokens=3)
    s.add_request(b)
    in_flight = s.schedule()  # a decodes, b's first chunk of 7
    assert [(x.request.request_id, x.num_new_tokens) for x in in_flight.scheduled] == [("a", 1), ("b", 7)]
    tokens = list(range(100, 140))
    seen = []
    while b.num_output_tokens < 2:
        ahead = s.schedule_ahead(in_flight)
        assert ahead is not None
        seen.append([(x.request.request_id, x.start, x.num_new_tokens, x.lookahead, x.samples)
                     for x in ahead.scheduled])
        _take(s, in_flight, ahead, tokens)
        in_flight = ahead
    a0 = 5  # a's position in the first step (its prompt and one token)
    assert seen == [
        [("a", a0 + 1, 1, 1, True), ("b", 7, 7, 0, False)],
        [("a", a0 + 2, 1, 1, True), ("b", 14, 6, 0, True)],  # the prompt's last chunk samples
        [("a", a0 + 3, 1, 1, True), ("b", 20, 1, 1, True)],  # b decodes its first token ahead
        [("a", a0 + 4, 1, 1, True), ("b", 21, 1, 1, True)]]
    assert b.output_token_ids == [103, 105] and b.num_computed_tokens == 21
    # once landed, a row reads as schedule() would have made it
    assert [(x.start, x.samples) for x in in_flight.scheduled] == [(a.num_computed_tokens, True), (21, True)]


def test_a_step_ahead_reserves_blocks_for_decode_arrivals():
    """A request whose KV comes by transfer gets its blocks in a step scheduled ahead, after
    the rows' own: it need not wait for the overlapped steps to stop."""
    s = make(num_blocks=8, budget=8, max_seqs=4)
    a = req("a", 6, max_tokens=20)
    s.add_reservation(a)
    assert s.schedule().reserved == [a]
    s.begin_kv_receive("a", s.kv.get_block_ids("a"))
    s.kv_received("a", 42)
    in_flight = s.schedule()
    assert [x.request.request_id for x in in_flight.scheduled] == ["a"]
    b = req("b", 9, start=40)
    s.add_reservation(b)
    ahead = s.schedule_ahead(in_flight)
    assert ahead is not None and [x.request.request_id for x in ahead.scheduled] == ["a"]
    assert ahead.reserved == [b] and b.status == RequestStatus.WAITING_FOR_KV
    assert len(s.kv.get_block_ids("b")) == 3 and len(s.kv.get_block_ids("a")) == 2
    assert not set(s.kv.get_block_ids("a")) & set(s.kv.get_block_ids("b"))


# ---- --scheduling-policy priority ------------------------------------------------------------
def make_priority(starvation=30.0, **kw) -> Scheduler:
    s = make(**kw)
    s.config = SchedulerConfig(max_num_seqs=s.config.max_num_seqs, max_num_batched_tokens=s.config.max_num_batched_tokens,
                               max_model_len=s.config.max_model_len, scheduling_policy="priority",
                               priority_starvation_timeout=starvation)
    return s


def preq(rid, priority, n=4, max_tokens=4, start=0, arrival=None) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   max_model_len=256, arrival_time=arrival, priority=priority)


def finish_order(s: Scheduler, limit=500) -> list[str]:
    done = []
    for _ in range(limit):
        if not s.has_unfinished_requests():
            return done
        out = step(s)
        done += [x.request.request_id for x in out.scheduled if x.request.is_finished]
    raise AssertionError("did not finish")


def test_priority_admits_lower_values_first_then_arrival():
    """One sequence at a time: the request running goes on; of those waiting, a later arrival
    with a lower priority value runs first, equal priorities in arrival order."""
    s = make_priority(max_seqs=1)
    for r in (preq("a", 5), preq("b", 5, start=20), preq("c", 5, start=40)):
        s.add_request(r)
    step(s)  # a runs
    s.add_request(preq("high", -1, start=60))
    s.add_request(preq("mid", 2, start=80))
    assert finish_order(s) == ["a", "high", "mid", "b", "c"]
    assert_no_leak(s)


def test_fcfs_keeps_arrival_order():
    s = make(max_seqs=1)
    for r in (req("a", 4), req("b", 4, start=20)):
        s.add_request(r)
    step(s)
    s.add_request(req("c", 4, start=40))
    assert finish_order(s) == ["a", "b", "c"]


def test_priority_preempts_the_lowest_priority_not_the_newest():
    """Two requests that cannot both grow in 6 blocks: the older one of lower priority (a
    higher value) is preempted, not the newer one of higher priority; both finish."""
    s = make_priority(num_blocks=6, block_size=4, budget=64, caching=False)
    low, high = preq("low", 3, max_tokens=12), preq("high", 0, max_tokens=12, start=50)
    s.add_request(low)
    s.add_request(high)
    run_to_end(s)
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert low.num_output_tokens == 12 and high.num_output_tokens == 12
    assert_no_leak(s)


def test_a_lower_priority_row_asking_for_blocks_preempts_itself():
    """Colocated: the low-priority request decodes (given its tokens first in the step) while a
    later high-priority one prefills in chunks; when the low one needs a block and the cache is
    full, it goes itself rather than preempting the higher-priority request."""
    s = make_priority(num_blocks=4, block_size=4, budget=4, caching=False)
    low = preq("low", 5, n=6, max_tokens=8)
    s.add_request(low)
    step(s)
    step(s)
    high = preq("high", 0, n=8, max_tokens=4, start=50)
    s.add_request(high)
    run_to_end(s)
    assert high.num_preemptions == 0 and low.num_preemptions >= 1
    assert low.num_output_tokens == 8 and high.num_output_tokens == 4
    assert_no_leak(s)


def test_priority_starvation_is_bounded():
    """A request that has waited past priority_starvation_timeout goes ahead of every other,
    whatever their priorities; before that, priority decides."""
    import time

    now = time.time()
    s = make_priority(starvation=10.0, max_seqs=1)
    s.add_request(preq("a", 0))
    step(s)
    s.add_request(preq("old-low", 100, start=20, arrival=now - 11))  # waited past the bound
    s.add_request(preq("young-low", 50, start=40, arrival=now - 5))
    s.add_request(preq("high", -100, start=60))
    assert finish_order(s) == ["a", "old-low", "high", "young-low"]


def test_decode_reservations_follow_priority():
    """Decode tier: reservations waiting for a sequence slot are reserved by priority."""
    s = make_priority(max_seqs=1)
    first, low, high = preq("first", 0), preq("low", 7, start=20), preq("high", 1, start=40)
    for r in (first, low, high):
        s.add_reservation(r)
    out = s.schedule()
    assert [r.request_id for r in out.reserved] == ["first"]
    s.finish_request("first")
    out = s.schedule()
    assert [r.request_id for r in out.reserved] == ["high"]


def test_priority_is_refused_under_fcfs():
    from engine.sampling_params import check_priority

    check_priority(0, "fcfs")
    check_priority(-3, "priority")
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        check_priority(1, "fcfs")
    with pytest.raises(ValueError, match="priority must be an integer"):
        check_priority(2**31, "priority")
