"""An OTLP trace receiver for tests, on loopback: the collector's gRPC
``TraceService/Export`` and the http/protobuf ``POST /v1/traces``, both
built on opentelemetry-proto's definitions. Received spans are flattened to
``ReceivedSpan``s with hex ids and plain attribute values.

``python -m tests.tracing.otlp_receiver [GRPC_PORT]`` runs one until Ctrl-C
(the tracing-overhead benchmark in docs/benchmarks.md exports to it) and
then says how many spans it received."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpReceiver:
    """Collects every span exported to it; ``grpc_endpoint`` / ``http_endpoint``."""

    def __init__(self, grpc_port: int = 0) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_requests = {"grpc": 0, "http": 0}
        self._lock = threading.Lock()
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._grpc)
        port = self._grpc.add_insecure_port(f"127.0.0.1:{grpc_port}")
        self.grpc_endpoint = f"http://127.0.0.1:{port}"
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body), "http")
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_endpoint = f"http://127.0.0.1:{self._http.server_address[1]}/v1/traces"

    def start(self) -> "OtlpReceiver":
        self._grpc.start()
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._grpc.stop(grace=None)
        self._http.shutdown()
        self._http.server_close()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest, via: str) -> None:
        out = []
        for rs in request.resource_spans:
            service = str(_attrs(rs.resource.attributes).get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    out.append(ReceivedSpan(s.trace_id.hex(), s.span_id.hex(),
                                            s.parent_span_id.hex() or None, s.name, service, s.kind,
                                            s.start_time_unix_nano, s.end_time_unix_nano, _attrs(s.attributes),
                                            [e.name for e in s.events]))
        with self._lock:
            self.spans.extend(out)
            self.num_requests[via] += 1

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[ReceivedSpan]:
        """Spans, once ``predicate(spans)`` holds (or after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):  # noqa: N802 - the proto's name
        self.receiver.add(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


if __name__ == "__main__":
    import sys

    receiver = OtlpReceiver(int(sys.argv[1]) if len(sys.argv) > 1 else 4317).start()
    print(f"OTLP receiver: grpc {receiver.grpc_endpoint}, http/protobuf {receiver.http_endpoint}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        print(f"received {len(receiver.spans)} spans in {receiver.num_requests} export requests")
    finally:
        receiver.stop()
