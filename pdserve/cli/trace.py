"""`pdserve trace`: where a request's time went, from its OpenTelemetry spans.

    pdserve trace REQUEST_ID             waterfall across services + time-to-first-token breakdown
    pdserve trace --slowest N [--by e2e] the slowest requests (by TTFT, or end to end)
    pdserve trace REQUEST_ID --html F    the same as a self-contained timeline page

Spans come from the traces file ``pdserve up`` writes (``--traces-file``,
default ``rpc.tracing.default_traces_file()``) or from Jaeger's HTTP query
API (``--jaeger-url http://localhost:16686``). How a request is found and how
its time to first token is split: trace_model.py. This module renders the text
and runs the command; trace_html.py renders the page.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import urllib.request
from typing import Any

from pdserve.cli.trace_model import (GATEWAY_SERVICE, Trace, find_request, from_jaeger, load_file, slowest,
                                     ttft_breakdown)


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


def render_seams(t: Trace) -> str:
    """A migrated request's seams, one line each: where its stream left a decode server that
    died or hung (the root span's "migration" events) and which one it resumed on (the next
    attempt's "route" span). Empty for a request that never moved."""
    events = [e for e in t.root.events if e.get("name") == "migration"]
    if not events:
        return ""
    resumed_on: dict[int, str] = {}
    for s in sorted(t.spans, key=lambda s: s.start_ns):  # the last attempt of each migration served it
        if s.name == "route" and "pdserve.route.migration" in s.attributes:
            resumed_on[int(s.attributes["pdserve.route.migration"])] = str(s.attributes.get("pdserve.route.decode"))
    lines = []
    for e in events:
        a = e.get("attributes") or {}
        n = int(a.get("pdserve.migration", 0))
        lines.append(f"seam {n} at {(int(e['time_ns']) - t.start_ns) / 1e6:.1f} ms: decode server "
                     f"{a.get('pdserve.migration.from')} lost ({a.get('pdserve.migration.cause')}) after "
                     f"{a.get('pdserve.migration.resume_tokens')} tokens; resumed on decode server "
                     f"{resumed_on.get(n, '(none)')}")
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
    if seams := render_seams(t):
        print(seams + "\n")
    if note := render_incomplete(t):
        print(note)
    print(render_breakdown(t))
    if spec := render_speculation(t):
        print(spec)
    if args.html:
        _write_html(args.html, [t])
    return 0


def _write_html(path: str, traces: list[Trace]) -> None:
    from pdserve.cli.trace_html import render_html

    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(traces))
    print(f"\nwrote {path}")
