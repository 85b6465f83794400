"""Stands in for Jaeger in the compose test (its image cannot be pulled
here): OTLP in on Jaeger's ports, gRPC on 4317 and http/protobuf on 4318, and
the part of Jaeger's query API on 16686 that ``pdserve trace --jaeger-url``
reads (``GET /api/traces?service=&tags=&limit=``, ``GET /api/services``).

It runs inside pdserve's own image (grpcio and opentelemetry-proto are
there), mounted by tests/compose/docker-compose.test.yml. Standard library
and those two only; spans are kept in memory."""
from __future__ import annotations

import json
import threading
import urllib.parse
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {1: "OK", 2: "ERROR"}


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _tag(key: str, value: Any) -> dict[str, Any]:
    """A Jaeger tag (OTLP arrays arrive in Jaeger as JSON text, as here)."""
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, list):
        return {"key": key, "type": "string", "value": json.dumps(value)}
    return {"key": key, "type": "string", "value": str(value)}


class Store:
    """Received spans in Jaeger's JSON shape, grouped by trace id."""

    def __init__(self) -> None:
        self.traces: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    tags = [_tag(kv.key, _value(kv.value)) for kv in s.attributes]
                    tags.append(_tag("span.kind", _KINDS.get(s.kind, "internal")))
                    if s.status.code in _STATUS:
                        tags.append(_tag("otel.status_code", _STATUS[s.status.code]))
                    logs = [{"timestamp": e.time_unix_nano // 1000,
                             "fields": [_tag("event", e.name)] + [_tag(kv.key, _value(kv.value))
                                                                  for kv in e.attributes]} for e in s.events]
                    refs = ([{"refType": "CHILD_OF", "traceID": s.trace_id.hex(), "spanID": s.parent_span_id.hex()}]
                            if s.parent_span_id else [])
                    spans.append({"traceID": s.trace_id.hex(), "spanID": s.span_id.hex(), "operationName": s.name,
                                  "references": refs, "startTime": s.start_time_unix_nano // 1000,
                                  "duration": (s.end_time_unix_nano - s.start_time_unix_nano) // 1000,
                                  "tags": tags, "logs": logs, "service": service})
        with self._lock:
            for span in spans:
                self.traces.setdefault(span["traceID"], []).append(span)

    def services(self) -> list[str]:
        with self._lock:
            return sorted({s["service"] for spans in self.traces.values() for s in spans})

    def find(self, service: str, tags: dict[str, str], limit: int) -> list[dict[str, Any]]:
        """Traces with a span of ``service`` carrying every tag (Jaeger's /api/traces), newest first."""
        with self._lock:
            traces = {tid: list(spans) for tid, spans in self.traces.items()}
        found = []
        for tid, spans in traces.items():
            for s in spans:
                values = {t["key"]: str(t["value"]) for t in s["tags"]}
                if (not service or s["service"] == service) and all(values.get(k) == str(v) for k, v in tags.items()):
                    found.append((max(x["startTime"] for x in spans), tid, spans))
                    break
        found.sort(reverse=True)
        return [_jaeger_trace(tid, spans) for _, tid, spans in found[:limit]]


def _jaeger_trace(trace_id: str, spans: list[dict[str, Any]]) -> dict[str, Any]:
    processes = {f"p{i}": {"serviceName": name, "tags": []}
                 for i, name in enumerate(sorted({s["service"] for s in spans}), 1)}
    pid = {p["serviceName"]: key for key, p in processes.items()}
    return {"traceID": trace_id, "processes": processes,
            "spans": [{**{k: v for k, v in s.items() if k != "service"}, "processID": pid[s["service"]]}
                      for s in spans]}


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: Store) -> None:
        self.store = store

    def Export(self, request, context):  # noqa: N802 - the proto's name
        self.store.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def _handler(store: Store) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path != "/v1/traces":
                self._send(404, b"{}")
                return
            store.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self._send(200, trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                       "application/x-protobuf")

        def do_GET(self) -> None:  # noqa: N802
            url = urllib.parse.urlparse(self.path)
            q = dict(urllib.parse.parse_qsl(url.query))
            if url.path == "/api/services":
                data: Any = store.services()
            elif url.path == "/api/traces":
                data = store.find(q.get("service", ""), json.loads(q.get("tags") or "{}"), int(q.get("limit", 20)))
            else:
                self._send(404, b"{}")
                return
            self._send(200, json.dumps({"data": data}).encode())

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def main() -> None:
    store = Store()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(store), server)
    server.add_insecure_port("0.0.0.0:4317")
    server.start()
    for port in (4318, 16686):
        http = ThreadingHTTPServer(("0.0.0.0", port), _handler(store))
        threading.Thread(target=http.serve_forever, daemon=True).start()
    print("OTLP stand-in for Jaeger: OTLP gRPC :4317, http/protobuf :4318, query API :16686", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
