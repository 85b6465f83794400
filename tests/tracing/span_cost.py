"""CPU cost of one request's spans, measured in one process:
``python -m tests.tracing.span_cost [N] [OTLP_GRPC_ENDPOINT]``.

Builds what a request records in all three services (the gateway's request,
tokenize, route, two engine calls and detokenize through ``RequestTrace``;
the prefill and decode engine spans through ``record_engine_spans``: 17
spans, the HTTP server span aside) N times, exports them to a JSONL traces
file and, given an endpoint, over OTLP/gRPC (e.g. to ``python -m
tests.tracing.otlp_receiver``), and prints the process CPU time per request
(exporter threads included) with tracing on and off.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from engine.sampling_params import SamplingParams
from gateway.request_trace import RequestTrace
from rpc.tracing import TracingConfig, build_provider, record_engine_spans


def one_request(i: int, tracer: Any, provider: Any) -> None:
    rt = RequestTrace("text_completion", "m", {}, "http", tracer)
    with rt.span("tokenize"):
        pass
    with rt.span("route") as s:
        s.set_attributes({"pdserve.route.decode": "127.0.0.1:50071", "pdserve.route.prefill": "127.0.0.1:50061"})
    rt.on_prepared(f"cmpl-{i}", f"cmpl-{i}", 128, SamplingParams(max_tokens=32))
    decode = rt.start_span("pdserve.v1.Decode/Generate", SpanKind.CLIENT, {"rpc.system": "grpc"})
    rt.metadata(decode)
    prefill = rt.start_span("pdserve.v1.Prefill/Prefill", SpanKind.CLIENT, {"rpc.system": "grpc"})
    rt.metadata(prefill)
    prefill.end()
    rt.on_first_token(0.1)
    t = time.time()
    times = SimpleNamespace(arrival=t, reserved=t, first_scheduled=t, first_token=t, kv_send_start=t,
                            kv_send_end=t, kv_recv_start=t, kv_recv_end=t, finished=t)
    record_engine_spans("prefill", f"cmpl-{i}", trace.set_span_in_context(prefill), times,
                        {"num_prompt_tokens": 128, "kv_bytes": 1 << 20, "kv_seconds": 0.01, "kv_blocks": 8},
                        tracer_provider=provider)
    record_engine_spans("decode", f"cmpl-{i}", trace.set_span_in_context(decode), times,
                        {"num_output_tokens": 32, "finish_reason": "length"}, tracer_provider=provider)
    decode.end()
    rt.finish({"gen_ai.usage.output_tokens": 32, "pdserve.e2e_ms": 1.0})


def cpu_per_request(n: int, endpoint: str | None, on: bool) -> float:
    provider = None
    tracer: Any = trace.NoOpTracer()
    if on:
        traces = Path(tempfile.mkdtemp()) / "traces.jsonl"
        provider = build_provider(TracingConfig("span-cost", endpoint, "grpc", str(traces)))
        tracer = provider.get_tracer("span-cost")
    for i in range(200):  # warm up
        one_request(i, tracer, provider)
    if provider:
        provider.force_flush()
    start = time.process_time()
    for i in range(n):
        one_request(i, tracer, provider)
    if provider:
        provider.force_flush()
    cpu = (time.process_time() - start) / n
    if provider:
        provider.shutdown()
    return cpu


def main() -> None:
    # A tight loop makes spans far faster than a server does: queue them all
    # (the default queue of 2048 would drop most, and their cost with them).
    os.environ.setdefault("OTEL_BSP_MAX_QUEUE_SIZE", "1000000")
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    endpoint = sys.argv[2] if len(sys.argv) > 2 else None
    for on in (False, True, False, True):
        print(f"tracing {'on ' if on else 'off'}: {cpu_per_request(n, endpoint, on) * 1e6:7.0f} us CPU per request "
              f"({n} requests{', OTLP to ' + endpoint if on and endpoint else ''})")


if __name__ == "__main__":
    main()
