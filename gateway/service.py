"""The gateway's core, shared by the HTTP and gRPC front ends: request ids,
validation of a tokenized request, and ``generate()``, which runs a request
through ``RequestFlow`` and ``OutputProcessor`` while it is registered in
``ActiveRequests`` (for Abort and drain).

    front end --prepare()--> PreparedRequest --generate()--> GenerationDelta...
                                   RequestFlow (tokens) -> OutputProcessor (text)
"""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine.sampling_params import SamplingParams
from gateway.active_requests import ActiveRequests
from gateway.errors import GatewayError, invalid
from gateway.instances import InstanceRegistry
from gateway.metrics import GatewayMetrics
from gateway.output_processor import GenerationDelta, OutputProcessor
from gateway.request_flow import PreparedRequest, RequestFlow
from gateway.router import Router
from gateway.tokenization import InputProcessor

logger = logging.getLogger(__name__)

_MAX_REQUEST_ID_LEN = 256


class GatewayService:
    """Owns the pieces a request needs; the front ends only translate."""

    def __init__(self, inputs: InputProcessor, registry: InstanceRegistry, metrics: GatewayMetrics,
                 request_timeout: float, max_queued_requests: int | None = None,
                 log_requests: bool = True) -> None:
        self.inputs = inputs
        self.registry = registry
        self.metrics = metrics
        self.router = Router(registry)
        self.active = ActiveRequests(max_queued_requests)
        self.request_timeout = request_timeout
        self.log_requests = log_requests

    @property
    def served_model_name(self) -> str:
        return self.inputs.served_model_name

    @property
    def is_ready(self) -> bool:
        """The cluster can serve: not draining and a decode server is healthy."""
        return not self.active.is_draining and self.registry.has_healthy_decode

    def token_text(self, token_id: int) -> str:
        """A token's own text (for logprobs)."""
        return self.inputs.tokenizer.decode([token_id], skip_special_tokens=False)

    def prepare(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None,
                id_prefix: str, traceparent: str | None = None, timeout: float | None = None) -> PreparedRequest:
        """Check the token budget and admission; assign ids and the deadline
        (``--request-timeout``, or ``timeout`` if shorter: a gRPC client's own
        deadline). ``sampling.max_tokens`` None means the rest of the context."""
        self.active.check_admission()
        sampling.max_tokens = self.inputs.resolve_max_tokens(len(prompt_token_ids), sampling.max_tokens)
        if sampling.min_tokens > sampling.max_tokens:
            raise invalid(f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens "
                          f"({sampling.max_tokens})", param="min_tokens")
        if request_id:
            if len(request_id) > _MAX_REQUEST_ID_LEN:
                raise invalid(f"request id is longer than {_MAX_REQUEST_ID_LEN} characters")
            internal_id = f"{request_id}-{uuid.uuid4().hex[:12]}"  # client ids may repeat
        else:
            request_id = internal_id = f"{id_prefix}-{uuid.uuid4().hex}"
        now = time.monotonic()
        timeout = self.request_timeout if timeout is None else min(timeout, self.request_timeout)
        return PreparedRequest(request_id=request_id, internal_id=internal_id, prompt_token_ids=prompt_token_ids,
                               sampling=sampling, arrival=now, deadline=now + timeout,
                               traceparent=traceparent)

    async def generate(self, req: PreparedRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas of one request until the one with a finish_reason. Raises
        GatewayError; closing the iterator cancels every internal call."""
        flow = RequestFlow(req, self.router)
        handle = self.active.add(req, flow)
        self.metrics.set_in_flight(len(self.active))
        output = OutputProcessor(self.inputs.tokenizer, req, self.metrics)
        outcome = "cancelled"
        try:
            async with aclosing(output.process(flow.stream())) as deltas:
                async for delta in deltas:
                    if delta.finish_reason:
                        outcome = delta.finish_reason
                    yield delta
        except GatewayError as e:
            outcome = f"error {e.kind.http_status}: {e.message}"
            raise
        finally:
            self.active.remove(handle)
            self.metrics.set_in_flight(len(self.active))
            if self.log_requests:
                internal = f" ({req.internal_id})" if req.internal_id != req.request_id else ""
                logger.info("request %s%s: %d prompt + %d output tokens, decode=%s prefill=%s, %.3fs, %s",
                            req.request_id, internal, len(req.prompt_token_ids), output.num_output_tokens,
                            flow.decode_address or "-", flow.prefill_address or ("local" if flow.decode_address else "-"),
                            time.monotonic() - req.arrival,
                            outcome)

    def abort(self, request_id: str) -> bool:
        """Abort a request by id (its stream ends with finish_reason "abort")."""
        return self.active.abort(request_id)

    def on_error(self, error: GatewayError) -> None:
        """Count an error a front end returned to its client."""
        self.metrics.on_error(error.kind.http_status)
