"""The trace model behind `pdserve trace` and its HTML page: spans, a request's
trace and its time-to-first-token breakdown, read from the traces file
``pdserve up`` writes (rpc/trace_file.py) or from Jaeger's JSON.

A request is found by the gateway's ``pdserve.request_id`` attribute (the
response ``id``, the ``x-request-id`` header, the gRPC stream's
``request_id``), by the internal id the engine servers saw, or by trace id.

The breakdown splits the time to first token (start of the gateway's request
span to the gateway's first token) by each span's ``pdserve.phase``; where spans overlap, prefill
compute wins over the KV transfer it overlaps (a layer-wise send runs beside the
prompt's last chunk: only what it adds after the compute counts), the transfer
over the first decode step, queues and gateway work, and what no phase covers
is "rest" (network, gRPC, waiting).
Without engine spans, the prefill phases come from the figures the prefill
server returned to the gateway (attributes of its Prefill client span).

Nothing here prints or renders: trace.py (text) and trace_html.py (the page)
both read this module, and neither imports the other's output.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

GATEWAY_SERVICE = "pdserve-gateway"
_REQUEST_KEYS = ("pdserve.request_id", "gen_ai.response.id", "pdserve.internal_request_id")
# Breakdown categories, later pipeline stages first (they win where spans overlap).
BREAKDOWN = ("prefill compute", "KV transfer", "first decode step", "prefill queue", "decode reservation",
             "gateway")


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    kind: str = "INTERNAL"
    status: str = "UNSET"
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_record(cls, r: dict[str, Any]) -> "Span":
        """A span from a traces-file line (rpc/trace_file.py)."""
        return cls(r["trace_id"], r["span_id"], r.get("parent_id"), r.get("name", ""), r.get("service", ""),
                   int(r["start_ns"]), int(r.get("end_ns") or r["start_ns"]), r.get("kind", "INTERNAL"),
                   r.get("status", "UNSET"), dict(r.get("attributes") or {}), list(r.get("events") or []))

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def phase(self) -> str | None:
        return self.attributes.get("pdserve.phase")


@dataclass
class Trace:
    """One trace's spans; ``root`` is the gateway's request span (the one
    with ``pdserve.request_id``), else the earliest top-level span."""

    trace_id: str
    spans: list[Span]

    @property
    def root(self) -> Span:
        ids = {s.span_id for s in self.spans}
        requests = [s for s in self.spans if s.service == GATEWAY_SERVICE and "pdserve.request_id" in s.attributes]
        tops = [s for s in self.spans if s.parent_id not in ids]
        return min(requests or tops or self.spans, key=lambda s: s.start_ns)

    @property
    def request_id(self) -> str:
        return str(self.root.attributes.get("pdserve.request_id", "?"))

    @property
    def start_ns(self) -> int:
        return min(s.start_ns for s in self.spans)

    @property
    def e2e_ms(self) -> float:
        return self.root.duration_ms

    @property
    def ttft_ms(self) -> float | None:
        root = self.root
        if "pdserve.ttft_ms" in root.attributes:
            return float(root.attributes["pdserve.ttft_ms"])
        for e in root.events:
            if e.get("name") == "first_token":
                return (int(e["time_ns"]) - root.start_ns) / 1e6
        return None

    @property
    def missing(self) -> list[str]:
        """Why the trace looks incomplete (empty when it does not): spans whose parent is not
        here, past the one top-level span (whose parent may be the caller's), and a gateway
        request span without the transport's span it always nests under. Spans reach the
        traces file as each process finishes its part of a request, so right after a
        response some may still be on their way."""
        ids = {s.span_id for s in self.spans}
        tops = sorted((s for s in self.spans if s.parent_id not in ids), key=lambda s: (s.start_ns, -s.end_ns))
        out = []
        if len(tops) > 1:
            out.append(f"{len(tops) - 1} span(s) whose parent is missing ({', '.join(s.name for s in tops[1:4])}"
                       f"{', ...' if len(tops) > 4 else ''})")
        request = [s for s in self.spans if s.service == GATEWAY_SERVICE and "pdserve.api" in s.attributes]
        if request and request[0].parent_id not in ids:
            out.append("the gateway's transport span (the request span's parent)")
        if not request and not any("pdserve.request_id" in s.attributes for s in self.spans):
            out.append("the gateway's request span")
        return out

    def children(self) -> dict[str | None, list[Span]]:
        """Spans by parent id; spans whose parent is not here count as roots (None)."""
        ids = {s.span_id for s in self.spans}
        out: dict[str | None, list[Span]] = defaultdict(list)
        for s in sorted(self.spans, key=lambda s: (s.start_ns, s.end_ns)):
            out[s.parent_id if s.parent_id in ids else None].append(s)
        return out

    def walk(self) -> Iterator[tuple[int, Span]]:
        """(depth, span) in tree order, children by start time."""
        kids = self.children()

        def visit(span: Span, depth: int) -> Iterator[tuple[int, Span]]:
            yield depth, span
            for child in kids.get(span.span_id, ()):
                yield from visit(child, depth + 1)

        for top in kids.get(None, ()):
            yield from visit(top, 0)


def group_traces(spans: Iterable[Span]) -> dict[str, Trace]:
    by_trace: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_trace[s.trace_id].append(s)
    return {tid: Trace(tid, ss) for tid, ss in by_trace.items()}


def find_request(traces: dict[str, Trace], request_id: str) -> list[Trace]:
    """Traces whose spans name ``request_id`` (or whose id it is), newest first."""
    found = [t for t in traces.values()
             if t.trace_id == request_id.lower()
             or any(s.attributes.get(k) == request_id for s in t.spans for k in _REQUEST_KEYS)]
    return sorted(found, key=lambda t: t.start_ns, reverse=True)


def request_traces(traces: Iterable[Trace]) -> list[Trace]:
    """Traces that have a gateway request span."""
    return [t for t in traces if "pdserve.request_id" in t.root.attributes]


def slowest(traces: Iterable[Trace], n: int, by: str = "ttft") -> list[Trace]:
    """The ``n`` slowest requests by "ttft" (requests without a first token
    last) or "e2e"."""
    reqs = request_traces(traces)
    if by == "ttft":
        key = lambda t: (t.ttft_ms or 0.0, t.e2e_ms)  # noqa: E731
    else:
        key = lambda t: (t.e2e_ms, t.ttft_ms or 0.0)  # noqa: E731
    return sorted(reqs, key=key, reverse=True)[:n]


# ------------------------------------------------------------------ breakdown

def _phase_intervals(t: Trace) -> dict[str, list[tuple[int, int]]]:
    """Breakdown category -> intervals (ns) of the spans in it."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    root = t.root
    has_engine = any(s.phase in ("prefill_queue", "prefill_compute", "kv_transfer") for s in t.spans)
    disaggregated = any(s.service.endswith("prefill") or s.name.endswith("Prefill/Prefill") for s in t.spans)
    for s in t.spans:
        iv = (s.start_ns, s.end_ns)
        if s is root:
            continue
        phase = s.phase
        if phase == "kv_transfer":
            out["KV transfer"].append(iv)
        elif phase == "prefill_compute":
            # On a decode server that prefilled itself, its first step made the first token.
            out["first decode step" if s.service.endswith("decode") else "prefill compute"].append(iv)
        elif phase == "prefill_queue" or (phase == "decode_queue" and not disaggregated):
            out["prefill queue"].append(iv)  # a decode server that prefills itself queues before it
        elif phase == "decode_reservation":
            out["decode reservation"].append(iv)
        elif phase == "decode" and s.service.endswith("decode") and s.name == "decode.generate":
            out["first decode step"].append(iv)
        elif phase == "gateway" and s.kind == "INTERNAL":  # tokenize, route, detokenize
            out["gateway"].append(iv)
        elif not has_engine and s.name.endswith("Prefill/Prefill"):
            # No engine spans: place what the prefill server reported inside its call.
            a = s.attributes
            queue = float(a.get("pdserve.prefill.queue_ms", 0)) * 1e6
            compute = float(a.get("pdserve.prefill.compute_ms", 0)) * 1e6
            # What the transfer added after the first token (a layer-wise send overlaps compute).
            kv = float(a.get("pdserve.kv.seconds_after_first_token", a.get("pdserve.kv.seconds", 0))) * 1e9
            t0 = s.start_ns
            out["prefill queue"].append((t0, int(t0 + queue)))
            out["prefill compute"].append((int(t0 + queue), int(t0 + queue + compute)))
            out["KV transfer"].append((int(t0 + queue + compute), int(t0 + queue + compute + kv)))
    return out


def ttft_breakdown(t: Trace) -> list[tuple[str, float]] | None:
    """[(category, ms)] over the time to first token, "rest" last; None
    without a first token."""
    ttft = t.ttft_ms
    if ttft is None:
        return None
    lo = t.root.start_ns
    hi = lo + int(ttft * 1e6)
    intervals = _phase_intervals(t)
    cuts = sorted({lo, hi, *(max(lo, min(hi, x)) for ivs in intervals.values() for iv in ivs for x in iv)})
    totals = dict.fromkeys(BREAKDOWN, 0.0)
    rest = 0.0
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        owner = next((c for c in BREAKDOWN if any(s <= mid < e for s, e in intervals.get(c, ()))), None)
        if owner is None:
            rest += (b - a) / 1e6
        else:
            totals[owner] += (b - a) / 1e6
    order = ("gateway", "prefill queue", "prefill compute", "KV transfer", "first decode step")
    rows = [(c, totals[c]) for c in order]
    if totals["decode reservation"] > 0:
        rows.insert(1, ("decode reservation", totals["decode reservation"]))
    return rows + [("rest", rest)]


# ------------------------------------------------------------------ sources

def load_file(path: str) -> dict[str, Trace]:
    from rpc.trace_file import read_spans

    return group_traces(Span.from_record(r) for r in read_spans(path))


def _jaeger_value(tag: dict[str, Any]) -> Any:
    value = tag.get("value")
    if tag.get("type") == "string" and isinstance(value, str) and value.startswith("["):
        try:
            return json.loads(value)  # OTLP array attributes arrive as JSON text
        except ValueError:
            pass
    return value


def from_jaeger(data: list[dict[str, Any]]) -> dict[str, Trace]:
    """Jaeger API traces as ``Trace``s (microseconds to nanoseconds, tags to attributes)."""
    spans: list[Span] = []
    for tr in data:
        processes = {pid: p.get("serviceName", "") for pid, p in (tr.get("processes") or {}).items()}
        for s in tr.get("spans") or []:
            tags = {t["key"]: _jaeger_value(t) for t in s.get("tags") or []}
            parent = next((r["spanID"] for r in s.get("references") or [] if r.get("refType") == "CHILD_OF"), None)
            start = int(s["startTime"]) * 1000
            events = []
            for log in s.get("logs") or []:
                fields = {f["key"]: f.get("value") for f in log.get("fields") or []}
                events.append({"name": fields.pop("event", ""), "time_ns": int(log["timestamp"]) * 1000,
                               "attributes": fields})
            status = str(tags.pop("otel.status_code", "UNSET")).upper()
            kind = str(tags.pop("span.kind", "internal")).upper()
            spans.append(Span(s["traceID"].rjust(32, "0"), s["spanID"].rjust(16, "0"),
                              parent.rjust(16, "0") if parent else None, s.get("operationName", ""),
                              processes.get(s.get("processID", ""), ""), start, start + int(s["duration"]) * 1000,
                              kind, status, tags, events))
    return group_traces(spans)
