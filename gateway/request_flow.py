"""One request's trip through the engine tiers, as a stream of token chunks.

    pick decode D (and prefill P, if one is healthy)
    no P:  D.Generate(remote_prefill=false) ............ deltas -> chunks
    P:     D.Generate(remote_prefill=true) -> reserved{block_ids}
           P.Prefill(dst_block_ids, decode_address=D) -> first token -> chunk (time to first token)
           D deltas -> chunks, minus the first token (D repeats it in its first delta)

Every call gets the request's remaining deadline and its trace context
(a CLIENT span per call, see ``request_trace``). Whatever way the stream ends (finish, error, the consumer
closing it, the task being cancelled, ``abort()``), every internal call is
cancelled, which makes the engine servers free the request's blocks.

A decode server that refuses the request (UNAVAILABLE, RESOURCE_EXHAUSTED)
before anything was streamed is retried on the next healthy decode server.
A request the engine servers refuse as invalid (INVALID_ARGUMENT: e.g. a
structured-output constraint that does not compile) is never retried nor
recomputed elsewhere: it fails the same way everywhere. A prefill server's
FAILED_PRECONDITION (no first token meets the request's constraint) is the
request's end, finish_reason "error" with the server's reason, as the decode
server streams it for later tokens.

LoRA: a request under an adapter carries its name to both servers
(``DecodeRequest.lora_name``, ``PrefillRequest.lora_name``), and the prefill
server gets the fingerprint the decode server holds it with
(``Reserved.lora_fingerprint`` -> ``PrefillRequest.lora_fingerprint``). A
prefill server known to hold another copy is not called; one that refuses
because of the adapter (its copy differs, or it no longer holds it) is
retried like a prefill server that is gone: another one, else the decode
server prefills. A decode server that refuses because of the adapter before
any output is retried on the next one that serves it.

Migration: a decode server whose stream breaks mid-response (it died: UNAVAILABLE,
a reset connection, CANCELLED by the peer, the stream ending without a finish reason)
does not end the request. The request is routed again (the dead server excluded) and
resumed: the prompt plus every token already streamed goes out as a new attempt
(``DecodeRequest.resume_output_token_ids``, and ``PrefillRequest``'s when a prefill
server computes it), whose engine counts those tokens as output (the seeded step k,
penalties, grammar replay, what remains of max_tokens/min_tokens). The new attempt's
first token is the next one: the consumer sees one uninterrupted chunk stream (the
output processor keeps its detokenizer, stop-string and usage state across the seam).
At most ``migration_limit`` times (``--migration-limit``) per request; past it the request
fails naming the servers it lost. Each migration counts in
``pdserve:gateway_migrations_total{cause}`` and marks the trace (a "migration" event on
the request's root span; the new attempt's "route" span carries
``pdserve.route.migration`` and ``pdserve.route.resume_tokens``).

A hung decode server (stopped, wedged; its connection still open) is found by the stream's
idle deadline (``--stream-idle-timeout``, the router's ``stream_idle_timeout``): a read of
the decode stream that waits longer than that since the last message (the last token, or
the call's start) ends the call there, which is the best-effort cancel: the server frees
the request's blocks once it runs again, and whatever it sent late is never read. The
server is marked unhealthy until its next good poll. Before anything was streamed that is
a refusal (the request is retried on another decode server), after it a migration (cause
"stalled"). The deadline does not run while a prefill server computes the request's KV
into the decode server's blocks: meanwhile the decode stream is only watched for a break.

A decode server that dies while the prefill server computes into its blocks (its stream
breaks, or the prefill fails and the decode server no longer answers a poll) migrates the
request too, with nothing to resume after: the prefill's failure is the decode server's
loss, not the prefill server's. A decode stream that ends with a status its server sent (ABORTED:
the transfer into it failed, as when the prefill server dies mid-send) is a live server's: then
the prefill call's own failure decides (another prefill server, or the decode server itself).

A KV hand-off the decode server fails after the prefill server's first token went out (its
checksum of the blocks that landed is not the sender's: kv_transfer/canary.py) ends its
stream ABORTED: with ``--kv-load-failure-policy recompute`` the request is resumed after
that token on a decode server that computes it itself (every prefill server excluded), as
a failed hand-off before the first token is; with ``fail`` the client gets the error.

Text, stop strings and usage are not this module's business: see
``output_processor``.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.trace import Span, SpanKind

from engine.sampling_params import SamplingParams
from gateway.errors import ErrorKind, GatewayError
from gateway.instances import Instance
from gateway.lora import is_adapter_refusal
from gateway.request_trace import RequestTrace, set_error
from gateway.router import BlockHashes, Route, Router, in_flight
from pdserve.v1 import common_pb2, engine_pb2
from rpc.convert import sampling_to_proto

_RETRYABLE = (ErrorKind.UNAVAILABLE, ErrorKind.RESOURCE_EXHAUSTED)
# How a decode stream breaks when its server dies or the connection does: the request migrates.
_BROKEN = {grpc.StatusCode.UNAVAILABLE: "unavailable", grpc.StatusCode.CANCELLED: "cancelled",
           grpc.StatusCode.UNKNOWN: "unknown"}
DEFAULT_MIGRATION_LIMIT = 3
# --stream-idle-timeout: seconds a decode stream may send nothing before its server counts as hung.
DEFAULT_STREAM_IDLE_TIMEOUT = 60.0
_DECODE_PROBE_S = 1.0  # a poll of a decode server suspected dead


@dataclass
class PreparedRequest:
    """A tokenized, validated request (``sampling.max_tokens`` is resolved)."""

    request_id: str  # the client's (or assigned) id, for responses and Abort
    internal_id: str  # unique per request; what the engine servers see
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: float  # time.monotonic()
    deadline: float  # time.monotonic()
    trace: RequestTrace = field(default_factory=RequestTrace.disabled)
    lora_name: str | None = None  # the LoRA adapter the request runs under (None: the base model)
    priority: int = 0  # the engine servers' --scheduling-policy priority: lower first

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


@dataclass
class TokenChunk:
    """New output tokens; ``finish_reason`` is set on the last chunk only."""

    token_ids: list[int]
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    num_cached_tokens: int = 0
    finish_message: str = ""  # finish_reason "error": why
    spec: tuple[int, int] = (0, 0)  # speculative decoding so far: (tokens proposed, accepted)
    prompt_logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)  # with the first token only


class _Refused(Exception):
    """A decode server failed the request before anything was streamed."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class _StreamBroken(Exception):
    """A decode server's stream broke after the request was under way (the server died, the
    connection broke): the request migrates. ``cause`` labels the metric."""

    def __init__(self, error: GatewayError, cause: str) -> None:
        super().__init__(error.message)
        self.error, self.cause = error, cause


class _FinishedInPrefill(Exception):
    """The prefill server ended the request as a finish (finish_reason "error"): no first
    token meets its constraint."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _PrefillFailed(Exception):
    """The prefill server (or its KV hand-off) failed before anything was
    streamed: worth another attempt with a fresh reservation, on another
    prefill server, or (``recompute``) prefilled by the decode server."""

    def __init__(self, error: GatewayError, prefill: Instance, recompute: bool = False) -> None:
        super().__init__(error.message)
        self.error, self.prefill, self.recompute = error, prefill, recompute


class _KVLoadFailed(Exception):
    """The decode server failed the KV hand-off after the first token was streamed
    (``recompute``: resumed after it, prefilled by a decode server)."""

    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


class RequestFlow:
    """Drives one request; owns its in-flight internal calls."""

    def __init__(self, req: PreparedRequest, router: Router, migration_limit: int = DEFAULT_MIGRATION_LIMIT,
                 on_migration: Callable[[str], None] | None = None, pin: Instance | None = None) -> None:
        """``pin``: the decode server of the first attempt, prefilling locally (another choice of
        the same prompt: its KV is in that server's prefix cache); a retry routes as usual."""
        self._req = req
        self._pin = pin
        # The first delta of a decode stream came: the prompt's KV is in that server's cache.
        self.decode_ready = asyncio.Event()
        self.ready_decode: Instance | None = None
        self._router = router
        self._migration_limit = migration_limit
        self._on_migration = on_migration  # called with the cause of each migration (the metric)
        self.migrations = 0  # times the request moved to another decode server
        self.lost_decode: list[str] = []  # decode servers whose stream broke under it
        self._generated: list[int] = []  # output tokens streamed so far (what a migration resumes after)
        self._resume: list[int] = []  # this attempt's resumed tokens
        self._spec_base = (0, 0)  # speculative figures of the attempts before this one
        self._spec_last = (0, 0)
        self._calls: set[Any] = set()
        self._sampling = sampling_to_proto(req.sampling)
        self._engine_id = req.internal_id  # this attempt's id on the engine servers
        self.is_aborted = False
        # The request has its end (a finish reason went out; a stop string may end it before
        # the decode call does): a call cut short after this is no failure.
        self.is_finished = False
        self.decode_address: str | None = None
        self.prefill_address: str | None = None
        # What the prefill server reported: queue/compute seconds, KV transfer.
        self.prefill_result: engine_pb2.PrefillResponse | None = None
        self.route: Route | None = None  # the last routing decision

    def abort(self) -> None:
        """End the stream early with finish_reason "abort" (cancels internal calls)."""
        self.is_aborted = True
        for call in list(self._calls):
            call.cancel()

    async def stream(self) -> AsyncIterator[TokenChunk]:
        """Token chunks until one with a finish_reason; raises GatewayError."""
        try:
            if self.is_aborted:
                raise asyncio.CancelledError
            # Closed here, not left to the garbage collector: the calls' spans end before the
            # request's does (and so reach the traces file with it).
            async with contextlib.aclosing(self._stream_with_retry()) as chunks:
                async for chunk in chunks:
                    yield chunk
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not self.is_aborted or (task is not None and task.cancelling()):
                raise
            yield TokenChunk([], finish_reason="abort")
        finally:
            for call in list(self._calls):
                call.cancel()

    async def _stream_with_retry(self) -> AsyncIterator[TokenChunk]:
        tried: list[str] = []  # decode servers that refused
        failed_prefill: list[str] = []  # prefill servers that failed (a retry prefills elsewhere, or locally)
        last: GatewayError | None = None
        hashes: BlockHashes | None = None
        while True:
            attempt = len(tried) + len(failed_prefill) + self.migrations
            # Each attempt is a new request to the engine servers: the last one's id may still be
            # releasing its blocks there.
            self._engine_id = self._req.internal_id if attempt == 0 else f"{self._req.internal_id}.{attempt}"
            attrs = {"pdserve.route.attempt": attempt + 1}
            if self.migrations:
                attrs.update({"pdserve.route.migration": self.migrations,
                              "pdserve.route.resume_tokens": len(self._resume)})
            with self._req.trace.span("route", **attrs) as span:
                try:
                    if self._pin is not None and attempt == 0:
                        route = Route(self._pin, None, reason="choice")
                    else:
                            route, hashes = await self._router.route(self._req.prompt_token_ids + self._resume,
                                                                 tried + self.lost_decode, hashes,
                                                                 exclude_prefill=failed_prefill,
                                                                 lora_name=self._req.lora_name)
                except GatewayError:
                    if last is not None:
                        raise last from None
                    raise
                decode, prefill = route.decode, route.prefill
                self.route = route
                span.set_attributes({"pdserve.route.decode": decode.address,
                                     "pdserve.route.prefill": prefill.address if prefill else "local",
                                     "pdserve.route.reason": route.reason,
                                     "pdserve.route.prefill_cached_tokens": route.cached_tokens(prefill),
                                     "pdserve.route.decode_cached_tokens": route.cached_tokens(decode)})
            self.decode_address = decode.address
            self.prefill_address = prefill.address if prefill else None
            try:
                async with contextlib.aclosing(self._run_on(decode, prefill)) as chunks:
                    async for chunk in chunks:
                        yield self._seen(chunk)
                return
            except _Refused as e:
                if e.error.kind not in _RETRYABLE:
                    raise e.error from None
                tried.append(decode.address)
                last = e.error
            except _PrefillFailed as e:
                failed_prefill += ([i.address for i in self._router.prefill_instances] if e.recompute
                                   else [e.prefill.address])
                last = e.error
            except _KVLoadFailed as e:
                failed_prefill += [i.address for i in self._router.prefill_instances]
                self._resume = list(self._generated)
                hashes, last = None, e.error
            except _StreamBroken as e:
                self.lost_decode.append(decode.address)
                self._migrate(e)
                if len(self._generated) >= (self._req.sampling.max_tokens or 1 << 62):
                    yield TokenChunk([], finish_reason="length")  # (a server always ends it itself)
                    return
                hashes, last = None, e.error

    def _migrate(self, e: _StreamBroken) -> None:
        """Count one migration, or raise the request's end when it has used them all."""
        req = self._req
        if self.migrations >= self._migration_limit or req.remaining() <= 0:
            lost = ", ".join(self.lost_decode)
            why = (f"--migration-limit {self._migration_limit} reached" if self.migrations >= self._migration_limit
                   else "its deadline passed")
            raise GatewayError(e.error.kind, f"request {req.request_id} lost its decode server{'s' * (len(self.lost_decode) > 1)} "
                               f"{lost} mid-stream after {len(self._generated)} tokens and cannot migrate again "
                               f"({why}): {e.error.message}", code="decode_server_lost") from None
        self.migrations += 1
        self._resume = list(self._generated)
        self._spec_base = self._spec_last
        if self._on_migration is not None:
            self._on_migration(e.cause)
        if req.trace.is_recording:
            req.trace.root.add_event("migration", {
                "pdserve.migration": self.migrations, "pdserve.migration.cause": e.cause,
                "pdserve.migration.from": self.lost_decode[-1], "pdserve.migration.resume_tokens": len(self._resume),
                "pdserve.migration.error": e.error.message})

    def _seen(self, chunk: TokenChunk) -> TokenChunk:
        """A chunk on its way out: its tokens join those a migration resumes after; a resumed
        attempt's figures continue the request's (cached tokens are the first attempt's, the
        speculative counts add up)."""
        self._generated += chunk.token_ids
        if chunk.token_ids:  # the prompt's logprobs went out with the first token: no attempt computes them again
            self._sampling.ClearField("prompt_logprobs")
        self._spec_last = (self._spec_base[0] + chunk.spec[0], self._spec_base[1] + chunk.spec[1])
        if self._resume:
            chunk.num_cached_tokens = 0
            chunk.spec = self._spec_last
        return chunk

    async def _run_on(self, decode: Instance, prefill: Instance | None) -> AsyncIterator[TokenChunk]:
        req = self._req
        span = _client_span(req.trace, "pdserve.v1.Decode/Generate", decode)
        done = False  # the last chunk yielded ended the call
        watch: asyncio.Future[Any] | None = None  # the decode stream's read during a remote prefill
        with in_flight(decode), _ending(span, lambda: done or self.is_finished):
            call = decode.stub.Generate(
                engine_pb2.DecodeRequest(request_id=self._engine_id, prompt_token_ids=req.prompt_token_ids,
                                         sampling=self._sampling, remote_prefill=prefill is not None,
                                         lora_name=req.lora_name or "", resume_output_token_ids=self._resume,
                                         priority=req.priority),
                timeout=self._timeout(), metadata=req.trace.metadata(span))
            self._calls.add(call)
            try:
                if prefill is None:
                    async for chunk in self._relay(call, decode, skip=0, refusable=True):
                        done = bool(chunk.finish_reason)
                        yield chunk
                    return
                msg = await self._read(call, decode, refusable=True)
                if msg.WhichOneof("kind") == "delta":  # a decode server in local-prefill mode
                    done = bool(msg.delta.finish_reason)
                    self.ready_decode = decode
                    self.decode_ready.set()
                    yield self._chunk(msg.delta, skip=0)
                    if not msg.delta.finish_reason:
                        async for chunk in self._relay(call, decode, skip=0, refusable=False):
                            done = bool(chunk.finish_reason)
                            yield chunk
                    return
                reserved = self._reserved(msg, decode)
                span.add_event("reserved", {"pdserve.kv.blocks": len(reserved.block_ids),
                                            "pdserve.cached_tokens": reserved.num_cached_tokens})
                # The decode stream is read while the prefill server computes: that read sees the
                # decode server die (and, should its first delta come before the prefill's answer,
                # keeps it for the relay).
                watch = asyncio.ensure_future(call.read())
                try:
                    first = await self._prefill_watched(prefill, decode, reserved, call, watch)
                except _FinishedInPrefill as e:
                    done = True
                    yield TokenChunk([], finish_reason="error", finish_message=e.message)
                    return
                yield TokenChunk([first.first_token], [first.logprob] if first.HasField("logprob") else [],
                                 num_cached_tokens=max(first.num_cached_tokens, reserved.num_cached_tokens),
                                 prompt_logprobs=list(first.prompt_logprobs))
                async for chunk in self._relay(call, decode, skip=1, refusable=False, pending=watch):
                    done = bool(chunk.finish_reason)
                    yield chunk
            finally:
                call.cancel()  # a no-op once the call has finished
                self._calls.discard(call)
                if watch is not None:
                    watch.cancel()
                    watch.add_done_callback(_retrieve)

    async def _prefill_watched(self, prefill: Instance, decode: Instance, reserved: engine_pb2.Reserved,
                               call: Any, watch: asyncio.Future[Any]) -> engine_pb2.PrefillResponse:
        """``_prefill`` while ``watch`` reads the decode stream. The decode server's death
        meanwhile raises _StreamBroken (the request migrates; the prefill call is cancelled):
        its stream broke, or the prefill failed and the decode server no longer answers."""
        task = asyncio.ensure_future(self._prefill(prefill, decode, reserved))
        try:
            await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and _broke(watch):  # the decode server is gone: the prefill's outcome is moot
                await self._read(call, decode, refusable=False, pending=watch, idle=False)  # raises
            return await task
        except _StreamBroken as e:
            raise self._lost_under_prefill(decode, prefill, e.error.message, e.cause) from None
        except (_PrefillFailed, GatewayError) as e:
            if not task.done() or self.is_aborted:
                raise
            if watch.done():
                # A status the decode server sent (ABORTED: the transfer into it failed, as it does
                # when the prefill server dies mid-send) is a live server's: the prefill's failure
                # is the one to act on.
                lost = _broke(watch)
            else:  # the prefill server may have seen it first: ask the decode server
                await decode.poll(_DECODE_PROBE_S)  # a dead server refuses the connection at once
                lost = not decode.is_healthy
            if not lost:
                raise
            error = e.error if isinstance(e, _PrefillFailed) else e
            raise self._lost_under_prefill(decode, prefill, f"{decode.error or 'its stream broke'}; the prefill: "
                                           f"{error.message}", "unavailable") from None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _lost_under_prefill(self, decode: Instance, prefill: Instance, why: str, cause: str) -> _StreamBroken:
        return _StreamBroken(GatewayError(ErrorKind.UNAVAILABLE, f"decode server {decode.address} was lost while "
                                          f"prefill server {prefill.address} computed request "
                                          f"{self._req.request_id} into it: {why}"), cause)

    def _check_adapter_copy(self, prefill: Instance, decode: Instance, reserved: engine_pb2.Reserved) -> None:
        """Raise _PrefillFailed, without calling it, when ``prefill`` is known to hold
        another copy of the request's adapter than the one ``decode`` reserved with."""
        name = self._req.lora_name
        adapter = prefill.lora_adapter(name) if name else None
        if adapter is None or not reserved.lora_fingerprint or adapter.fingerprint == reserved.lora_fingerprint:
            return
        raise _PrefillFailed(GatewayError(
            ErrorKind.UNAVAILABLE, f"prefill server {prefill.address} holds LoRA adapter `{name}` with fingerprint "
            f"{adapter.fingerprint}, decode server {decode.address} with {reserved.lora_fingerprint}",
            code="prefill_failed"), prefill)

    @staticmethod
    def _reserved(msg: engine_pb2.DecodeResponse, decode: Instance) -> engine_pb2.Reserved:
        if msg.WhichOneof("kind") != "reserved":
            raise GatewayError(ErrorKind.INTERNAL, f"decode server {decode.address} answered a remote-prefill "
                               f"request with {msg.WhichOneof('kind')!r} instead of 'reserved'")
        return msg.reserved

    async def _prefill(self, prefill: Instance, decode: Instance,
                       reserved: engine_pb2.Reserved) -> engine_pb2.PrefillResponse:
        req = self._req
        block_size = decode.block_size
        # Leading blocks the decode server already holds (its own prefix-cache
        # hit) need no transfer.
        num_skip = reserved.num_cached_tokens // block_size if block_size else 0
        self._check_adapter_copy(prefill, decode, reserved)
        span = _client_span(req.trace, "pdserve.v1.Prefill/Prefill", prefill)
        uncached = (len(req.prompt_token_ids) + len(self._resume)
                    - (self.route.cached_tokens(prefill) if self.route else 0))
        with in_flight(prefill, tokens=uncached), _ending(span):
            call = prefill.stub.Prefill(
                engine_pb2.PrefillRequest(request_id=self._engine_id, prompt_token_ids=req.prompt_token_ids,
                                          sampling=self._sampling, decode_address=decode.address,
                                          dst_block_ids=reserved.block_ids, num_skip_blocks=num_skip,
                                          lora_name=req.lora_name or "",
                                          lora_fingerprint=reserved.lora_fingerprint,
                                          resume_output_token_ids=self._resume, priority=req.priority,
                                          # a hybrid model's linear-attention state slot (-1: none)
                                          dst_state_slot=reserved.state_slot if reserved.HasField("state_slot")
                                          else None),
                timeout=self._timeout(), metadata=req.trace.metadata(span))
            self._calls.add(call)
            try:
                result = await call
            except grpc.aio.AioRpcError as e:
                if req.lora_name and is_adapter_refusal(e.code(), e.details()):
                    # Its copy of the adapter differs from the decode server's, or it no longer holds it:
                    # another prefill server (or the decode server itself) takes the request afresh.
                    raise _PrefillFailed(GatewayError(
                        ErrorKind.UNAVAILABLE, f"prefill server {prefill.address} refused LoRA adapter "
                        f"`{req.lora_name}`: {e.code().name}: {e.details()}", code="prefill_failed"), prefill) from None
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise _FinishedInPrefill(e.details() or "no token meets the request's constraint") from None
                error = self._prefill_error(e, prefill)
                if e.code() == grpc.StatusCode.UNAVAILABLE and self._req.remaining() > 0:
                    # The prefill server is gone or draining and nothing was streamed yet: another one
                    # (or, with none left, the decode server itself) takes the request afresh.
                    raise _PrefillFailed(error, prefill) from None
                if (e.code() == grpc.StatusCode.ABORTED and self._router.kv_load_failure_policy == "recompute"
                        and self._req.remaining() > 0):
                    # The KV hand-off failed (stalled past its deadline, refused, broken): the decode
                    # server computes the prompt itself. With "fail" the client gets the error.
                    raise _PrefillFailed(error, prefill, recompute=True) from None
                raise error from None
            finally:
                self._calls.discard(call)
            self.prefill_result = result
            if span.is_recording():
                span.set_attributes(prefill_attributes(result, num_skip))
            return result

    async def _relay(self, call: Any, decode: Instance, skip: int, refusable: bool,
                     pending: asyncio.Future[Any] | None = None) -> AsyncIterator[TokenChunk]:
        """Decode deltas as chunks, dropping the first ``skip`` tokens (``pending``: a read
        of the call already under way, the first one)."""
        while True:
            msg = await self._read(call, decode, refusable=refusable, pending=pending)
            refusable, pending = False, None
            if msg.WhichOneof("kind") != "delta":
                raise GatewayError(ErrorKind.INTERNAL, f"decode server {decode.address} sent "
                                   f"{msg.WhichOneof('kind')!r} where a token delta was expected")
            chunk = self._chunk(msg.delta, skip)
            skip = max(0, skip - len(msg.delta.token_ids))
            if not self.decode_ready.is_set():
                self.ready_decode = decode
                self.decode_ready.set()
            yield chunk
            if chunk.finish_reason:
                return

    @staticmethod
    def _chunk(delta: engine_pb2.TokenDelta, skip: int) -> TokenChunk:
        """A decode delta as a chunk, without its first ``skip`` tokens."""
        n = min(skip, len(delta.token_ids))
        return TokenChunk(list(delta.token_ids)[n:], list(delta.logprobs)[n:], delta.finish_reason,
                          delta.num_cached_tokens, delta.finish_message if delta.finish_reason == "error" else "",
                          (delta.num_draft_tokens, delta.num_accepted_draft_tokens), list(delta.prompt_logprobs))

    async def _read(self, call: Any, decode: Instance, refusable: bool, pending: asyncio.Future[Any] | None = None,
                    idle: bool = True) -> engine_pb2.DecodeResponse:
        """The decode stream's next message (``pending``: a read already under way), within the
        stream's idle deadline unless ``idle`` is False; its failures as this flow's exceptions."""
        timeout = self._router.stream_idle_timeout if idle else None
        try:
            async with asyncio.timeout(timeout):
                msg = await (pending if pending is not None else call.read())
        except TimeoutError:
            error = GatewayError(ErrorKind.UNAVAILABLE, f"decode server {decode.address} sent nothing on the "
                                 f"stream of request {self._req.request_id} for {timeout:g} s "
                                 f"(--stream-idle-timeout): it is hung or stalled", code="decode_server_stalled")
            decode.set_unhealthy(f"stalled: nothing streamed for {timeout:g} s")
            if refusable:
                raise _Refused(error) from None
            if self._req.remaining() > 0 and not self.is_aborted:
                raise _StreamBroken(error, "stalled") from None
            raise error from None
        except grpc.aio.AioRpcError as e:
            error = self._decode_error(e, decode)
            if refusable:
                raise _Refused(error) from None
            if (e.code() == grpc.StatusCode.ABORTED and self._router.kv_load_failure_policy == "recompute"
                    and self._req.remaining() > 0 and not self.is_aborted):
                raise _KVLoadFailed(error) from None  # the hand-off failed on the decode side
            if e.code() in _BROKEN and self._req.remaining() > 0 and not self.is_aborted:
                raise _StreamBroken(error, _BROKEN[e.code()]) from None
            raise error from None
        if msg is grpc.aio.EOF:
            error = GatewayError(ErrorKind.UNAVAILABLE, f"decode server {decode.address} ended the stream of "
                                 f"request {self._req.request_id} without a finish reason")
            if refusable:
                raise error
            raise _StreamBroken(error, "stream_ended")
        return msg

    def _decode_error(self, e: grpc.aio.AioRpcError, decode: Instance) -> GatewayError:
        code, details, where = e.code(), e.details(), f"decode server {decode.address}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return GatewayError(ErrorKind.RESOURCE_EXHAUSTED,
                                f"{where} is at capacity ({details}); retry later", code="server_overloaded")
        if self._req.lora_name and is_adapter_refusal(code, details):  # retried on another one that serves it
            return GatewayError(ErrorKind.UNAVAILABLE, f"{where} refused LoRA adapter `{self._req.lora_name}`: "
                                f"{code.name}: {details}", code="no_healthy_decode_server")
        return self._rpc_error(code, details, where, decode)

    def _prefill_error(self, e: grpc.aio.AioRpcError, prefill: Instance) -> GatewayError:
        code, details, where = e.code(), e.details(), f"prefill server {prefill.address}"
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return GatewayError(ErrorKind.RESOURCE_EXHAUSTED, f"{where} is at capacity ({details}); retry later",
                                code="server_overloaded")
        if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT):
            return self._rpc_error(code, details, where, prefill)
        if code == grpc.StatusCode.UNAVAILABLE:
            prefill.set_unhealthy(f"UNAVAILABLE: {details}")
        return GatewayError(ErrorKind.UNAVAILABLE, f"{where} failed to prefill request "
                            f"{self._req.request_id}: {code.name}: {details}", code="prefill_failed")

    def _rpc_error(self, code: grpc.StatusCode, details: str, where: str, inst: Instance) -> GatewayError:
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            if self._req.remaining() > 0:  # the server's own bound on a state, not the client's deadline
                return GatewayError(ErrorKind.DEADLINE_EXCEEDED, f"{where}: {details}", code="timeout")
            return GatewayError(ErrorKind.DEADLINE_EXCEEDED, f"request {self._req.request_id} ran past its "
                                f"deadline while waiting for {where}", code="timeout")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE,
                    grpc.StatusCode.FAILED_PRECONDITION):
            return GatewayError(ErrorKind.INVALID_ARGUMENT, f"{where} rejected the request: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            inst.set_unhealthy(f"UNAVAILABLE: {details}")
            return GatewayError(ErrorKind.UNAVAILABLE, f"{where} is unavailable: {details}")
        if code == grpc.StatusCode.CANCELLED:
            return GatewayError(ErrorKind.UNAVAILABLE, f"{where} cancelled the request: {details}")
        if code == grpc.StatusCode.ABORTED:  # the KV hand-off failed; the server itself is fine
            return GatewayError(ErrorKind.UNAVAILABLE, f"{where} ended the request: {details}",
                                code="kv_transfer_failed")
        return GatewayError(ErrorKind.INTERNAL, f"{where} failed: {code.name}: {details}")

    def _timeout(self) -> float:
        remaining = self._req.remaining()
        if remaining <= 0:
            raise GatewayError(ErrorKind.DEADLINE_EXCEEDED,
                               f"request {self._req.request_id} ran past its deadline", code="timeout")
        return remaining



def prefill_attributes(result: engine_pb2.PrefillResponse, num_skip_blocks: int) -> dict[str, Any]:
    """Span attributes of what a prefill server reported."""
    t = result.transfer
    attrs: dict[str, Any] = {
        "pdserve.prefill.queue_ms": round(result.queue_seconds * 1e3, 3),
        "pdserve.prefill.compute_ms": round(max(0.0, result.prefill_seconds - result.queue_seconds) * 1e3, 3),
        "pdserve.cached_tokens": result.num_cached_tokens, "pdserve.kv.skipped_blocks": num_skip_blocks}
    if result.HasField("transfer"):
        attrs.update({"pdserve.kv.blocks": t.num_blocks, "pdserve.kv.bytes": t.num_bytes,
                      "pdserve.kv.seconds": t.seconds, "pdserve.kv.backend": t.backend,
                      "pdserve.kv.seconds_after_first_token": t.seconds_after_first_token})
        if t.seconds > 0:
            attrs["pdserve.kv.gbps"] = round(t.num_bytes / t.seconds / 1e9, 3)
    return attrs


def _broke(watch: asyncio.Future[Any]) -> bool:
    """Whether a finished read of a decode stream says the server or its connection is gone
    (cancelled, a broken-stream status, anything but a status the server sent), rather than
    a status a live server ended the call with."""
    if watch.cancelled():
        return True
    exc = watch.exception()
    if exc is None:
        return False
    return not isinstance(exc, grpc.aio.AioRpcError) or exc.code() in _BROKEN


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Read a dropped task's outcome (asyncio would log an exception nobody read)."""
    if not task.cancelled():
        task.exception()


def _client_span(trace: RequestTrace, method: str, instance: Instance) -> Span:
    service, _, name = method.partition("/")
    host, _, port = instance.address.rpartition(":")
    return trace.start_span(method, SpanKind.CLIENT, {
        "rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "server.address": host,
        "server.port": int(port) if port.isdigit() else 0, "pdserve.instance.role": instance.role})


@contextlib.contextmanager
def _ending(span: Span, finished: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """End ``span`` when the block exits; failures mark it as an error, and so does a stream
    closed by its consumer before ``finished()`` (the call was cut short: the client went
    away)."""
    try:
        yield
    except _Refused as e:
        set_error(span, e.error)
        raise
    except GeneratorExit:
        if not finished():
            set_error(span, "cancelled: the stream was closed before the call finished")
        raise
    except BaseException as e:
        set_error(span, e)
        raise
    finally:
        span.end()
