"""`pdserve trace`: where a request's time went, from its OpenTelemetry spans.

    pdserve trace REQUEST_ID             waterfall across services + time-to-first-token breakdown
    pdserve trace --slowest N [--by e2e] the slowest requests (by TTFT, or end to end)
    pdserve trace REQUEST_ID --html F    the same as a self-contained timeline page

Spans come from the traces file ``pdserve up`` writes (``--traces-file``,
default ``rpc.tracing.default_traces_file()``) or from Jaeger's HTTP query
API (``--jaeger-url http://localhost:16686``). A request is found by the
gateway's ``pdserve.request_id`` attribute (the response ``id``, the
``x-request-id`` header, the gRPC stream's ``request_id``), by the internal
id the engine servers saw, or by trace id.

The breakdown splits the time to first token (start of the gateway's request
span to the gateway's first token) by each span's ``pdserve.phase``; where spans overlap, prefill
compute wins over the KV transfer it overlaps (a layer-wise send runs beside the
prompt's last chunk: only what it adds after the compute counts), the transfer
over the first decode step, queues and gateway work, and what no phase covers
is "rest" (network, gRPC, waiting).
Without engine spans, the prefill phases come from the figures the prefill
server returned to the gateway (attributes of its Prefill client span).
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import urllib.request
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


# ------------------------------------------------------------------ text

def _bar(start_ms: float, dur_ms: float, total_ms: float, width: int) -> str:
    if total_ms <= 0:
        return " " * width
    a = min(width - 1, int(start_ms / total_ms * width))
    n = max(1, round(dur_ms / total_ms * width))
    n = min(n, width - a)
    return " " * a + "█" * n + " " * (width - a - n)


def render_waterfall(t: Trace, width: int = 40) -> str:
    rows = list(t.walk())
    t0 = t.start_ns
    total = (max(s.end_ns for s in t.spans) - t0) / 1e6
    services = sorted({s.service for s in t.spans})
    head = [f"trace {t.trace_id}  request {t.request_id}",
            f"{len(t.spans)} spans from {len(services)} services ({', '.join(services)}), {total:.1f} ms"]
    callers = {s.parent_id for _, s in rows[:1] if s.parent_id}
    if callers:
        head.append(f"continues the caller's span {callers.pop()}")
    names = [("  " * d) + s.name for d, s in rows]
    name_w = min(60, max(len(n) for n in names))
    svc_w = max(len(s.service) for _, s in rows)
    lines = head + ["", f"{'service':<{svc_w}}  {'span':<{name_w}}  {'start ms':>9}  {'dur ms':>9}  timeline",
                    "-" * (svc_w + name_w + width + 28)]
    for (_, s), name in zip(rows, names):
        start = (s.start_ns - t0) / 1e6
        flag = " !" if s.status == "ERROR" else ""
        lines.append(f"{s.service:<{svc_w}}  {name[:name_w]:<{name_w}}  {start:9.1f}  {s.duration_ms:9.1f}  "
                     f"|{_bar(start, s.duration_ms, total, width)}|{flag}")
    return "\n".join(lines)


def render_speculation(t: Trace) -> str:
    """Speculative decoding's acceptance on the decode server, when it speculated ("" else)."""
    for s in t.spans:
        a = s.attributes
        if "pdserve.spec.draft_tokens" in a:
            return (f"speculative decoding: {a.get('pdserve.spec.accepted_tokens', 0)} of "
                    f"{a['pdserve.spec.draft_tokens']} proposed tokens accepted "
                    f"({100 * float(a.get('pdserve.spec.acceptance_rate', 0.0)):.1f}%)")
    return ""


def render_incomplete(t: Trace) -> str:
    """A note when the trace looks incomplete (see ``Trace.missing``), else ""."""
    missing = t.missing
    if not missing:
        return ""
    return ("this trace looks incomplete: missing " + "; ".join(missing) + ". Spans reach the traces file as "
            "each process finishes its part of a request: run the command again in a moment.")


def render_breakdown(t: Trace) -> str:
    if t.missing:  # no conclusion from part of the spans
        ttft = t.ttft_ms
        return (f"time to first token: {f'{ttft:.1f} ms' if ttft is not None else 'not known yet'} "
                "(no breakdown: the trace looks incomplete)")
    rows = ttft_breakdown(t)
    if rows is None:
        return "time to first token: none (the request produced no token)"
    ttft = t.ttft_ms or 0.0
    has_engine = any(s.phase in ("prefill_queue", "prefill_compute", "kv_transfer") for s in t.spans)
    lines = [f"time to first token: {ttft:.1f} ms"]
    for name, ms in rows:
        share = ms / ttft * 100 if ttft > 0 else 0.0
        lines.append(f"  {name:<19}{ms:9.1f} ms  {share:5.1f}%")
    if not has_engine and any(s.name.endswith("Prefill/Prefill") for s in t.spans):
        lines.append("  (prefill phases as the prefill server reported them to the gateway)")
    return "\n".join(lines)


def render_slowest(traces: list[Trace], by: str) -> str:
    header = (f"{'request id':<42} {'TTFT ms':>9} {'e2e ms':>9} {'prompt':>7} {'cached':>7} {'output':>7}  "
              f"{'finish':<8} trace id")
    lines = [f"slowest {len(traces)} request(s) by {'time to first token' if by == 'ttft' else 'end-to-end latency'}",
             header, "-" * len(header)]
    for t in traces:
        a = t.root.attributes
        reasons = a.get("gen_ai.response.finish_reasons") or ["error" if t.root.status == "ERROR" else "-"]
        reason = reasons[0] if isinstance(reasons, list) else str(reasons)
        ttft = f"{t.ttft_ms:9.1f}" if t.ttft_ms is not None else f"{'-':>9}"
        lines.append(f"{t.request_id[:42]:<42} {ttft} {t.e2e_ms:9.1f} {a.get('gen_ai.usage.input_tokens', '-'):>7} "
                     f"{a.get('pdserve.cached_tokens', '-'):>7} {a.get('gen_ai.usage.output_tokens', '-'):>7}  "
                     f"{reason:<8} {t.trace_id}")
    return "\n".join(lines)


# ------------------------------------------------------------------ sources

def load_file(path: str) -> dict[str, Trace]:
    from rpc.trace_file import read_spans

    return group_traces(Span.from_record(r) for r in read_spans(path))


class JaegerClient:
    """Jaeger's HTTP query API (the one its UI uses): /api/traces."""

    def __init__(self, url: str, lookback: str = "2h", timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.lookback = lookback
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str]) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=self.timeout) as r:
            return json.load(r).get("data") or []

    def find_request(self, request_id: str) -> dict[str, Trace]:
        out: dict[str, Trace] = {}
        for key in ("pdserve.request_id", "pdserve.internal_request_id"):
            data = self._get("/api/traces", {"service": GATEWAY_SERVICE, "lookback": self.lookback, "limit": "20",
                                             "tags": json.dumps({key: request_id})})
            out.update(from_jaeger(data))
            if out:
                break
        return out

    def recent(self, limit: int) -> dict[str, Trace]:
        return from_jaeger(self._get("/api/traces", {"service": GATEWAY_SERVICE, "lookback": self.lookback,
                                                     "limit": str(limit)}))


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


# ------------------------------------------------------------------ command

def add_cli_args(p: argparse.ArgumentParser) -> None:
    from rpc.tracing import default_traces_file

    p.add_argument("request_id", nargs="?", default=None,
                   help="the request's id (response id / x-request-id / gRPC request_id) or its trace id")
    p.add_argument("--slowest", type=int, default=None, metavar="N", help="list the N slowest requests")
    p.add_argument("--by", choices=("ttft", "e2e"), default="ttft", help="--slowest order (default: ttft)")
    p.add_argument("--html", default=None, metavar="FILE", help="also write a self-contained timeline page")
    p.add_argument("--traces-file", default=None,
                   help=f"spans written by pdserve up (default: {default_traces_file()})")
    p.add_argument("--jaeger-url", default=None, help="read from Jaeger's query API instead, e.g. "
                                                      "http://localhost:16686")
    p.add_argument("--lookback", default="2h", help="with --jaeger-url: how far back to search (Jaeger syntax)")
    p.add_argument("--width", type=int, default=40, help="timeline width in characters")


def main(args: argparse.Namespace) -> int:
    from rpc.tracing import default_traces_file

    if (args.request_id is None) == (args.slowest is None):
        print("pdserve trace: give a REQUEST_ID or --slowest N", file=sys.stderr)
        return 2
    jaeger = JaegerClient(args.jaeger_url, args.lookback) if args.jaeger_url else None
    source = args.jaeger_url or args.traces_file or str(default_traces_file())
    try:
        if jaeger is not None:
            traces = (jaeger.find_request(args.request_id) if args.request_id
                      else jaeger.recent(max(100, 4 * args.slowest)))
        else:
            traces = load_file(source)
    except OSError as e:
        print(f"pdserve trace: cannot read spans from {source}: {e}", file=sys.stderr)
        return 1
    if args.slowest is not None:
        found = slowest(traces.values(), args.slowest, args.by)
        if not found:
            print(f"pdserve trace: no request spans in {source}", file=sys.stderr)
            return 1
        print(render_slowest(found, args.by))
        if args.html:
            _write_html(args.html, found)
        return 0
    matches = find_request(traces, args.request_id)
    if not matches:
        print(f"pdserve trace: no spans of request {args.request_id!r} in {source} (a request's spans reach "
              "the traces file as each process finishes its part of it)", file=sys.stderr)
        return 1
    t = matches[0]
    if len(matches) > 1:
        print(f"({len(matches)} traces carry this id; showing the newest)\n")
    print(render_waterfall(t, args.width))
    print()
    if note := render_incomplete(t):
        print(note)
    print(render_breakdown(t))
    if spec := render_speculation(t):
        print(spec)
    if args.html:
        _write_html(args.html, [t])
    return 0


def _write_html(path: str, traces: list[Trace]) -> None:
    from pdserve.trace_html import render_html

    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(traces))
    print(f"\nwrote {path}")
