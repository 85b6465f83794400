"""End to end: a real prefill server, decode server and gateway as separate
processes on the default model, exporting OTLP to a receiver this test runs
(the gateway and decode server over gRPC, the prefill server over
http/protobuf) and to a shared traces file. One HTTP request with a caller's
traceparent must give one trace with spans from all three services, every
parent link resolving under the caller's span, the GenAI attributes and the
engine spans (queue, compute, KV send and receive, decode) set, and
`pdserve trace` must render it from the file."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from pdserve.cli import main as pdserve_main
from tests.processes import GatewayProcess, ServiceProcess, free_port
from tests.tracing.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow

CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"
ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
SERVICES = {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    receiver = OtlpReceiver().start()
    traces = tmp_path_factory.mktemp("e2e-traces") / "traces.jsonl"
    common = {"OTEL_BSP_SCHEDULE_DELAY": "200", "PDSERVE_TRACES_FILE": str(traces), "OMP_NUM_THREADS": "1",
              "OTEL_SDK_DISABLED": "", "OTEL_TRACES_EXPORTER": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}
    grpc_env = {**common, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    http_env = {**common, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint.removesuffix("/v1/traces"),
                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    engines = {}
    for role, env in (("prefill", http_env), ("decode", grpc_env)):
        port = free_port()
        engines[role] = (f"127.0.0.1:{port}", ServiceProcess(role, f"{role}_service.server",
                                                             ["--port", str(port), *ENGINE_FLAGS],
                                                             f"{role} server ready", env=env))
    gw = GatewayProcess("traced-e2e", ["--prefill", engines["prefill"][0], "--decode", engines["decode"][0],
                                       "--max-model-len", "512"], env=grpc_env)
    procs = [gw, engines["prefill"][1], engines["decode"][1]]
    try:
        for p in procs[1:] + procs[:1]:
            p.wait_ready()
        deadline = time.monotonic() + 30
        # Both engine servers healthy at the gateway: a request routed before
        # the prefill server is seen would be prefilled by the decode server.
        while not all(i["healthy"] for i in httpx.get(gw.http_url + "/cluster").json()["instances"]):
            assert time.monotonic() < deadline, gw.logs()
            time.sleep(0.1)
        yield gw, receiver, traces, procs
    finally:
        codes = [p.stop() for p in procs]
        receiver.stop()
    assert codes == [0, 0, 0], [p.logs() for p in procs]


@pytest.fixture(scope="module")
def request_trace(cluster):
    """(response body, spans of its trace) once all three services exported."""
    gw, receiver, _, _ = cluster
    r = httpx.post(gw.http_url + "/v1/completions", timeout=120, headers={
        "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text

    def complete(spans) -> bool:
        """Every process's part is in: the request span, and every span's parent (the spans
        that end last are the roots: the gateway's HTTP span, each engine server's own)."""
        mine = [s for s in spans if s.trace_id == CALLER_TRACE]
        ids = {s.span_id for s in mine}
        return ({s.service for s in mine} == SERVICES and any("pdserve.request_id" in s.attributes for s in mine)
                and any(s.name == "POST /v1/completions" for s in mine)
                and all(s.parent_id in ids or s.parent_id == CALLER_SPAN for s in mine))

    spans = receiver.wait_for(complete, timeout=30)
    assert complete(spans), (sorted({(s.service, s.name) for s in spans if s.trace_id == CALLER_TRACE}),
                             receiver.num_requests, [p.logs() for p in cluster[3]])
    return r.json(), receiver.trace(CALLER_TRACE)


def test_one_trace_holds_spans_from_all_three_services(request_trace):
    _, spans = request_trace
    assert {s.service for s in spans} == SERVICES
    assert len({s.span_id for s in spans}) == len(spans)


def test_every_parent_link_resolves_under_the_callers_span(request_trace):
    _, spans = request_trace
    by_id = {s.span_id: s for s in spans}
    tops = [s for s in spans if s.parent_id not in by_id]
    assert [(s.name, s.parent_id) for s in tops] == [("POST /v1/completions", CALLER_SPAN)]
    for s in spans:  # every span reaches the top through its parents
        seen = 0
        while s.parent_id in by_id:
            s, seen = by_id[s.parent_id], seen + 1
            assert seen < 50
        assert s is tops[0]
    # Each engine server's span is a child of the gateway's call to it.
    for name in ("Prefill/Prefill", "Decode/Generate"):
        [server] = [s for s in spans if s.name == f"/pdserve.v1.{name}"]
        parent = by_id[server.parent_id]
        assert parent.name == f"pdserve.v1.{name}" and parent.service == "pdserve-gateway"


def test_genai_attributes_are_set(request_trace):
    body, spans = request_trace
    [req] = [s for s in spans if "pdserve.request_id" in s.attributes]
    a = req.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == body["model"] == "SmolLM2-135M-Instruct"
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.top_p"] == 1.0
    assert a["gen_ai.response.id"] == a["pdserve.request_id"] == body["id"]
    assert a["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert a["pdserve.cached_tokens"] == 0 and 0 < a["pdserve.ttft_ms"] < a["pdserve.e2e_ms"]
    assert a["pdserve.kv.bytes"] > 0  # reported by the prefill server
    [pcall] = [s for s in spans if s.name == "pdserve.v1.Prefill/Prefill"]
    assert pcall.attributes["pdserve.kv.backend"] == "gloo" and pcall.attributes["pdserve.kv.blocks"] >= 1


def test_engine_spans_are_there(request_trace):
    _, spans = request_trace
    by_id = {s.span_id: s for s in spans}
    names = {(s.service, s.name) for s in spans}
    for expected in (("pdserve-prefill", "prefill"), ("pdserve-prefill", "prefill.queue"),
                     ("pdserve-prefill", "prefill.compute"), ("pdserve-prefill", "kv.send"),
                     ("pdserve-decode", "decode"), ("pdserve-decode", "decode.reservation_wait"),
                     ("pdserve-decode", "kv.receive"), ("pdserve-decode", "decode.queue"),
                     ("pdserve-decode", "decode.generate")):
        assert expected in names, expected
    for role in ("prefill", "decode"):  # under the server span of the call that carried the request
        [top] = [s for s in spans if s.name == role]
        assert by_id[top.parent_id].kind == 2 and by_id[top.parent_id].service == f"pdserve-{role}"  # SERVER
    [send] = [s for s in spans if s.name == "kv.send"]
    assert send.attributes["pdserve.kv.bytes"] > 0 and send.attributes["pdserve.kv.blocks"] >= 1
    assert send.attributes["pdserve.kv.backend"] == "gloo"
    [gen] = [s for s in spans if s.name == "decode.generate"]
    assert "first_token" in gen.events


def test_kv_receive_span_carries_the_transfer_figures(request_trace):
    _, spans = request_trace
    [recv] = [s for s in spans if s.name == "kv.receive"]
    assert recv.attributes["pdserve.kv.bytes"] > 0 and recv.attributes["pdserve.kv.blocks"] >= 1
    assert recv.attributes["pdserve.kv.backend"] == "gloo"


def test_pdserve_trace_renders_the_request_from_the_traces_file(cluster, request_trace, capsys):
    _, _, traces, _ = cluster
    body, spans = request_trace
    deadline = time.monotonic() + 10
    while True:  # the file gets the same spans (its processor flushes every 200 ms here)
        code = pdserve_main(["trace", body["id"], "--traces-file", str(traces)])
        out = capsys.readouterr().out
        if code == 0 and f"{len(spans)} spans from 3 services" in out or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert code == 0, out
    assert out.splitlines()[0] == f"trace {CALLER_TRACE}  request {body['id']}"
    assert f"{len(spans)} spans from 3 services" in out
    for service, name in (("pdserve-gateway", "POST /v1/completions"), ("pdserve-prefill", "/pdserve.v1.Prefill"),
                          ("pdserve-decode", "/pdserve.v1.Decode/Generate")):
        assert re.search(rf"^{service}\s+\s*{re.escape(name)}", out, re.M), (service, name, out)
    ttft = next(s for s in spans if "pdserve.request_id" in s.attributes).attributes["pdserve.ttft_ms"]
    assert f"time to first token: {ttft:.1f} ms" in out
    # (a "decode reservation" row is printed only when the reservation falls inside the TTFT)
    parts = dict(re.findall(r"^  (gateway|decode reservation|prefill queue|prefill compute|KV transfer|"
                            r"first decode step|rest)\s+(\d+\.\d) ms", out, re.M))
    assert set(parts) - {"decode reservation"} == {"gateway", "prefill queue", "prefill compute", "KV transfer",
                                                   "first decode step", "rest"}, out
    assert abs(sum(map(float, parts.values())) - ttft) < 0.5
    assert float(parts["prefill compute"]) > 0
    # The KV transfer's share is what its spans add past the prefill compute (a layer-wise send
    # overlaps the compute; a fully overlapped one adds nothing), counted here from the spans.
    root = min((s for s in spans if s.service == "pdserve-gateway" and "pdserve.request_id" in s.attributes),
               key=lambda s: s.start_ns)  # the span the time to first token is counted from
    lo, hi = root.start_ns, root.start_ns + int(ttft * 1e6)
    compute = [(s.start_ns, s.end_ns) for s in spans if s.attributes.get("pdserve.phase") == "prefill_compute"]
    kv = [(s.start_ns, s.end_ns) for s in spans if s.attributes.get("pdserve.phase") == "kv_transfer"]
    assert compute and kv, sorted({(s.service, s.name, s.attributes.get("pdserve.phase")) for s in spans})
    step = 10_000  # ns
    added = sum(step for t in range(lo, hi, step)
                if any(a <= t < b for a, b in kv) and not any(a <= t < b for a, b in compute))
    assert abs(float(parts["KV transfer"]) - added / 1e6) <= 0.15, (parts, added / 1e6)


def test_gateway_observes_kv_transfer_per_request(cluster, request_trace):
    gw, _, _, _ = cluster
    metrics = httpx.get(gw.http_url + "/metrics").text
    for name in ("request_kv_transfer_bytes", "request_kv_transfer_seconds", "request_prefill_time_seconds"):
        m = re.search(rf'^pdserve:{name}_count{{model_name="SmolLM2-135M-Instruct"}} (\S+)$', metrics, re.M)
        assert m and float(m.group(1)) >= 1, name
