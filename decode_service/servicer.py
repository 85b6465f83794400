"""pdserve.v1.Decode: continuous batching of requests whose prompt KV arrives
from a prefill server (or is computed here in local-prefill mode).

Remote prefill, as seen from one request:
  Generate() -> reserve blocks (wait FIFO if full) -> "reserved" message
  -> the KV receiver writes the blocks and calls kv_arrived -> the request
  joins the running batch with the prefill's first token -> token deltas.
Every exit path (finish, client cancel, deadline, KV timeout, abort) goes
through ``EngineBridge.abort`` / the scheduler's one finish path, which
frees the request's blocks.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

import grpc

from engine.llm_engine import LLMEngine
from engine.request import Request
from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc.convert import logprobs_to_proto, sampling_from_proto
from decode_service.kv_receiver import KVReceivers
from rpc.engine_bridge import Delta, EngineBridge
from rpc.engine_metrics import EngineMetrics
from rpc.engine_server import EngineServicerBase

logger = logging.getLogger(__name__)


class Reservations:
    """FIFO of requests waiting for KV blocks. Engine thread only."""

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.pending: deque[tuple[Request, asyncio.Future, asyncio.AbstractEventLoop]] = deque()

    def try_reserve(self, engine: LLMEngine, req: Request, fut: asyncio.Future,
                    aloop: asyncio.AbstractEventLoop) -> None:
        if not self.pending:
            ids = engine.scheduler.reserve(req)
            if ids is not None:
                aloop.call_soon_threadsafe(_resolve, fut, ids)
                return
        if len(self.pending) >= self.max_queued:
            raise OverflowError(f"decode queue is full ({self.max_queued} requests waiting for KV blocks)")
        self.pending.append((req, fut, aloop))

    def drain(self, engine: LLMEngine) -> bool:
        """Reserve for waiting requests in order while blocks allow."""
        did = False
        while self.pending:
            req, fut, aloop = self.pending[0]
            if fut.cancelled():
                self.pending.popleft()
                continue
            ids = engine.scheduler.reserve(req)
            if ids is None:
                break
            self.pending.popleft()
            aloop.call_soon_threadsafe(_resolve, fut, ids)
            did = True
        return did

    def cancel(self, request_id: str) -> bool:
        for item in list(self.pending):
            if item[0].request_id == request_id:
                self.pending.remove(item)
                return True
        return False


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def delta_to_proto(d: Delta) -> engine_pb2.DecodeResponse:
    return engine_pb2.DecodeResponse(delta=engine_pb2.TokenDelta(
        token_ids=d.token_ids, logprobs=logprobs_to_proto(d.logprobs),
        finish_reason=d.finish_reason or "", num_cached_tokens=d.num_cached_tokens))


class DecodeServicer(EngineServicerBase, engine_pb2_grpc.DecodeServicer):
    """The decode tier's gRPC service; answers UNAVAILABLE until attached."""

    name = "pdserve.v1.Decode"
    role = "decode"

    def __init__(self, kv_host: str, kv_timeout: float, max_queued: int, local_prefill: bool = False) -> None:
        super().__init__()
        self.kv_host, self.kv_timeout, self.local_prefill = kv_host, kv_timeout, local_prefill
        self.reservations = Reservations(max_queued)
        self.kv_receivers: KVReceivers | None = None

    def register(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_DecodeServicer_to_server(self, server)

    def attach(self, engine: LLMEngine, address: str, metrics: EngineMetrics | None = None) -> None:
        self.bridge = EngineBridge(engine, "decode", address, metrics,
                                   idle_hook=lambda: self.reservations.drain(engine))
        self.kv_receivers = KVReceivers(self.bridge, self.kv_host, self.kv_timeout,
                                        metrics.record_transfer if metrics else None)
        self.bridge.start()

    def close(self) -> None:
        if self.kv_receivers is not None:
            self.kv_receivers.close()
        super().close()

    async def Generate(self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        bridge = await self._ready(context)
        try:
            params: SamplingParams = sampling_from_proto(request.sampling)
            req = await bridge.run(lambda e: e.make_request(rid, list(request.prompt_token_ids), params))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            queue = bridge.open_stream(rid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        finished = False
        try:
            if request.remote_prefill and not self.local_prefill:
                block_ids = await self._reserve(req, context)
                yield engine_pb2.DecodeResponse(reserved=engine_pb2.Reserved(
                    block_ids=block_ids, num_cached_tokens=req.num_cached_tokens))
                first = await self._wait_first(queue, rid, context)
                finished = bool(first.finish_reason)
                yield delta_to_proto(first)
            else:
                await bridge.run(lambda e: e.scheduler.add_request(req))
            while not finished:
                d = await queue.get()
                finished = bool(d.finish_reason)
                yield delta_to_proto(d)
        finally:
            bridge.close_stream(rid)
            if not finished:  # cancelled, deadline, error: free everything
                bridge.submit(lambda e: self._abort(e, rid))

    async def _reserve(self, req: Request, context) -> list[int]:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        aloop = asyncio.get_running_loop()
        try:
            await self.bridge.run(lambda e: self.reservations.try_reserve(e, req, fut, aloop))
        except OverflowError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return await fut

    async def _wait_first(self, queue: "asyncio.Queue[Delta]", rid: str, context) -> Delta:
        try:
            return await asyncio.wait_for(queue.get(), self.kv_timeout)
        except asyncio.TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"request {rid}: no KV arrived from the prefill tier within {self.kv_timeout:.0f}s")
            raise  # unreachable: abort raises

    def _abort(self, engine: LLMEngine, rid: str) -> None:
        """Engine thread: the one abort path for every state."""
        self.reservations.cancel(rid)
        if self.kv_receivers.defer_abort_if_receiving(rid):
            return  # freed when the in-flight receive into its blocks ends
        self.bridge.abort_in_engine(engine, rid)  # type: ignore[union-attr]

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        rid = request.request_id
        await self._ready(context)
        found = await self.bridge.run(lambda e: rid in e.scheduler.requests or
                                      any(r.request_id == rid for r, _, _ in self.reservations.pending))
        self.bridge.submit(lambda e: self._abort(e, rid))
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        bridge = await self._ready(context)
        info = bridge.load_info()
        info.num_waiting += len(self.reservations.pending)
        return info

    async def OpenKVChannel(self, request: engine_pb2.OpenKVChannelRequest, context):
        await self._ready(context)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self.kv_receivers.open, request)
        except ValueError as exc:  # incompatible layout or device
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
