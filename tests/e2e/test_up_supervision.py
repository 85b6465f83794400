"""`pdserve up` supervises its servers: a decode server killed outright is
started again and serves; one that keeps dying past --max-restarts stops the
cluster with a clear message and no process left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from rpc.health_probe import is_serving
from tests.e2e.test_cluster_up import UpProcess, _children, _port_base
from tests.processes import pid_alive

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
        assert "restarted 1 times; giving up" in up.log_text()
        _wait(lambda: not _children(up.proc.pid), 30, "servers left behind")
    finally:
        if up.proc.poll() is None:
            up.stop()


def test_sigkill_of_up_itself_leaves_no_server_behind():
    """`pdserve up` killed outright runs no cleanup of its own: its servers must go anyway
    (they die with their parent), none left serving on its ports."""
    base = _port_base(4)
    up = UpProcess("up-killed", "pdserve.cli", [
        "up", "--prefill-mode", "local", "--decode", "1", "--http-port", str(base), "--grpc-port", str(base + 1),
        "--decode-port", str(base + 2), "--kv-cache-memory", "64MiB", "--max-model-len", "512"],
        "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    children: list[int] = []
    try:
        up.wait_ready()
        children = _children(up.proc.pid)
        assert len(children) == 2  # the decode server and the gateway
        up.proc.kill()
        assert up.proc.wait(timeout=30) == -signal.SIGKILL
        _wait(lambda: not any(pid_alive(c) for c in children), 60, "servers orphaned by a SIGKILLed pdserve up")
        assert not is_serving(f"127.0.0.1:{base + 2}", timeout=1.0)
    finally:
        if up.proc.poll() is None:
            up.stop()
        for pid in children:  # what this test started, if the check above failed
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


class _Clock:
    """The supervisor's monotonic clock, moved by hand (wall time stays real for stop())."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


def test_restart_backoff_doubles_and_the_count_resets_once_a_server_stayed_up(monkeypatch):
    """The supervisor's policy on a fake clock (the servers are plain processes that live
    until killed): restart 1 s, 2 s, 4 s after each death, give up past --max-restarts, and
    count again from zero once a restarted server has stayed up for a minute."""
    from pdserve.cli import up as up_module
    from pdserve.cli import build_parser

    clock = _Clock()
    monkeypatch.setattr(up_module, "time", clock)
    monkeypatch.setattr(up_module, "_spawn", lambda argv, threads, env: subprocess.Popen(
        ["sleep", "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    args = build_parser("up").parse_args(["up", "--max-restarts", "3"])
    cluster = up_module.Cluster(args)
    cluster._launch("decode-0", "decode-0", "decode", ["decode"], None, {}, 8)

    def kill() -> subprocess.Popen:
        proc = cluster.procs[0][1]
        proc.kill()
        proc.wait()
        return proc

    def restarted_after(delay: float) -> None:
        """Dead now: not started again before ``delay`` seconds, started at ``delay``."""
        dead = kill()
        assert cluster.supervise() is None and cluster.procs[0][1] is dead  # the death is noted now
        clock.now += delay - 0.01
        assert cluster.supervise() is None and cluster.procs[0][1] is dead
        clock.now += 0.01
        assert cluster.supervise() is None and cluster.procs[0][1] is not dead
        assert cluster.procs[0][1].poll() is None

    try:
        restarted_after(1.0)
        restarted_after(2.0)
        clock.now += 59  # up, but not for a minute yet: the count stays
        assert cluster.supervise() is None and cluster.restarts == {0: 2}
        restarted_after(4.0)
        clock.now += 61  # stayed up: the next death counts from zero again
        assert cluster.supervise() is None and cluster.restarts == {}
        restarted_after(1.0)
        restarted_after(2.0)
        restarted_after(4.0)
        kill()
        assert cluster.supervise() == "decode-0 exited with code -9 and was restarted 3 times; giving up"
    finally:
        cluster.stop(grace=5)
