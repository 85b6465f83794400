"""Each tier's request state machine, driven through the scheduler's named
operations with a tiny cache and no model: exact transitions and block ids,
an abort in every state, every deadline, transfers that fail, and blocks that
are never freed under a transfer but always freed after it."""
from __future__ import annotations

import gc
import time
import tracemalloc

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.request import Request, RequestStatus as S
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

T = 10.0  # kv_transfer_timeout of these schedulers


def make(num_blocks=8, block_size=4, max_seqs=4, max_queued=8, caching=True, budget=64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                                     kv_transfer_timeout=T, max_queued_requests=max_queued),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks)


def req(rid, n, max_tokens=3, start=0, hold=False) -> Request:
    r = Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                max_model_len=256)
    if hold:  # what LLMEngine.add_prefill_request sets
        r.max_tokens, r.hold_kv_on_finish = 1, True
    return r


def step(s: Scheduler, token=7):
    out = s.schedule()
    s.update_from_output(out, [token if x.samples else None for x in out.scheduled])
    return out


def used(s: Scheduler) -> int:
    return s.kv.pool.num_used_blocks


def assert_no_leak(s: Scheduler):
    pool = s.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not s.kv.groups[0].req_blocks and not s.requests and not s.pending_free
    assert not (s.waiting or s.running or s.block_waiting or s.reserved or s.held)


def reserved(s: Scheduler, r: Request) -> list[int]:
    s.add_reservation(r)
    out = s.schedule()
    assert out.reserved == [r] and r.status == S.WAITING_FOR_KV
    return s.kv.get_block_ids(r.request_id)


# ---- decode tier ------------------------------------------------------------
def test_decode_tier_path_with_exact_blocks():
    s = make()
    r = req("d", 7)
    s.add_reservation(r)
    assert r.status == S.WAITING_FOR_BLOCKS and s.num_waiting == 1 and used(s) == 0
    out = s.schedule()
    assert out.reserved == [r] and not out.scheduled
    assert r.status == S.WAITING_FOR_KV and s.kv.get_block_ids("d") == [0, 1] and r.times.reserved
    with pytest.raises(ValueError, match="reserved \\[0, 1\\]"):
        s.begin_kv_receive("d", [1, 0])
    assert r.status == S.WAITING_FOR_KV
    s.begin_kv_receive("d", [0, 1])
    assert r.status == S.RECEIVING_KV
    with pytest.raises(ValueError, match="not waiting for KV"):
        s.begin_kv_receive("d", [0, 1])  # one receive at a time
    assert s.kv_received("d", 42) is r
    assert r.status == S.RUNNING and r.num_computed_tokens == 7 and r.output_token_ids == [42]
    step(s)
    step(s)
    assert r.output_token_ids == [42, 7, 7] and r.status == S.FINISHED_LENGTH
    assert_no_leak(s)


def test_reservations_are_first_come_first_served_and_bounded():
    s = make(num_blocks=4, max_queued=2)
    a, b, c = req("a", 12), req("b", 8, start=20), req("c", 2, start=40)
    assert reserved(s, a) == [0, 1, 2]
    s.add_reservation(b)  # needs 2 blocks, 1 free: waits
    s.add_reservation(c)  # would fit, but may not overtake b
    with pytest.raises(OverflowError, match="queue is full"):
        s.add_reservation(req("x", 2, start=60))
    assert "x" not in s.requests
    assert s.schedule().reserved == [] and (b.status, c.status) == (S.WAITING_FOR_BLOCKS, S.WAITING_FOR_BLOCKS)
    s.finish_request("a")
    assert s.schedule().reserved == [b, c]
    assert s.kv.get_block_ids("b") == [3, 2] and s.kv.get_block_ids("c") == [1]  # LRU: a's tail freed first
    for r in (b, c):
        s.finish_request(r.request_id)
    assert_no_leak(s)


def test_reservation_reuses_decode_side_prefix_hits():
    s = make(num_blocks=8, block_size=4)
    first = req("a", 10, max_tokens=2)
    assert reserved(s, first) == [0, 1, 2] and first.num_cached_tokens == 0
    s.begin_kv_receive("a", [0, 1, 2])
    s.kv_received("a", 42)
    step(s)
    second = req("b", 10, max_tokens=2)  # same prompt: blocks 0 and 1 are cached here
    ids = reserved(s, second)
    assert ids[:2] == [0, 1] and len(ids) == 3 and second.num_cached_tokens == 8
    with pytest.raises(ValueError):
        s.begin_kv_receive("b", ids[:2])  # only a tail of the reserved blocks may be skipped
    s.begin_kv_receive("b", ids[2:])
    s.kv_received("b", 42)
    step(s)
    assert s.prefix_hits_total == 8 and s.prefix_queries_total == 20
    assert_no_leak(s)


@pytest.mark.parametrize("state", ["WAITING_FOR_BLOCKS", "WAITING_FOR_KV", "RUNNING"])
def test_abort_frees_at_once(state):
    s = make(num_blocks=2)
    blocker = req("blocker", 5)
    reserved(s, blocker)  # both blocks: the next reservation must wait
    r = req("r", 5, start=50)
    if state == "WAITING_FOR_BLOCKS":
        s.add_reservation(r)
        s.schedule()
    else:
        s.finish_request("blocker")
        reserved(s, r)
        if state == "RUNNING":
            s.begin_kv_receive("r", s.kv.get_block_ids("r"))
            s.kv_received("r", 1)
    assert r.status.name == state
    assert s.finish_request("r") is r and r.status == S.FINISHED_ABORTED and r.error is None
    assert s.finish_request("r") is None  # once
    s.finish_request("blocker")
    assert_no_leak(s)


def test_abort_while_receiving_frees_only_after_the_receive():
    for ending in ("received", "failed"):
        s = make()
        r = req("r", 7)
        ids = reserved(s, r)
        s.begin_kv_receive("r", ids)
        assert s.finish_request("r") is r and r.status == S.FINISHED_ABORTED
        assert used(s) == 2 and s.kv.get_block_ids("r") == [0, 1]  # the receiver still writes them
        assert s.expire(time.monotonic() + 100 * T) == []  # finished: nothing left to expire
        with pytest.raises(ValueError, match="duplicate"):
            s.add_request(req("r", 3))  # its id and blocks are still taken
        got = s.kv_received("r", 5) if ending == "received" else s.kv_failed("r", "peer gone")
        assert got is None and r.status == S.FINISHED_ABORTED and r.output_token_ids == []
        assert_no_leak(s)


def test_kv_failure_ends_waiting_or_receiving_requests_only():
    s = make()
    w, rx, run = req("w", 3), req("rx", 3, start=10), req("run", 3, start=20)
    reserved(s, w)
    reserved(s, rx)
    s.begin_kv_receive("rx", s.kv.get_block_ids("rx"))
    reserved(s, run)
    s.begin_kv_receive("run", s.kv.get_block_ids("run"))
    s.kv_received("run", 1)
    for r in (w, rx):
        assert s.kv_failed(r.request_id, "boom") is r
        assert r.status == S.FINISHED_ABORTED and r.error.kind == "kv_transfer" and r.error.message == "boom"
    assert s.kv_failed("run", "a stale failure") is None and run.status == S.RUNNING
    assert s.kv_failed("unknown", "x") is None
    s.finish_request("run")
    assert_no_leak(s)


def test_kv_wait_counts_from_prefill_start():
    """A prefill queue longer than the KV timeout does not cost the reservation."""
    s = make()
    r = req("r", 7)
    ids = reserved(s, r)
    t0 = time.monotonic()
    assert s.expire(t0 + 3 * T) == []  # prefill not started yet: the long unstarted bound applies
    assert s.prefill_started("r") and r.times.prefill_started
    assert not s.prefill_started("unknown")
    started = time.monotonic()
    assert s.expire(started + 0.9 * T) == []
    s.begin_kv_receive("r", ids)
    s.kv_received("r", 3)
    assert r.status == S.RUNNING
    s.finish_request("r")
    assert_no_leak(s)


def test_kv_wait_deadlines():
    s = make()
    late, never = req("late", 3), req("never", 3, start=10)
    reserved(s, late)
    reserved(s, never)
    s.prefill_started("late")
    now = time.monotonic()
    assert s.expire(now + T + 0.5) == [late]
    assert late.status == S.FINISHED_ABORTED and late.error.kind == "deadline"
    assert "within 10s of its prefill start" in late.error.message
    assert s.expire(now + 10 * T + 0.5) == [never]
    assert "did not start on it within 100s" in never.error.message
    assert_no_leak(s)


def test_receive_deadline_keeps_blocks_until_the_receiver_ends():
    s = make()
    r = req("r", 7)
    ids = reserved(s, r)
    s.begin_kv_receive("r", ids)
    assert s.expire(time.monotonic() + T - 1) == []  # the transfer's own deadline comes first
    assert s.expire(time.monotonic() + 2 * T) == [r] and "KV receive did not end" in r.error.message
    assert used(s) == 2
    s.kv_failed("r", "the receiver's own deadline")
    assert_no_leak(s)


def test_callers_deadline_in_any_state():
    s = make(num_blocks=2)
    a, b = req("a", 3), req("b", 6, start=30)
    a.deadline = b.deadline = time.monotonic() + 1.0
    s.add_request(a)
    s.schedule()
    s.add_reservation(b)  # 2 blocks, 1 free
    s.schedule()
    assert (a.status, b.status) == (S.RUNNING, S.WAITING_FOR_BLOCKS)
    expired = s.expire(time.monotonic() + 2.0)
    assert set(expired) == {a, b}
    assert all(r.error.kind == "deadline" and "ran past its deadline" in r.error.message for r in expired)
    assert_no_leak(s)


# ---- prefill tier -----------------------------------------------------------
def test_prefill_tier_holds_then_releases_after_send():
    s = make()
    r = req("p", 9, hold=True)
    s.add_request(r)
    out = step(s)
    assert out.started == [r]
    assert r.status == S.HELD_FOR_SEND and not r.is_finished and r.output_token_ids == [7]
    assert s.held == {"p": r} and s.kv.get_block_ids("p") == [0, 1, 2] and s.num_running == 0
    assert s.begin_send("p") == [0, 1, 2] and r.is_sending
    with pytest.raises(ValueError):
        s.begin_send("p")  # one send
    assert s.release_held("p") is r and r.status == S.FINISHED_LENGTH
    assert r.times.kv_send_start <= r.times.kv_send_end
    assert_no_leak(s)
    assert s.kv.pool.get_cached_block(s.kv.pool.blocks[0].block_hash) is not None  # stays in the prefix cache


def test_prefill_abort_during_send_waits_for_the_send():
    s = make()
    r = req("p", 9, hold=True)
    s.add_request(r)
    step(s)
    s.begin_send("p")
    assert s.finish_request("p") is r and r.status == S.FINISHED_ABORTED
    assert used(s) == 3  # the send still reads them
    assert s.release_held("p") is None
    assert_no_leak(s)


@pytest.mark.parametrize("end", ["abort_running", "abort_held", "expire_running", "released"])
def test_layerwise_send_starts_with_the_last_chunk_and_holds_the_blocks(end):
    s = make(budget=4)
    r = req("p", 9, hold=True)
    s.add_request(r)
    step(s)
    step(s)
    out = s.schedule()  # the last chunk: the engine starts the layer-wise send here
    assert [x.samples for x in out.scheduled] == [True]
    s.begin_streamed_send("p")
    assert r.is_sending and r.status == S.RUNNING
    with pytest.raises(ValueError):
        s.begin_streamed_send("p")
    if end == "abort_running":
        s.finish_request("p")
    elif end == "expire_running":
        r.deadline = time.monotonic()
        assert s.expire(time.monotonic() + 1) == [r]
    else:
        s.update_from_output(out, [7])
        assert r.status == S.HELD_FOR_SEND and r.is_sending
        with pytest.raises(ValueError):
            s.begin_send("p")  # it is sending already
        if end == "abort_held":
            s.finish_request("p")
    if end != "released":
        assert r.is_finished and used(s) == 3  # the send still reads them
        assert s.release_held("p") is None
    else:
        assert s.release_held("p") is r and r.status == S.FINISHED_LENGTH
    assert_no_leak(s)


@pytest.mark.parametrize("state", ["WAITING", "RUNNING", "HELD_FOR_SEND"])
def test_prefill_abort_before_send_frees_at_once(state):
    s = make(budget=4)
    r = req("p", 9, hold=True)
    s.add_request(r)
    for _ in range({"WAITING": 0, "RUNNING": 1, "HELD_FOR_SEND": 3}[state]):
        step(s)
    assert r.status.name == state
    s.finish_request("p")
    assert r.status == S.FINISHED_ABORTED
    with pytest.raises(ValueError, match="no KV held"):
        s.begin_send("p")
    assert_no_leak(s)


def test_held_deadlines():
    s = make()
    idle, busy = req("idle", 5, hold=True), req("busy", 5, start=40, hold=True)
    s.add_request(idle)
    s.add_request(busy)
    step(s)
    s.begin_send("busy")
    expired = s.expire(time.monotonic() + 2 * T)
    assert set(expired) == {idle, busy}
    assert "did not start" in idle.error.message and "did not end" in busy.error.message
    assert used(s) == 2  # busy's blocks wait for its send
    s.release_held("busy")
    assert_no_leak(s)


# ---- memory -----------------------------------------------------------------
def test_long_run_state_does_not_grow():
    """Thousands of requests through both tiers' paths: every per-request
    container empties, the block pool records no events until subscribed,
    and traced memory stays flat."""
    s = make(num_blocks=64, block_size=4, max_seqs=8)

    def serve(first: int, n: int) -> None:
        for i in range(first, first + n):
            p = req(f"p{i}", 9, start=i, hold=True)  # a new prompt each time: new hashes, evictions
            s.add_request(p)
            d = req(f"d{i}", 9, start=i)
            s.add_reservation(d)
            step(s)
            s.begin_send(p.request_id)
            s.release_held(p.request_id)
            s.begin_kv_receive(d.request_id, s.kv.get_block_ids(d.request_id))
            s.kv_received(d.request_id, 1)
            while d.status == S.RUNNING:
                step(s)

    serve(0, 300)
    tracemalloc.start()
    gc.collect()  # what stays, not what the cyclic collector has yet to visit
    before = tracemalloc.take_snapshot()
    serve(300, 3000)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(st.size_diff for st in after.compare_to(before, "filename"))
    assert growth < 64 * 1024, f"{growth} bytes retained after 3000 more requests"
    assert_no_leak(s)
    assert s.kv.pool.take_events() == ([], False) and len(s.kv.pool.cached) <= 64
    s.kv.pool.subscribe_events(max_events=50)
    serve(3300, 30)
    events, lost = s.kv.pool.take_events()
    assert len(events) <= 50 and lost


def test_a_prompt_that_outgrows_the_cache_waits_for_blocks_held_for_a_send():
    """Prefill tier: a prompt alone in the batch that cannot get its next block, while blocks
    wait for a KV send, waits for them (preempted, resumed once the send frees them) instead
    of ending with "length"."""
    s = make(num_blocks=8, block_size=4, budget=8)
    a = req("a", 16, hold=True)
    s.add_request(a)
    while a.status != S.HELD_FOR_SEND:
        step(s)
    assert used(s) == 4  # a's blocks, held for its send
    b = req("b", 20, start=100, hold=True)
    s.add_request(b)
    for _ in range(6):
        step(s)
    assert b.status in (S.WAITING, S.PREEMPTED) and not b.is_finished  # out of blocks: it waits
    s.begin_send("a")
    s.release_held("a")
    while b.status != S.HELD_FOR_SEND:
        step(s)
    assert b.num_computed_tokens == 20
    s.begin_send("b")
    s.release_held("b")
    assert_no_leak(s)
