"""Tracing set-up: the OTEL_* variables and flags resolve as documented, both
OTLP protocols deliver to a real receiver, and the JSONL traces file is
written in whole lines by several writers, bounded by rotation, and read
back."""
from __future__ import annotations

import json
import multiprocessing
import os

import pytest
from opentelemetry.sdk.trace import TracerProvider

from rpc import tracing
from rpc.trace_file import JsonlSpanExporter, read_spans
from rpc.tracing import TracingConfig
from tests.tracing.otlp_receiver import OtlpReceiver


def _cfg(env: dict[str, str], **kw) -> TracingConfig:
    return TracingConfig.from_env("pdserve-decode", environ=env, **kw)


def test_config_from_environment_and_flags():
    assert not _cfg({}).is_enabled
    assert _cfg({}).service_name == "pdserve-decode"
    assert _cfg({"OTEL_SERVICE_NAME": "dec-7"}).service_name == "dec-7"
    c = _cfg({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317"})
    assert (c.otlp_endpoint, c.otlp_protocol, c.traces_file) == ("http://j:4317", "grpc", None)
    # http/protobuf: the generic endpoint gets the signal path, the traces one is used as is.
    c = _cfg({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318/", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert (c.otlp_endpoint, c.otlp_protocol) == ("http://j:4318/v1/traces", "http/protobuf")
    c = _cfg({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1/x",
              "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert (c.otlp_endpoint, c.otlp_protocol) == ("http://t:1/x", "http/protobuf")
    # The flag wins over the environment; the traces file comes from either.
    c = _cfg({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317", tracing.TRACES_FILE_ENV: "/tmp/a.jsonl"},
             otlp_endpoint="http://flag:4317")
    assert (c.otlp_endpoint, c.traces_file) == ("http://flag:4317", "/tmp/a.jsonl")
    assert _cfg({}, traces_file="/tmp/b.jsonl").traces_file == "/tmp/b.jsonl"
    # Off switches.
    assert not _cfg({"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317"},
                    traces_file="/tmp/b.jsonl").is_enabled
    c = _cfg({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4317"}, traces_file="/t")
    assert (c.otlp_endpoint, c.traces_file) == (None, "/t")
    with pytest.raises(ValueError, match="http/protobuf"):
        _cfg({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://j:4318"})


def test_child_env_carries_the_flags():
    assert tracing.child_env(None, None) == {}
    assert tracing.child_env("http://j:4317", "/tmp/t.jsonl") == {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://j:4317", tracing.TRACES_FILE_ENV: "/tmp/t.jsonl"}


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_both_otlp_protocols_reach_a_receiver(receiver, protocol, tmp_path):
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    provider = tracing.build_provider(TracingConfig("pdserve-prefill", endpoint, protocol,
                                                    str(tmp_path / "t.jsonl")))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(f"via {protocol}") as span:
        span.set_attribute("gen_ai.request.model", "m")
    assert provider.force_flush(10_000)
    provider.shutdown()
    got = [s for s in receiver.spans if s.name == f"via {protocol}"]
    assert len(got) == 1 and got[0].service == "pdserve-prefill"
    assert got[0].attributes == {"gen_ai.request.model": "m"}
    assert receiver.num_requests["grpc" if protocol == "grpc" else "http"] >= 1
    # The traces file got the same span beside the OTLP exporter.
    [record] = list(read_spans(tmp_path / "t.jsonl"))
    assert record["name"] == f"via {protocol}" and record["service"] == "pdserve-prefill"
    assert record["trace_id"] == got[0].trace_id and record["span_id"] == got[0].span_id


def _write_spans(path: str, tag: str, n: int) -> None:
    provider = TracerProvider()
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    tracer = provider.get_tracer("w")
    for i in range(n):
        with tracer.start_as_current_span(f"{tag}-{i}") as s:
            s.set_attribute("pad", "x" * 3000)  # lines longer than a pipe's atomic write
    provider.shutdown()


def test_several_processes_append_whole_lines(tmp_path):
    path = str(tmp_path / "t.jsonl")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_spans, args=(path, f"p{k}", 200)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = open(path).read().splitlines()
    assert len(lines) == 600
    names = {json.loads(line)["name"] for line in lines}  # every line parses
    assert names == {f"p{k}-{i}" for k in range(3) for i in range(200)}


def test_rotation_bounds_the_file_and_reading_covers_both_parts(tmp_path):
    path = tmp_path / "t.jsonl"
    exporter = JsonlSpanExporter(path, max_bytes=20_000)
    provider = TracerProvider()
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("w")
    for i in range(60):
        with tracer.start_as_current_span(f"s{i}") as s:
            s.set_attribute("pad", "y" * 500)
    provider.shutdown()
    assert os.path.getsize(path) <= 20_000
    assert os.path.getsize(str(path) + ".1") <= 20_000
    names = [r["name"] for r in read_spans(path)]
    assert names == [f"s{i}" for i in range(60 - len(names), 60)]  # the newest, in order
    assert 20 < len(names) < 60


def test_a_writer_reopens_after_another_rotated_and_torn_lines_are_skipped(tmp_path):
    path = tmp_path / "t.jsonl"
    provider = TracerProvider()
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    provider.add_span_processor(SimpleSpanProcessor(JsonlSpanExporter(path)))
    tracer = provider.get_tracer("w")
    with tracer.start_as_current_span("before"):
        pass
    os.replace(path, str(path) + ".1")  # what another writer's rotation does
    with tracer.start_as_current_span("after"):
        pass
    with open(path, "a") as f:
        f.write('{"trace_id": "ab", "span_')  # a line still being written
    provider.shutdown()
    assert [r["name"] for r in read_spans(path)] == ["before", "after"]
    assert json.loads(open(path).readline())["name"] == "after"  # into the new file, not the rotated one


def test_a_request_reaches_the_traces_file_as_it_ends_not_with_the_next_batch(tmp_path, monkeypatch):
    """No periodic batch here (10 minutes): the gateway's request span and its children are
    written as the request span ends, under a transport span still open (it ends after the
    response); a local root (that transport span) writes whatever is left as it ends."""
    from opentelemetry import trace

    from gateway.request_trace import RequestTrace

    path = tmp_path / "t.jsonl"
    processor = tracing._file_processor(JsonlSpanExporter(path), 600_000)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    monkeypatch.setattr(tracing, "_installed_file_processor", processor)
    tracer = provider.get_tracer("test")
    transport = tracer.start_span("POST /v1/completions", kind=trace.SpanKind.SERVER)
    token = tracing.otel_context.attach(trace.set_span_in_context(transport))
    try:
        request = RequestTrace("text_completion", "m", tracer=tracer)
    finally:
        tracing.otel_context.detach(token)
    with request.span("tokenize"):
        pass
    assert list(read_spans(path)) == []  # batched until the request ends
    request.finish()
    assert [s["name"] for s in read_spans(path)] == ["tokenize", "text_completion m"]
    transport.end()
    assert [s["name"] for s in read_spans(path)][-1] == "POST /v1/completions"
    provider.shutdown()
