"""SIGTERM: the gateway stops taking requests (new ones are refused, none
reaches an engine server), lets the in-flight stream finish, and exits 0."""
from __future__ import annotations

import json
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.gateway.conftest import SCRIPT_TEXT

GATEWAY_SERVICE = "pdserve.v1.Gateway"


def _wait_not_serving(address: str) -> None:
    # The gateway marks its service NOT_SERVING, then starts draining; by the
    # time this answer has crossed the wire, draining has begun.
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 10
        while True:
            status = stub.Check(health_pb2.HealthCheckRequest(service=GATEWAY_SERVICE), timeout=5).status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                return
            assert time.monotonic() < deadline, "still SERVING after SIGTERM"
            time.sleep(0.02)


def test_sigterm_refuses_new_requests_and_drains_the_in_flight_stream(cluster):
    gw, fake = cluster.drain, cluster.fake_local
    release = threading.Event()
    fake.state.knobs.hold_after_first = release  # the stream stays in flight until released
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
    try:
        assert got_first.wait(10)
        gw.terminate()
        _wait_not_serving(gw.grpc_address)

        # gRPC keeps listening while draining and refuses with UNAVAILABLE.
        with grpc.insecure_channel(gw.grpc_address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
                    text="x", sampling=common_pb2.SamplingParams(max_tokens=4)), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in info.value.details()
        # HTTP stops listening; a request that still gets in is refused with 503.
        try:
            r = httpx.post(gw.http_url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=10)
        except httpx.TransportError:
            pass
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        assert len(fake.state.decode_requests) == 1  # nothing new reached the decode server
        assert reader.is_alive() and fake.state.active  # the first stream is still in flight
    finally:
        release.set()
    reader.join(20)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == SCRIPT_TEXT
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert gw.proc.wait(20) == 0
    assert not fake.state.active
