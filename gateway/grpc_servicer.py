"""``pdserve.v1.Gateway`` over grpc.aio: the same GatewayService as the HTTP
API, with errors as gRPC status codes. A request's trace continues the
``traceparent`` of the call's metadata."""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.output_processor import GenerationDelta
from gateway.request_flow import PreparedRequest
from gateway.request_trace import RequestTrace, trace_headers
from gateway.service import GatewayService
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from rpc.convert import sampling_from_proto

logger = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Generate and Abort on top of GatewayService."""

    def __init__(self, service: GatewayService) -> None:
        self._service = service

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        kind = request.WhichOneof("prompt")
        trace = self._service.start_trace("chat" if kind == "chat" else "text_completion",
                                          trace_headers(context.invocation_metadata() or ()), "grpc")
        try:
            try:
                req = await self._prepare(request, trace, context.time_remaining())
            except BaseException as e:
                trace.finish(error=e)
                raise
            first = True
            async with aclosing(self._service.generate(req)) as deltas:
                async for delta in deltas:
                    yield _to_response(req, delta, first)
                    first = False
        except GatewayError as e:
            self._service.on_error(e)
            await context.abort(e.kind.grpc_status, e.message)
        except Exception as e:  # a bug: say so instead of a bare UNKNOWN
            logger.exception("Generate failed")
            error = GatewayError(ErrorKind.INTERNAL, f"internal error in the gateway: {type(e).__name__}: {e}")
            self._service.on_error(error)
            await context.abort(error.kind.grpc_status, error.message)

    async def Abort(self, request: common_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        return common_pb2.AbortResponse(found=self._service.abort(request.request_id))

    async def _prepare(self, request: gateway_pb2.GenerateRequest, trace: RequestTrace,
                       timeout: float | None) -> PreparedRequest:
        inputs = self._service.inputs
        inputs.check_model(request.model)
        try:
            sampling = sampling_from_proto(request.sampling)
        except ValueError as e:
            raise invalid(str(e)) from e
        if not request.sampling.HasField("max_tokens"):
            sampling.max_tokens = None  # proto default: up to the context length
        kind = request.WhichOneof("prompt")
        with trace.span("tokenize"):
            if kind == "text":
                ids = await inputs.encode_text(request.text)
            elif kind == "chat":
                ids = await inputs.encode_chat([{"role": m.role, "content": m.content}
                                                for m in request.chat.messages])
            elif kind == "token_ids":
                ids = inputs.check_token_ids(request.token_ids.ids)
            else:
                raise invalid("GenerateRequest needs a prompt: text, chat or token_ids")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return self._service.prepare(ids, sampling, request.request_id or None, prefix, trace, timeout)


def _to_response(req: PreparedRequest, delta: GenerationDelta, first: bool) -> gateway_pb2.GenerateResponse:
    msg = gateway_pb2.GenerateResponse(request_id=req.request_id, token_ids=delta.token_ids, text=delta.text,
                                       finish_reason=delta.finish_reason or "", logprobs=delta.logprobs)
    if first:
        msg.prompt_token_ids.extend(req.prompt_token_ids)
    if delta.usage is not None:
        msg.usage.CopyFrom(delta.usage.to_proto())
    return msg

