"""The gRPC server hook-up on a real grpc.aio server: a streaming and a
unary method each get a SERVER span under the caller's traceparent (sent
with ``inject_metadata``), the span is current inside the handler (so engine
spans recorded from ``current_context()`` nest under it), a cancelled stream
still ends its span, and load polls are not traced."""
from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from rpc import tracing

CALLER_TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN = 0xB7AD6B7169203331


class _Decode(engine_pb2_grpc.DecodeServicer):
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.handler_span: trace.SpanContext | None = None

    async def Generate(self, request, context):
        ctx = tracing.current_context()
        self.handler_span = trace.get_current_span(ctx).get_span_context()
        t0 = time.time()
        try:
            if request.request_id == "flood":  # large responses and no await: blocked in grpc's write
                for _ in range(100_000):
                    yield engine_pb2.DecodeResponse(delta=engine_pb2.TokenDelta(token_ids=list(range(20_000))))
            for i in range(3 if request.request_id != "slow" else 1000):
                yield engine_pb2.DecodeResponse(delta=engine_pb2.TokenDelta(token_ids=[i]))
                await asyncio.sleep(0.01 if request.request_id == "slow" else 0)
        finally:
            times = SimpleNamespace(arrival=t0, first_scheduled=t0 + 0.001, first_token=t0 + 0.002,
                                    finished=time.time())
            tracing.record_engine_spans("decode", request.request_id, ctx, times, {"num_output_tokens": 3},
                                        tracer_provider=self.provider)

    async def GetLoad(self, request, context):
        return common_pb2.LoadInfo(role="decode")


async def _serve_and_call(provider: TracerProvider, servicer: _Decode, request_id: str, cancel: bool) -> None:
    server = grpc.aio.server(interceptors=tracing.server_interceptors(["pdserve.v1.Decode"],
                                                                       tracer_provider=provider))
    engine_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    caller = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        CALLER_TRACE, CALLER_SPAN, is_remote=True, trace_flags=trace.TraceFlags(1))))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = engine_pb2_grpc.DecodeStub(ch)
            await stub.GetLoad(common_pb2.LoadRequest(), timeout=5)
            call = stub.Generate(engine_pb2.DecodeRequest(request_id=request_id), timeout=5,
                                 metadata=tracing.inject_metadata(caller))
            if cancel:
                await call.read()
                await asyncio.sleep(0.2 if request_id == "flood" else 0)  # the server's writes fill the window
                call.cancel()
            else:
                assert len([m async for m in call]) == 3
            for _ in range(100):  # the handler's finally runs after the client saw the end
                if any(s.name == "decode" for s in provider._exporter.get_finished_spans()):  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.02)
    finally:
        await server.stop(grace=None)


@pytest.fixture()
def provider():
    exporter = InMemorySpanExporter()
    p = TracerProvider()
    p.add_span_processor(SimpleSpanProcessor(exporter))
    p._exporter = exporter  # type: ignore[attr-defined]
    yield p
    p.shutdown()


@pytest.mark.parametrize("request_id", ["r1", "slow", "flood"],
                         ids=["complete", "cancelled", "cancelled-while-writing"])
def test_streaming_call_gets_a_server_span_under_the_callers_trace(provider, caplog, request_id):
    """Cancelled while the handler awaits, or while grpc writes what it yielded (its generator
    suspended at a ``yield``): the handler's ``finally`` runs in the call's own context, so no
    span context is detached elsewhere (which logs "Failed to detach context")."""
    servicer = _Decode(provider)
    with caplog.at_level(logging.ERROR):
        asyncio.run(_serve_and_call(provider, servicer, request_id, request_id != "r1"))
    spans = provider._exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    server = by_name["/pdserve.v1.Decode/Generate"]  # GetLoad is not traced
    assert {s.name for s in spans} == {"/pdserve.v1.Decode/Generate", "decode", "decode.queue",
                                       "prefill.compute", "decode.generate"}
    assert server.kind == trace.SpanKind.SERVER
    assert server.context.trace_id == CALLER_TRACE and server.parent.span_id == CALLER_SPAN
    assert servicer.handler_span is not None and servicer.handler_span.span_id == server.context.span_id
    assert by_name["decode"].parent.span_id == server.context.span_id
    assert all(s.context.trace_id == CALLER_TRACE for s in spans)
    assert not [r for r in caplog.records if "detach" in r.getMessage().lower()]


def test_tracing_off_installs_no_interceptor(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", tracing.TRACES_FILE_ENV):
        monkeypatch.delenv(var, raising=False)
    if tracing.is_enabled():
        pytest.skip("this process already installed a tracer provider")
    assert tracing.server_interceptors(["pdserve.v1.Decode"]) == []
    assert not tracing.is_enabled()


def test_invalid_or_missing_traceparent_gives_an_empty_context():
    assert trace.get_current_span(tracing.extract({"traceparent": "00-11-22-01"})).get_span_context().is_valid is False
    assert trace.get_current_span(tracing.extract(None)).get_span_context().is_valid is False
    ctx = tracing.extract({"traceparent": f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"})
    assert trace.get_current_span(ctx).get_span_context().trace_id == CALLER_TRACE
    assert dict(tracing.inject_metadata(ctx))["traceparent"] == f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"
