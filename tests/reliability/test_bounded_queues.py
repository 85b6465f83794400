"""Every engine-side queue has a bound: the engine loop's command queue
refuses new awaited work when full (never an abort), a request stream holds
at most one pending token delta, and a server's waiting queue refuses
requests past --max-queued-requests."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine.config import CacheConfig, SchedulerConfig
from engine.engine_loop import EngineLoop
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from rpc.engine_bridge import Delta, _DeltaQueue


class _Idle:
    def bind_thread(self) -> None:
        pass

    def has_unfinished_requests(self) -> bool:
        return False


def test_command_queue_refuses_bounded_work_when_full_but_never_fire_and_forget():
    loop = EngineLoop(_Idle(), lambda out: None, max_pending=3)  # type: ignore[arg-type]
    gate, running = threading.Event(), threading.Event()
    loop.start()
    try:
        blocker = loop.submit(lambda e: running.set() or gate.wait(5))  # holds the engine thread
        assert running.wait(5)
        queued = [loop.submit(lambda e: "ok", bounded=True) for _ in range(3)]
        refused = loop.submit(lambda e: "late", bounded=True)
        with pytest.raises(OverflowError, match="command queue is full"):
            refused.result(1)
        aborts = [loop.submit(lambda e: "abort") for _ in range(10)]  # always taken
        gate.set()
        assert blocker.result(5) is True
        assert [f.result(5) for f in queued] == ["ok"] * 3
        assert [f.result(5) for f in aborts] == ["abort"] * 10
        assert loop.submit(lambda e: "again", bounded=True).result(5) == "again"
    finally:
        loop.stop()


def test_a_stream_keeps_one_pending_token_delta():
    async def run() -> list[Delta]:
        q = _DeltaQueue()
        q.put_nowait(Delta("r", [], event="reserved", block_ids=[1, 2]))
        for i in range(1000):  # a reader that does not keep up with the engine
            q.put_nowait(Delta("r", [i], logprobs=[f"lp{i}"], num_output_tokens=i + 1))
        assert q.qsize() == 2
        q.put_nowait(Delta("r", [1000], num_output_tokens=1001, finish_reason="length"))
        q.put_nowait(Delta("r", [], event="started"))  # events are never merged
        return [q.get_nowait() for _ in range(q.qsize())]

    reserved, tokens, started = asyncio.run(run())
    assert reserved.event == "reserved" and reserved.block_ids == [1, 2]
    assert tokens.token_ids == list(range(1001)) and tokens.logprobs == [f"lp{i}" for i in range(1000)]
    assert tokens.finish_reason == "length" and tokens.num_output_tokens == 1001
    assert started.event == "started"


def test_finished_or_held_deltas_are_not_merged_into():
    async def run() -> int:
        q = _DeltaQueue()
        q.put_nowait(Delta("r", [1], is_held=True))
        q.put_nowait(Delta("r", [2]))
        q.put_nowait(Delta("r", [3], finish_reason="stop"))
        q.put_nowait(Delta("r", [4]))
        return q.qsize()

    assert asyncio.run(run()) == 3


def test_waiting_queue_bound():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  kv_transfer_timeout=10.0, max_queued_requests=8),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 16)

    def req(i: int) -> Request:
        return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2), max_model_len=256)

    for i in range(5):  # unbounded unless a server sets the bound (the offline LLM queues any number)
        s.add_request(req(i))
    s.limit_waiting(5)
    with pytest.raises(OverflowError, match="waiting queue is full"):
        s.add_request(req(5))
    assert "r5" not in s.requests and len(s.waiting) == 5
    s.finish_request("r0")
    s.add_request(req(6))
