"""The gateway's spans, request log line and per-phase metrics, from a real
gateway process (``--traces-file``) in front of fake engine servers:

* HTTP and gRPC requests continue the caller's traceparent; FastAPI's HTTP
  span or the gRPC interceptor's span is the root, the request span (GenAI
  attributes, request id) under it, then tokenize, route, the two engine
  calls (whose metadata carries their own span as parent) and detokenize;
* a request that fails validation ends its span with an error;
* one log line per request with the ids, token counts, TTFT and latency;
* a gateway without tracing (and --disable-log-requests) forwards the
  caller's trace headers untouched and logs no request line.
"""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pdserve.cli import main as pdserve_main
from rpc.trace_file import read_spans
from tests.gateway.fake_engine import FakeEngine
from tests.processes import GatewayProcess

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
GRPC_CALLER_TRACE = "5cf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_dir):
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    traces = tmp_path_factory.mktemp("gw-traces") / "traces.jsonl"
    fake = FakeEngine().start()
    fake.state.script, fake.state.eos = tokenizer.encode("Hello there, my friend."), tokenizer.eos_token_id
    flags = ["--prefill", fake.prefill_address, "--decode", fake.decode_address]
    # No periodic batch within the tests: spans reach the file only because a request's end
    # writes them (rpc/tracing.py), which is what a user running pdserve trace relies on.
    traced = GatewayProcess("traced", [*flags, "--traces-file", str(traces)],
                            env={"OTEL_SDK_DISABLED": "", "OTEL_EXPORTER_OTLP_ENDPOINT": "",
                                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "", "OTEL_BSP_SCHEDULE_DELAY": "600000"})
    plain = GatewayProcess("untraced", [*flags, "--disable-log-requests"],
                           env={"PDSERVE_TRACES_FILE": "", "OTEL_EXPORTER_OTLP_ENDPOINT": "",
                                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""})
    try:
        traced.wait_ready()
        plain.wait_ready()
        yield fake, traced, plain, traces
    finally:
        codes = [p.stop() for p in (traced, plain)]
        fake.stop()
    assert codes == [0, 0], [traced.logs(), plain.logs()]


def _trace(traces: Path, predicate, timeout: float = 10.0) -> list[dict]:
    """The spans of the one trace holding a span that matches ``predicate``, once its
    transport span (the SERVER span, which ends last and writes the rest with it) is in."""
    deadline = time.monotonic() + timeout
    while True:
        spans = list(read_spans(traces))
        hits = {s["trace_id"] for s in spans if predicate(s)}
        if hits:
            [tid] = hits
            mine = [s for s in spans if s["trace_id"] == tid]
            if any(s["kind"] == "SERVER" for s in mine):
                return mine
        assert time.monotonic() < deadline, f"no such trace in {len(spans)} spans"
        time.sleep(0.05)


def _by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


def _request_span(spans: list[dict]) -> dict:
    [req] = [s for s in spans if "pdserve.request_id" in s["attributes"]]
    return req


def test_http_request_continues_the_callers_trace(setup):
    fake, gw, _, traces = setup
    fake.reset()
    r = httpx.post(gw.http_url + "/v1/completions", timeout=20, headers={
        "traceparent": TRACEPARENT, "x-request-id": "http-span-test"},
        json={"model": MODEL, "prompt": "Say hi", "max_tokens": 4, "temperature": 0.5, "top_p": 0.9})
    assert r.status_code == 200
    spans = _trace(traces, lambda s: s["attributes"].get("pdserve.request_id") == "http-span-test")
    by = _by_name(spans)
    assert set(by) == {"POST /v1/completions", "text_completion SmolLM2-135M-Instruct", "tokenize", "route",
                       "pdserve.v1.Decode/Generate", "pdserve.v1.Prefill/Prefill", "detokenize"}
    assert {s["trace_id"] for s in spans} == {CALLER_TRACE} and {s["service"] for s in spans} == {"pdserve-gateway"}
    http, req = by["POST /v1/completions"], by["text_completion SmolLM2-135M-Instruct"]
    assert http["kind"] == "SERVER" and http["parent_id"] == CALLER_SPAN
    assert http["attributes"]["http.route"] == "/v1/completions"
    assert http["attributes"]["http.response.status_code"] == 200
    assert req["parent_id"] == http["span_id"]
    for name in ("tokenize", "route", "pdserve.v1.Decode/Generate", "pdserve.v1.Prefill/Prefill", "detokenize"):
        assert by[name]["parent_id"] == req["span_id"], name
    a = req["attributes"]
    internal = a["pdserve.internal_request_id"]
    assert internal.startswith("http-span-test-")
    expected = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": MODEL,
                "gen_ai.request.max_tokens": 4, "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
                "gen_ai.response.id": "http-span-test", "gen_ai.response.finish_reasons": ["length"],
                "gen_ai.usage.input_tokens": r.json()["usage"]["prompt_tokens"], "gen_ai.usage.output_tokens": 4,
                "pdserve.request_id": "http-span-test", "pdserve.cached_tokens": 0, "pdserve.api": "http",
                "pdserve.route.decode": fake.decode_address, "pdserve.route.prefill": fake.prefill_address}
    assert {k: a[k] for k in expected} == expected
    assert 0 < a["pdserve.ttft_ms"] <= a["pdserve.e2e_ms"]
    assert [e["name"] for e in req["events"]] == ["first_token"]
    assert by["route"]["attributes"]["pdserve.route.decode"] == fake.decode_address
    dcall, pcall = by["pdserve.v1.Decode/Generate"], by["pdserve.v1.Prefill/Prefill"]
    assert dcall["kind"] == pcall["kind"] == "CLIENT"
    assert [e["name"] for e in dcall["events"]] == ["reserved"]
    assert pcall["attributes"]["pdserve.prefill.queue_ms"] == 0.0  # what the fake prefill reported
    # The engine servers got each call's own span as parent.
    assert fake.state.metadata[0]["traceparent"] == f"00-{CALLER_TRACE}-{dcall['span_id']}-01"
    assert by["detokenize"]["start_ns"] >= pcall["end_ns"]


@pytest.mark.parametrize("stream", [False, True])
def test_pdserve_trace_right_after_the_response_finds_the_whole_request(setup, capsys, stream):
    """What a user does: take the response's id and run `pdserve trace` at once. The request
    span and everything under it are in the file before the response leaves; only the
    transport's span may come a moment later, and then the output says so rather than
    concluding from part of the spans."""
    fake, gw, _, traces = setup
    fake.reset()
    rid = f"at-once-{stream}"
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 5, "temperature": 0, "stream": stream}
    with httpx.Client(timeout=20) as client:
        with client.stream("POST", gw.http_url + "/v1/completions", json=body, headers={"x-request-id": rid}) as r:
            assert r.status_code == 200
            text = r.read().decode()
    assert (text.rstrip().endswith("data: [DONE]") if stream else f'"id":"{rid}"' in text.replace(" ", ""))
    code = pdserve_main(["trace", rid, "--traces-file", str(traces)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0].endswith(f"request {rid}"), out
    req = _request_span([s for s in read_spans(traces) if s["attributes"].get("pdserve.request_id") == rid])
    assert req["attributes"]["gen_ai.usage.output_tokens"] == 5 and "produced no token" not in out
    for name in ("tokenize", "route", "pdserve.v1.Decode/Generate", "pdserve.v1.Prefill/Prefill", "detokenize"):
        assert f"  {name}" in out, (name, out.splitlines())
    ttft = f"time to first token: {req['attributes']['pdserve.ttft_ms']:.1f} ms"
    if "POST /v1/completions" in out:  # the transport's span made it too: the full breakdown
        assert f"{ttft}\n" in out and "looks incomplete" not in out
    else:
        assert "this trace looks incomplete: missing the gateway's transport span" in out
        assert f"{ttft} (no breakdown: the trace looks incomplete)" in out


def test_a_stop_string_ends_the_decode_call_without_an_error(setup):
    """The gateway cuts the decode call short on a stop string: a normal end, not a failure.
    (A client that goes away makes it one: see the cancellation test below.)"""
    fake, gw, _, traces = setup
    fake.reset()
    fake.state.knobs.hold_before_last = threading.Event()  # only the gateway's cancel ends the stream
    r = httpx.post(gw.http_url + "/v1/completions", headers={"x-request-id": "stop-span-test"}, timeout=20,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 20, "stop": [" my"]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    fake.wait_idle()
    assert len(fake.state.cancelled) == 1
    spans = _trace(traces, lambda s: s["attributes"].get("pdserve.request_id") == "stop-span-test")
    [dcall] = [s for s in spans if s["name"] == "pdserve.v1.Decode/Generate"]
    assert dcall["status"] == "UNSET" and _request_span(spans)["status"] == "UNSET"


def test_grpc_request_continues_the_callers_trace(setup):
    fake, gw, _, traces = setup
    fake.reset()
    with grpc.insecure_channel(gw.grpc_address) as ch:
        chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Hi")])
        msgs = list(gateway_pb2_grpc.GatewayStub(ch).Generate(
            gateway_pb2.GenerateRequest(chat=chat, request_id="grpc-span-test",
                                        sampling=common_pb2.SamplingParams(max_tokens=3)),
            metadata=[("traceparent", f"00-{GRPC_CALLER_TRACE}-{CALLER_SPAN}-01")], timeout=20))
    assert msgs[-1].finish_reason == "length"
    spans = _trace(traces, lambda s: s["attributes"].get("pdserve.request_id") == "grpc-span-test")
    by = _by_name(spans)
    server = by["/pdserve.v1.Gateway/Generate"]
    assert server["kind"] == "SERVER" and server["parent_id"] == CALLER_SPAN
    req = _request_span(spans)
    assert req["name"] == f"chat {MODEL}" and req["parent_id"] == server["span_id"]
    assert req["attributes"]["gen_ai.operation.name"] == "chat" and req["attributes"]["pdserve.api"] == "grpc"
    assert req["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert {s["trace_id"] for s in spans} == {GRPC_CALLER_TRACE}


def test_without_traceparent_the_gateway_starts_the_trace(setup):
    _, gw, _, traces = setup
    r = httpx.post(gw.http_url + "/v1/chat/completions", timeout=20,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True})
    rid = r.headers["x-request-id"]
    spans = _trace(traces, lambda s: s["attributes"].get("pdserve.request_id") == rid)
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_id"] not in ids]
    assert [(s["name"], s["parent_id"]) for s in roots] == [("POST /v1/chat/completions", None)]


def test_a_failed_request_ends_its_span_with_the_error(setup):
    _, gw, _, traces = setup
    r = httpx.post(gw.http_url + "/v1/completions", headers={"x-request-id": "bad-request-test"},
                   json={"prompt": "x", "max_tokens": 10**6}, timeout=20)
    assert r.status_code == 400
    spans = _trace(traces, lambda s: s["name"].startswith("text_completion") and s["status"] == "ERROR"
                   and s["start_ns"] > 0 and "maximum context length" in s.get("status_message", ""))
    req = next(s for s in spans if s["name"].startswith("text_completion"))
    assert req["attributes"]["error.type"] == "INVALID_ARGUMENT"
    assert "pdserve.request_id" not in req["attributes"]  # it failed before an id was assigned


def test_request_log_line_and_phase_metrics(setup):
    _, gw, _, _ = setup
    r = httpx.post(gw.http_url + "/v1/completions", headers={"x-request-id": "log-line-test"},
                   json={"prompt": "Say hi", "max_tokens": 3}, timeout=20)
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while "request log-line-test" not in gw.log_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in gw.log_text().splitlines() if "request log-line-test " in x)
    m = re.search(r"request log-line-test \(log-line-test-\w+\): prompt_tokens=(\d+) cached_tokens=0 "
                  r"output_tokens=3 ttft=(\d+\.\d+)s e2e=(\d+\.\d+)s decode=\S+ prefill=\S+ "
                  r"route=load matched_tokens=0 finish=length "
                  r"trace=([0-9a-f]{32})$", line)
    assert m, line
    assert int(m.group(1)) == r.json()["usage"]["prompt_tokens"] and float(m.group(2)) <= float(m.group(3))
    metrics = httpx.get(gw.http_url + "/metrics").text

    def count(name: str) -> float:
        m = re.search(rf'^pdserve:{name}_count{{model_name="{MODEL}"}} (\S+)$', metrics, re.M)
        assert m, name
        return float(m.group(1))

    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert count(name) >= 1, name
    # The fake prefill server reports no KV transfer: nothing observed (the end-to-end test has one).
    assert count("request_kv_transfer_seconds") == count("request_kv_transfer_bytes") == 0


def test_untraced_gateway_forwards_trace_headers_and_logs_nothing(setup):
    fake, _, plain, traces = setup
    fake.reset()
    before = len(list(read_spans(traces)))
    headers = {"traceparent": TRACEPARENT, "tracestate": "vendor=1", "x-request-id": "untraced-test"}
    r = httpx.post(plain.http_url + "/v1/completions", headers=headers, json={"prompt": "x", "max_tokens": 2},
                   timeout=20)
    assert r.status_code == 200
    assert fake.state.metadata[0]["traceparent"] == TRACEPARENT
    assert fake.state.metadata[0]["tracestate"] == "vendor=1"
    # A request's log line and spans are written before its response leaves: none here.
    assert "untraced-test" not in plain.log_text()
    assert not any("untraced-test" in str(s["attributes"]) for s in list(read_spans(traces))[before:])


def test_cancellation_with_tracing_on_frees_the_engine_and_ends_the_spans(setup):
    fake, gw, _, traces = setup
    fake.reset()
    fake.state.knobs.token_delay = 0.3
    try:
        with grpc.insecure_channel(gw.grpc_address) as ch:  # gRPC client cancels mid-stream
            stream = gateway_pb2_grpc.GatewayStub(ch).Generate(
                gateway_pb2.GenerateRequest(text="x", request_id="cancel-grpc"), timeout=20)
            next(stream)
            stream.cancel()
            fake.wait_idle(timeout=3)
        with httpx.Client(base_url=gw.http_url, timeout=20) as c:  # HTTP client disconnects mid-stream
            with c.stream("POST", "/v1/completions", headers={"x-request-id": "cancel-http"},
                          json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
                assert next(r.iter_lines()).startswith("data: ")
        fake.wait_idle(timeout=3)
    finally:
        fake.state.knobs.token_delay = 0.0
    assert len(fake.state.cancelled) == 2
    for rid in ("cancel-grpc", "cancel-http"):
        spans = _trace(traces, lambda s, rid=rid: s["attributes"].get("pdserve.request_id") == rid)
        req = _request_span(spans)
        assert req["status"] == "ERROR" and req["end_ns"] > req["start_ns"], req
        [dcall] = [s for s in spans if s["name"] == "pdserve.v1.Decode/Generate"]
        assert dcall["status"] == "ERROR"
