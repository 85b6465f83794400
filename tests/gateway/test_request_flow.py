"""RequestFlow in-process against fake decode servers: retry on another
decode server, error kinds, abort and deadlines."""
from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling_params import SamplingParams
from gateway.errors import ErrorKind, GatewayError
from gateway.instances import InstanceRegistry
from gateway.request_flow import PreparedRequest, RequestFlow
from gateway.router import Router
from tests.gateway.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def fakes():
    engines = [FakeEngine().start(), FakeEngine().start()]
    for e in engines:
        e.state.script = list(range(10, 30))
    yield engines
    for e in engines:
        e.stop()


@pytest.fixture(autouse=True)
def _reset(fakes):
    for f in fakes:
        f.reset()


def _request(timeout: float = 10.0, max_tokens: int = 5) -> PreparedRequest:
    now = time.monotonic()
    return PreparedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=max_tokens), now, now + timeout)


def _run(decode: list[str], body, prefill: tuple[str, ...] = ()):
    async def go():
        reg = InstanceRegistry(prefill, tuple(decode))
        await reg.poll_once()
        try:
            return await body(reg, Router(reg))
        finally:
            await reg.close()
    return asyncio.run(go())


async def _collect(flow: RequestFlow):
    return [c async for c in flow.stream()]


def test_refused_request_is_retried_on_another_decode_server(fakes):
    a, b = fakes
    a.state.knobs.queue_full = True

    async def body(reg, router):
        return await _collect(RequestFlow(_request(), router))
    chunks = _run([a.decode_address, b.decode_address], body)
    assert [t for c in chunks for t in c.token_ids] == list(range(10, 15))
    assert chunks[-1].finish_reason == "length"
    assert len(a.state.decode_requests) == 1 and len(b.state.decode_requests) == 1


def test_every_decode_server_full_is_resource_exhausted(fakes):
    for f in fakes:
        f.state.knobs.queue_full = True

    async def body(reg, router):
        return await _collect(RequestFlow(_request(), router))
    with pytest.raises(GatewayError) as e:
        _run([f.decode_address for f in fakes], body)
    assert e.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "at capacity" in e.value.message


def test_unreachable_decode_server_is_marked_unhealthy_and_skipped(fakes):
    async def body(reg, router):
        dead = reg.decode[0]
        dead.is_healthy, dead.error = True, None  # polled healthy, died since
        chunks = await _collect(RequestFlow(_request(), router))
        return chunks, dead.is_healthy
    chunks, dead_healthy = _run(["127.0.0.1:1", fakes[0].decode_address], body)
    assert chunks[-1].finish_reason == "length" and not dead_healthy


def test_abort_ends_with_abort_and_cancels_the_decode_call(fakes):
    fake = fakes[0]
    fake.state.knobs.token_delay = 0.2

    async def body(reg, router):
        flow = RequestFlow(_request(max_tokens=50), router)
        chunks = []
        async for c in flow.stream():
            chunks.append(c)
            if len(chunks) == 1:
                flow.abort()
        return chunks
    chunks = _run([fake.decode_address], body)
    assert chunks[-1].finish_reason == "abort" and len(chunks) == 2
    fake.wait_idle()
    assert len(fake.state.cancelled) == 1


def test_deadline(fakes):
    fake = fakes[0]
    fake.state.knobs.token_delay = 0.3

    async def body(reg, router):
        return await _collect(RequestFlow(_request(timeout=0.5, max_tokens=50), router))
    with pytest.raises(GatewayError) as e:
        _run([fake.decode_address], body)
    assert e.value.kind is ErrorKind.DEADLINE_EXCEEDED


def test_remote_prefill_skips_the_repeated_first_token(fakes):
    fake = fakes[0]

    async def body(reg, router):
        return await _collect(RequestFlow(_request(max_tokens=4), router))
    chunks = _run([fake.decode_address], body, prefill=(fake.prefill_address,))
    assert [c.token_ids for c in chunks][0] == [10]  # from Prefill, before any decode delta
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13]
    assert fake.state.decode_requests[0].remote_prefill
