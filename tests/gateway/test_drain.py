"""SIGTERM: the gateway stops taking requests, lets the in-flight stream
finish, and exits 0."""
from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gateway.conftest import SCRIPT_TEXT


def test_sigterm_drains_in_flight_streams(cluster):
    gw, fake = cluster.drain, cluster.fake_local
    fake.state.knobs.token_delay = 0.1  # ~1 s for the whole script
    events: list[str] = []
    got_first = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", gw.http_url + "/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 60, "stream": True}) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    got_first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert got_first.wait(10)
    gw.terminate()
    with grpc.insecure_channel(gw.grpc_address) as ch:  # gRPC stays up while draining, NOT_SERVING
        deadline = time.monotonic() + 5
        while True:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING or time.monotonic() > deadline:
                break
            time.sleep(0.02)
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    reader.join(20)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == SCRIPT_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert gw.proc.wait(20) == 0
    assert not fake.state.active
