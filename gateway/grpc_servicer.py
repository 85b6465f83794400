"""``pdserve.v1.Gateway`` over grpc.aio: the same GatewayService as the HTTP
API, with errors as gRPC status codes. A request's trace continues the
``traceparent`` of the call's metadata.

Requests arrive as raw bytes (``add_gateway_servicer`` registers the methods
without a deserializer) and are parsed here: bytes that are not a valid
message (truncated, wrong wire types, invalid UTF-8 in a string) get
INVALID_ARGUMENT with the parser's reason, not the UNKNOWN that grpcio
answers when its own deserializer raises. A message longer than
``--max-request-body`` gets RESOURCE_EXHAUSTED. With ``--api-key`` every
method needs ``authorization: Bearer <key>`` metadata (UNAUTHENTICATED
otherwise); health and reflection stay open.

LoRA: ``GenerateRequest.model`` selects an adapter as the HTTP API's ``model``
does. ``ListModels`` answers the base model (``parent`` empty, ``root`` its
name) and every known adapter (``parent`` the served model name, ``root`` its
directory); ``LoadLoRAAdapter`` / ``UnloadLoRAAdapter`` act on every engine
server and answer one ``LoRAServerResult`` per server when all succeed, else
the status code of the HTTP API's error with the same message (a deadline
shorter than the gateway's own bounds the engine calls).

``sampling.structured_outputs`` is checked as the HTTP API's constraints are (a
bad one: INVALID_ARGUMENT naming it); a request that ends with finish_reason
"error" has the reason in the last message's ``finish_message``.

A chat's ``tools``, ``tool_choice`` (or ``tool_choice_function``) and
``parallel_tool_calls`` go through the HTTP API's checks as OpenAI's fields
would (``openai_protocol.tool_plan``), and assistant ``tool_calls`` and tool
``tool_call_id`` messages render as they do there. With tools, each response's
``text`` is the answer's content only and ``tool_calls`` carries the parsed calls
in pieces (``ToolCallStream``), and a natural end after a call is
finish_reason "tool_calls". ``chat_template_kwargs_json`` is the HTTP API's
``chat_template_kwargs`` as JSON text. With a ``--reasoning-parser``, a chat's
``reasoning_text`` carries the model's reasoning and ``text`` the answer's content after
it (gateway/reasoning_parsers.py).
"""
from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.lora import ServerResult
from gateway.openai_protocol import ChatMessage, tool_plan, with_tool_constraint
from gateway.output_processor import GenerationDelta
from gateway.request_flow import PreparedRequest
from gateway.request_trace import RequestTrace, trace_headers
from gateway.service import GatewayService
from gateway.reasoning_parsers import ChatStream
from gateway.tool_parsers import ToolPlan
from gateway.tool_parsers import finish_reason as tool_finish_reason
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc.convert import sampling_from_proto

logger = logging.getLogger(__name__)


def add_gateway_servicer(servicer: "GatewayServicer", server: grpc.aio.Server) -> None:
    """Register ``pdserve.v1.Gateway`` with requests parsed by the servicer itself."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.generate_raw, response_serializer=gateway_pb2.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.abort_raw, response_serializer=common_pb2.AbortResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.list_models_raw, response_serializer=gateway_pb2.ListModelsResponse.SerializeToString),
        "LoadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.load_lora_adapter_raw, response_serializer=gateway_pb2.LoRAAdapterResults.SerializeToString),
        "UnloadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.unload_lora_adapter_raw,
            response_serializer=gateway_pb2.LoRAAdapterResults.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.Gateway", handlers),))


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate, Abort, ListModels and the LoRA adapter methods on top of GatewayService."""

    def __init__(self, service: GatewayService, api_key: str | None = None,
                 max_request_bytes: int | None = None) -> None:
        self._service = service
        self._api_key = api_key
        self._max_request_bytes = max_request_bytes

    async def generate_raw(self, data: bytes,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request = await self._parse(gateway_pb2.GenerateRequest, data, context)
        async for response in self.Generate(request, context):
            yield response

    async def abort_raw(self, data: bytes, context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        return await self.Abort(await self._parse(common_pb2.AbortRequest, data, context), context)

    async def list_models_raw(self, data: bytes,
                              context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        return await self.ListModels(await self._parse(gateway_pb2.ListModelsRequest, data, context), context)

    async def load_lora_adapter_raw(self, data: bytes,
                                    context: grpc.aio.ServicerContext) -> gateway_pb2.LoRAAdapterResults:
        request = await self._parse(common_pb2.LoadLoRAAdapterRequest, data, context)
        return await self.LoadLoRAAdapter(request, context)

    async def unload_lora_adapter_raw(self, data: bytes,
                                      context: grpc.aio.ServicerContext) -> gateway_pb2.LoRAAdapterResults:
        request = await self._parse(common_pb2.UnloadLoRAAdapterRequest, data, context)
        return await self.UnloadLoRAAdapter(request, context)

    async def _parse(self, cls: Any, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        """Check the key and the size, then parse; aborts the call on failure."""
        error: GatewayError | None = self._auth_error(context)
        if error is None and self._max_request_bytes is not None and len(data) > self._max_request_bytes:
            error = GatewayError(ErrorKind.PAYLOAD_TOO_LARGE,
                                 f"the request is {len(data)} bytes; the limit is {self._max_request_bytes} "
                                 "(--max-request-body)", code="request_too_large")
        if error is None:
            try:
                return cls.FromString(data)
            except DecodeError as e:
                error = invalid(f"the request is not a valid {cls.DESCRIPTOR.full_name} message: {e}")
        self._service.on_error(error)
        await context.abort(error.kind.grpc_status, error.message)

    def _auth_error(self, context: grpc.aio.ServicerContext) -> GatewayError | None:
        if self._api_key is None:
            return None
        value = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = (value if isinstance(value, str) else "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self._api_key.encode()):
            return None
        return GatewayError(ErrorKind.UNAUTHENTICATED, "Incorrect or missing API key: send "
                            "'authorization: Bearer <key>' metadata.", code="invalid_api_key")

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        kind = request.WhichOneof("prompt")
        trace = self._service.start_trace("chat" if kind == "chat" else "text_completion",
                                          trace_headers(context.invocation_metadata() or ()), "grpc")
        try:
            try:
                auth = self._auth_error(context)
                if auth is not None:
                    raise auth
                req, answers = await self._prepare(request, trace, context.time_remaining())
            except BaseException as e:
                trace.finish(error=e)
                raise
            first = True
            async with aclosing(self._service.generate(req)) as deltas:
                async for delta in deltas:
                    yield _to_response(req, delta, first, answers[delta.index] if answers else None)
                    first = False
        except Exception as e:
            await self._abort(context, e, "Generate")

    async def Abort(self, request: common_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        await self._check_auth(context)
        return common_pb2.AbortResponse(found=self._service.abort(request.request_id))

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        await self._check_auth(context)
        name = self._service.served_model_name
        out = gateway_pb2.ListModelsResponse(models=[gateway_pb2.ModelCard(id=name, root=name)])
        out.models.extend(gateway_pb2.ModelCard(id=a.name, parent=name, root=a.path)
                          for a in self._service.lora_adapters().values())
        return out

    async def LoadLoRAAdapter(self, request: common_pb2.LoadLoRAAdapterRequest,
                              context: grpc.aio.ServicerContext) -> gateway_pb2.LoRAAdapterResults:
        await self._check_auth(context)
        return await self._lora_results(context, self._service.load_lora_adapter(
            request.lora_name, request.lora_path, context.time_remaining(), load_inplace=request.load_inplace))

    async def UnloadLoRAAdapter(self, request: common_pb2.UnloadLoRAAdapterRequest,
                                context: grpc.aio.ServicerContext) -> gateway_pb2.LoRAAdapterResults:
        await self._check_auth(context)
        return await self._lora_results(context, self._service.unload_lora_adapter(
            request.lora_name, context.time_remaining()))

    async def _lora_results(self, context: grpc.aio.ServicerContext,
                            work: Awaitable[list[ServerResult]]) -> gateway_pb2.LoRAAdapterResults:
        try:
            results = await work
        except Exception as e:
            await self._abort(context, e, "LoRA adapter call")
        return gateway_pb2.LoRAAdapterResults(servers=[
            gateway_pb2.LoRAServerResult(address=r.address, role=r.role, ok=r.ok, error=r.error) for r in results])

    async def _abort(self, context: grpc.aio.ServicerContext, e: Exception, what: str) -> None:
        """End the call with ``e`` as its status: a GatewayError's own, any other exception (a
        bug) INTERNAL saying so instead of a bare UNKNOWN."""
        if not isinstance(e, GatewayError):
            logger.exception("%s failed", what)
            e = GatewayError(ErrorKind.INTERNAL, f"internal error in the gateway: {type(e).__name__}: {e}")
        self._service.on_error(e)
        await context.abort(e.kind.grpc_status, e.message)

    async def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        auth = self._auth_error(context)
        if auth is not None:
            self._service.on_error(auth)
            await context.abort(auth.kind.grpc_status, auth.message)

    async def _prepare(self, request: gateway_pb2.GenerateRequest, trace: RequestTrace,
                       timeout: float | None) -> tuple[PreparedRequest, list[ChatStream]]:
        """The prepared request and, for a chat, how each choice's answer splits."""
        inputs = self._service.inputs
        lora = self._service.resolve_model(request.model)
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise invalid(str(e)) from e
        if not request.sampling.HasField("max_tokens"):
            sampling.max_tokens = None  # proto default: up to the context length
        kind = request.WhichOneof("prompt")
        tools, template_kwargs, answers = None, None, []
        if kind == "chat":
            tools = _tool_plan(request.chat, self._service)
            sampling.structured_outputs = with_tool_constraint(sampling.structured_outputs, tools)
            if tools is not None and tools.keeps_special_tokens:
                sampling.skip_special_tokens = False  # the tool-call format's markers are special tokens
            template_kwargs = _template_kwargs(request.chat.chat_template_kwargs_json)
        with trace.span("tokenize"):
            if kind == "text":
                ids = await inputs.encode_text(request.text)
            elif kind == "chat":
                ids = await inputs.encode_chat([_template_message(m) for m in request.chat.messages], True,
                                               tools.template_tools() if tools is not None else None,
                                               template_kwargs)
            elif kind == "token_ids":
                ids = inputs.check_token_ids(request.token_ids.ids)
            else:
                raise invalid("GenerateRequest needs a prompt: text, chat or token_ids")
        if kind == "chat":
            answers = [self._service.begin_chat(ids, sampling, tools, template_kwargs)
                       for _ in range(sampling.num_sequences)]
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return self._service.prepare(ids, sampling, request.request_id or None, prefix, trace, timeout,
                                     lora_name=lora, priority=request.priority), answers


def _tool_plan(chat: gateway_pb2.ChatMessages, service: GatewayService) -> ToolPlan | None:
    """The chat's tools as OpenAI's fields, through the HTTP API's checks."""
    tools = []
    for i, t in enumerate(chat.tools):
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        if t.parameters_json:
            try:
                function["parameters"] = json.loads(t.parameters_json)
            except ValueError as e:
                raise invalid(f"tools[{i}].parameters_json is not JSON: {e}", param="tools") from e
        tools.append({"type": "function", "function": function})
    choice: str | dict[str, Any] | None = chat.tool_choice or None
    if chat.tool_choice_function:
        if choice is not None:
            raise invalid("give tool_choice or tool_choice_function, not both", param="tool_choice")
        choice = {"type": "function", "function": {"name": chat.tool_choice_function}}
    parallel = chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True
    return tool_plan(tools, choice, parallel, service.tool_parser, service.enable_auto_tool_choice)


def _template_kwargs(text: str) -> dict[str, Any] | None:
    """``ChatMessages.chat_template_kwargs_json``: a JSON object (empty: none)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        raise invalid(f"chat_template_kwargs_json is not JSON: {e}", param="chat_template_kwargs") from e
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs_json must be a JSON object", param="chat_template_kwargs")
    return value


def _template_message(m: gateway_pb2.ChatMessage) -> dict[str, Any]:
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}}
             for c in m.tool_calls]
    return ChatMessage(role=m.role, content=m.content, tool_calls=calls or None,
                       tool_call_id=m.tool_call_id or None).to_template_dict()


def _to_response(req: PreparedRequest, delta: GenerationDelta, first: bool,
                 answer: ChatStream | None) -> gateway_pb2.GenerateResponse:
    text, finish_reason, tool_calls, reasoning = delta.text, delta.finish_reason or "", [], ""
    if answer is not None:  # a chat: its reasoning, its content and its calls parsed out
        new = answer.feed(delta.token_ids, delta.text, final=bool(finish_reason))
        text, tool_calls, reasoning = new.content, new.tool_calls, new.reasoning
        finish_reason = tool_finish_reason(finish_reason, answer.num_calls) or ""
    msg = gateway_pb2.GenerateResponse(request_id=req.request_id, token_ids=delta.token_ids, text=text,
                                       finish_reason=finish_reason, logprobs=delta.logprobs,
                                       finish_message=delta.finish_message, reasoning_text=reasoning,
                                       index=delta.index)
    msg.tool_calls.extend(gateway_pb2.ToolCallDelta(index=c.index, id=c.id or "", name=c.name or "",
                                                    arguments=c.arguments) for c in tool_calls)
    if first:
        msg.prompt_token_ids.extend(req.prompt_token_ids)
    msg.prompt_logprobs.extend(delta.prompt_logprobs)  # (the first delta's: SamplingParams.prompt_logprobs)
    if delta.usage is not None:
        msg.usage.CopyFrom(delta.usage.to_proto())
    return msg

