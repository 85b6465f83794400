"""The decode side's KV roles (KVReceiveWorker, KVReceiveScheduler) against a real
engine thread and a real gloo pair: every receive it begins ends in the engine (received or failed),
also when the engine refuses the destination blocks or answers too late, and
the pair keeps working afterwards."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from engine.config import EngineArgs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import ChannelRequest, KVLayout, KVReceiveScheduler, KVReceiveWorker, KVSender, KVTransferError
from rpc.engine_bridge import EngineBridge

TIMEOUT = 2.0
TP_WINDOW = 10.0  # the two-rank test's setup window
SP = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _engine(model_dir, timeout: float = TIMEOUT, **kw) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), kv_cache_memory="4MiB",
                                                 kv_transfer_timeout=timeout, **kw))


def _serve(engine: LLMEngine, timeout: float = TIMEOUT, window: float | None = None
           ) -> tuple[EngineBridge, KVReceiveWorker]:
    """The engine thread, and the decode server's KV receive roles on it (``timeout``: how long a
    reserved request waits for its parts; ``window``, default ``timeout``: each pair's setup and
    data window)."""
    bridge = EngineBridge(engine, "decode", "test")
    bridge.start()
    return bridge, KVReceiveWorker(engine, KVReceiveScheduler(bridge.loop, timeout), "127.0.0.1",
                                   timeout if window is None else window)


async def _reserve(bridge: EngineBridge, rid: str):
    """A 37-token prompt's three blocks reserved for ``rid``: (its delta queue, the blocks)."""
    q = bridge.open_stream(rid)
    await bridge.run(lambda e: e.reserve(rid, list(range(3, 40)), SP))
    d = await asyncio.wait_for(q.get(), 10)
    assert d.event == "reserved" and len(d.block_ids) == 3
    return q, d.block_ids


async def _stream_to_end(q, seconds: float):
    """A request's deltas until it finishes (each within ``seconds``): (its tokens, the last delta)."""
    tokens = []
    while True:
        d = await asyncio.wait_for(q.get(), seconds)
        tokens += d.token_ids
        if d.finish_reason:
            return tokens, d


async def _until(done, seconds: float) -> None:
    """Poll ``done()`` until it is true or ``seconds`` pass (the caller asserts it after)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def test_every_begun_receive_ends_in_the_engine(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    asyncio.run(_scenario(engine))


async def _scenario(engine: LLMEngine) -> None:
    loop = asyncio.get_running_loop()
    bridge, receivers = _serve(engine)
    layout = KVLayout.of(engine.kv_cache, engine.config.model.served_model_name)
    source = torch.randn_like(engine.kv_cache)  # the "prefill" side's cache
    try:
        resp = await loop.run_in_executor(None, receivers.open, ChannelRequest(peer="p:1", layout=layout,
                                                                               device="cpu"))
        sender = await loop.run_in_executor(None, lambda: KVSender.connect(
            "127.0.0.1", resp.port, layout, timeout=10))

        async def send(rid: str, dst: list[int]) -> None:
            await loop.run_in_executor(None, lambda: sender.send(rid, [10, 11, 12], dst, source,
                                                                 meta={"first_token": 5}))

        # 1. The engine refuses the destination blocks (a ValueError, not a
        #    KVTransferError): the data is drained and the request fails at once.
        q, dst = await _reserve(bridge, "wrong")
        await send("wrong", dst[::-1])
        d = await asyncio.wait_for(q.get(), 10)
        assert d.finish_reason == "abort" and d.error.kind == "kv_transfer" and "reserved" in d.error.message
        assert engine.stats().kv_blocks_used == 0

        # 2. The engine thread answers the validation after the receiver gave
        #    up waiting: the failure still lands after the begin, and frees.
        q, dst = await _reserve(bridge, "late")
        bridge.submit(lambda e: time.sleep(TIMEOUT + 1.0))  # the engine thread is busy
        t0 = time.monotonic()
        await send("late", dst)
        d = await asyncio.wait_for(q.get(), 10)
        assert d.finish_reason == "abort" and d.error.kind == "kv_transfer"
        assert time.monotonic() - t0 < TIMEOUT + 5
        assert engine.stats().kv_blocks_used == 0 and not engine.scheduler.requests

        # 3. The pair is still good: the next transfer lands and the request runs.
        q, dst = await _reserve(bridge, "ok")
        await send("ok", dst)
        tokens, d = await _stream_to_end(q, 10)
        assert d.finish_reason == "length" and d.error is None and tokens[0] == 5 and len(tokens) == 3
        # The two full prompt blocks hold exactly what was sent (decoding has written into the third).
        assert torch.equal(engine.kv_cache[:, dst[:2]], source[:, [10, 11]])
        assert engine.stats().kv_blocks_used == 0 and receivers.num_pairs == 1
        await loop.run_in_executor(None, sender.close)
        await _until(lambda: not receivers.num_pairs, 10)  # the peer closed: the pair is forgotten
        assert receivers.num_pairs == 0
    finally:
        receivers.close()
        bridge.stop()


def test_parts_from_tensor_parallel_ranks_come_together(tiny_llama_dir):
    """A two-rank prefill engine's channel: a pair per rank, each into its share of the KV
    heads. A request runs once both parts landed; one whose second part never comes fails
    after the transfer timeout, and its blocks go back. The pairs' setup window is wider than
    that timeout: on a loaded machine (the whole suite on 2 cores) building both pairs at once
    took more than 2 s, and the receiver closed one pair's store under its sender; the window
    is not what this test checks."""
    engine = _engine(tiny_llama_dir)
    asyncio.run(_parts_scenario(engine))


async def _parts_scenario(engine: LLMEngine) -> None:
    loop = asyncio.get_running_loop()
    bridge, receivers = _serve(engine, window=TP_WINDOW)
    layout = KVLayout.of(engine.kv_cache, engine.config.model.served_model_name)  # 2 KV heads
    source = torch.randn_like(engine.kv_cache)
    senders = []
    try:
        resp = await loop.run_in_executor(None, receivers.open, ChannelRequest(
            peer="p:1", layout=layout, device="cpu", tensor_parallel_size=2))
        assert [(p.src_rank, *p.src_heads) for p in resp.parts] == [(0, 0, 1), (1, 0, 1)]
        one_head = KVLayout.of(engine.kv_cache[..., 0:1, :], layout.model)
        senders += await asyncio.gather(*(loop.run_in_executor(None, lambda p=part: KVSender.connect(
            "127.0.0.1", p.port, one_head, timeout=10)) for part in resp.parts))  # both ranks at once

        async def send(rank: int, rid: str, dst: list[int]) -> None:
            await loop.run_in_executor(None, lambda: senders[rank].send(
                rid, [10, 11, 12], dst, source[..., rank:rank + 1, :], meta={"first_token": 5}))

        q, dst = await _reserve(bridge, "both")
        await asyncio.gather(send(1, "both", dst), send(0, "both", dst))
        d = await asyncio.wait_for(q.get(), 10)
        assert d.error is None and d.token_ids[:1] == [5]
        assert torch.equal(engine.kv_cache[:, dst[:2]], source[:, [10, 11]])  # both heads, each from its rank

        q, dst = await _reserve(bridge, "half")
        t0 = time.monotonic()
        await send(0, "half", dst)
        d = await asyncio.wait_for(q.get(), 10)
        assert d.finish_reason == "abort" and "1 of 2 KV parts" in d.error.message
        assert TIMEOUT - 0.5 < time.monotonic() - t0 < TIMEOUT + 5
        await _until(lambda: not engine.stats().kv_blocks_used, 10)  # "both" finishes decoding
        assert engine.stats().kv_blocks_used == 0
        # One part lands, the other is refused before admission (a block id out of range):
        # the request fails with the refusal, once both parts are over, and frees its blocks.
        q, dst = await _reserve(bridge, "mixed")
        await send(0, "mixed", dst)
        await send(1, "mixed", [dst[0], dst[1], 10_000])
        d = await asyncio.wait_for(q.get(), 10)
        assert d.finish_reason == "abort" and "out of range" in d.error.message
        await _until(lambda: not engine.stats().kv_blocks_used, 10)
        assert engine.stats().kv_blocks_used == 0
        # The late part is refused (drained): the pair stays in step for the next request.
        await send(1, "half", dst)
        # A part that never comes: one more timeout after the failure nothing of it is left.
        q, dst = await _reserve(bridge, "lost")
        await send(0, "lost", dst)
        d = await asyncio.wait_for(q.get(), 10)
        assert d.finish_reason == "abort" and "1 of 2 KV parts" in d.error.message
        assert "lost" in receivers.scheduler._receives
        await _until(lambda: not receivers.scheduler._receives, 2 * TIMEOUT + 5)
        assert not receivers.scheduler._receives
        q, dst = await _reserve(bridge, "again")
        await asyncio.gather(send(0, "again", dst), send(1, "again", dst))
        d = await asyncio.wait_for(q.get(), 10)
        assert d.error is None and d.token_ids[:1] == [5]
    finally:
        for s in senders:
            await loop.run_in_executor(None, s.close)
        receivers.close()
        bridge.stop()


def test_a_part_that_ends_before_its_admission_is_refused_when_it_comes(tiny_llama_dir):
    """A worker rank that gave up waiting for rank 0's answer to its admission ends its part;
    rank 0 may take that end before the admission itself. The request fails at once, the
    late admission is refused (nothing counts it in flight), and nothing of it stays."""
    engine = _engine(tiny_llama_dir)
    asyncio.run(_late_admission_scenario(engine))


async def _late_admission_scenario(engine: LLMEngine) -> None:
    loop = asyncio.get_running_loop()
    bridge, receivers = _serve(engine)
    parts = receivers.scheduler
    try:
        q, dst = await _reserve(bridge, "late")
        t0 = time.monotonic()
        await loop.run_in_executor(None, lambda: parts.ended("late", "rank 1 gave up waiting", part="b"))
        d = await asyncio.wait_for(q.get(), 10)
        assert d.finish_reason == "abort" and "gave up waiting" in d.error.message
        assert time.monotonic() - t0 < TIMEOUT
        with pytest.raises(KVTransferError, match="after it ended"):
            await loop.run_in_executor(None, lambda: parts.admit("late", dst, 2, part="b"))
        # the other rank's part comes now: the engine no longer has the request, so it is refused
        with pytest.raises(ValueError, match="request late is not waiting for KV here"):
            await loop.run_in_executor(None, lambda: parts.admit("late", dst, 2, part="a"))
        await loop.run_in_executor(None, lambda: parts.ended("late", "refused", part="a"))
        await _until(lambda: not parts._receives, 2 * TIMEOUT + 5)
        assert not parts._receives and not parts._ended_unadmitted
        assert engine.stats().kv_blocks_used == 0
    finally:
        receivers.close()
        bridge.stop()


def test_a_tensor_parallel_decode_engine_receives_on_every_rank(tiny_llama_dir):
    """A two-rank decode engine: one pair into rank 0's KV head, one into the worker's (which
    asks rank 0 before anything lands). A prefill peer that opens its channel again gets new
    pairs on both ranks; the old worker pair goes once the new channel is up. The pairs' setup
    window is wider than the other tests': on a loaded machine building the two pairs (the second
    one in the worker process) took more than 2 s, and 5 s when both were built at once; the
    window is not what this test checks."""
    engine = _engine(tiny_llama_dir, timeout=TP_WINDOW, tensor_parallel_size=2)
    try:
        asyncio.run(_tp_decode_scenario(engine))
    finally:
        engine.close()


async def _tp_decode_scenario(engine: LLMEngine) -> None:
    loop = asyncio.get_running_loop()
    bridge, receivers = _serve(engine, TP_WINDOW)
    model_layout = receivers.layout  # both KV heads; rank 0's cache holds one
    one_head = KVLayout.of(engine.kv_cache, model_layout.model)
    source = torch.randn(*engine.kv_cache.shape[:4], 2, engine.kv_cache.shape[5])
    senders = []
    try:
        request = ChannelRequest(peer="p:1", layout=model_layout, device="cpu")
        first = await loop.run_in_executor(None, receivers.open, request)
        assert [(p.src_rank, *p.src_heads) for p in first.parts] == [(0, 0, 1), (0, 1, 2)]
        second = await loop.run_in_executor(None, receivers.open, request)  # the peer opens again
        for part in second.parts:  # one after the other: both within the window that began at open
            senders.append(await loop.run_in_executor(None, lambda p=part: KVSender.connect(
                "127.0.0.1", p.port, one_head, timeout=TP_WINDOW)))
        await _until(lambda: receivers.num_pairs == 2, 3 * TP_WINDOW + 5)  # the first channel's pairs go
        assert receivers.num_pairs == 2 and [r for r, _ in receivers._remote["p:1"]] == [1]

        q, dst = await _reserve(bridge, "r")
        await asyncio.gather(*(loop.run_in_executor(None, lambda s=s, h=h: s.send(
            "r", [10, 11, 12], dst, source[..., h:h + 1, :].contiguous(), meta={"first_token": 5}))
            for h, s in enumerate(senders)))
        tokens, d = await _stream_to_end(q, 20)
        assert d.error is None and tokens[0] == 5 and len(tokens) == 3
        assert torch.equal(engine.kv_cache[:, dst[:2]], source[:, [10, 11], ..., 0:1, :])  # rank 0's head
    finally:
        for s in senders:
            await loop.run_in_executor(None, s.close)
        receivers.close()
        bridge.stop()
