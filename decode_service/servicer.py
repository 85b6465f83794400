"""pdserve.v1.Decode: continuous batching of requests whose prompt KV arrives
from a prefill server (or is computed here in local-prefill mode).

Remote prefill, as seen from one request (states are the engine's):
  Generate() -> engine.reserve (WAITING_FOR_BLOCKS) -> "reserved" delta ->
  Reserved message -> PrefillStarted from the prefill server -> the KV
  transfer's scheduler side begins and ends the receive -> RUNNING with the
  prefill's first token -> token deltas.
This servicer only translates between protobuf and the engine's operations.
Every way out (finish, client cancel, deadline, KV failure, abort) ends in
the engine's one finish path, which frees the request's blocks.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kv_transfer import KVReceiveScheduler, KVReceiveWorker
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc.convert import logprobs_to_proto, sampling_from_proto
from rpc.engine_bridge import Delta, EngineBridge
from rpc.engine_metrics import EngineMetrics
from rpc import tracing
from rpc.engine_server import EngineServicerBase, admission_status, deadline_of, error_status
from rpc.layout_convert import channel_offer_to_proto, channel_request_from_proto

logger = logging.getLogger(__name__)


def delta_to_proto(d: Delta) -> engine_pb2.DecodeResponse:
    message = d.error.message if d.error is not None and d.finish_reason == "error" else ""
    return engine_pb2.DecodeResponse(delta=engine_pb2.TokenDelta(
        token_ids=d.token_ids, logprobs=logprobs_to_proto(d.logprobs),
        finish_reason=d.finish_reason or "", num_cached_tokens=d.num_cached_tokens, finish_message=message,
        num_draft_tokens=d.spec[0], num_accepted_draft_tokens=d.spec[1],
        prompt_logprobs=logprobs_to_proto(d.prompt_logprobs)))


def _spec_attributes(spec: tuple[int, int]) -> dict:
    """Speculative decoding's figures of one request, for its decode span (none without)."""
    proposed, accepted = spec
    if not proposed:
        return {}
    return {"pdserve.spec.draft_tokens": proposed, "pdserve.spec.accepted_tokens": accepted,
            "pdserve.spec.acceptance_rate": round(accepted / proposed, 4)}


class DecodeServicer(EngineServicerBase, engine_pb2_grpc.DecodeServicer):
    """The decode tier's gRPC service; answers UNAVAILABLE until attached."""

    name = "pdserve.v1.Decode"
    role = "decode"

    def __init__(self, kv_host: str, local_prefill: bool = False) -> None:
        super().__init__()
        self.kv_host, self.local_prefill = kv_host, local_prefill
        self.kv_receivers: KVReceiveWorker | None = None

    def register(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_DecodeServicer_to_server(self, server)

    def attach(self, engine: LLMEngine, address: str, metrics: EngineMetrics | None = None) -> None:
        self.bridge = EngineBridge(engine, "decode", address, metrics, thread=self.engine_thread)
        timeout = engine.config.scheduler.kv_transfer_timeout
        receives = KVReceiveScheduler(self.bridge.loop, timeout,
                                      metrics.record_checksum_mismatch if metrics else None)
        self.kv_receivers = KVReceiveWorker(engine, receives, self.kv_host, timeout,
                                            metrics.record_transfer if metrics else None)
        self.bridge.start()

    def close(self) -> None:
        if self.kv_receivers is not None:
            self.kv_receivers.close()
        super().close()

    async def Generate(self, request: engine_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        bridge = await self._ready(context)
        trace_ctx = tracing.current_context()
        remote = request.remote_prefill and not self.local_prefill
        try:
            params: SamplingParams = sampling_from_proto(request.sampling)
            queue = bridge.open_stream(rid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finished, last = False, None
        try:
            prompt, deadline = list(request.prompt_token_ids), deadline_of(context)
            lora_name = request.lora_name or None
            resumed = list(request.resume_output_token_ids)  # a migrated request: its output so far
            try:
                req = await bridge.run(lambda e: (e.reserve if remote else e.add_request)(
                    rid, prompt, params, deadline=deadline, lora_name=lora_name, resume_output_token_ids=resumed,
                    priority=request.priority))
            except (OverflowError, ValueError) as exc:
                await context.abort(admission_status(exc), str(exc))
            fingerprint = req.lora.fingerprint if req.lora is not None else ""
            while not finished:
                d = await queue.get()
                if d.event == "reserved":
                    yield engine_pb2.DecodeResponse(reserved=engine_pb2.Reserved(
                        block_ids=d.block_ids, num_cached_tokens=d.num_cached_tokens, lora_fingerprint=fingerprint,
                        state_slot=d.state_slot))
                    continue
                finished, last = bool(d.finish_reason), d
                if d.error is not None and d.finish_reason != "error":  # "error": a finish, with its message
                    await context.abort(*error_status(d.error))
                yield delta_to_proto(d)
        finally:
            bridge.close_stream(rid)
            if not finished:  # cancelled, deadline, error: free everything
                bridge.abort(rid)
            if last is not None and last.times is not None:
                kv = last.kv_transfer or {}
                tracing.record_engine_spans("decode", rid, trace_ctx, last.times, {
                    "num_prompt_tokens": last.num_prompt_tokens, "num_cached_tokens": last.num_cached_tokens,
                    "num_output_tokens": last.num_output_tokens, "finish_reason": last.finish_reason or "abort",
                    "kv_bytes": kv.get("num_bytes"), "kv_blocks": kv.get("num_blocks"),
                    "kv_seconds": kv.get("seconds"), "kv_backend": kv.get("backend"),
                    "kv_parts": kv.get("parts") if len(kv.get("parts") or ()) > 1 else None,
                    **_spec_attributes(last.spec)})

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        rid = request.request_id
        bridge = await self._ready(context)
        found = await bridge.run(lambda e: e.abort_request(rid) is not None)
        return common_pb2.AbortResponse(found=found)

    async def PrefillStarted(self, request: engine_pb2.PrefillStartedRequest, context
                             ) -> engine_pb2.PrefillStartedResponse:
        bridge = await self._ready(context)
        rid = request.request_id
        return engine_pb2.PrefillStartedResponse(found=await bridge.run(lambda e: e.prefill_started(rid)))

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return (await self._ready(context)).load_info()

    async def OpenKVChannel(self, request: engine_pb2.OpenKVChannelRequest, context):
        await self._ready(context)  # UNAVAILABLE until the engine is up
        receivers = self.kv_receivers
        assert receivers is not None
        try:
            offer = await asyncio.get_running_loop().run_in_executor(
                None, lambda: receivers.open(channel_request_from_proto(request)))
            return channel_offer_to_proto(offer)
        except ValueError as exc:  # incompatible layout or device
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except OverflowError as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
