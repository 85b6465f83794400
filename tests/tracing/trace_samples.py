"""A traces file with known requests, written in rpc/trace_file.py's format,
with whole-millisecond times so that every breakdown figure is exact.

``cmpl-a`` (disaggregated, engine spans wired), time to first token 120 ms::

    ms   0 ........................................................ 500
    gateway  POST /v1/completions                 0-499 (parent: the caller's span)
      text_completion m                           1-499  ttft 120
        tokenize 1-5, route 5-6, detokenize 121-499
        Decode/Generate (client) 6-499
          decode server 7-498: reservation 7-9, kv.receive 80-110, queue 110-112, generate 112-498
        Prefill/Prefill (client) 10-118
          prefill server 11-117: queue 11-21, compute 21-85, kv.send 86-110

    breakdown (compute wins over the KV transfer it overlaps, 80-85): gateway 5,
               decode reservation 2, prefill queue 10, prefill compute 64 (21-85),
               KV transfer 25 (85-110), first decode step 9 (112-121), rest 5

``cmpl-e`` (e2e 400) has no engine spans: its Prefill client span (10-118)
says queue 10 ms, compute 60 ms, KV 30 ms -> gateway 5, queue 10, compute 60,
KV 30, rest 15. ``cmpl-b`` (ttft 300, e2e 350), ``cmpl-c`` (ttft 50, e2e 900) and
``cmpl-d`` (failed, no first token, e2e 1000) are bare request spans.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

BASE_NS = 1_750_000_000_000_000_000
CALLER_SPAN = "00f067aa0ba902b7"
_ids = itertools.count(1)


def _span(trace: str, name: str, service: str, start_ms: float, end_ms: float, parent: dict | None = None,
          kind: str = "INTERNAL", attributes: dict[str, Any] | None = None, events: list | None = None,
          status: str = "UNSET", parent_id: str | None = None, t0_ms: float = 0) -> dict[str, Any]:
    return {"trace_id": trace, "span_id": f"{next(_ids):016x}",
            "parent_id": parent["span_id"] if parent else parent_id, "name": name, "kind": kind,
            "service": service, "start_ns": BASE_NS + int((t0_ms + start_ms) * 1e6),
            "end_ns": BASE_NS + int((t0_ms + end_ms) * 1e6), "status": status,
            "attributes": attributes or {}, "events": events or []}


GW, PF, DC = "pdserve-gateway", "pdserve-prefill", "pdserve-decode"


def _request(trace: str, rid: str, e2e: float, ttft: float | None, t0_ms: float, status: str = "UNSET",
             http: bool = True) -> list[dict[str, Any]]:
    top = _span(trace, "POST /v1/completions", GW, 0, e2e + 1, kind="SERVER", parent_id=CALLER_SPAN, t0_ms=t0_ms,
                attributes={"http.route": "/v1/completions"}) if http else None
    attrs = {"pdserve.request_id": rid, "gen_ai.response.id": rid, "pdserve.internal_request_id": rid + "-x",
             "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "m", "pdserve.phase": "gateway",
             "gen_ai.usage.input_tokens": 7, "gen_ai.usage.output_tokens": 5, "pdserve.cached_tokens": 0}
    events = []
    if ttft is not None:
        attrs["pdserve.ttft_ms"] = ttft
        attrs["gen_ai.response.finish_reasons"] = ["length"]
        events = [{"name": "first_token", "time_ns": BASE_NS + int((t0_ms + 1 + ttft) * 1e6), "attributes": {}}]
    req = _span(trace, "text_completion m", GW, 1, 1 + e2e, top, attributes=attrs, events=events, status=status,
                t0_ms=t0_ms, parent_id=None if http else CALLER_SPAN)
    return ([top] if top else []) + [req]


def sample_spans() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    # cmpl-a: everything wired.
    ta = "a" * 32
    top, req = _request(ta, "cmpl-a", 498, 120, 0)
    g = {"pdserve.phase": "gateway"}
    dcall = _span(ta, "pdserve.v1.Decode/Generate", GW, 6, 499, req, "CLIENT", {**g})
    pcall = _span(ta, "pdserve.v1.Prefill/Prefill", GW, 10, 118, req, "CLIENT",
                  {**g, "pdserve.prefill.queue_ms": 10.0, "pdserve.prefill.compute_ms": 64.0, "pdserve.kv.seconds": 0.024})
    dsrv = _span(ta, "/pdserve.v1.Decode/Generate", DC, 7, 498, dcall, "SERVER")
    dtop = _span(ta, "decode", DC, 7, 498, dsrv, attributes={"pdserve.phase": "decode"})
    psrv = _span(ta, "/pdserve.v1.Prefill/Prefill", PF, 11, 117, pcall, "SERVER")
    ptop = _span(ta, "prefill", PF, 11, 116, psrv, attributes={"pdserve.phase": "prefill"})
    out += [top, req, dcall, pcall, dsrv, dtop, psrv, ptop,
            _span(ta, "tokenize", GW, 1, 5, req, attributes=g), _span(ta, "route", GW, 5, 6, req, attributes=g),
            _span(ta, "detokenize", GW, 121, 499, req, attributes=g),
            _span(ta, "decode.reservation_wait", DC, 7, 9, dtop, attributes={"pdserve.phase": "decode_reservation"}),
            _span(ta, "kv.receive", DC, 80, 110, dtop, attributes={"pdserve.phase": "kv_transfer"}),
            _span(ta, "decode.queue", DC, 110, 112, dtop, attributes={"pdserve.phase": "decode_queue"}),
            _span(ta, "decode.generate", DC, 112, 498, dtop, attributes={"pdserve.phase": "decode"}),
            _span(ta, "prefill.queue", PF, 11, 21, ptop, attributes={"pdserve.phase": "prefill_queue"}),
            _span(ta, "prefill.compute", PF, 21, 85, ptop, attributes={"pdserve.phase": "prefill_compute"}),
            _span(ta, "kv.send", PF, 86, 110, ptop, attributes={"pdserve.phase": "kv_transfer",
                                                                 "pdserve.kv.bytes": 1 << 20})]
    # cmpl-e: no engine spans, only what the prefill server reported.
    te = "e" * 32
    top, req = _request(te, "cmpl-e", 400, 120, 5000)
    out += [top, req, _span(te, "tokenize", GW, 1, 5, req, attributes=g, t0_ms=5000),
            _span(te, "route", GW, 5, 6, req, attributes=g, t0_ms=5000),
            _span(te, "pdserve.v1.Prefill/Prefill", GW, 10, 118, req, "CLIENT",
                  {**g, "pdserve.prefill.queue_ms": 10.0, "pdserve.prefill.compute_ms": 60.0,
                   "pdserve.kv.seconds": 0.030}, t0_ms=5000)]
    out += _request("b" * 32, "cmpl-b", 350, 300, 1000, http=False)
    out += _request("c" * 32, "cmpl-c", 900, 50, 2000)
    out += _request("d" * 32, "cmpl-d", 1000, None, 3000, status="ERROR")
    # A span of no request (e.g. a trace started elsewhere) is ignored by --slowest.
    out.append(_span("f" * 32, "/pdserve.v1.Decode/Generate", DC, 0, 5, kind="SERVER", t0_ms=6000))
    return out


def write_sample_file(path: Path) -> Path:
    with open(path, "w") as f:
        for record in sample_spans():
            f.write(json.dumps(record) + "\n")
    return path
