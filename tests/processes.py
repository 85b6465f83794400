"""Service processes for tests: ``python -m <module> ...`` with its stdout
watched for the ready line and its stderr kept in a log file."""
from __future__ import annotations

import contextlib
import functools
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180.0


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

class ServiceProcess:
    """A pdserve service subprocess; ``wait_ready`` returns its ready line."""

    def __init__(self, name: str, module: str, argv: list[str], ready_prefix: str,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.ready_prefix = ready_prefix
        self.ready_line = ""
        self._terminated = False
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"pdserve-{name}-", suffix=".log", delete=False)
        full_env = {k: v for k, v in os.environ.items() if k != "PDSERVE_API_KEY"}
        full_env.update(TOKENIZERS_PARALLELISM="false", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=full_env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self) -> str:
        while not self.ready_line:
            try:
                line = self._lines.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"{self.name} not ready in {READY_TIMEOUT_S}s:\n{self.logs()}") from None
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}):\n{self.logs()}")
            if line.startswith(self.ready_prefix):
                self.ready_line = line.strip()
        return self.ready_line

    def logs(self) -> str:
        self.log.flush()
        return f"--- {self.name} ({self.log.name}) ---\n" + Path(self.log.name).read_text()[-6000:]

    def terminate(self) -> None:
        """Send SIGTERM once (a second one would kill a process that is draining)."""
        if not self._terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self._terminated = True

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (killed, and raising, after ``timeout``)."""
        self.terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        if code == 0:  # keep the log only when something went wrong
            self.log.close()
            Path(self.log.name).unlink(missing_ok=True)
        return code


class EngineServer(ServiceProcess):
    """``python -m <role>_service.server`` on 127.0.0.1 at a free port (or
    ``port``), one torch thread (the suite's servers share two cores), with
    ``flags``; ``load()`` asks it over gRPC."""

    def __init__(self, role: str, flags: list[str], name: str | None = None, port: int | None = None,
                 metrics_port: int = 0, env: dict[str, str] | None = None) -> None:
        self.role, self.flags, self.env = role, list(flags), dict(env or {})
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        super().__init__(name or f"{role}-{self.port}", f"{role}_service.server",
                         ["--port", str(self.port), "--metrics-port", str(metrics_port), *self.flags],
                         f"{role} server ready", env={"OMP_NUM_THREADS": "1", **self.env})

    def restart(self) -> "EngineServer":
        """A new server with the same flags (and environment) on the same port (this one must have exited)."""
        return EngineServer(self.role, self.flags, self.name, self.port, env=self.env)

    @functools.cached_property
    def channel(self):  # -> grpc.Channel, one for the server's life
        import grpc

        return grpc.insecure_channel(self.address)

    def load(self):  # -> common_pb2.LoadInfo
        from pdserve.v1 import common_pb2, engine_pb2_grpc

        stub = engine_pb2_grpc.PrefillStub if self.role == "prefill" else engine_pb2_grpc.DecodeStub
        return stub(self.channel).GetLoad(common_pb2.LoadRequest(), timeout=10)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until it holds no KV block and runs and queues nothing."""
        import time

        deadline = time.monotonic() + timeout
        while (info := self.load()).kv_blocks_used or info.num_running or info.num_waiting:
            assert time.monotonic() < deadline, (self.name, info)
            time.sleep(0.05)


class GatewayProcess(ServiceProcess):
    """``python -m gateway.server`` on free ports; ``http_url`` and
    ``grpc_address`` come from its ready line."""

    def __init__(self, name: str, flags: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__(name, "gateway.server", ["--http-port", "0", "--grpc-port", "0", *flags],
                         "gateway ready: ", env)
        self.http_url = self.grpc_address = ""

    def wait_ready(self) -> str:
        line = super().wait_ready()
        parts = line.split()  # gateway ready: http://HOST:PORT grpc HOST:PORT
        self.http_url, self.grpc_address = parts[2], parts[4]
        return line

    def wait_healthy(self, timeout: float = 30.0, api_key: str | None = None) -> None:
        """Until the gateway has seen every engine server it knows healthy
        (``/health`` alone turns 200 with one decode server, before the
        prefill servers may have been polled)."""
        try:
            wait_every_instance_healthy(self.http_url, timeout, api_key)
        except RuntimeError as exc:
            raise RuntimeError(f"{self.name}: {exc}\n{self.logs()}") from None


def wait_every_instance_healthy(http_url: str, timeout: float = 60.0, api_key: str | None = None) -> None:
    """Until the gateway at ``http_url`` has seen every engine server it knows healthy (its
    /health, and `pdserve up`'s ready line, come with one decode server, before the prefill
    servers may have been polled: until then it prefills on the decode server)."""
    import time

    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while True:
        instances = httpx.get(http_url + "/cluster", headers=headers, timeout=10).json().get("instances", [])
        if instances and all(i["healthy"] for i in instances):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"not every engine server healthy after {timeout}s: {instances}")
        time.sleep(0.1)


@contextlib.contextmanager
def running_cluster(engines: list[ServiceProcess], gateway: GatewayProcess,
                    api_key: str | None = None) -> Iterator[GatewayProcess]:
    """Engine servers and a gateway, started, seen healthy by the gateway,
    then stopped (gateway first), each required to exit 0."""
    procs = [gateway, *engines]
    try:
        for p in (*engines, gateway):
            p.wait_ready()
        gateway.wait_healthy(api_key=api_key)
        yield gateway
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0] * len(procs), [p.logs() for p in procs]
