"""One port, one server. grpcio sets SO_REUSEPORT by default, which let a second
server bind a port already served, beside the first (and the kernel spread the
connections over both). Every server here binds exclusively: on a port in use
it exits non-zero with a message naming the port and the flag that changes it.
`pdserve up` checks all of its ports before it starts anything; a port taken after
that check stops the servers it started, and the message comes last. (A second
server or `pdserve up` on the ports of a running `pdserve up`, which goes on
serving: tests/e2e/test_cluster_up.py, on its cluster.)"""
from __future__ import annotations

import socket

import pytest

from rpc.ports import bind_error
from tests.e2e.test_cluster_up import ENGINE, EXIT_TIMEOUT_S, UpProcess, _exit_code, _last_line, _port_base
from tests.processes import ServiceProcess, free_port

pytestmark = pytest.mark.slow

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
