"""`pdserve trace` on a traces file with known requests (tests/tracing/
trace_samples.py): the waterfall's order, indentation and figures, the exact
time-to-first-token breakdown (with and without engine spans), --slowest
order by TTFT and end to end, lookup by internal id and trace id, and the
same output read from a (fake) Jaeger query API."""
from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdserve.cli import main as pdserve_main
from pdserve.cli import trace as trace_cli
from pdserve.cli import trace_model
from tests.tracing.trace_samples import CALLER_SPAN, sample_spans, write_sample_file


@pytest.fixture(scope="module")
def traces_file(tmp_path_factory) -> Path:
    return write_sample_file(tmp_path_factory.mktemp("traces") / "traces.jsonl")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = pdserve_main(["trace", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _rows(out: str) -> list[tuple[str, str, float, float]]:
    """(service, indented span name, start ms, duration ms) of the waterfall."""
    rows = []
    for line in out.splitlines():
        if line.startswith("pdserve-") and "|" in line:
            left = line.split("|")[0]
            service, rest = left[:17].strip(), left[17:]
            name_part, start, dur = rest[:-22], rest[-22:-11], rest[-11:]
            rows.append((service, name_part.rstrip(), float(start), float(dur)))
    return rows


def test_waterfall_of_a_request(capsys, traces_file):
    code, out, _ = _run(capsys, "cmpl-a", "--traces-file", str(traces_file))
    assert code == 0
    assert out.splitlines()[0] == f"trace {'a' * 32}  request cmpl-a"
    assert f"continues the caller's span {CALLER_SPAN}" in out
    assert "18 spans from 3 services (pdserve-decode, pdserve-gateway, pdserve-prefill), 499.0 ms" in out
    assert _rows(out) == [
        ("pdserve-gateway", "POST /v1/completions", 0.0, 499.0),
        ("pdserve-gateway", "  text_completion m", 1.0, 498.0),
        ("pdserve-gateway", "    tokenize", 1.0, 4.0),
        ("pdserve-gateway", "    route", 5.0, 1.0),
        ("pdserve-gateway", "    pdserve.v1.Decode/Generate", 6.0, 493.0),
        ("pdserve-decode", "      /pdserve.v1.Decode/Generate", 7.0, 491.0),
        ("pdserve-decode", "        decode", 7.0, 491.0),
        ("pdserve-decode", "          decode.reservation_wait", 7.0, 2.0),
        ("pdserve-decode", "          kv.receive", 80.0, 30.0),
        ("pdserve-decode", "          decode.queue", 110.0, 2.0),
        ("pdserve-decode", "          decode.generate", 112.0, 386.0),
        ("pdserve-gateway", "    pdserve.v1.Prefill/Prefill", 10.0, 108.0),
        ("pdserve-prefill", "      /pdserve.v1.Prefill/Prefill", 11.0, 106.0),
        ("pdserve-prefill", "        prefill", 11.0, 105.0),
        ("pdserve-prefill", "          prefill.queue", 11.0, 10.0),
        ("pdserve-prefill", "          prefill.compute", 21.0, 64.0),
        ("pdserve-prefill", "          kv.send", 86.0, 24.0),
        ("pdserve-gateway", "    detokenize", 121.0, 378.0)]
    bars = [line.split("|")[1] for line in out.splitlines() if line.startswith("pdserve-") and "|" in line]
    assert bars[0] == "█" * 40  # the whole trace
    assert bars[16].index("█") == int(86 / 499 * 40)  # kv.send starts at 86 of 499 ms


def test_ttft_breakdown_with_engine_spans(traces_file):
    t = trace_model.find_request(trace_model.load_file(str(traces_file)), "cmpl-a")[0]
    assert t.ttft_ms == 120.0
    assert [(n, round(ms, 6)) for n, ms in trace_model.ttft_breakdown(t)] == [
        ("gateway", 5.0), ("decode reservation", 2.0), ("prefill queue", 10.0), ("prefill compute", 64.0),
        ("KV transfer", 25.0), ("first decode step", 9.0), ("rest", 5.0)]


def test_ttft_breakdown_from_what_the_prefill_server_reported(capsys, traces_file):
    code, out, _ = _run(capsys, "cmpl-e", "--traces-file", str(traces_file))
    assert code == 0
    tail = out.split("time to first token: ")[1].splitlines()
    assert tail[0] == "120.0 ms"
    assert [line.split()[0:-3] + line.split()[-3:-2] for line in tail[1:7]] == [
        ["gateway", "5.0"], ["prefill", "queue", "10.0"], ["prefill", "compute", "60.0"],
        ["KV", "transfer", "30.0"], ["first", "decode", "step", "0.0"], ["rest", "15.0"]]
    assert "as the prefill server reported them" in out


def _write(path: Path, spans: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in spans))
    return path


def test_an_incomplete_trace_is_said_to_be_and_draws_no_breakdown(capsys, traces_file, tmp_path):
    """Right after a response some processes' spans may still be on their way: the decode
    server's span that its engine spans nest under, or the gateway's transport span."""
    code, out, _ = _run(capsys, "cmpl-a", "--traces-file", str(traces_file))
    assert code == 0 and "looks incomplete" not in out  # the whole trace: no note
    spans = [s for s in sample_spans() if s["trace_id"] == "a" * 32]
    no_server = [s for s in spans if not (s["name"] == "/pdserve.v1.Decode/Generate" and s["kind"] == "SERVER")]
    code, out, _ = _run(capsys, "cmpl-a", "--traces-file", str(_write(tmp_path / "a.jsonl", no_server)))
    assert code == 0 and out.splitlines()[0] == f"trace {'a' * 32}  request cmpl-a"
    assert "this trace looks incomplete: missing 1 span(s) whose parent is missing (decode)" in out
    assert out.rstrip().endswith("time to first token: 120.0 ms (no breakdown: the trace looks incomplete)")
    # The gateway's request span without its transport span (real request spans carry pdserve.api).
    request_only = [dict(s, attributes={**s["attributes"], "pdserve.api": "http"})
                    for s in spans if s["name"] == "text_completion m"]
    request_only[0]["attributes"].pop("pdserve.ttft_ms")
    request_only[0]["events"] = []
    code, out, _ = _run(capsys, "cmpl-a", "--traces-file", str(_write(tmp_path / "b.jsonl", request_only)))
    assert "missing the gateway's transport span (the request span's parent)" in out
    assert "time to first token: not known yet (no breakdown" in out and "produced no token" not in out
    # Engine spans with no gateway request span at all: the request's id is not known.
    engine_only = [s for s in spans if s["service"] != "pdserve-gateway"]
    traces = trace_model.group_traces(trace_model.Span.from_record(r) for r in engine_only)
    assert "the gateway's request span" in trace_cli.render_incomplete(traces["a" * 32])


def test_lookup_by_internal_id_and_trace_id(traces_file):
    traces = trace_model.load_file(str(traces_file))
    assert [t.trace_id for t in trace_model.find_request(traces, "cmpl-c-x")] == ["c" * 32]
    assert [t.request_id for t in trace_model.find_request(traces, "B" * 32)] == ["cmpl-b"]
    assert trace_model.find_request(traces, "cmpl-zzz") == []


def test_unknown_request_and_missing_file(capsys, traces_file, tmp_path):
    code, _, err = _run(capsys, "cmpl-zzz", "--traces-file", str(traces_file))
    assert code == 1 and "no spans of request 'cmpl-zzz'" in err
    code, _, err = _run(capsys, "--slowest", "3", "--traces-file", str(tmp_path / "none.jsonl"))
    assert code == 1 and "no request spans" in err
    code, _, err = _run(capsys, "--traces-file", str(traces_file))
    assert code == 2 and "REQUEST_ID or --slowest" in err


def _slowest_ids(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines() if line.startswith("cmpl-")]


def test_slowest_orders_by_ttft_then_by_e2e(capsys, traces_file):
    code, out, _ = _run(capsys, "--slowest", "10", "--traces-file", str(traces_file))
    assert code == 0 and "by time to first token" in out
    assert _slowest_ids(out) == ["cmpl-b", "cmpl-a", "cmpl-e", "cmpl-c", "cmpl-d"]  # no first token: last
    code, out, _ = _run(capsys, "--slowest", "2", "--by", "e2e", "--traces-file", str(traces_file))
    assert _slowest_ids(out) == ["cmpl-d", "cmpl-c"]
    line = next(x for x in out.splitlines() if x.startswith("cmpl-d"))
    assert line.split()[1:3] == ["-", "1000.0"] and "error" in line


def test_html_is_written_for_a_request_and_for_slowest(capsys, traces_file, tmp_path):
    page = tmp_path / "a.html"
    code, out, _ = _run(capsys, "cmpl-a", "--traces-file", str(traces_file), "--html", str(page))
    assert code == 0 and f"wrote {page}" in out
    html = page.read_text()
    assert html.count('class="row"') == 18 and "http://" not in html.replace("http://localhost", "")
    _run(capsys, "--slowest", "3", "--traces-file", str(traces_file), "--html", str(tmp_path / "s.html"))
    assert (tmp_path / "s.html").read_text().count("<h2>request") == 3


# ------------------------------------------------------------------ Jaeger

def _to_jaeger(records: list[dict]) -> dict:
    """The sample spans as Jaeger's /api/traces answers them."""
    traces: dict[str, dict] = {}
    for r in records:
        t = traces.setdefault(r["trace_id"], {"traceID": r["trace_id"], "spans": [], "processes": {}})
        pid = "p" + str(["pdserve-gateway", "pdserve-prefill", "pdserve-decode"].index(r["service"]) + 1)
        t["processes"][pid] = {"serviceName": r["service"], "tags": []}
        tags = [{"key": k, "type": "string" if isinstance(v, (str, list)) else "float64",
                 "value": json.dumps(v) if isinstance(v, list) else v} for k, v in r["attributes"].items()]
        tags.append({"key": "span.kind", "type": "string", "value": r["kind"].lower()})
        if r["status"] == "ERROR":
            tags.append({"key": "otel.status_code", "type": "string", "value": "ERROR"})
        t["spans"].append({
            "traceID": r["trace_id"], "spanID": r["span_id"], "operationName": r["name"],
            "references": [{"refType": "CHILD_OF", "traceID": r["trace_id"], "spanID": r["parent_id"]}]
            if r["parent_id"] else [],
            "startTime": r["start_ns"] // 1000, "duration": (r["end_ns"] - r["start_ns"]) // 1000, "tags": tags,
            "logs": [{"timestamp": e["time_ns"] // 1000, "fields": [{"key": "event", "type": "string",
                                                                     "value": e["name"]}]} for e in r["events"]],
            "processID": pid})
    return {"data": list(traces.values())}


@pytest.fixture(scope="module")
def jaeger():
    data = _to_jaeger(sample_spans())
    queries: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            url = urllib.parse.urlparse(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            queries.append(q)
            tags = json.loads(q.get("tags", "{}"))
            found = [t for t in data["data"] if all(
                any(tag["key"] == k and tag["value"] == v for s in t["spans"] for tag in s["tags"])
                for k, v in tags.items())]
            body = json.dumps({"data": found[:int(q.get("limit", "20"))]}).encode()
            self.send_response(200 if url.path == "/api/traces" else 404)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", queries
    server.shutdown()
    server.server_close()


def test_jaeger_source_gives_the_same_output(capsys, traces_file, jaeger):
    url, queries = jaeger
    _, from_file, _ = _run(capsys, "cmpl-a", "--traces-file", str(traces_file))
    code, from_jaeger, _ = _run(capsys, "cmpl-a", "--jaeger-url", url)
    assert code == 0 and from_jaeger == from_file
    assert queries[-1]["service"] == "pdserve-gateway"
    assert json.loads(queries[-1]["tags"]) == {"pdserve.request_id": "cmpl-a"}
    _, slow_file, _ = _run(capsys, "--slowest", "3", "--traces-file", str(traces_file))
    _, slow_jaeger, _ = _run(capsys, "--slowest", "3", "--jaeger-url", url)
    assert slow_jaeger == slow_file
    # The internal id is tried when the client-facing one is not found.
    code, out, _ = _run(capsys, "cmpl-c-x", "--jaeger-url", url)
    assert code == 0 and "request cmpl-c" in out


def test_breakdown_counts_what_a_layer_wise_send_added_after_the_first_token(traces_file):
    """The prefill server reports its transfer's whole time (it overlapped the prompt's last
    chunk) and what it added after the first token: the breakdown counts the latter."""
    t = trace_model.find_request(trace_model.load_file(str(traces_file)), "cmpl-e")[0]
    prefill_call = next(s for s in t.spans if s.name.endswith("Prefill/Prefill"))
    prefill_call.attributes.update({"pdserve.kv.seconds": 0.070, "pdserve.kv.seconds_after_first_token": 0.004})
    rows = dict(trace_model.ttft_breakdown(t))
    assert rows["prefill compute"] == 60.0 and round(rows["KV transfer"], 3) == 4.0 and round(rows["rest"], 3) == 41.0
