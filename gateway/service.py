"""The gateway's core, shared by the HTTP and gRPC front ends: request ids,
validation of a tokenized request, and ``generate()``, which runs a request
through ``RequestFlow`` and ``OutputProcessor`` while it is registered in
``ActiveRequests`` (for Abort and drain).

    front end --start_trace()--> RequestTrace --prepare()--> PreparedRequest
              --generate()--> GenerationDelta...
                                   RequestFlow (tokens) -> OutputProcessor (text)

``generate()`` ends the request's trace, observes its per-phase metrics and
writes its log line (unless ``--disable-log-requests``)::

    request cmpl-1f.. : prompt_tokens=12 cached_tokens=0 output_tokens=16 ttft=0.081s e2e=0.412s
        decode=127.0.0.1:50071 prefill=127.0.0.1:50061 finish=length trace=4bf92f35...

(a request that finished with "error" has its reason after it: ``finish=error (request ...:
no token meets the structured-output constraint at output position 3)``; one under a LoRA
adapter ends with ``lora=NAME``, and one that speculated with ``spec_accepted=A/P``: of its P
proposed tokens, A were accepted).

LoRA adapters: ``resolve_model`` turns a request's ``model`` into the adapter it
selects (the served model name: the base model, None; a name some engine server
lists: that adapter; anything else: 404 ``model_not_found``); ``lora_adapters`` are
the known ones (for /v1/models); ``load_lora_adapter`` / ``unload_lora_adapter`` fan
out to every engine server (gateway/lora.py), as vLLM guards them: only with
``--allow-runtime-lora-updating`` (or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; a 404
naming both otherwise), and a load of a name some server already lists only with
``load_inplace`` (a 400 otherwise, in vLLM's words).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from engine.sampling_params import MAX_N, SamplingParams, check_priority
from gateway.active_requests import ActiveRequests
from gateway.choices import ChoiceStreams
from gateway.errors import ErrorKind, GatewayError, invalid
from gateway.instances import InstanceRegistry
from gateway.lora import LoRAAdmin, ServerResult, known_adapters
from gateway.metrics import GatewayMetrics
from gateway.output_processor import GenerationDelta, OutputProcessor
from gateway.reasoning_parsers import ChatStream, ReasoningParser, plain_chat_stream
from gateway.request_flow import DEFAULT_MIGRATION_LIMIT, PreparedRequest, RequestFlow
from gateway.request_trace import RequestTrace
from gateway.router import Router
from gateway.tokenization import InputProcessor
from gateway.tool_parsers import ToolParser, ToolPlan
from pdserve.v1 import common_pb2
from rpc import tracing

logger = logging.getLogger(__name__)

_MAX_REQUEST_ID_LEN = 256


class GatewayService:
    """Owns the pieces a request needs; the front ends only translate."""

    def __init__(self, inputs: InputProcessor, registry: InstanceRegistry, metrics: GatewayMetrics,
                 request_timeout: float, max_queued_requests: int | None = None,
                 log_requests: bool = True, router: Router | None = None,
                 tool_parser: ToolParser | None = None, enable_auto_tool_choice: bool = False,
                 allow_runtime_lora_updating: bool = False, reasoning_parser: ReasoningParser | None = None,
                 migration_limit: int = DEFAULT_MIGRATION_LIMIT, max_n: int = MAX_N) -> None:
        self.inputs = inputs
        self.migration_limit = migration_limit  # --migration-limit
        self.max_n = max_n  # --max-n: n and best_of at most this
        self.reasoning_parser = reasoning_parser  # --reasoning-parser
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.tool_parser = tool_parser  # --tool-call-parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.registry = registry
        self.metrics = metrics
        self.router = router or Router(registry)
        metrics.follow_routed_cached_tokens(lambda: self.router.routed_cached_tokens)
        self.active = ActiveRequests(max_queued_requests)
        self.request_timeout = request_timeout
        self.log_requests = log_requests
        self.lora = LoRAAdmin(registry, inputs.served_model_name)
        self._tracer = tracing.get_tracer("pdserve.gateway")

    @property
    def served_model_name(self) -> str:
        return self.inputs.served_model_name

    @property
    def is_ready(self) -> bool:
        """The cluster can serve: not draining and a decode server is healthy."""
        return not self.active.is_draining and self.registry.has_healthy_decode

    def lora_adapters(self) -> dict[str, common_pb2.LoRAAdapter]:
        """Every LoRA adapter some routable engine server lists, by name (decode servers' listings first)."""
        return known_adapters([*self.registry.decode, *self.registry.prefill])

    def resolve_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the base model); 404 when it names neither."""
        return self.inputs.check_model(model, self.lora_adapters())

    def model_name(self, lora_name: str | None) -> str:
        """The ``model`` responses carry: the adapter's name, else the served model name."""
        return lora_name or self.served_model_name

    async def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: float | None = None,
                                load_inplace: bool = False) -> list[ServerResult]:
        """Load an adapter on every engine server; GatewayError unless all succeed (and
        unless runtime updates are on, and the name is new or ``load_inplace``)."""
        self._check_runtime_lora_updating("load_lora_adapter")
        if not load_inplace and isinstance(lora_name, str) and lora_name in self.lora_adapters():
            raise invalid(f"The lora adapter '{lora_name:.256}' has already been loaded. If you want to load the "
                          "adapter in place, set 'load_inplace' to True.", code="lora_adapter_already_loaded",
                          param="lora_name")
        return await self.lora.load(lora_name, lora_path, timeout)

    async def unload_lora_adapter(self, lora_name: str, timeout: float | None = None) -> list[ServerResult]:
        """Unload an adapter from every engine server; GatewayError unless all succeed
        (and unless runtime updates are on)."""
        self._check_runtime_lora_updating("unload_lora_adapter")
        return await self.lora.unload(lora_name, timeout)

    def _check_runtime_lora_updating(self, method: str) -> None:
        if not self.allow_runtime_lora_updating:
            raise GatewayError(ErrorKind.NOT_FOUND,
                               f"{method} is off: loading and unloading LoRA adapters at run time needs the gateway "
                               "(or pdserve up) started with --allow-runtime-lora-updating, or with "
                               "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment, as vLLM",
                               code="runtime_lora_updating_disabled")

    def begin_chat(self, prompt_token_ids: list[int], sampling: SamplingParams, tools: ToolPlan | None,
                   template_kwargs: Mapping[str, Any] | None) -> ChatStream:
        """How a chat's answer splits (reasoning, content, tool calls), and what the
        reasoning parser asks of its sampling: a constraint holds back until the reasoning
        ends (its end token sequence; none when the prompt ended the reasoning), and the
        model's end-of-turn tokens stop it (harmony's)."""
        parser = self.reasoning_parser
        if parser is None:
            return plain_chat_stream(tools)
        stream, end_ids = parser.chat_stream(prompt_token_ids, template_kwargs or {}, tools)
        if sampling.structured_outputs is not None:
            sampling.structured_outputs = dataclasses.replace(sampling.structured_outputs,
                                                              reasoning_end_token_ids=tuple(end_ids))
        extra = [t for t in parser.extra_stop_token_ids() if t not in sampling.stop_token_ids]
        sampling.stop_token_ids = [*sampling.stop_token_ids, *extra]
        return stream

    def token_text(self, token_id: int) -> str:
        """A token's own text (for logprobs)."""
        return self.inputs.tokenizer.decode([token_id], skip_special_tokens=False)

    def start_trace(self, operation: str, headers: Mapping[str, str] | None, api: str) -> RequestTrace:
        """The root span of a new request ("chat" | "text_completion"),
        continuing the caller's trace headers if any. ``generate()`` ends it;
        a front end whose request fails before that calls ``finish``."""
        return RequestTrace(operation, self.served_model_name, headers, api, self._tracer)

    def prepare(self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None,
                id_prefix: str, trace: RequestTrace | None = None, timeout: float | None = None,
                lora_name: str | None = None, priority: int = 0) -> PreparedRequest:
        """Check the token budget and admission; assign ids and the deadline
        (``--request-timeout``, or ``timeout`` if shorter: a gRPC client's own
        deadline). ``sampling.max_tokens`` None means the rest of the context;
        ``lora_name``: the adapter ``resolve_model`` chose (None: the base model); ``priority``:
        passed to both tiers (the servers refuse anything but 0 unless they schedule by priority)."""
        self.active.check_admission()
        self.inputs.check_sampling(sampling)  # the one range check for HTTP and gRPC
        for name in ("n", "best_of"):
            value = getattr(sampling, name)
            if value is not None and value > self.max_n:
                raise invalid(f"{name} must be at most {self.max_n} (the gateway's --max-n), got {value}", param=name)
        try:
            check_priority(priority)
        except ValueError as e:
            raise invalid(str(e), param="priority") from e
        sampling.max_tokens = self.inputs.resolve_max_tokens(len(prompt_token_ids), sampling.max_tokens)
        if sampling.min_tokens > sampling.max_tokens:
            raise invalid(f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens "
                          f"({sampling.max_tokens})", param="min_tokens")
        if request_id:
            if len(request_id) > _MAX_REQUEST_ID_LEN:
                raise invalid(f"request id is longer than {_MAX_REQUEST_ID_LEN} characters")
            internal_id = f"{request_id}-{uuid.uuid4().hex[:12]}"  # client ids may repeat
        else:
            join = "" if id_prefix.endswith("_") else "-"  # msg_<hex> (Anthropic's form), else cmpl-<hex>
            request_id = internal_id = f"{id_prefix}{join}{uuid.uuid4().hex}"
        now = time.monotonic()
        timeout = self.request_timeout if timeout is None else min(timeout, self.request_timeout)
        trace = trace or RequestTrace.disabled()
        trace.on_prepared(request_id, internal_id, len(prompt_token_ids), sampling, lora_name, priority)
        return PreparedRequest(request_id=request_id, internal_id=internal_id, prompt_token_ids=prompt_token_ids,
                               sampling=sampling, arrival=now, deadline=now + timeout, trace=trace,
                               lora_name=lora_name, priority=priority)

    async def generate(self, req: PreparedRequest) -> AsyncIterator[GenerationDelta]:
        """Deltas of one request until the one with a finish_reason (with ``n`` or ``best_of``:
        every choice's, tagged with its index; gateway/choices.py). Raises GatewayError;
        closing the iterator cancels every internal call."""
        outputs: dict[str, OutputProcessor] = {}  # by the choice's internal id

        def flow_of(choice: PreparedRequest, pin: Any = None) -> RequestFlow:
            return RequestFlow(choice, self.router, self.migration_limit, self.metrics.on_migration, pin)

        async def run(choice: PreparedRequest, flow: RequestFlow) -> AsyncIterator[GenerationDelta]:
            handle = self.active.add(choice, flow)
            self.metrics.set_in_flight(len(self.active))
            output = outputs[choice.internal_id] = OutputProcessor(self.inputs.tokenizer, choice, self.metrics)
            try:
                async with aclosing(output.process(flow.stream())) as deltas:
                    async for delta in deltas:
                        if delta.finish_reason:
                            flow.is_finished = True
                        yield delta
            finally:
                self.active.remove(handle)
                self.metrics.set_in_flight(len(self.active))

        if req.lora_name:
            self.metrics.on_lora_request(req.lora_name)
        choices = ChoiceStreams(req, flow_of, run) if req.sampling.num_sequences > 1 else None
        flows = choices.flows if choices is not None else [flow_of(req)]
        outcome, message = "cancelled", ""
        error: BaseException | str | None = "cancelled"
        try:
            stream = choices.deltas() if choices is not None else run(req, flows[0])
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    if delta.finish_reason and delta.index == 0:
                        outcome, message, error = delta.finish_reason, delta.finish_message, None
                    yield delta
        except GatewayError as e:
            outcome, error = f"error {e.kind.http_status}: {e.message}", e
            raise
        finally:
            if req.internal_id in outputs:
                total = choices.num_output_tokens if choices is not None else None
                self._finish(req, flows[0], outputs[req.internal_id], outcome, error, message, total)

    def _finish(self, req: PreparedRequest, flow: RequestFlow, output: OutputProcessor, outcome: str,
                error: BaseException | str | None, message: str = "", num_output_tokens: int | None = None) -> None:
        """A request's end: phase metrics, its trace's root span, its log line
        (``message``: why a request finished with "error"; ``num_output_tokens``: every
        choice's, when it had several; its phases and route are choice 0's)."""
        if num_output_tokens is None:
            num_output_tokens = output.num_output_tokens
        e2e = time.monotonic() - req.arrival
        ttft = output.first_token_time - req.arrival if output.first_token_time is not None else None
        prefill = flow.prefill_result
        kv = prefill.transfer if prefill is not None and prefill.HasField("transfer") else None
        if kv is not None and kv.host_staged:
            self.metrics.on_kv_host_staged()
        if error is None:
            decode_s = (output.last_token_time - output.first_token_time
                        if output.first_token_time is not None and output.last_token_time is not None else None)
            self.metrics.on_request_phases(
                num_prompt_tokens=len(req.prompt_token_ids), num_generation_tokens=num_output_tokens,
                queue_seconds=prefill.queue_seconds if prefill is not None else None,
                prefill_seconds=max(0.0, prefill.prefill_seconds - prefill.queue_seconds) if prefill else None,
                decode_seconds=decode_s, kv_seconds=kv.seconds if kv else None, kv_bytes=kv.num_bytes if kv else None)
        req.trace.finish({
            "gen_ai.response.finish_reasons": [outcome] if error is None else None,
            "gen_ai.usage.output_tokens": num_output_tokens,
            "pdserve.cached_tokens": output.num_cached_tokens, "pdserve.e2e_ms": round(e2e * 1e3, 3),
            "pdserve.kv.bytes": kv.num_bytes if kv else None,
            "pdserve.route.decode": flow.decode_address, "pdserve.route.prefill": flow.prefill_address,
            "pdserve.finish_message": message or None}, error)
        if self.log_requests:
            internal = f" ({req.internal_id})" if req.internal_id != req.request_id else ""
            route = flow.route
            matched = route.cached_tokens(route.prefill or route.decode) if route is not None else 0
            logger.info("request %s%s: prompt_tokens=%d cached_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs "
                        "decode=%s prefill=%s route=%s matched_tokens=%d finish=%s%s%s%s",
                        req.request_id, internal, len(req.prompt_token_ids), output.num_cached_tokens,
                        num_output_tokens, f"{ttft:.3f}s" if ttft is not None else "-", e2e,
                        flow.decode_address or "-",
                        flow.prefill_address or ("local" if flow.decode_address else "-"),
                        route.reason if route is not None else "-", matched,
                        f"{outcome} ({message})" if message else outcome,
                        f" trace={req.trace.trace_id}" if req.trace.trace_id else "",
                        f" lora={req.lora_name}" if req.lora_name else "",
                        f" spec_accepted={output.spec[1]}/{output.spec[0]}" if output.spec[0] else "")

    def cluster_json(self) -> dict[str, Any]:
        """The /cluster body: every instance's load and health, and with the in-memory prefix
        index the blocks it credits each with, in its device cache (``prefix_blocks``) and in
        its host tier (``prefix_host_blocks``; both null while not followed); the prefix index
        (``prefix_index``: backend, and for Redis whether it is reachable); the prompt tokens
        the index credited the instances routed to with, by tier (``routed_cached_tokens``:
        device, host); and the degraded modes (``degraded``: the counts of gateway/metrics.py)."""
        out = self.registry.to_json()
        index = self.router.index
        out["prefix_index"] = index.to_json() if index is not None else None
        out["routed_cached_tokens"] = dict(self.router.routed_cached_tokens)
        out["degraded"] = self.metrics.degraded_json()
        num_blocks = getattr(index, "num_blocks", None)  # Redis keeps no per-instance count
        num_host_blocks = getattr(index, "num_host_blocks", None)
        for inst in out["instances"]:
            if num_blocks is not None:
                inst["prefix_blocks"] = num_blocks(inst["address"])
            if num_host_blocks is not None:
                inst["prefix_host_blocks"] = num_host_blocks(inst["address"])
        return out

    def abort(self, request_id: str) -> bool:
        """Abort a request by id (its stream ends with finish_reason "abort")."""
        return self.active.abort(request_id)

    def on_error(self, error: GatewayError) -> None:
        """Count an error a front end returned to its client."""
        self.metrics.on_error(error.kind.http_status)
