"""``record_engine_spans``: a request's engine spans built after the fact
from its timestamps, checked with the SDK's in-memory exporter: exact names,
nesting, start and end times, attributes, tolerated missing and extra
fields, and no failure ever reaching the servicer."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rpc.tracing import record_engine_spans

T0 = 1_700_000_000.0
NS = 1_000_000_000
TRACE_ID, PARENT_ID = 0x1234, 0x99


@pytest.fixture()
def recorded():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(trace.SpanContext(
        TRACE_ID, PARENT_ID, is_remote=True, trace_flags=trace.TraceFlags(1))))

    def record(role, times, attributes=None):
        exporter.clear()
        record_engine_spans(role, "req-1", parent, times, attributes, tracer_provider=provider)
        return {s.name: s for s in exporter.get_finished_spans()}, exporter.get_finished_spans()

    yield record
    provider.shutdown()


def _ms(span) -> tuple[float, float]:
    """(start, end) in ms after T0."""
    return round((span.start_time - T0 * NS) / 1e6, 3), round((span.end_time - T0 * NS) / 1e6, 3)


def test_prefill_spans(recorded):
    times = SimpleNamespace(arrival=T0, first_scheduled=T0 + 0.010, first_token=T0 + 0.050,
                            kv_send_start=T0 + 0.051, kv_send_end=T0 + 0.061, finished=T0 + 0.062,
                            prefill_chunks=[(T0 + 0.010, T0 + 0.030, 512), (T0 + 0.030, T0 + 0.050, 100)],
                            some_future_field=T0)
    spans, all_spans = recorded("prefill", times, {
        "num_prompt_tokens": 612, "num_cached_tokens": 64, "num_output_tokens": 1, "finish_reason": "length",
        "kv_blocks": 39, "kv_bytes": 10_000_000, "kv_seconds": 0.01, "kv_backend": "gloo",
        "gen_ai.request.model": "m", "queue_position": 3})
    assert sorted(spans) == ["kv.send", "prefill", "prefill.compute", "prefill.queue"]
    assert len(all_spans) == 4
    top = spans["prefill"]
    assert top.parent.span_id == PARENT_ID and all(s.context.trace_id == TRACE_ID for s in all_spans)
    assert all(s.parent.span_id == top.context.span_id for n, s in spans.items() if n != "prefill")
    assert _ms(top) == (0.0, 62.0)
    assert _ms(spans["prefill.queue"]) == (0.0, 10.0)
    assert _ms(spans["prefill.compute"]) == (10.0, 50.0)
    assert _ms(spans["kv.send"]) == (51.0, 61.0)
    assert dict(top.attributes) == {
        "pdserve.internal_request_id": "req-1", "pdserve.phase": "prefill", "gen_ai.usage.input_tokens": 612,
        "pdserve.cached_tokens": 64, "gen_ai.usage.output_tokens": 1, "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.request.model": "m", "pdserve.queue_position": 3}
    assert dict(spans["kv.send"].attributes) == {
        "pdserve.internal_request_id": "req-1", "pdserve.phase": "kv_transfer", "pdserve.kv.blocks": 39,
        "pdserve.kv.bytes": 10_000_000, "pdserve.kv.seconds": 0.01, "pdserve.kv.backend": "gloo",
        "pdserve.kv.gbps": 1.0, "pdserve.kv.direction": "send"}
    events = spans["prefill.compute"].events
    assert [e.name for e in events] == ["chunk", "chunk", "first_token"]
    assert [e.attributes["pdserve.chunk.num_tokens"] for e in events[:2]] == [512, 100]
    assert events[2].timestamp == int((T0 + 0.050) * NS)
    assert spans["prefill.queue"].attributes["pdserve.phase"] == "prefill_queue"
    assert spans["prefill.compute"].attributes["pdserve.phase"] == "prefill_compute"


def test_decode_spans_after_a_remote_prefill(recorded):
    times = SimpleNamespace(arrival=T0, reserved=T0 + 0.002, kv_recv_start=T0 + 0.040, kv_recv_end=T0 + 0.050,
                            first_scheduled=T0 + 0.055, first_token=T0 + 0.060, finished=T0 + 0.500)
    spans, all_spans = recorded("decode", times, {"num_output_tokens": 32, "finish_reason": "stop",
                                                   "kv_bytes": 5_000, "kv_blocks": 2, "kv_backend": "gloo"})
    assert sorted(spans) == ["decode", "decode.generate", "decode.queue", "decode.reservation_wait", "kv.receive"]
    assert _ms(spans["decode"]) == (0.0, 500.0)
    assert _ms(spans["decode.reservation_wait"]) == (0.0, 2.0)
    assert _ms(spans["kv.receive"]) == (40.0, 50.0)
    assert _ms(spans["decode.queue"]) == (50.0, 55.0)
    assert _ms(spans["decode.generate"]) == (55.0, 500.0)
    assert [e.name for e in spans["decode.generate"].events] == ["first_token"]
    assert spans["decode.generate"].attributes["gen_ai.usage.output_tokens"] == 32
    assert spans["decode.generate"].attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert spans["kv.receive"].attributes["pdserve.kv.direction"] == "receive"
    assert "pdserve.kv.gbps" not in spans["kv.receive"].attributes  # no seconds given


def test_decode_spans_of_a_local_prefill(recorded):
    times = SimpleNamespace(arrival=T0, first_scheduled=T0 + 0.003, first_token=T0 + 0.080, finished=T0 + 0.3)
    spans, _ = recorded("decode", times)
    assert sorted(spans) == ["decode", "decode.generate", "decode.queue", "prefill.compute"]
    assert _ms(spans["decode.queue"]) == (0.0, 3.0)
    assert _ms(spans["prefill.compute"]) == (3.0, 80.0)
    assert _ms(spans["decode.generate"]) == (80.0, 300.0)


def test_missing_timestamps_leave_their_spans_out(recorded):
    # Aborted while waiting for blocks: no finish time, nothing scheduled.
    spans, _ = recorded("decode", SimpleNamespace(arrival=T0, reserved=None))
    assert sorted(spans) == ["decode"] and _ms(spans["decode"]) == (0.0, 0.0)
    spans, _ = recorded("prefill", SimpleNamespace(arrival=T0, first_scheduled=T0 + 0.01))
    assert sorted(spans) == ["prefill", "prefill.queue"]
    assert _ms(spans["prefill"]) == (0.0, 10.0)  # ends at the last known time
    spans, _ = recorded("prefill", object())  # nothing known: nothing recorded
    assert spans == {}


def test_failures_never_reach_the_caller(recorded, caplog):
    spans, _ = recorded("detokenizer", SimpleNamespace(arrival=T0))
    assert spans == {} and "could not record" in caplog.text
    spans, _ = recorded("decode", SimpleNamespace(arrival="not a time"))
    assert spans == {}


def test_no_provider_means_no_spans_and_no_error():
    record_engine_spans("decode", "r", None, SimpleNamespace(arrival=T0, finished=T0 + 1))


def test_a_send_in_parts_has_a_span_per_rank(recorded):
    times = SimpleNamespace(arrival=T0, first_scheduled=T0 + 0.010, first_token=T0 + 0.050,
                            kv_send_start=T0 + 0.051, kv_send_end=T0 + 0.061, finished=T0 + 0.062)
    spans, all_spans = recorded("prefill", times, {
        "kv_bytes": 3000, "kv_seconds": 0.009, "kv_backend": "gloo",
        "kv_parts": ((0, T0 + 0.052, T0 + 0.058, 1000), (1, T0 + 0.052, T0 + 0.060, 1000),
                     (2, T0 + 0.053, T0 + 0.060, 1000))})
    ranks = sorted((s for s in all_spans if s.name == "kv.send.rank"), key=lambda s: s.attributes["pdserve.kv.rank"])
    assert [s.attributes["pdserve.kv.rank"] for s in ranks] == [0, 1, 2]
    assert all(s.parent.span_id == spans["kv.send"].context.span_id for s in ranks)
    assert [_ms(s) for s in ranks] == [(52.0, 58.0), (52.0, 60.0), (53.0, 60.0)]
    assert ranks[0].attributes["pdserve.kv.bytes"] == 1000 and ranks[0].attributes["pdserve.phase"] == "kv_transfer"
    assert "pdserve.kv.parts" not in spans["kv.send"].attributes


def test_a_receive_in_parts_has_a_span_per_receiving_rank(recorded):
    times = SimpleNamespace(arrival=T0, reserved=T0 + 0.002, kv_recv_start=T0 + 0.040, kv_recv_end=T0 + 0.050,
                            first_scheduled=T0 + 0.055, first_token=T0 + 0.060, finished=T0 + 0.500)
    spans, all_spans = recorded("decode", times, {
        "kv_bytes": 2000, "kv_seconds": 0.009, "kv_parts": ((0, T0 + 0.041, T0 + 0.049, 1000),
                                                            (1, T0 + 0.041, T0 + 0.050, 1000))})
    ranks = sorted((s for s in all_spans if s.name == "kv.receive.rank"),
                   key=lambda s: s.attributes["pdserve.kv.rank"])
    assert [(s.attributes["pdserve.kv.rank"], _ms(s)) for s in ranks] == [(0, (41.0, 49.0)), (1, (41.0, 50.0))]
    assert all(s.parent.span_id == spans["kv.receive"].context.span_id for s in ranks)
    assert {s.attributes["pdserve.kv.direction"] for s in ranks} == {"receive"}
