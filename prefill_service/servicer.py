"""pdserve.v1.Prefill: chunked prefill of many prompts under a token budget,
then the KV send to the decode server the gateway chose.

One request: make it finish after its first token and hold its blocks
(``hold_kv_on_finish``) -> the engine prefills it in chunks alongside others
-> the first token is sampled -> a worker thread sends the blocks to the
decode server -> the blocks are released (they stay in the prefix cache,
unreferenced, until evicted). Blocks are never released while a send reads
them, whatever happens to the RPC.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from engine.kv_transfer import KVLayout, KVTransferError
from engine.llm_engine import LLMEngine
from engine.request import Request
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from prefill_service.kv_sender import KVSenders
from rpc.convert import logprob_to_proto, sampling_from_proto
from rpc.engine_bridge import Delta, EngineBridge
from rpc.engine_metrics import EngineMetrics
from rpc.engine_server import EngineServicerBase

logger = logging.getLogger(__name__)


class PrefillServicer(EngineServicerBase, engine_pb2_grpc.PrefillServicer):
    name = "pdserve.v1.Prefill"
    role = "prefill"

    def __init__(self, kv_timeout: float) -> None:
        super().__init__()
        self.kv_timeout = kv_timeout
        self.senders: KVSenders | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")

    def register(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_PrefillServicer_to_server(self, server)

    def attach(self, engine: LLMEngine, address: str, metrics: EngineMetrics | None = None) -> None:
        self.bridge = EngineBridge(engine, "prefill", address, metrics, on_step=self._on_step)
        layout = KVLayout.of(engine.runner.kv_cache, engine.config.model.served_model_name)
        self.senders = KVSenders(engine.runner.kv_cache, layout, address, self.kv_timeout)
        self.bridge.start()

    def close(self) -> None:
        if self.senders is not None:
            self.senders.close()
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _on_step(self, updated: list[Request]) -> None:
        """Engine thread: a finished request's delta carries its held blocks."""
        assert self.bridge is not None
        for req in updated:
            d = self.bridge.snapshot(req)
            d.block_ids = self.bridge.engine.scheduler.kv.get_block_ids(req.request_id)
            self.bridge.post(d)

    async def Prefill(self, request: engine_pb2.PrefillRequest, context) -> engine_pb2.PrefillResponse:
        bridge = await self._ready(context)
        rid, t0 = request.request_id, time.time()
        try:
            params = sampling_from_proto(request.sampling)
            req = await bridge.run(lambda e: e.make_request(rid, list(request.prompt_token_ids), params))
            queue = bridge.open_stream(rid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        req.max_tokens = 1
        req.hold_kv_on_finish = True
        send = None
        try:
            await bridge.run(lambda e: e.scheduler.add_request(req))
            d: Delta = await queue.get()
            if d.finish_reason == "abort" or not d.token_ids:
                await context.abort(grpc.StatusCode.ABORTED, f"request {rid} was aborted during prefill")
            t_first = time.time()
            meta = {"first_token": d.token_ids[0],
                    "logprob": dataclasses.asdict(d.logprobs[0]) if d.logprobs else None}
            skip = request.num_skip_blocks  # the decode side has these leading blocks cached
            if not 0 <= skip < len(d.block_ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"num_skip_blocks {skip} out of range")
            send = asyncio.get_running_loop().run_in_executor(
                self._pool, self.senders.send, request.decode_address, rid, d.block_ids[skip:],  # type: ignore[union-attr]
                list(request.dst_block_ids)[skip:], meta)
            try:
                stats = await asyncio.shield(send)
            except KVTransferError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer to {request.decode_address} "
                                    f"failed: {exc}")
            if bridge.metrics is not None:
                bridge.metrics.record_transfer(stats)
            resp = engine_pb2.PrefillResponse(
                first_token=d.token_ids[0], num_cached_tokens=d.num_cached_tokens,
                transfer=engine_pb2.KVTransferStats(num_blocks=stats.num_blocks, num_bytes=stats.num_bytes,
                                                    seconds=stats.seconds, backend=stats.backend),
                queue_seconds=max(0.0, (req.times.first_scheduled or t0) - t0),
                prefill_seconds=t_first - t0)
            if d.logprobs:
                resp.logprob.CopyFrom(logprob_to_proto(d.logprobs[0]))
            return resp
        finally:
            bridge.close_stream(rid)
            release = lambda e: e.abort_request(rid)  # noqa: E731 - releases held blocks too
            if send is None or send.done():
                bridge.submit(release)
            else:  # the send still reads the blocks: release when it ends
                send.add_done_callback(lambda _: bridge.submit(release))

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        bridge = await self._ready(context)
        rid = request.request_id
        found = await bridge.run(lambda e: rid in e.scheduler.requests and rid not in e.scheduler.held)
        if found:  # held blocks are released by Prefill() itself once its send ends
            bridge.abort(rid)
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return (await self._ready(context)).load_info()
