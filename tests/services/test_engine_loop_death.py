"""A decode server whose engine loop dies (the forward pass fails, injected
with the hidden --inject-forward-fault flag) says so on its health service
(NOT_SERVING), ends the open stream with an error instead of leaving it
hanging, and exits with a non-zero code so that a supervisor restarts it."""
from __future__ import annotations

import queue
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.processes import ServiceProcess, free_port

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
FORWARDS_BEFORE_FAULT = 2


def test_engine_loop_death_reports_not_serving_and_exits(tiny_llama_dir):
    port = free_port()
    proc = ServiceProcess("decode-fault", "decode_service.server",
                          ["--port", str(port), "--metrics-port", "0", "--model", str(tiny_llama_dir),
                           "--inject-forward-fault", str(FORWARDS_BEFORE_FAULT)],
                          "decode server ready", env={"OMP_NUM_THREADS": "1"})
    try:
        proc.wait_ready()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        # Watch streams every status change: NOT_SERVING cannot slip between two polls.
        statuses: queue.Queue = queue.Queue()

        def watch() -> None:
            try:
                for r in health_pb2_grpc.HealthStub(channel).Watch(
                        health_pb2.HealthCheckRequest(service="pdserve.v1.Decode"), timeout=60):
                    statuses.put(r.status)
            except grpc.RpcError as e:
                statuses.put(e.code())

        threading.Thread(target=watch, daemon=True).start()
        assert statuses.get(timeout=10) == SERVING

        stream = engine_pb2_grpc.DecodeStub(channel).Generate(engine_pb2.DecodeRequest(
            request_id="doomed", prompt_token_ids=list(range(3, 20)), remote_prefill=False,
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)), timeout=30)
        tokens = []
        with pytest.raises(grpc.RpcError) as info:
            for msg in stream:
                tokens += msg.delta.token_ids
        # The forward passes before the fault produced tokens; the stream then failed.
        assert 1 <= len(tokens) <= FORWARDS_BEFORE_FAULT, tokens
        # UNAVAILABLE (the server stops and cancels its calls): what a caller retries elsewhere.
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value

        assert statuses.get(timeout=10) == NOT_SERVING
        assert proc.proc.wait(timeout=30) != 0
        assert "InjectedFault" in proc.log_text()  # the log says why it stopped
        channel.close()
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()


def test_no_environment_variable_arms_the_fault(tiny_llama_dir, monkeypatch):
    """The variable that once armed it, inherited by every server `pdserve up` starts, is
    inert: an engine built with it set serves normally."""
    from engine import LLM, SamplingParams

    monkeypatch.setenv("PDSERVE_FAULT_FORWARD_FAILS_AFTER", "0")
    out = LLM(str(tiny_llama_dir), kv_cache_memory="4MiB").generate(
        [[3, 4, 5]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
