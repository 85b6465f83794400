"""Fake prefill and decode servers for gateway tests: the real protocol of
protos/pdserve/v1/engine.proto, no model. The "model" emits a fixed script
of token ids (truncated by max_tokens / stop_token_ids, ending in eos).

Both servers run on one grpc.aio event loop in a background thread; the
prefill's "KV transfer" just wakes the decode request waiting for it. Knobs
(``FakeEngine.knobs``) change behaviour between tests; observations
(``active``, ``cancelled``, ``decode_requests``, ...) let tests assert that
the gateway freed everything.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc.server import RpcServer

BLOCK_SIZE = 16


@dataclass
class Knobs:
    token_delay: float = 0.0  # seconds between decode deltas
    tokens_per_delta: int = 2
    queue_full: bool = False  # Decode.Generate -> RESOURCE_EXHAUSTED
    prefill_error: grpc.StatusCode | None = None
    prefill_delay: float = 0.0
    num_cached_tokens: int = 0
    fail_after_deltas: int | None = None  # Decode.Generate fails (INTERNAL) after this many deltas
    # Set: Decode.Generate sends its first delta, then waits for this event before the rest.
    hold_after_first: threading.Event | None = None
    # Set: Decode.Generate waits for this event before its last delta (a stream that cannot end
    # on its own: only a cancel ends it).
    hold_before_last: threading.Event | None = None


@dataclass
class FakeState:
    script: list[int] = field(default_factory=list)
    eos: int = 2
    knobs: Knobs = field(default_factory=Knobs)
    active: set[str] = field(default_factory=set)  # decode requests holding "blocks"
    cancelled: list[str] = field(default_factory=list)
    decode_requests: list[engine_pb2.DecodeRequest] = field(default_factory=list)
    prefill_requests: list[engine_pb2.PrefillRequest] = field(default_factory=list)
    metadata: list[dict[str, str]] = field(default_factory=list)
    kv_arrived: dict[str, asyncio.Future[int]] = field(default_factory=dict)


def _logprob(token_id: int, n: int) -> common_pb2.TokenLogprob:
    top = [common_pb2.TopLogprob(token_id=token_id, logprob=-0.25)]
    top += [common_pb2.TopLogprob(token_id=token_id + i, logprob=-1.0 - i) for i in range(1, n)]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=-0.25, rank=1, top=top[:n])


class FakeDecode(engine_pb2_grpc.DecodeServicer):
    def __init__(self, state: FakeState, address: str) -> None:
        self.s = state
        self.address = address

    def _output(self, req: engine_pb2.DecodeRequest) -> tuple[list[int], str]:
        limit = req.sampling.max_tokens if req.sampling.HasField("max_tokens") else 10**9
        out: list[int] = []
        for t in self.s.script + [self.s.eos]:
            out.append(t)
            if (t == self.s.eos and not req.sampling.ignore_eos) or t in req.sampling.stop_token_ids:
                return out, "stop"
            if len(out) >= limit:
                return out, "length"
        return out, "length"

    async def Generate(self, req: engine_pb2.DecodeRequest, context: Any):
        s = self.s
        s.decode_requests.append(req)
        s.metadata.append({k: v for k, v in context.invocation_metadata()})
        if s.knobs.queue_full:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode queue is full (fake)")
        s.active.add(req.request_id)
        finished = False
        try:
            out, reason = self._output(req)
            if req.remote_prefill:
                fut = asyncio.get_running_loop().create_future()
                s.kv_arrived[req.request_id] = fut
                n = -(-len(req.prompt_token_ids) // BLOCK_SIZE)
                yield engine_pb2.DecodeResponse(reserved=engine_pb2.Reserved(
                    block_ids=list(range(100, 100 + n)), num_cached_tokens=s.knobs.num_cached_tokens))
                out[0] = await fut  # the token the prefill server sampled
            want_lp = req.sampling.HasField("logprobs")
            chunks = [out[:1]] + [out[i:i + s.knobs.tokens_per_delta]
                                  for i in range(1, len(out), s.knobs.tokens_per_delta)]
            for i, ids in enumerate(chunks):
                if i == s.knobs.fail_after_deltas:
                    finished = True  # failed, not cancelled
                    await context.abort(grpc.StatusCode.INTERNAL, "decode step failed (fake)")
                if i and s.knobs.token_delay:
                    await asyncio.sleep(s.knobs.token_delay)
                if i == 1 and s.knobs.hold_after_first is not None:
                    while not s.knobs.hold_after_first.is_set():
                        await asyncio.sleep(0.01)
                last = i == len(chunks) - 1
                if last and s.knobs.hold_before_last is not None:
                    while not s.knobs.hold_before_last.is_set():
                        await asyncio.sleep(0.01)
                finished = last
                yield engine_pb2.DecodeResponse(delta=engine_pb2.TokenDelta(
                    token_ids=ids, finish_reason=reason if last else "",
                    logprobs=[_logprob(t, req.sampling.logprobs) for t in ids] if want_lp else [],
                    num_cached_tokens=s.knobs.num_cached_tokens))
        finally:
            # Cancellation reaches a streaming handler as CancelledError or, when it
            # is parked at a yield, as GeneratorExit: count both.
            if not finished:
                s.cancelled.append(req.request_id)
            s.active.discard(req.request_id)
            s.kv_arrived.pop(req.request_id, None)

    async def GetLoad(self, req: Any, context: Any) -> common_pb2.LoadInfo:
        return common_pb2.LoadInfo(role="decode", address=self.address, metrics_url="http://fake/metrics",
                                   num_running=len(self.s.active), kv_blocks_used=len(self.s.active),
                                   kv_blocks_total=1000, block_size=BLOCK_SIZE, model="fake")

    async def Abort(self, req: common_pb2.AbortRequest, context: Any) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=False)


class FakePrefill(engine_pb2_grpc.PrefillServicer):
    def __init__(self, state: FakeState, address: str) -> None:
        self.s = state
        self.address = address

    async def Prefill(self, req: engine_pb2.PrefillRequest, context: Any) -> engine_pb2.PrefillResponse:
        s = self.s
        s.prefill_requests.append(req)
        if s.knobs.prefill_delay:
            await asyncio.sleep(s.knobs.prefill_delay)
        if s.knobs.prefill_error is not None:
            await context.abort(s.knobs.prefill_error, "KV transfer failed (fake)")
        first = s.script[0] if s.script else s.eos
        fut = s.kv_arrived.get(req.request_id)
        if fut is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation for {req.request_id}")
        fut.set_result(first)
        lp = _logprob(first, req.sampling.logprobs) if req.sampling.HasField("logprobs") else None
        return engine_pb2.PrefillResponse(first_token=first, logprob=lp, num_cached_tokens=s.knobs.num_cached_tokens)

    async def GetLoad(self, req: Any, context: Any) -> common_pb2.LoadInfo:
        return common_pb2.LoadInfo(role="prefill", address=self.address, kv_blocks_total=1000,
                                   block_size=BLOCK_SIZE, model="fake")


class FakeEngine:
    """One fake prefill server and one fake decode server on loopback."""

    def __init__(self) -> None:
        self.state = FakeState()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-engine", daemon=True)
        self._servers: list[RpcServer] = []
        self.prefill_address = self.decode_address = ""

    def start(self) -> "FakeEngine":
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        prefill = RpcServer("127.0.0.1:0", ["pdserve.v1.Prefill"])
        decode = RpcServer("127.0.0.1:0", ["pdserve.v1.Decode"])
        self.prefill_address, self.decode_address = f"127.0.0.1:{prefill.port}", f"127.0.0.1:{decode.port}"
        engine_pb2_grpc.add_PrefillServicer_to_server(FakePrefill(self.state, self.prefill_address), prefill.server)
        engine_pb2_grpc.add_DecodeServicer_to_server(FakeDecode(self.state, self.decode_address), decode.server)
        for srv in (prefill, decode):
            await srv.start()
            await srv.set_serving(True)
        self._servers = [prefill, decode]

    def set_serving(self, serving: bool) -> None:
        async def go() -> None:
            for srv in self._servers:
                await srv.set_serving(serving)
        self._call(go())

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Assert that every decode request is gone (its "blocks" are free)."""
        deadline = time.monotonic() + timeout
        while self.state.active and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not self.state.active, self.state.active

    def reset(self) -> None:
        self.state.knobs = Knobs()
        self.state.cancelled.clear()
        self.state.decode_requests.clear()
        self.state.prefill_requests.clear()
        self.state.metadata.clear()

    def stop(self) -> None:
        async def go() -> None:
            for srv in self._servers:
                await srv.server.stop(grace=0)
        self._call(go())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)
