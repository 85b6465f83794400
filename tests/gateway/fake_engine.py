"""Fake prefill and decode servers for gateway tests: the real protocol of
protos/pdserve/v1/engine.proto, no model. The "model" emits a fixed script
of token ids (truncated by max_tokens / stop_token_ids, ending in eos).

Both servers run on one grpc.aio event loop in a background thread; the
prefill's "KV transfer" just wakes the decode request waiting for it. Knobs
(``FakeEngine.knobs``) change behaviour between tests; observations
(``active``, ``cancelled``, ``decode_requests``, ...) let tests assert that
the gateway freed everything.

LoRA: each server has its own ``FakeLoRA`` (``FakeState.lora[role]``; LoRA
off, ``max_loras`` 0, by default): GetLoad lists its adapters, Load/Unload
change them (a path under ``/adapters/`` is a valid adapter, anything else
INVALID_ARGUMENT), a request under an adapter the server does not hold is
refused, Reserved carries the decode server's fingerprint and the prefill
server refuses another one (FAILED_PRECONDITION), as the real servers do.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from engine.block_hash import hash_block_tokens
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc.server import RpcServer

BLOCK_SIZE = 16
ADAPTERS_DIR = "/adapters/"  # the fake's valid adapter paths start here


def lora_adapter(name: str, path: str = "", fingerprint: str | None = None,
                 in_slot: bool = True) -> common_pb2.LoRAAdapter:
    """An adapter as a server lists it; the fingerprint defaults to one of the path, the
    root hash is derived from name and fingerprint as the engine derives it."""
    path = path or ADAPTERS_DIR + name
    fingerprint = fingerprint if fingerprint is not None else f"fp:{path}"
    return common_pb2.LoRAAdapter(name=name, path=path, rank=8, fingerprint=fingerprint, base_model="fake",
                                  root_hash=hash_block_tokens(0, list(f"lora:{name}:{fingerprint}".encode())),
                                  in_slot=in_slot)


@dataclass
class FakeLoRA:
    """One fake server's adapters (``max_loras`` 0: not started with --enable-lora)."""

    max_loras: int = 0
    adapters: dict[str, common_pb2.LoRAAdapter] = field(default_factory=dict)
    load_delay: float = 0.0
    calls: list[str] = field(default_factory=list)  # "load NAME PATH" | "unload NAME"

    def add(self, adapter: common_pb2.LoRAAdapter) -> None:
        self.adapters[adapter.name] = adapter
        self.max_loras = max(self.max_loras, 1)

    async def load(self, req: common_pb2.LoadLoRAAdapterRequest, context: Any) -> common_pb2.LoRAAdapter:
        self.calls.append(f"load {req.lora_name} {req.lora_path}")
        if self.load_delay:
            await asyncio.sleep(self.load_delay)
        if self.max_loras <= 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is not enabled on this server (start it with --enable-lora)")
        if not req.lora_path.startswith(ADAPTERS_DIR):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{req.lora_path}: no adapter_config.json (not a PEFT adapter directory)")
        in_slot = sum(a.in_slot for a in self.adapters.values()) < self.max_loras
        self.adapters[req.lora_name] = lora_adapter(req.lora_name, req.lora_path, in_slot=in_slot)
        return self.adapters[req.lora_name]

    async def unload(self, req: common_pb2.UnloadLoRAAdapterRequest,
                     context: Any) -> common_pb2.UnloadLoRAAdapterResponse:
        self.calls.append(f"unload {req.lora_name}")
        if self.max_loras <= 0:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "LoRA is not enabled on this server (start it with --enable-lora)")
        if self.adapters.pop(req.lora_name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"LoRA adapter {req.lora_name!r} is not loaded")
        return common_pb2.UnloadLoRAAdapterResponse()

    def load_info(self) -> dict[str, Any]:
        return {"lora_adapters": list(self.adapters.values()), "max_loras": self.max_loras}


@dataclass
class Knobs:
    token_delay: float = 0.0  # seconds between decode deltas
    tokens_per_delta: int = 2
    queue_full: bool = False  # Decode.Generate -> RESOURCE_EXHAUSTED
    prefill_error: grpc.StatusCode | None = None
    prefill_delay: float = 0.0
    get_load_delay: float = 0.0  # GetLoad answers this late (a busy server; polls run past their deadline)
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
    lora: dict[str, FakeLoRA] = field(default_factory=lambda: {"prefill": FakeLoRA(), "decode": FakeLoRA()})


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
        adapter = s.lora["decode"].adapters.get(req.lora_name) if req.lora_name else None
        if req.lora_name and adapter is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"LoRA adapter {req.lora_name!r} is not loaded")
        s.active.add(req.request_id)
        finished = False
        try:
            out, reason = self._output(req)
            if req.remote_prefill:
                fut = asyncio.get_running_loop().create_future()
                s.kv_arrived[req.request_id] = fut
                n = -(-len(req.prompt_token_ids) // BLOCK_SIZE)
                yield engine_pb2.DecodeResponse(reserved=engine_pb2.Reserved(
                    block_ids=list(range(100, 100 + n)), num_cached_tokens=s.knobs.num_cached_tokens,
                    lora_fingerprint=adapter.fingerprint if adapter is not None else ""))
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
        await asyncio.sleep(self.s.knobs.get_load_delay)
        return common_pb2.LoadInfo(role="decode", address=self.address, metrics_url="http://fake/metrics",
                                   num_running=len(self.s.active), kv_blocks_used=len(self.s.active),
                                   kv_blocks_total=1000, block_size=BLOCK_SIZE, model="fake",
                                   **self.s.lora["decode"].load_info())

    async def Abort(self, req: common_pb2.AbortRequest, context: Any) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=False)

    async def LoadLoRAAdapter(self, req: Any, context: Any) -> common_pb2.LoRAAdapter:
        return await self.s.lora["decode"].load(req, context)

    async def UnloadLoRAAdapter(self, req: Any, context: Any) -> common_pb2.UnloadLoRAAdapterResponse:
        return await self.s.lora["decode"].unload(req, context)


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
        if req.lora_name:
            adapter = s.lora["prefill"].adapters.get(req.lora_name)
            if adapter is None or adapter.fingerprint != req.lora_fingerprint:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"LoRA adapter {req.lora_name!r}: this server holds "
                                    f"{adapter.fingerprint if adapter else 'no copy'}, the decode server "
                                    f"{req.lora_fingerprint or 'none'}")
        first = s.script[0] if s.script else s.eos
        fut = s.kv_arrived.get(req.request_id)
        if fut is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no reservation for {req.request_id}")
        fut.set_result(first)
        lp = _logprob(first, req.sampling.logprobs) if req.sampling.HasField("logprobs") else None
        return engine_pb2.PrefillResponse(first_token=first, logprob=lp, num_cached_tokens=s.knobs.num_cached_tokens)

    async def GetLoad(self, req: Any, context: Any) -> common_pb2.LoadInfo:
        await asyncio.sleep(self.s.knobs.get_load_delay)
        return common_pb2.LoadInfo(role="prefill", address=self.address, kv_blocks_total=1000,
                                   block_size=BLOCK_SIZE, model="fake", **self.s.lora["prefill"].load_info())

    async def LoadLoRAAdapter(self, req: Any, context: Any) -> common_pb2.LoRAAdapter:
        return await self.s.lora["prefill"].load(req, context)

    async def UnloadLoRAAdapter(self, req: Any, context: Any) -> common_pb2.UnloadLoRAAdapterResponse:
        return await self.s.lora["prefill"].unload(req, context)


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
        self.state.lora = {"prefill": FakeLoRA(), "decode": FakeLoRA()}
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
