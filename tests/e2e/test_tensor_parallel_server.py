"""A colocated decode server with --tensor-parallel-size 3 (the default model's
9 heads and 3 KV heads over 3 ranks, gloo) serves through the gateway beside
a one-rank server; killing one of its worker processes takes it down
(NOT_SERVING, exit 1, its other workers gone) and the gateway keeps serving
from the other server."""
from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import EngineServer, GatewayProcess, pid_alive as _alive

pytestmark = pytest.mark.slow
FLAGS = ["--prefill-mode", "local", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]


def _workers(pid: int) -> list[int]:
    """The tensor-parallel worker processes a server spawned (not its resource tracker)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == pid and b"spawn_main" in cmdline and _alive(int(entry)):
            out.append(int(entry))
    return out


def _generate(gw: GatewayProcess, n: int) -> list[list[int]]:
    with grpc.insecure_channel(gw.grpc_address) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=list(range(100, 140))),
                                          sampling=common_pb2.SamplingParams(temperature=0, max_tokens=8,
                                                                             ignore_eos=True))
        return [[t for d in stub.Generate(req, timeout=120) for t in d.token_ids] for _ in range(n)]


def test_tp_server_serves_and_dies_cleanly_with_a_worker():
    tp = EngineServer("decode", [*FLAGS, "--tensor-parallel-size", "3"], name="decode-tp3")
    one = EngineServer("decode", FLAGS, name="decode-tp1")
    gw = GatewayProcess("gw", ["--decode", f"{tp.address},{one.address}", "--max-model-len", "1024"])
    try:
        for p in (tp, one, gw):
            p.wait_ready()
        gw.wait_healthy()
        outs = _generate(gw, 4)  # spread over both servers
        # Both served, and three ranks give the tokens of one (greedy, float32).
        assert tp.load().num_requests_finished > 0 and one.load().num_requests_finished > 0
        assert len(outs[0]) == 8 and outs == [outs[0]] * 4, outs
        workers = _workers(tp.proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[0], signal.SIGKILL)
        assert tp.proc.wait(30) == 1  # the watchdog saw the dead worker: NOT_SERVING, then exit
        deadline = time.monotonic() + 10
        while _alive(workers[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(workers[1])  # no orphan
        assert _generate(gw, 2) == [outs[0]] * 2  # the gateway routes around the dead server
    finally:
        codes = [p.stop() for p in (gw, one, tp)]
    assert codes[:2] == [0, 0], [p.logs() for p in (gw, one)]
