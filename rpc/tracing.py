"""OpenTelemetry tracing for every pdserve process: set-up, W3C context in
gRPC metadata, and engine spans built after the fact from timestamps.

Set-up (once per process, before its ``RpcServer`` is created)::

    from rpc import tracing
    tracing.add_cli_args(parser)              # --otlp-traces-endpoint, --traces-file
    tracing.init_tracing("pdserve-decode", otlp_endpoint=args.otlp_traces_endpoint,
                         traces_file=args.traces_file)

What it reads (flags win over the environment; this module is the only
reader of these variables):

==================================================  ===========================================
``OTEL_SDK_DISABLED=true``                           no tracing at all
``--otlp-traces-endpoint`` /                         OTLP exporter on (``http://jaeger:4317``);
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /             for http/protobuf the traces endpoint is
``OTEL_EXPORTER_OTLP_ENDPOINT``                      used as is, the generic one gets /v1/traces
``OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL``             ``grpc`` (default, as vLLM) or ``http/protobuf``
``OTEL_TRACES_EXPORTER=none``                        no OTLP exporter (the traces file still works)
``--traces-file`` / ``PDSERVE_TRACES_FILE``          JSON lines file (``rpc/trace_file.py``)
``OTEL_SERVICE_NAME``                                overrides the role's default service name
``OTEL_TRACES_SAMPLER[_ARG]``                        the SDK's sampler (default parentbased_always_on)
``OTEL_BSP_*``                                       the SDK's batch span processor settings
==================================================  ===========================================

With no exporter configured nothing is installed: spans are no-ops, and the
gateway forwards a caller's ``traceparent`` unchanged. ``init_tracing`` is
idempotent; ``RpcServer`` calls it (environment only) for a process that did
not, so engine servers trace from the environment alone.

gRPC context: ``server_interceptors`` (opentelemetry-instrumentation-grpc's
aio interceptor, which handles unary and streaming methods) opens a SERVER
span for each request-carrying method in ``TRACED_METHODS`` under the
caller's ``traceparent``; inside the handler that span is the current span.
Health, reflection, GetLoad and Abort are not traced. Streaming handlers run
as coroutines that write what they yield, so a stream the client cancels
closes its generator (and the span's context) in the call's own task.
Clients put their context in the call's metadata with
``inject_metadata(ctx)``.

Engine spans (the engine thread carries no context): a servicer captures the
context at the start of its handler and, once the request is done with on
this tier, records its spans from the engine's ``RequestTimes``::

    from rpc import tracing

    async def Prefill(self, request, context):
        trace_ctx = tracing.current_context()       # the interceptor's SERVER span
        ...
        finally:
            tracing.record_engine_spans(
                "prefill", request.request_id, trace_ctx, req.times,
                {"num_prompt_tokens": len(request.prompt_token_ids),
                 "num_cached_tokens": d.num_cached_tokens,
                 "num_output_tokens": 1, "finish_reason": d.finish_reason,
                 "kv_blocks": stats.num_blocks, "kv_bytes": stats.num_bytes,
                 "kv_seconds": stats.seconds, "kv_backend": stats.backend})

The decode servicer calls it the same way with ``"decode"`` when its stream
ends (in the ``finally`` of ``Generate``). ``times`` is any object; these
attributes are read with ``getattr(times, name, None)`` (``time.time()``
seconds, None when absent), so fields added later are tolerated:

    arrival, reserved, kv_recv_start, kv_recv_end, first_scheduled,
    first_token, finished, kv_send_start, kv_send_end, prefill_chunks
    (a sequence of (start, end, num_tokens): one event each)

Spans it records, each with explicit start and end times (one call per
request; never a span per token)::

    prefill  (arrival .. finished)                   decode  (arrival .. finished)
      prefill.queue    arrival .. first_scheduled      decode.reservation_wait  arrival .. reserved
      prefill.compute  first_scheduled .. first_token  kv.receive   kv_recv_start .. kv_recv_end
      kv.send          kv_send_start .. kv_send_end    decode.queue  max(reserved, kv_recv_end) .. first_scheduled
                                                       decode.generate  .. finished (event first_token)
    decode without KV receive (it prefilled itself): decode.queue arrival .. first_scheduled,
    prefill.compute first_scheduled .. first_token, decode.generate first_token .. finished

Attribute keys: ``num_prompt_tokens`` -> ``gen_ai.usage.input_tokens``,
``num_output_tokens`` -> ``gen_ai.usage.output_tokens``, ``finish_reason``
-> ``gen_ai.response.finish_reasons``, ``num_cached_tokens`` ->
``pdserve.cached_tokens``, ``kv_blocks|kv_bytes|kv_seconds|kv_backend`` ->
``pdserve.kv.*`` (on the KV span, with ``pdserve.kv.gbps``); a key with a dot
is kept as is, any other becomes ``pdserve.<key>``. Every span carries
``pdserve.internal_request_id`` and a ``pdserve.phase`` that ``pdserve
trace`` uses for its time-to-first-token breakdown. Recording never raises.
"""
from __future__ import annotations

import argparse
import inspect
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer

logger = logging.getLogger(__name__)

GATEWAY, PREFILL, DECODE = "pdserve-gateway", "pdserve-prefill", "pdserve-decode"
TRACES_FILE_ENV = "PDSERVE_TRACES_FILE"
PROTOCOLS = ("grpc", "http/protobuf")
# Methods that carry a request (and so a trace); everything else (health,
# reflection, load polls every 0.5 s, Abort) would only add noise.
TRACED_METHODS = frozenset({"/pdserve.v1.Gateway/Generate", "/pdserve.v1.Prefill/Prefill",
                            "/pdserve.v1.Decode/Generate"})
_SERVICE_BY_GRPC_NAME = {"pdserve.v1.Gateway": GATEWAY, "pdserve.v1.Prefill": PREFILL,
                         "pdserve.v1.Decode": DECODE}
# Spans reach the traces file within this long; a request's as its part in a process ends
# (_file_processor).
_FILE_SCHEDULE_DELAY_MS = 500

_lock = threading.Lock()
_provider: Any = None  # the TracerProvider this module installed, if any
_installed_file_processor: Any = None  # its traces-file processor (flush_request_spans)


def default_traces_file() -> Path:
    """Where ``pdserve up`` writes spans and ``pdserve trace`` reads them:
    ``$PDSERVE_TRACES_FILE``, else ``traces.jsonl`` in pdserve's cache directory."""
    from engine.model_files import cache_dir

    return Path(os.environ.get(TRACES_FILE_ENV) or cache_dir() / "traces.jsonl").expanduser()


def child_env(otlp_endpoint: str | None, traces_file: str | os.PathLike[str] | None) -> dict[str, str]:
    """Environment entries that make a child process (any pdserve service)
    trace as these flags say."""
    env = {}
    if traces_file:
        env[TRACES_FILE_ENV] = str(traces_file)
    if otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = otlp_endpoint
    return env


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """``--otlp-traces-endpoint`` (vLLM's flag) and ``--traces-file``."""
    g = parser.add_argument_group("tracing")
    g.add_argument("--otlp-traces-endpoint", default=None,
                   help="send OpenTelemetry traces over OTLP to this endpoint, e.g. http://localhost:4317 "
                        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT)")
    g.add_argument("--traces-file", default=None,
                   help=f"also append finished spans as JSON lines to this file (default: ${TRACES_FILE_ENV})")


@dataclass(frozen=True)
class TracingConfig:
    """Where this process's spans go; ``from_env`` resolves flags and environment."""

    service_name: str
    otlp_endpoint: str | None = None  # None: no OTLP exporter
    otlp_protocol: str = "grpc"
    traces_file: str | None = None

    def __post_init__(self) -> None:
        if self.otlp_protocol not in PROTOCOLS:
            raise ValueError(f"OTLP protocol must be one of {', '.join(PROTOCOLS)}, got {self.otlp_protocol!r}")

    @property
    def is_enabled(self) -> bool:
        return bool(self.otlp_endpoint or self.traces_file)

    @classmethod
    def from_env(cls, service_name_default: str, otlp_endpoint: str | None = None,
                 traces_file: str | None = None, environ: Mapping[str, str] = os.environ) -> "TracingConfig":
        service = environ.get("OTEL_SERVICE_NAME") or service_name_default
        if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls(service)
        protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                    or "grpc").strip()
        exporters = {e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")}
        endpoint = otlp_endpoint
        if endpoint is None and "none" not in exporters:
            endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            generic = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            if not endpoint and generic:
                # http/protobuf appends the signal path to the generic endpoint.
                endpoint = generic.rstrip("/") + "/v1/traces" if protocol == "http/protobuf" else generic
        return cls(service, endpoint or None, protocol, traces_file or environ.get(TRACES_FILE_ENV) or None)


def init_tracing(service_name_default: str, *, otlp_endpoint: str | None = None,
                 traces_file: str | None = None) -> Any:
    """Install this process's TracerProvider (first call wins); returns it,
    or None when nothing is configured to export (then nothing is installed
    and a later call may still install one)."""
    global _provider, _installed_file_processor
    with _lock:
        if _provider is not None:
            return _provider
        cfg = TracingConfig.from_env(service_name_default, otlp_endpoint, traces_file)
        if not cfg.is_enabled:
            return None
        _provider, _installed_file_processor = _build(cfg)
        trace.set_tracer_provider(_provider)
    logger.info("tracing: service %s, OTLP %s, traces file %s", cfg.service_name,
                f"{cfg.otlp_protocol} {cfg.otlp_endpoint}" if cfg.otlp_endpoint else "off", cfg.traces_file or "off")
    return _provider


def build_provider(cfg: TracingConfig) -> Any:
    """A TracerProvider with the exporters ``cfg`` names (not installed globally)."""
    return _build(cfg)[0]


def _build(cfg: TracingConfig) -> tuple[Any, Any]:
    """(provider, its traces-file span processor or None)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}))
    file_processor = None
    if cfg.traces_file:
        from rpc.trace_file import JsonlSpanExporter

        delay = None if "OTEL_BSP_SCHEDULE_DELAY" in os.environ else _FILE_SCHEDULE_DELAY_MS
        file_processor = _file_processor(JsonlSpanExporter(cfg.traces_file), delay)
        provider.add_span_processor(file_processor)
    if cfg.otlp_endpoint:
        if cfg.otlp_protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
    return provider, file_processor


def _file_processor(exporter: Any, delay_ms: int | None) -> Any:
    """The traces file's span processor: batched, and written out at once when a request's
    part in this process ends, so that `pdserve trace` right after a response finds it:

    * a local root ends (no parent, or a remote one: the transport's SERVER span, which
      the engine servers' spans nest under and which the gateway's ends after the response);
    * ``flush_request_spans`` is called (the gateway, as its request span ends, before the
      response goes out).

    A flush is one append to the file, in the thread that ended the span."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class FileSpanProcessor(BatchSpanProcessor):
        def on_end(self, span: Any) -> None:
            super().on_end(span)
            if span.parent is None or span.parent.is_remote:
                self.force_flush()

    return FileSpanProcessor(exporter, schedule_delay_millis=delay_ms)


def flush_request_spans() -> None:
    """Write the spans ended so far to the traces file now (a request span just ended). Never
    raises; nothing to do without a traces file."""
    processor = _installed_file_processor
    if processor is None:
        return
    try:
        processor.force_flush()
    except Exception:  # tracing must never break serving
        logger.debug("could not flush the traces file", exc_info=True)


def is_enabled() -> bool:
    """True once this process installed a TracerProvider."""
    return _provider is not None


def get_tracer(name: str, tracer_provider: Any = None) -> Tracer:
    return trace.get_tracer(name, tracer_provider=tracer_provider)


def service_name_for(grpc_service_names: Iterable[str]) -> str:
    """The default service name of a server that serves these gRPC services."""
    for name in grpc_service_names:
        if name in _SERVICE_BY_GRPC_NAME:
            return _SERVICE_BY_GRPC_NAME[name]
    return "pdserve"


def server_interceptors(grpc_service_names: Iterable[str], *, tracer_provider: Any = None) -> list[Any]:
    """Interceptors for a grpc.aio server: a SERVER span per call of a method
    in ``TRACED_METHODS``, under the caller's ``traceparent``. Without
    ``tracer_provider``, initializes tracing from the environment if this
    process has not; empty when tracing is off."""
    if tracer_provider is None and init_tracing(service_name_for(grpc_service_names)) is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [_StreamsEndInTheirCall(),
            aio_server_interceptor(tracer_provider=tracer_provider, filter_=_is_traced_method)]


class _StreamsEndInTheirCall(grpc.aio.ServerInterceptor):
    """Runs each streaming handler as a coroutine that writes its responses and closes the
    handler's generator in the call's own task. grpc.aio iterates a generator handler and, when
    a write fails (the client cancelled), leaves it suspended at its ``yield``: it is closed
    later by the event loop's finalizer, in another context, where the tracing interceptor's
    span context cannot be detached ("Failed to detach context" logged for each such call)."""

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or not (handler.unary_stream or handler.stream_stream):
            return handler
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _written(handler.unary_stream), request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _written(handler.stream_stream), request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


def _written(behavior: Any) -> Any:
    if not inspect.isasyncgenfunction(behavior):
        return behavior

    async def write_all(request: Any, context: Any) -> None:
        responses = behavior(request, context)
        try:
            async for response in responses:
                await context.write(response)
        finally:
            await responses.aclose()

    return write_all


def _is_traced_method(handler_call_details: Any) -> bool:
    return handler_call_details.method in TRACED_METHODS


def current_context() -> Context:
    """The calling task's context (in a traced handler: its SERVER span)."""
    return otel_context.get_current()


def extract(carrier: Mapping[str, str] | None) -> Context:
    """A context from W3C ``traceparent``/``tracestate`` headers or metadata
    (keys lower case); the empty context when there is none or it is invalid."""
    return propagate.extract(dict(carrier or {}), context=Context())


def inject_metadata(ctx: Context | None) -> list[tuple[str, str]]:
    """gRPC metadata entries that carry ``ctx`` (``traceparent``, ``tracestate``)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return list(carrier.items())


# ---------------------------------------------------------------- engine spans

_NS = 1_000_000_000


def _ns(t: float) -> int:
    return int(float(t) * _NS)


def _engine_attributes(attributes: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(request attributes, KV attributes) in their OpenTelemetry names."""
    req: dict[str, Any] = {}
    kv: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if value is None:
            continue
        if key == "num_prompt_tokens":
            req["gen_ai.usage.input_tokens"] = int(value)
        elif key == "num_output_tokens":
            req["gen_ai.usage.output_tokens"] = int(value)
        elif key == "num_cached_tokens":
            req["pdserve.cached_tokens"] = int(value)
        elif key == "finish_reason":
            if value:
                req["gen_ai.response.finish_reasons"] = [str(value)]
        elif key.startswith("kv_"):
            kv["pdserve.kv." + key[3:]] = value
        elif "." in key:
            req[key] = value
        else:
            req["pdserve." + key] = value
    num_bytes, seconds = kv.get("pdserve.kv.bytes"), kv.get("pdserve.kv.seconds")
    if num_bytes and seconds:
        kv["pdserve.kv.gbps"] = round(num_bytes / seconds / 1e9, 3)
    return req, kv


def record_engine_spans(role: str, request_id: str, parent_context: Context | None, times: Any,
                        attributes: Mapping[str, Any] | None = None, *, tracer_provider: Any = None) -> None:
    """Record one request's spans on this tier from its timestamps (see the
    module docstring). ``role`` is "prefill" or "decode"; ``parent_context``
    None means the current context. Never raises; a no-op when tracing is off."""
    try:
        _record(role, request_id, parent_context, times, attributes, tracer_provider)
    except Exception:  # tracing must never break serving
        logger.exception("could not record the %s spans of request %s", role, request_id)


def _record(role: str, request_id: str, parent_context: Context | None, times: Any,
            attributes: Mapping[str, Any] | None, tracer_provider: Any) -> None:
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
    t = {name: getattr(times, name, None) for name in (
        "arrival", "reserved", "kv_recv_start", "kv_recv_end", "first_scheduled", "first_token", "finished",
        "kv_send_start", "kv_send_end")}
    known = [v for v in t.values() if v is not None]
    if not known:
        return
    start = t["arrival"] if t["arrival"] is not None else min(known)
    end = t["finished"] if t["finished"] is not None else max(known)
    attributes = dict(attributes or {})
    parts = attributes.pop("kv_parts", None) or ()  # a transfer in parts: (rank, start, end, bytes) each
    req_attrs, kv_attrs = _engine_attributes(attributes)
    base = {"pdserve.internal_request_id": request_id}
    parent_ctx = parent_context if parent_context is not None else otel_context.get_current()
    top = tracer.start_span(role, context=parent_ctx, kind=SpanKind.INTERNAL, start_time=_ns(start),
                            attributes={**base, **req_attrs, "pdserve.phase": role})
    ctx = trace.set_span_in_context(top, parent_ctx)

    def child(name: str, phase: str, begin: float | None, finish: float | None,
              extra: Mapping[str, Any] | None = None) -> Any:
        if begin is None or finish is None:
            return None
        span = tracer.start_span(name, context=ctx, start_time=_ns(begin),
                                 attributes={**base, "pdserve.phase": phase, **(extra or {})})
        return span, max(begin, finish)

    def rank_parts(kv: Any, direction: str) -> list[Any]:
        """A span per rank's part of a transfer in parts (tensor-parallel engines), under ``kv``."""
        if kv is None:
            return []
        part_ctx = trace.set_span_in_context(kv[0], ctx)
        out = []
        for rank, p_start, p_end, p_bytes in parts:
            span = tracer.start_span(f"kv.{direction}.rank", context=part_ctx, start_time=_ns(p_start), attributes={
                **base, "pdserve.phase": "kv_transfer", "pdserve.kv.rank": int(rank),
                "pdserve.kv.bytes": int(p_bytes), "pdserve.kv.direction": direction})
            out.append((span, max(p_start, p_end)))
        return out

    spans: list[Any] = []
    if role == "prefill":
        spans.append(child("prefill.queue", "prefill_queue", start, t["first_scheduled"]))
        compute = child("prefill.compute", "prefill_compute", t["first_scheduled"], t["first_token"])
        if compute is not None:
            for chunk in getattr(times, "prefill_chunks", None) or ():
                c_start, c_end, n = chunk
                compute[0].add_event("chunk", {"pdserve.chunk.duration_ms": round((c_end - c_start) * 1e3, 3),
                                               "pdserve.chunk.num_tokens": int(n)}, timestamp=_ns(c_end))
            compute[0].add_event("first_token", timestamp=_ns(t["first_token"]))
        spans.append(compute)
        send = child("kv.send", "kv_transfer", t["kv_send_start"], t["kv_send_end"],
                     {**kv_attrs, "pdserve.kv.direction": "send"})
        spans += [send, *rank_parts(send, "send")]
    else:
        remote = t["kv_recv_start"] is not None or t["kv_recv_end"] is not None
        spans.append(child("decode.reservation_wait", "decode_reservation", start, t["reserved"]))
        receive = child("kv.receive", "kv_transfer", t["kv_recv_start"], t["kv_recv_end"],
                        {**kv_attrs, "pdserve.kv.direction": "receive"})
        spans += [receive, *rank_parts(receive, "receive")]
        ready = max(v for v in (start, t["reserved"], t["kv_recv_end"]) if v is not None)
        spans.append(child("decode.queue", "decode_queue", ready, t["first_scheduled"]))
        gen_start = t["first_scheduled"]
        if not remote:
            spans.append(child("prefill.compute", "prefill_compute", t["first_scheduled"], t["first_token"]))
            gen_start = t["first_token"] if t["first_token"] is not None else gen_start
        gen = child("decode.generate", "decode", gen_start, end,
                    {k: v for k, v in req_attrs.items() if k.startswith("gen_ai.")})
        if gen is not None and t["first_token"] is not None:
            gen[0].add_event("first_token", timestamp=_ns(t["first_token"]))
        spans.append(gen)
    for item in spans:
        if item is not None:
            span, finish = item
            span.end(end_time=_ns(finish))
    top.end(end_time=_ns(max(end, start)))
