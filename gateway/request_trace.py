"""One request's spans at the gateway (OpenTelemetry; see rpc/tracing.py).

    POST /v1/chat/completions | /pdserve.v1.Gateway/Generate
    │                             SERVER, the root: FastAPI's own HTTP span or the gRPC
    │                             interceptor's; continues the caller's traceparent (HTTP
    │                             header or gRPC metadata), else starts the trace
    {operation} {model}           the request (GenAI span)
    ├─ tokenize
    ├─ route                      the chosen decode and prefill server (one per attempt)
    ├─ pdserve.v1.Decode/Generate CLIENT: the decode stream (event "reserved")
    ├─ pdserve.v1.Prefill/Prefill CLIENT: queue, compute and KV figures the prefill server reports
    └─ detokenize                 first token .. last delta (incremental detokenization, stop strings)

The root carries the GenAI attributes (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens|temperature|top_p``,
``gen_ai.response.id``, ``gen_ai.response.finish_reasons``,
``gen_ai.usage.input_tokens|output_tokens``) and ours under ``pdserve.*``:
``request_id`` (what ``pdserve trace`` looks up), ``internal_request_id``,
``cached_tokens``, ``ttft_ms``, ``e2e_ms``, ``kv.bytes``, ``lora_name`` (a request under a LoRA
adapter).

Spans are parented explicitly, never through the current context: a
request's work spans several asyncio tasks and async generators, where
attaching a context in one and detaching it in another would fail.

With tracing off every span is a no-op and the caller's ``traceparent`` and
``tracestate`` are forwarded to the engine servers unchanged.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from rpc import tracing

_TRACE_HEADERS = ("traceparent", "tracestate")
_TRACER_NAME = "pdserve.gateway"


def trace_headers(items: Any) -> dict[str, str]:
    """The W3C trace headers among ``items`` ((key, value) pairs: HTTP headers
    or gRPC metadata), keys lower case."""
    out: dict[str, str] = {}
    for key, value in items:
        key = key.lower()
        if key in _TRACE_HEADERS:
            out[key] = value if isinstance(value, str) else value.decode()
    return out


class RequestTrace:
    """Owns one request's gateway spans; ``finish`` ends the root (once)."""

    def __init__(self, operation: str, model: str, headers: Mapping[str, str] | None = None,
                 api: str = "", tracer: Any = None) -> None:
        self._tracer = tracer or tracing.get_tracer(_TRACER_NAME)
        self._headers = dict(headers or {})
        # Under the transport's SERVER span when there is one (it already
        # continued the caller's context), else straight under the caller's.
        current = tracing.current_context()
        parent = current if trace.get_current_span(current).is_recording() else tracing.extract(self._headers)
        self.root: Span = self._tracer.start_span(
            f"{operation} {model}", context=parent, kind=SpanKind.INTERNAL,
            attributes={"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                        "gen_ai.provider.name": "pdserve", "pdserve.api": api, "pdserve.phase": "gateway"})
        self._root_ctx = trace.set_span_in_context(self.root)
        self._detokenize: Span | None = None
        self.is_finished = False

    @classmethod
    def disabled(cls) -> "RequestTrace":
        """A trace whose spans are all no-ops (requests built without one)."""
        return cls("", "", tracer=trace.NoOpTracer())

    @property
    def is_recording(self) -> bool:
        return self.root.is_recording()

    @property
    def trace_id(self) -> str | None:
        ctx = self.root.get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.is_valid else None

    def start_span(self, name: str, kind: SpanKind = SpanKind.INTERNAL,
                   attributes: Mapping[str, Any] | None = None) -> Span:
        """A child of the root, started now; the caller ends it."""
        return self._tracer.start_span(name, context=self._root_ctx, kind=kind,
                                       attributes={"pdserve.phase": "gateway", **(attributes or {})})

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        """A child span around a block; an exception marks it as an error."""
        span = self.start_span(name, attributes=attributes)
        try:
            yield span
        except BaseException as e:
            set_error(span, e)
            raise
        finally:
            span.end()

    def metadata(self, span: Span) -> tuple[tuple[str, str], ...] | None:
        """gRPC metadata for a call made under ``span``: its context, or with
        tracing off the caller's own trace headers."""
        if span.is_recording():
            return tuple(tracing.inject_metadata(trace.set_span_in_context(span)))
        return tuple(self._headers.items()) or None

    def on_prepared(self, request_id: str, internal_id: str, num_prompt_tokens: int, sampling: Any,
                    lora_name: str | None = None, priority: int = 0) -> None:
        if not self.is_recording:
            return
        attrs: dict[str, Any] = {"gen_ai.response.id": request_id, "pdserve.request_id": request_id,
                                 "pdserve.internal_request_id": internal_id,
                                 "gen_ai.usage.input_tokens": num_prompt_tokens}
        if lora_name:
            attrs["pdserve.lora_name"] = lora_name
        if priority:
            attrs["pdserve.priority"] = priority
        for key, value in (("max_tokens", sampling.max_tokens), ("temperature", sampling.temperature),
                           ("top_p", sampling.top_p), ("seed", getattr(sampling, "seed", None))):
            if value is not None:
                attrs[f"gen_ai.request.{key}"] = value
        self.root.set_attributes(attrs)

    def on_first_token(self, ttft_seconds: float) -> None:
        """The first output token reached the gateway: starts "detokenize"."""
        if not self.is_recording or self._detokenize is not None:
            return
        self.root.add_event("first_token")
        self.root.set_attribute("pdserve.ttft_ms", round(ttft_seconds * 1e3, 3))
        self._detokenize = self.start_span("detokenize")

    def finish(self, attributes: Mapping[str, Any] | None = None, error: BaseException | str | None = None) -> None:
        """End the root (and "detokenize"); later calls do nothing."""
        if self.is_finished:
            return
        self.is_finished = True
        recording = self.is_recording
        if self._detokenize is not None:
            if error is not None:
                set_error(self._detokenize, error)
            self._detokenize.end()
        if self.is_recording:
            self.root.set_attributes({k: v for k, v in (attributes or {}).items() if v is not None})
            if error is not None:
                set_error(self.root, error)
        self.root.end()
        if recording:  # this request's spans to the traces file before the response leaves
            tracing.flush_request_spans()


def set_error(span: Span, error: BaseException | str) -> None:
    """Mark ``span`` failed: ERROR status with the message, ``error.type``."""
    if not span.is_recording():
        return
    if isinstance(error, str):
        span.set_status(Status(StatusCode.ERROR, error))
        return
    kind = getattr(error, "kind", None)
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    span.set_status(Status(StatusCode.ERROR, message))
    span.set_attribute("error.type", kind.name if kind is not None else type(error).__name__)
