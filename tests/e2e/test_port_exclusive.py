"""One port, one server. grpcio sets SO_REUSEPORT by default, which let a second
server bind a port already served, beside the first (and the kernel spread the
connections over both). Every server here binds exclusively: on a port in use
it exits non-zero with a message naming the port and the flag that changes it,
and the server already there goes on serving. `pdserve up` checks all of its
ports before it starts anything; a port taken after that check stops the
servers it started, and the message comes last."""
from __future__ import annotations

import socket
import subprocess
import time

import httpx
import pytest

from rpc.health_probe import is_serving
from rpc.ports import bind_error
from tests.e2e.test_cluster_up import UpProcess, _children, _port_base
from tests.processes import ServiceProcess, free_port, free_ports

pytestmark = pytest.mark.slow

ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
EXIT_TIMEOUT_S = 90.0  # a server that wrongly starts loads its model and serves: it never exits by itself


@pytest.fixture(scope="module")
def cluster():
    """A running `pdserve up`: one prefill and one decode server (metrics on gRPC + 1000)."""
    base = _port_base(6)
    ports = dict(http=base, grpc=base + 1, prefill=base + 2, decode=base + 4)
    up = UpProcess("up-first", "pdserve.cli", [
        "up", "--prefill", "1", "--decode", "1", "--http-port", str(ports["http"]),
        "--grpc-port", str(ports["grpc"]), "--prefill-port", str(ports["prefill"]),
        "--decode-port", str(ports["decode"]), *ENGINE], "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    try:
        up.wait_ready()
        yield up, ports
    finally:
        if up.proc.poll() is None:
            assert up.stop() == 0, up.logs()


def _exit_code(proc: ServiceProcess, timeout: float = EXIT_TIMEOUT_S) -> int:
    """The exit code; a process still running after ``timeout`` (it started where it should
    not have) is stopped and the test fails."""
    try:
        return proc.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.proc.kill()
        proc.proc.wait()
        pytest.fail(f"{proc.name} did not exit within {timeout:.0f}s: it started on a port in use\n{proc.logs()}")


def _last_line(proc: ServiceProcess) -> str:
    lines = [line for line in proc.log_text().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _still_serves(up: UpProcess, ports: dict[str, int]) -> None:
    """The first cluster: alive, both engine servers SERVING, and a completion through it."""
    assert up.proc.poll() is None, up.logs()
    for role in ("prefill", "decode"):
        assert is_serving(f"127.0.0.1:{ports[role]}", timeout=5.0), role
    r = httpx.post(f"http://127.0.0.1:{ports['http']}/v1/completions", timeout=120,
                   json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is",
                         "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_a_second_engine_server_on_a_served_grpc_port_exits(cluster):
    up, ports = cluster
    port = ports["decode"]
    # Metrics off: only the gRPC port is shared (its default, gRPC + 1000, is taken too).
    second = ServiceProcess("second-decode", "decode_service.server",
                            ["--port", str(port), "--metrics-port", "0", *ENGINE], "decode server ready",
                            env={"OMP_NUM_THREADS": "1"})
    assert _exit_code(second) == 1, second.logs()
    assert _last_line(second) == (
        f"pdserve decode: error: cannot serve gRPC on 127.0.0.1:{port}: the port is already in use "
        "(another server listens on it); choose another port with --port"), second.logs()
    _still_serves(up, ports)


def test_a_second_engine_server_on_a_served_metrics_port_exits(cluster):
    up, ports = cluster
    metrics_port = ports["decode"] + 1000  # the cluster's decode server serves /metrics there
    second = ServiceProcess("second-decode-metrics", "decode_service.server",
                            ["--port", str(free_port()), "--metrics-port", str(metrics_port), *ENGINE],
                            "decode server ready", env={"OMP_NUM_THREADS": "1"})
    assert _exit_code(second) == 1, second.logs()
    assert _last_line(second) == (
        f"pdserve decode: error: cannot serve metrics on 127.0.0.1:{metrics_port}: the port is already in use "
        "(another server listens on it); choose another port with --metrics-port (0 turns the metrics "
        "endpoint off)"), second.logs()
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert 'pdserve:num_requests_running{model_name="SmolLM2-135M-Instruct",role="decode"}' in text
    _still_serves(up, ports)


def test_a_second_pdserve_up_names_the_taken_ports_and_starts_nothing(cluster):
    up, ports = cluster
    first_servers = sorted(_children(up.proc.pid))
    http, grpc_port = free_ports(1), free_ports(1)  # only the gateway's ports differ
    second = UpProcess("up-second", "pdserve.cli", [
        "up", "--prefill", "1", "--decode", "1", "--http-port", str(http), "--grpc-port", str(grpc_port),
        "--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"]), *ENGINE],
        "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    started: set[int] = set()
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while second.proc.poll() is None:  # watch for any process it starts
        started.update(_children(second.proc.pid))
        if time.monotonic() > deadline:
            second.proc.kill()
            pytest.fail(f"the second pdserve up did not exit\n{second.logs()}")
        time.sleep(0.02)
    assert second.proc.returncode == 1, second.logs()
    assert not started, f"the second pdserve up started processes {started}\n{second.logs()}"
    p, d = ports["prefill"], ports["decode"]
    assert second.log_text().strip().splitlines() == [
        "pdserve: error: cannot listen on these ports of 127.0.0.1 (nothing was started):",
        f"  {p:<5}  prefill-0 gRPC: in use; change --prefill-port",
        f"  {p + 1000:<5}  prefill-0 metrics: in use; change --prefill-port",
        f"  {d:<5}  decode-0 gRPC: in use; change --decode-port",
        f"  {d + 1000:<5}  decode-0 metrics: in use; change --decode-port",
        "  (an engine server's metrics port is its gRPC port + 1000)"], second.logs()
    assert second.rest_of_stdout() == []  # not even the traces file line: it exited before
    assert sorted(_children(up.proc.pid)) == first_servers
    _still_serves(up, ports)


def _hold(port: int) -> socket.socket:
    """A listening socket with SO_REUSEPORT, as grpcio binds its own by default."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


@pytest.mark.parametrize("server, flag, what", [
    ("decode", "--port", "gRPC"),
    ("prefill", "--port", "gRPC"),
    ("gateway", "--grpc-port", "gRPC"),
    ("gateway", "--http-port", "HTTP"),
])
def test_a_port_held_with_so_reuseport_fails_the_start(server, flag, what):
    port = free_port()
    held = _hold(port)
    try:
        if server == "gateway":  # the other port any free one
            other = "--http-port" if flag == "--grpc-port" else "--grpc-port"
            proc = ServiceProcess(f"gateway-{port}", "gateway.server",
                                  [flag, str(port), other, "0", "--decode", "127.0.0.1:1"], "gateway ready: ")
        else:
            proc = ServiceProcess(f"{server}-{port}", f"{server}_service.server",
                                  ["--port", str(port), "--metrics-port", "0", *ENGINE], f"{server} server ready",
                                  env={"OMP_NUM_THREADS": "1"})
        assert _exit_code(proc) == 1, proc.logs()
        assert _last_line(proc) == (
            f"pdserve {server}: error: cannot serve {what} on 127.0.0.1:{port}: the port is already in use "
            f"(another server listens on it); choose another port with {flag}"), proc.logs()
    finally:
        held.close()


def test_a_port_taken_while_pdserve_up_starts_stops_its_servers_and_says_so_last():
    """The race the check before starting cannot close: the gateway's HTTP port is taken
    after the check, before the gateway binds it."""
    base = _port_base(4)
    up = UpProcess("up-race", "pdserve.cli", [
        "up", "--prefill-mode", "local", "--decode", "1", "--http-port", str(base), "--grpc-port", str(base + 1),
        "--decode-port", str(base + 2), *ENGINE], "pdserve ready", env={"OMP_NUM_THREADS": "1"})
    held = None
    try:
        while True:  # its first line comes after the check, as the servers start
            line = up._lines.get(timeout=120)
            assert line is not None, f"pdserve up exited ({up.proc.wait()}):\n{up.logs()}"
            if line.startswith("traces file: "):
                break
        held = socket.create_server(("127.0.0.1", base))  # before the gateway (still importing) binds it
        assert up.proc.wait(timeout=EXIT_TIMEOUT_S) == 1, up.logs()
        lines = up.log_text().strip().splitlines()
        assert lines[-2:] == ["pdserve: error: cannot listen on these ports of 127.0.0.1 (the servers were stopped):",
                              f"  {base:<5}  gateway HTTP: in use; change --http-port"], up.logs()
        assert any(line.startswith("gateway") and "--http-port" in line for line in lines), up.logs()
        # Its decode server and gateway were stopped before it said so: their ports are free.
        for port in (base + 1, base + 2, base + 1002):
            assert bind_error("127.0.0.1", port) is None, port
    finally:
        if held is not None:
            held.close()
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()
