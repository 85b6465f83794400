"""The OpenAI-compatible HTTP API (FastAPI), a thin translation layer over
``GatewayService``.

    GET  /v1/models              POST /v1/completions    POST /v1/chat/completions
    POST /v1/responses  (run as the chat request it translates into: gateway/responses_protocol.py)
    POST /v1/messages, /v1/messages/count_tokens  (Anthropic's, likewise: gateway/anthropic_protocol.py)
    POST /v1/load_lora_adapter   POST /v1/unload_lora_adapter
    GET  /health  (200 when a decode server is healthy)  GET /metrics  GET /cluster

A request's ``model`` is the served model name or a LoRA adapter some engine
server lists (``GatewayService.resolve_model``); responses carry that name.
/v1/models lists the base model (``parent`` null) and one card per known
adapter (``root``: its directory, ``parent``: the served model name). The
adapter endpoints (with ``--allow-runtime-lora-updating``) take vLLM's bodies
(``{"lora_name", "lora_path", "load_inplace"}``, ``{"lora_name"}``), act on every
engine server and answer
``{"lora_name", "servers": [{"address", "role", "ok", "error"}]}`` when all
succeed, else the error gateway/lora.py derives from the failures.

Streaming: the first delta is awaited before the response starts, so errors
that happen before any token (no decode server, queue full, prefill failure)
get their real status code; later errors become an SSE ``{"error": ...}``
event followed by ``[DONE]`` (/v1/responses: named events, no ``[DONE]``). A
client that disconnects cancels the request and with it every internal call.

Limits and keys: a request body longer than ``max_request_body`` bytes gets
413 before it is parsed (``_BodyLimit``); with ``api_key`` set, ``/v1/*`` and
``/cluster`` need ``Authorization: Bearer <key>`` (``/health`` and
``/metrics`` stay open for probes and scrapers); a 429 carries
``Retry-After``. Every error is ``{"error": {"message", "type", "param",
"code"}}``; bodies that do not parse or have the wrong types are 400s.

Bodies are JSON whatever their ``Content-Type`` says (``_AnyContentType``:
curl's ``-d`` alone sends ``application/x-www-form-urlencoded``, some clients
send none); a body that is not JSON is a 400 ``invalid_json`` giving the line
and column of the fault, and the Content-Type it came with when that was not
``application/json``.

Each request's trace starts when its handler does (continuing a
``traceparent`` header) and is ended by ``GatewayService.generate``, or here
when the request fails before that.
"""
from __future__ import annotations

import asyncio
import contextlib
import email.message
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.anthropic_protocol import ANTHROPIC_PATHS, CountTokensRequest, MessagesRequest
from gateway.anthropic_protocol import error_body as anthropic_error_body
from gateway.anthropic_protocol import error_json as anthropic_error_json
from gateway.anthropic_responses import MessagesFormatter
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.lora import ServerResult
from gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                                     UnloadLoRAAdapterRequest)
from gateway.openai_responses import ChatFormatter, CompletionFormatter, PromptView, ResponseFormatter
from gateway.output_processor import GenerationDelta
from gateway.reasoning_parsers import ChatStream
from gateway.request_flow import PreparedRequest
from gateway.request_trace import RequestTrace, trace_headers
from gateway.responses_output import ResponsesFormatter
from gateway.responses_protocol import ResponsesRequest, responses_errors
from gateway.service import GatewayService
from gateway.sse import SSE_MEDIA_TYPE
from pdserve.v1 import common_pb2

T = TypeVar("T")


class _ClientDisconnected(Exception):
    pass


def _untraced(scope: dict[str, Any]) -> bool:
    """Only generation requests get FastAPI's HTTP span (not health or metrics polls)."""
    return scope.get("path") not in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


# FastAPI's own OpenTelemetry HTTP span (active once rpc.tracing installed a
# provider) is the root of a request's trace; RequestTrace nests under it.
_TELEMETRY: Any = {"tracing": True, "operation_spans": False, "metrics": False, "logs": False,
                   "exclude": _untraced}


DEFAULT_MAX_REQUEST_BODY = 4 * 1024 * 1024


def create_app(service: GatewayService, api_key: str | None = None,
               max_request_body: int = DEFAULT_MAX_REQUEST_BODY) -> FastAPI:
    """The FastAPI app; ``api_key`` set -> /v1/* and /cluster need
    ``Authorization: Bearer <key>``; bodies over ``max_request_body`` bytes get 413."""
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=_TELEMETRY)
    _install_error_handlers(app, service)
    app.add_middleware(_AnyContentType)
    app.add_middleware(_BodyLimit, max_bytes=max_request_body, on_error=service.on_error)
    auth = Depends(_auth_dependency(api_key))
    v1 = APIRouter(prefix="/v1", dependencies=[auth])

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        adapters = service.lora_adapters().values()
        return {"object": "list", "data": [_model_card(service), *(_model_card(service, a) for a in adapters)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        lora = service.resolve_model(model_id)
        return _model_card(service, service.lora_adapters().get(lora) if lora is not None else None)

    @v1.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> dict[str, Any]:
        return _lora_results(body.lora_name, await service.load_lora_adapter(body.lora_name, body.lora_path,
                                                                             load_inplace=body.load_inplace))

    @v1.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> dict[str, Any]:
        return _lora_results(body.lora_name, await service.unload_lora_adapter(body.lora_name))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        trace = service.start_trace("text_completion", trace_headers(request.headers.items()), "http")
        try:
            lora = service.resolve_model(body.model)
            sampling = body.to_sampling_params()
            prompt = body.single_prompt()
            with trace.span("tokenize"):
                ids = (await service.inputs.encode_text(prompt) if isinstance(prompt, str)
                       else service.inputs.check_token_ids(prompt))
            req = _prepare(service, request, ids, sampling, "cmpl", trace, lora, body.priority)
        except BaseException as e:
            trace.finish(error=e)
            raise
        echo = (prompt if isinstance(prompt, str) else service.inputs.tokenizer.decode(ids)) if body.echo else None
        shown = PromptView(ids, echo, body.logprobs or 0, body.prompt_logprobs)
        fmt = CompletionFormatter(req.request_id, service.model_name(lora), service.token_text,
                                  body.include_usage, sampling.logprobs is not None, shown, n=body.n)
        return await _respond(service, request, req, fmt, body.stream)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        req, answer, lora = await _traced_chat(service, request, lambda: body, "chatcmpl")
        shown = PromptView(req.prompt_token_ids, body.echoed_text() or None, prompt_logprobs=body.prompt_logprobs)
        fmt = ChatFormatter(req.request_id, service.model_name(lora), service.token_text,
                            body.include_usage, req.sampling.logprobs is not None, shown, answer=answer,
                            reasoning=service.reasoning_parser is not None, n=body.n)
        return await _respond(service, request, req, fmt, body.stream)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        req, answer, lora = await _traced_chat(service, request, body.to_chat_request, "resp", responses_errors())
        fmt = ResponsesFormatter(req.request_id, service.model_name(lora), body.echo(), answer)
        return await _respond(service, request, req, fmt, body.stream)

    @v1.post("/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        chat = body.to_chat_request(service.tool_parser, service.enable_auto_tool_choice)
        req, answer, lora = await _traced_chat(service, request, lambda: chat, "msg_")
        fmt = MessagesFormatter(req.request_id, service.model_name(lora), service.token_text, answer,
                                len(req.prompt_token_ids))
        return await _respond(service, request, req, fmt, body.stream)

    @v1.post("/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, Any]:
        chat = body.to_chat_request(service.tool_parser, service.enable_auto_tool_choice)
        service.resolve_model(chat.model)
        tools = chat.tool_plan(service.tool_parser, service.enable_auto_tool_choice)
        ids = await service.inputs.encode_chat(chat.template_messages(), True,
                                               tools.template_tools() if tools is not None else None,
                                               chat.chat_template_kwargs)
        return {"input_tokens": len(ids)}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> JSONResponse:
        if service.is_ready:
            return JSONResponse({"status": "ok"})
        reason = "draining" if service.active.is_draining else "no healthy decode server"
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=service.metrics.CONTENT_TYPE)

    @app.get("/cluster", dependencies=[auth])
    async def cluster() -> dict[str, Any]:
        return service.cluster_json()

    return app


def _model_card(service: GatewayService, adapter: common_pb2.LoRAAdapter | None = None) -> dict[str, Any]:
    """The base model's card, or a LoRA adapter's (as vLLM shapes them)."""
    if adapter is not None:
        return {"id": adapter.name, "object": "model", "created": int(time.time()), "owned_by": "pdserve",
                "root": adapter.path, "parent": service.served_model_name}
    return {"id": service.served_model_name, "object": "model", "created": int(time.time()), "owned_by": "pdserve",
            "root": service.served_model_name, "parent": None, "max_model_len": service.inputs.max_model_len}


def _lora_results(lora_name: str, results: list[ServerResult]) -> dict[str, Any]:
    return {"lora_name": lora_name, "servers": [r.to_json() for r in results]}


def _prepare(service: GatewayService, request: Request, ids: list[int], sampling: Any,
             prefix: str, trace: RequestTrace, lora_name: str | None, priority: int = 0) -> PreparedRequest:
    return service.prepare(ids, sampling, request.headers.get("x-request-id"), prefix, trace=trace,
                           lora_name=lora_name, priority=priority)


async def _traced_chat(service: GatewayService, request: Request, chat: Callable[[], ChatCompletionRequest],
                       prefix: str, errors: contextlib.AbstractContextManager[Any] | None = None
                       ) -> tuple[PreparedRequest, Any, str | None]:
    """A chat request's trace started and the request prepared (``_prepare_chat``); ``chat()``
    gives the chat request (a translation may refuse it) under ``errors``; a failure ends the
    trace with its error."""
    trace = service.start_trace("chat", trace_headers(request.headers.items()), "http")
    try:
        with errors or contextlib.nullcontext():
            return await _prepare_chat(service, request, chat(), prefix, trace)
    except BaseException as e:
        trace.finish(error=e)
        raise


async def _prepare_chat(service: GatewayService, request: Request, body: ChatCompletionRequest, prefix: str,
                        trace: RequestTrace) -> tuple[PreparedRequest, Any, str | None]:
    """A chat request tokenized and prepared, how its answer splits (a ChatStream; with ``n``
    or ``best_of``, one per sequence), and its LoRA adapter (/v1/chat/completions, and
    /v1/responses translated into a chat request)."""
    lora = service.resolve_model(body.model)
    tools = body.tool_plan(service.tool_parser, service.enable_auto_tool_choice)
    sampling = body.to_sampling_params(tools)
    with trace.span("tokenize"):
        ids = await service.inputs.encode_chat(body.template_messages(), body.add_generation_prompt,
                                               tools.template_tools() if tools is not None else None,
                                               body.chat_template_kwargs)
    answers = [service.begin_chat(ids, sampling, tools, body.chat_template_kwargs)
               for _ in range(sampling.num_sequences)]
    answer: ChatStream | list[ChatStream] = answers if len(answers) > 1 else answers[0]
    return _prepare(service, request, ids, sampling, prefix, trace, lora, body.priority), answer, lora


async def _respond(service: GatewayService, request: Request, req: PreparedRequest, fmt: ResponseFormatter,
                   stream: bool) -> Response:
    deltas = service.generate(req)
    headers = {"X-Request-Id": req.request_id}
    try:
        if not stream:
            collected = await _until_disconnect(request, _collect(deltas))
            return JSONResponse(fmt.response(collected), headers=headers)
        first = await _until_disconnect(request, anext(deltas))
    except _ClientDisconnected:
        req.trace.finish(error="client disconnected")  # in case generate() never started
        return Response(status_code=499)
    return _SSEResponse(_sse(service, fmt, first, deltas), deltas, headers=headers)


async def _collect(deltas: AsyncIterator[GenerationDelta]) -> list[GenerationDelta]:
    return [d async for d in deltas]


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; cancel it and raise _ClientDisconnected if the client goes away first."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise _ClientDisconnected
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(service: GatewayService, fmt: ResponseFormatter, first: GenerationDelta,
               deltas: AsyncIterator[GenerationDelta]) -> AsyncIterator[bytes]:
    try:
        for chunk in fmt.stream_start() + fmt.stream_delta(first):
            yield fmt.sse_event(chunk)
        if not first.finish_reason:
            async for delta in deltas:
                for chunk in fmt.stream_delta(delta):
                    yield fmt.sse_event(chunk)
        for chunk in fmt.stream_end():
            yield fmt.sse_event(chunk)
    except GatewayError as e:
        service.on_error(e)
        yield fmt.sse_event(e.to_openai())
    if done := fmt.sse_done():
        yield done


class _SSEResponse(StreamingResponse):
    """Closes the delta stream however the response ends. Starlette may stop
    iterating the body without closing it (client gone while a chunk was
    being sent); closing here cancels the internal calls deterministically."""

    def __init__(self, body: AsyncIterator[bytes], deltas: AsyncIterator[GenerationDelta],
                 headers: dict[str, str]) -> None:
        super().__init__(body, media_type=SSE_MEDIA_TYPE, headers={"Cache-Control": "no-cache", **headers})
        self._body_gen = body
        self._deltas = deltas

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body_gen.aclose()  # type: ignore[attr-defined]
            await self._deltas.aclose()  # type: ignore[attr-defined]


def _auth_dependency(api_key: str | None) -> Any:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        x_api_key = request.headers.get("x-api-key")  # Anthropic's clients send the key here
        if not any(k is not None and hmac.compare_digest(k.encode(), api_key.encode()) for k in (bearer, x_api_key)):
            raise GatewayError(ErrorKind.UNAUTHENTICATED, "Incorrect or missing API key: send "
                               "'Authorization: Bearer <key>' (or 'x-api-key: <key>').", code="invalid_api_key")
    return check


# An over-limit body of up to this many bytes is read and dropped before its 413 goes out (for at
# most _DRAIN_SECONDS): a server that closes its socket on unread bytes resets the connection, and
# a client still sending its body then loses the answer (httpx: "Connection reset by peer"). A
# longer body is answered at once: reading it would cost more than the client's clear error.
_DRAIN_BYTES = 64 * 2**20
_DRAIN_SECONDS = 10.0


class _BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` (by Content-Length, or
    counted as it arrives) is answered 413 before the app parses it; a body
    within the limit is handed on whole (it is bounded, so buffering is)."""

    def __init__(self, app: Any, max_bytes: int, on_error: Any) -> None:
        self.app, self.max_bytes, self.on_error = app, max_bytes, on_error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= _DRAIN_BYTES:
                await _drain(receive)
            await self._too_large(scope, receive, send, int(declared))
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                if message.get("more_body", False):
                    await _drain(receive)
                await self._too_large(scope, receive, send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal replayed
            if replayed:
                return await receive()  # disconnect watching goes on as usual
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any, size: int | None) -> None:
        got = f"{size} bytes" if size is not None else f"more than {self.max_bytes} bytes"
        error = GatewayError(ErrorKind.PAYLOAD_TOO_LARGE, f"the request body is {got}; the limit is "
                             f"{self.max_bytes} bytes (--max-request-body)", code="request_too_large")
        self.on_error(error)
        # Connection: close: the connection ends with this answer (the body was drained, or is too long to).
        await JSONResponse(_error_json(scope.get("path"), error), status_code=413, headers={"Connection": "close"})(scope, receive, send)


async def _drain(receive: Any) -> None:
    """Read and drop the rest of a request body: up to _DRAIN_BYTES, for up to _DRAIN_SECONDS."""
    async def read() -> None:
        seen = 0
        while seen <= _DRAIN_BYTES:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
    try:
        await asyncio.wait_for(read(), _DRAIN_SECONDS)
    except asyncio.TimeoutError:
        pass


# The Content-Type a POST came with, where _AnyContentType replaced it (None: it had none).
_SENT_CONTENT_TYPE = "pdserve.sent_content_type"


def _is_json_media_type(value: bytes | None) -> bool:
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value.decode("latin-1")
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _AnyContentType:
    """ASGI middleware: a POST whose Content-Type is missing or not JSON is read as JSON
    all the same (FastAPI would not parse it and answer that the body is not an object);
    the header it came with is kept in the scope for the error when it is not JSON."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST":
            headers = list(scope.get("headers") or ())
            sent = next((v for k, v in headers if k == b"content-type"), None)
            if not _is_json_media_type(sent):
                scope = {**scope, _SENT_CONTENT_TYPE: sent.decode("latin-1") if sent else None,
                         "headers": [(k, v) for k, v in headers if k != b"content-type"]
                         + [(b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def _body_error(request: Request, e: RequestValidationError) -> GatewayError | None:
    """The error of a body that is not a JSON object (not JSON: with the line and
    column; empty; another JSON value), else None (a field's own error)."""
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid" and isinstance(e.body, str) and len(loc) == 2:
        doc, pos = e.body, int(loc[1])
        line, column = doc.count("\n", 0, pos) + 1, pos - doc.rfind("\n", 0, pos)
        reason = (first.get("ctx") or {}).get("error", "not JSON")
        message = f"the request body is not valid JSON: {reason} at line {line}, column {column}"
    elif loc == ("body",) and first.get("type") == "missing":
        message = "the request body is empty; send a JSON object"
    elif loc == ("body",) and first.get("type") in ("model_attributes_type", "dict_type"):
        got = type(first.get("input")).__name__
        kind = {"list": "an array", "str": "a string", "int": "a number", "float": "a number",
                "bool": "a boolean", "NoneType": "null"}.get(got, got)
        message = f"the request body must be a JSON object, got {kind}"
    else:
        return None
    if _SENT_CONTENT_TYPE in request.scope:
        sent = request.scope[_SENT_CONTENT_TYPE]
        message += (f" (it was sent as Content-Type: {sent:.100}; send JSON with Content-Type: application/json)"
                    if sent else " (it was sent without a Content-Type; send JSON with Content-Type: "
                                 "application/json)")
    return invalid(message, code="invalid_json")


def _error_json(path: str | None, error: GatewayError) -> dict[str, Any]:
    """The error body in the shape of the API the path belongs to (Anthropic's or OpenAI's)."""
    return anthropic_error_json(error) if path in ANTHROPIC_PATHS else error.to_openai()


def _install_error_handlers(app: FastAPI, service: GatewayService) -> None:
    @app.exception_handler(GatewayError)
    async def gateway_error(request: Request, e: GatewayError) -> JSONResponse:
        service.on_error(e)
        return JSONResponse(_error_json(request.url.path, e), status_code=e.kind.http_status,
                            headers=e.http_headers())

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        error = _body_error(request, e)
        if error is None:
            parts = []
            for err in e.errors()[:5]:
                loc = ".".join(f"{x!s:.40}" for x in err.get("loc", ()) if x != "body")
                msg = f"{err.get('msg')!s:.200}"
                parts.append(f"{loc}: {msg}" if loc else msg)
            error = invalid("invalid request: " + "; ".join(parts))
        service.on_error(error)
        return JSONResponse(_error_json(request.url.path, error), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception) -> JSONResponse:
        error = GatewayError(ErrorKind.INTERNAL, f"internal error in the gateway: {type(e).__name__}: {e}")
        service.on_error(error)
        return JSONResponse(_error_json(request.url.path, error), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # 400 here: a body FastAPI could not parse (not UTF-8, nested too deep).
        message = f"invalid request: {e.detail}" if e.status_code == 400 else str(e.detail)
        code = None
        if e.status_code == 400 and e.detail == "There was an error parsing the body":
            message, code = "the request body cannot be read as JSON: it is not UTF-8 text, or it is nested too deeply", "invalid_json"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": code}}
        if request.url.path in ANTHROPIC_PATHS:
            body = anthropic_error_body(e.status_code, message)
        return JSONResponse(body, status_code=e.status_code, headers=getattr(e, "headers", None))
