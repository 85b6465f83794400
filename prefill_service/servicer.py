"""pdserve.v1.Prefill: chunked prefill of many prompts under a token budget,
then the KV send to the decode server the gateway chose.

One request, in the engine's states: ``add_prefill_request`` (WAITING) -> the
engine prefills it in chunks alongside others (RUNNING; we tell the decode
server it started) -> the first token is sampled and the blocks are held
(HELD_FOR_SEND) -> ``begin_send`` -> a worker thread sends the blocks ->
``release_after_send``: the blocks go back to the pool (they stay in the
prefix cache, unreferenced, until evicted). The engine never frees blocks
while a send reads them, whatever happens to the RPC.

With ``--kv-send layerwise`` (the default) the send starts earlier, when the
engine schedules the prompt's last chunk, and each layer leaves as the
forward pass finishes it; held, the request only adds its first token to that
send and waits for it to end. Which send a request gets, and its state, are the
KV transfer's scheduler side (``kv_transfer.KVSendScheduler``); this servicer
translates the RPC into its calls and the engine's operations.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from types import SimpleNamespace

import grpc

from engine.llm_engine import LLMEngine
from engine.lora.adapter import LoRAMismatch
from kv_transfer import ChannelOffer, ChannelRequest, KVSendScheduler, KVTransferError
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from prefill_service.flags import KV_SEND_MODES, PAIRS_PER_DECODE
from rpc.convert import logprob_to_proto, logprobs_to_proto, sampling_from_proto
from rpc.engine_bridge import Delta, EngineBridge
from rpc.engine_metrics import EngineMetrics
from rpc import tls, tracing
from rpc.engine_server import EngineServicerBase, admission_status, deadline_of, error_status
from rpc.layout_convert import channel_offer_from_proto, channel_request_to_proto
from rpc.server import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)
_NOTIFY_TIMEOUT_S = 5.0


class PrefillServicer(EngineServicerBase, engine_pb2_grpc.PrefillServicer):
    name = "pdserve.v1.Prefill"
    role = "prefill"

    def __init__(self, kv_send: str = "layerwise", pairs_per_decode: int = PAIRS_PER_DECODE) -> None:
        super().__init__()
        if kv_send not in KV_SEND_MODES:
            raise ValueError(f"--kv-send must be one of {', '.join(KV_SEND_MODES)}, got {kv_send!r}")
        self.kv_send, self.pairs_per_decode = kv_send, pairs_per_decode
        self.sends: KVSendScheduler | None = None
        self._decode_stubs: dict[str, engine_pb2_grpc.DecodeStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._notifications: set[asyncio.Task] = set()

    def register(self, server: grpc.aio.Server) -> None:
        engine_pb2_grpc.add_PrefillServicer_to_server(self, server)

    def attach(self, engine: LLMEngine, address: str, metrics: EngineMetrics | None = None) -> None:
        self.bridge = EngineBridge(engine, "prefill", address, metrics, post_started=True,
                                   thread=self.engine_thread)
        self.sends = KVSendScheduler.attach(engine, address, _open_kv_channel, self.kv_send == "layerwise",
                                            self.pairs_per_decode)
        self.bridge.start()

    def close(self) -> None:
        if self.sends is not None:
            self.sends.close()
        super().close()

    async def Prefill(self, request: engine_pb2.PrefillRequest, context) -> engine_pb2.PrefillResponse:
        bridge = await self._ready(context)
        rid, t0 = request.request_id, time.time()
        trace_ctx = tracing.current_context()
        try:
            params = sampling_from_proto(request.sampling)
            queue = bridge.open_stream(rid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sends = self.sends
        assert sends is not None
        d = stats = None
        try:
            prompt, deadline = list(request.prompt_token_ids), deadline_of(context)
            # The decode side has the prompt's first skip blocks of --block-size tokens cached (its
            # prefix-cache hit): every cache group's blocks of those tokens stay out of the send.
            try:
                skip_tokens, dst_blocks = _skipped(bridge.engine, request, len(prompt))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            # a hybrid model's linear-attention state goes whole into this slot (-1: no such layers)
            dst_state = request.dst_state_slot if request.HasField("dst_state_slot") else -1
            if sends.worker.linear_states is not None and dst_state < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request {rid}: this model has linear-attention layers, whose state goes to "
                                    "the decode server's reserved state slot, but the request names none "
                                    "(dst_state_slot; a gateway or decode server older than this server?)")
            # (the engine leaves the skipped blocks out of what it hands the send: none to skip here)
            sends.expect(rid, request.decode_address, dst_blocks, 0, dst_state)
            try:
                await bridge.run(lambda e: _add_prefill(e, request, prompt, params, deadline, skip_tokens))
            except (OverflowError, ValueError) as exc:
                await context.abort(admission_status(exc), str(exc))
            d = await self._wait_held(queue, request.decode_address, context)
            t_first = time.time()
            meta = {"first_token": d.token_ids[0],
                    "logprob": dataclasses.asdict(d.logprobs[0]) if d.logprobs else None}
            # sending since its last chunk began (layer-wise): the token completes it
            send = sends.first_token(rid, meta)
            try:
                if send is None:
                    try:
                        block_ids, state_slot = await bridge.run(lambda e: (e.begin_send(rid), e.state_slot(rid)))
                    except ValueError as exc:  # expired or aborted since it was held
                        await context.abort(grpc.StatusCode.ABORTED, str(exc))
                    send = sends.send_after_prefill(rid, block_ids, state_slot)
                stats = await asyncio.shield(asyncio.wrap_future(send))
            except KVTransferError as exc:
                # ABORTED, not UNAVAILABLE: this server is fine, the hand-off to that decode server is not.
                await context.abort(grpc.StatusCode.ABORTED, f"KV transfer to {request.decode_address} "
                                    f"failed: {exc}")
            after_token = time.time() - t_first
            if bridge.metrics is not None:
                bridge.metrics.record_transfer(stats)
                bridge.metrics.kv_wait.observe(after_token)
            resp = engine_pb2.PrefillResponse(
                first_token=d.token_ids[0], num_cached_tokens=d.num_cached_tokens,
                transfer=engine_pb2.KVTransferStats(num_blocks=stats.num_blocks, num_bytes=stats.num_bytes,
                                                    seconds=stats.seconds, backend=stats.backend,
                                                    seconds_after_first_token=after_token,
                                                    host_staged=stats.host_staged),
                queue_seconds=max(0.0, (d.times.first_scheduled or t0) - d.times.arrival) if d.times else 0.0,
                prefill_seconds=t_first - t0)
            if d.logprobs:
                resp.logprob.CopyFrom(logprob_to_proto(d.logprobs[0]))
            resp.prompt_logprobs.extend(logprobs_to_proto(d.prompt_logprobs))
            return resp
        finally:
            reading = sends.end(rid)  # the send still reading the blocks (one that never got its token ends aborted)
            if stats is None:  # failed or cancelled: whatever state it is in, end it
                bridge.abort(rid)  # (blocks a send still reads wait for its release below)
            if reading is not None:  # release the blocks once the send is done with them
                reading.add_done_callback(lambda _: bridge.submit(lambda e: e.release_after_send(rid)))
            bridge.close_stream(rid)
            if d is not None and d.times is not None:  # after the response has gone
                asyncio.get_running_loop().call_soon(_record_spans, rid, trace_ctx, d, stats,
                                                     len(request.prompt_token_ids), time.time())

    async def _wait_held(self, queue: "asyncio.Queue[Delta]", decode_address: str, context) -> Delta:
        """Deltas until the first token is sampled and the blocks are held;
        tells the decode server when the engine starts on the request."""
        while True:
            d = await queue.get()
            if d.event == "started":
                self._notify_started(decode_address, d.request_id)
            elif d.is_held:
                return d
            elif d.finish_reason:
                if d.error is not None:
                    await context.abort(*error_status(d.error))
                await context.abort(grpc.StatusCode.ABORTED, f"request {d.request_id} was aborted during prefill")

    def _notify_started(self, decode_address: str, request_id: str) -> None:
        stub = self._decode_stubs.get(decode_address)
        if stub is None:
            channel = tls.aio_channel(decode_address, CHANNEL_OPTIONS)
            self._channels.append(channel)
            stub = self._decode_stubs[decode_address] = engine_pb2_grpc.DecodeStub(channel)

        async def notify() -> None:
            try:
                await stub.PrefillStarted(engine_pb2.PrefillStartedRequest(request_id=request_id),
                                          timeout=_NOTIFY_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:  # the KV send will fail too, with the real error
                logger.warning("could not tell %s that request %s started: %s", decode_address, request_id,
                               exc.code().name)

        task = asyncio.ensure_future(notify())
        self._notifications.add(task)
        task.add_done_callback(self._notifications.discard)

    async def Abort(self, request: common_pb2.AbortRequest, context) -> common_pb2.AbortResponse:
        bridge = await self._ready(context)
        rid = request.request_id
        # A held request's blocks stay until its send ends (the engine defers the free).
        found = await bridge.run(lambda e: e.abort_request(rid) is not None)
        return common_pb2.AbortResponse(found=found)

    async def GetLoad(self, request, context) -> common_pb2.LoadInfo:
        return (await self._ready(context)).load_info()


def _open_kv_channel(decode_address: str, request: ChannelRequest, timeout: float) -> ChannelOffer:
    """Ask a decode server for a KV channel (``OpenKVChannel``); the KV transfer's worker side
    calls this, in a send thread, the first time it sends there."""
    with tls.channel(decode_address, CHANNEL_OPTIONS) as ch:
        try:
            resp = engine_pb2_grpc.DecodeStub(ch).OpenKVChannel(channel_request_to_proto(request), timeout=timeout)
        except grpc.RpcError as exc:
            raise KVTransferError(f"decode server {decode_address} refused the KV channel: "
                                  f"{exc.details() or exc.code()}") from exc
    return channel_offer_from_proto(resp)


def _record_spans(rid: str, trace_ctx, d: Delta, stats, num_prompt_tokens: int, now: float) -> None:
    """This tier's spans from the engine's timestamps; the send and the
    request end at ``now``, as far as the client is concerned."""
    times = SimpleNamespace(**vars(d.times))
    if times.kv_send_start is not None and times.kv_send_end is None:
        times.kv_send_end = now
    times.finished = times.finished or now
    attrs = {"num_prompt_tokens": num_prompt_tokens, "num_cached_tokens": d.num_cached_tokens,
             "num_output_tokens": len(d.token_ids)}
    if stats is not None:
        attrs.update(kv_blocks=stats.num_blocks, kv_bytes=stats.num_bytes, kv_seconds=stats.seconds,
                     kv_backend=stats.backend, kv_parts=stats.parts or None)
    tracing.record_engine_spans("prefill", rid, trace_ctx, times, attrs)


def _skipped(engine: LLMEngine, request: engine_pb2.PrefillRequest, num_prompt: int) -> tuple[int, list[int]]:
    """The decode side's cached prefix in tokens (``num_skip_blocks`` of --block-size), and the
    blocks there the KV goes to: every cache group's table (``dst_block_ids`` holds them in group
    order) less its blocks of that prefix. ValueError when the request names no such prefix."""
    skip, block_size = request.num_skip_blocks, engine.config.cache.block_size
    num_tokens = num_prompt + len(request.resume_output_token_ids)  # (what the reservation holds)
    num_blocks = -(-num_tokens // block_size)
    if not 0 <= skip < num_blocks:
        raise ValueError(f"num_skip_blocks {skip} out of range [0, {num_blocks})")
    try:
        return skip * block_size, engine.cache_layout.blocks_past(list(request.dst_block_ids), num_tokens,
                                                                  skip * block_size)
    except ValueError as exc:
        raise ValueError(f"num_skip_blocks {skip}: {exc}") from None


def _add_prefill(engine: LLMEngine, request: engine_pb2.PrefillRequest, prompt: list[int], params,
                 deadline: float | None, skip_tokens: int) -> None:
    """Queue the prompt (engine thread), its send to leave out the decode side's cached
    ``skip_tokens``; under an adapter, only if this server's copy of it is the one the decode
    server reserved with."""
    name = request.lora_name or None
    if name is not None and request.lora_fingerprint:
        mine = engine.lora_info(name).fingerprint
        if mine != request.lora_fingerprint:
            raise LoRAMismatch(f"LoRA adapter {name!r} differs between this prefill server (fingerprint {mine}) and "
                               f"the decode server ({request.lora_fingerprint}): load the same files on both")
    engine.add_prefill_request(request.request_id, prompt, params, deadline=deadline, lora_name=name,
                               resume_output_token_ids=list(request.resume_output_token_ids),
                               priority=request.priority, kv_skip_tokens=skip_tokens)
