"""A real decode server process, driven over gRPC: metrics, health and
reflection, the KV channel handshake and a setup that never completes,
reservation back-pressure, the KV wait counted from prefill start, client
cancel and abort in each state, and SIGTERM drain. Every case checks no block is left held."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc
from tests.processes import ServiceProcess, free_port, metric_total

SP = common_pb2.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)



@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    port, mport = free_port(), free_port()
    # 40 blocks of 16 tokens, at most 2 requests waiting for blocks, KV timeout 1.5 s; decode
    # steps paced at 10 ms (the hidden --test-step-delay), so a stream outlives the RPCs about it
    proc = ServiceProcess("decode", "decode_service.server",
                          ["--port", str(port), "--metrics-port", str(mport), "--model", str(tiny_llama_dir),
                           "--num-gpu-blocks-override", "40", "--max-queued-requests", "2",
                           "--kv-transfer-timeout", "1.5", "--test-step-delay", "0.01"], "decode server ready", env={"OMP_NUM_THREADS": "1"})
    proc.wait_ready()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield proc, engine_pb2_grpc.DecodeStub(channel), channel, mport
    channel.close()
    if proc.proc.poll() is None:
        proc.stop()


def _load(stub) -> common_pb2.LoadInfo:
    return stub.GetLoad(common_pb2.LoadRequest(), timeout=10)


def _wait_idle(stub) -> None:
    deadline = time.monotonic() + 10
    while (info := _load(stub)).kv_blocks_used or info.num_running or info.num_waiting:
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def test_health_reflection_and_metrics(server, tiny_llama_dir):
    proc, stub, channel, mport = server
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Decode"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert {"pdserve.v1.Decode", "grpc.health.v1.Health"} <= names

    def metrics() -> tuple[dict[str, float], str]:
        text = httpx.get(f"http://127.0.0.1:{mport}/metrics", timeout=10).text
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line.startswith("pdserve:")}, text

    before, finished = metrics()[0], _load(stub).num_requests_finished
    # A prompt of its own (no prefix-cache hit from an earlier test), 20 tokens, 5 generated.
    for _ in stub.Generate(engine_pb2.DecodeRequest(request_id="m1", prompt_token_ids=list(range(300, 320)),
                                                    sampling=SP), timeout=60):
        pass
    info = _load(stub)
    assert info.metrics_url == f"http://127.0.0.1:{mport}/metrics"
    assert info.num_requests_finished == finished + 1
    lines, text = metrics()
    key = f'{{model_name="{tiny_llama_dir.name}",role="decode"}}'
    # Exact increments: one request counted once (a counter bumped twice would show here).
    for name, n in (("prompt_tokens_total", 20), ("generation_tokens_total", 5),
                    ("prefix_cache_queries_total", 20), ("prefix_cache_hits_total", 0)):
        assert lines["pdserve:" + name + key] - before.get("pdserve:" + name + key, 0.0) == n, name
    assert "pdserve:kv_cache_usage_perc" + key in lines and "pdserve:num_preemptions_total" + key in lines
    info = [line for line in text.splitlines() if line.startswith("pdserve:engine_config_info{")]
    assert len(info) == 1 and 'tensor_parallel_size="1"' in info[0] and 'device="cpu"' in info[0]
    _wait_idle(stub)


def test_mismatched_kv_layout_is_refused_with_the_field_named(server):
    _, stub, _, _ = server
    bad = engine_pb2.KVLayout(model="other", dtype="float32", block_size=32, num_layers=3, num_kv_heads=2,
                              head_dim=16)
    with pytest.raises(grpc.RpcError) as err:
        stub.OpenKVChannel(engine_pb2.OpenKVChannelRequest(peer="p:1", layout=bad, device="cpu"), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size" in err.value.details() and "model" in err.value.details()


def _reserve(stub, rid: str, prompt: list[int]):
    return stub.Generate(engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=SP,
                                                  remote_prefill=True), timeout=60)


def test_reservation_backpressure_kv_wait_and_abort(server):
    _, stub, _, _ = server
    long_prompt = [3 + i % 300 for i in range(16 * 30)]  # 30 of the 40 blocks
    held = _reserve(stub, "r1", long_prompt)
    assert len(next(held).reserved.block_ids) == 30
    t_reserved = time.monotonic()
    # Next two wait for blocks (queue of 2); the third is refused at once.
    # Each call is sent only once the one before it is queued: two streams in
    # flight together may reach the server in either order.
    waiting, got, threads = [], {}, []
    for i in range(2):
        waiting.append(_reserve(stub, f"w{i}", long_prompt))
        threads.append(threading.Thread(target=lambda i=i, w=waiting[i]: got.update({i: next(w)})))
        threads[i].start()
        deadline = time.monotonic() + 10
        while _load(stub).num_waiting < 2 + i:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        next(_reserve(stub, "x", long_prompt))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # A prefill that starts later than the KV timeout (1.5 s) after the
    # reservation does not find it gone: the KV wait counts from prefill start.
    time.sleep(max(0.0, t_reserved + 3.0 - time.monotonic()))
    assert stub.PrefillStarted(engine_pb2.PrefillStartedRequest(request_id="r1"), timeout=10).found
    assert not stub.PrefillStarted(engine_pb2.PrefillStartedRequest(request_id="w0"), timeout=10).found
    # No KV ever comes for r1: 1.5 s after its prefill start the blocks are freed and w0 gets them.
    with pytest.raises(grpc.RpcError) as err:
        next(held)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "no KV arrived from the prefill tier within 1.5s of its prefill start" in err.value.details()
    threads[0].join(10)
    assert len(got[0].reserved.block_ids) == 30
    waiting[0].cancel()  # client cancel frees w0; w1 gets the blocks; Abort frees them
    threads[1].join(10)
    assert len(got[1].reserved.block_ids) == 30
    assert stub.Abort(common_pb2.AbortRequest(request_id="w1"), timeout=10).found
    assert next(waiting[1]).delta.finish_reason == "abort"  # the stream ends in a defined way
    _wait_idle(stub)


def _generate(stub, rid: str, max_tokens: int):
    """A locally prefilled request on the decode server."""
    return stub.Generate(engine_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=list(range(3, 40)),
        sampling=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)), timeout=60)


def _generation_tokens(mport: int) -> float:
    return metric_total(f"http://127.0.0.1:{mport}/metrics", "pdserve:generation_tokens_total")


def test_running_request_cancelled_by_the_client_frees_its_blocks(server):
    _, stub, _, mport = server
    before = _generation_tokens(mport)
    # 37 + 470 tokens fit the model's 512 and the 40 blocks: left alone it runs 470 paced
    # steps (4.7 s), far longer than one GetLoad and the cancel take.
    stream = _generate(stub, "c1", 470)
    next(stream)
    info = _load(stub)  # one snapshot: running, holding blocks
    assert info.num_running == 1 and info.kv_blocks_used > 0, info
    stream.cancel()
    _wait_idle(stub)
    assert _generation_tokens(mport) - before < 470  # stopped by the cancel, not by max_tokens


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_kv_channel_whose_sender_never_comes_is_closed_and_forgotten(server, tiny_llama_dir):
    """The pair's setup times out: its thread must exit, not spin re-raising."""
    proc, stub, _, _ = server
    layout = engine_pb2.KVLayout(model=tiny_llama_dir.name, dtype="float32", block_size=16, num_layers=3,
                                 num_kv_heads=2, head_dim=16)
    ports = []
    for i in range(3):
        resp = stub.OpenKVChannel(engine_pb2.OpenKVChannelRequest(peer=f"ghost:{i}", layout=layout,
                                                                  device="cpu"), timeout=10)
        assert resp.port > 0 and resp.backend == "gloo"
        ports.append(resp.port)
    time.sleep(1.5 + 2.0)  # the setup deadline (the KV timeout) has passed for all three
    before = _cpu_seconds(proc.proc.pid)
    time.sleep(1.0)
    busy = _cpu_seconds(proc.proc.pid) - before
    assert busy < 0.3, f"the idle decode server used {busy:.2f} CPU-seconds in 1 s"
    for port in ports:  # each port is closed: nothing listens there any more
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    _wait_idle(stub)


def test_sigterm_drains_in_flight_stream(server):
    proc, stub, _, _ = server
    stream = _generate(stub, "d1", 60)
    first = next(stream)
    proc.proc.send_signal(signal.SIGTERM)
    tokens = list(first.delta.token_ids)
    finish = ""
    for m in stream:
        tokens += m.delta.token_ids
        finish = m.delta.finish_reason or finish
    assert finish == "length" and len(tokens) == 60  # finished, not cut off
    assert proc.proc.wait(timeout=60) == 0
