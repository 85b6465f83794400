"""`pdserve up` with two prefill and two decode servers, as a user runs it:
32 concurrent gRPC streams all complete with the offline engine's exact
greedy tokens, requests spread over both servers of each tier, no KV block
stays held, and Ctrl-C stops every process."""
from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from tests.processes import ServiceProcess

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
             "Say hello in Spanish.", "What do bees make?", "Which planet is red?",
             "Write one word about the sea.", "What is the opposite of hot?"]


def _port_base(count: int) -> int:
    """A base port with ``count`` consecutive free ports."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.fixture(scope="module")
def cluster():
    base = _port_base(6)
    ports = dict(http=base, grpc=base + 1, prefill=base + 2, decode=base + 4)
    up = ServiceProcess("up", "pdserve.cli", [
        "up", "--prefill", "2", "--decode", "2", "--http-port", str(ports["http"]),
        "--grpc-port", str(ports["grpc"]), "--prefill-port", str(ports["prefill"]),
        "--decode-port", str(ports["decode"]), "--kv-cache-memory", "64MiB",
        "--max-model-len", str(MAX_MODEL_LEN)], "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    up.wait_ready()
    yield up, ports
    if up.proc.poll() is None:
        up.stop()


def _generate(address: str, question: str) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(
            chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=question)]),
            sampling=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        tokens, finish = [], ""
        for delta in stub.Generate(req, timeout=300):
            tokens += delta.token_ids
            finish = delta.finish_reason or finish
        assert finish in ("stop", "length")
        return tokens


def _finished(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        for stub in (engine_pb2_grpc.DecodeStub(ch), engine_pb2_grpc.PrefillStub(ch)):
            try:
                return stub.GetLoad(common_pb2.LoadRequest(), timeout=5).num_requests_finished
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
    raise AssertionError(address)


def test_32_concurrent_streams_exact_and_spread(cluster):
    up, ports = cluster
    from engine import LLM

    llm = LLM(None, kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    expected = {q: llm.chat([{"role": "user", "content": q}], sp)[0].outputs[0].token_ids for q in QUESTIONS}
    del llm

    address = f"127.0.0.1:{ports['grpc']}"
    work = QUESTIONS * 4
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda q: _generate(address, q), work))
    assert [r for r in results] == [expected[q] for q in work]

    prefill = [f"127.0.0.1:{ports['prefill'] + i}" for i in range(2)]
    decode = [f"127.0.0.1:{ports['decode'] + i}" for i in range(2)]
    counts = {a: _finished(a) for a in prefill + decode}
    assert sum(counts[a] for a in decode) == 32 and sum(counts[a] for a in prefill) == 32
    assert all(counts[a] >= 4 for a in prefill + decode), counts  # both servers of each tier served
    # Later requests hit the decode servers' prefix caches (the chat template's
    # system prompt at least): those blocks are reserved from cache, not sent again.
    for q in QUESTIONS[:2]:
        assert _generate(address, q) == expected[q]
    hits = 0.0
    for a in decode:
        with grpc.insecure_channel(a) as ch:
            url = engine_pb2_grpc.DecodeStub(ch).GetLoad(common_pb2.LoadRequest(), timeout=5).metrics_url
        hits += sum(float(line.split(" ")[1]) for line in httpx.get(url, timeout=5).text.splitlines()
                    if line.startswith("pdserve:prefix_cache_hits_total"))
    assert hits > 0

    deadline = time.monotonic() + 10
    while True:
        inst = httpx.get(f"http://127.0.0.1:{ports['http']}/cluster").json()["instances"]
        if all(i["healthy"] and i["kv_blocks_used"] == 0 for i in inst):
            break
        assert time.monotonic() < deadline, inst
        time.sleep(0.3)
    assert len(inst) == 4


def test_ctrl_c_stops_every_process(cluster):
    up, _ = cluster
    children = _children(up.proc.pid)
    assert len(children) == 5  # 2 prefill + 2 decode + gateway
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(timeout=90) == 0
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{c}") and _state(c) != "Z" for c in children):
        assert time.monotonic() < deadline, "orphaned server processes"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
