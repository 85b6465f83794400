"""`pdserve up` supervises its servers: a decode server killed outright is
started again and serves; one that keeps dying past --max-restarts stops the
cluster with a clear message and no process left behind."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from rpc.health_probe import is_serving
from tests.e2e.test_cluster_up import UpProcess, _children, _port_base

pytestmark = pytest.mark.slow


def _server_pid(up_pid: int, role: str) -> int | None:
    for pid in _children(up_pid):
        try:
            if f" {role} " in " " + Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "):
                return pid
        except OSError:  # exited meanwhile
            pass
    return None


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_dead_server_is_restarted_until_the_limit():
    base = _port_base(6)
    decode = f"127.0.0.1:{base + 4}"
    up = UpProcess("up-supervised", "pdserve.cli", [
        "up", "--prefill", "1", "--decode", "1", "--max-restarts", "1", "--http-port", str(base),
        "--grpc-port", str(base + 1), "--prefill-port", str(base + 2), "--decode-port", str(base + 4),
        "--kv-cache-memory", "64MiB", "--max-model-len", "512"], "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    try:
        up.wait_ready()
        first = _server_pid(up.proc.pid, "decode")
        assert first is not None
        os.kill(first, signal.SIGKILL)
        _wait(lambda: _server_pid(up.proc.pid, "decode") not in (None, first) and is_serving(decode, timeout=1.0),
              120, "the decode server was not started again")
        assert up.proc.poll() is None

        def answered() -> bool:
            r = httpx.post(f"http://127.0.0.1:{base}/v1/completions", timeout=60,
                           json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                                 "max_tokens": 4, "temperature": 0})
            return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

        _wait(answered, 30, "the restarted cluster did not serve")
        again = _server_pid(up.proc.pid, "decode")
        assert again is not None
        os.kill(again, signal.SIGKILL)  # again, before it counts as stable
        assert up.proc.wait(timeout=120) == 1
        assert "restarted 1 times; giving up" in up.logs()
        _wait(lambda: not _children(up.proc.pid), 30, "servers left behind")
    finally:
        if up.proc.poll() is None:
            up.stop()
