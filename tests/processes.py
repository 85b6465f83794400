"""Service processes for tests: ``python -m <module> ...`` with its stdout
watched for the ready line and its stderr kept in a log file."""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 180.0


# Ports for servers the tests start. Not the kernel's bind(0) choice: that port is free only
# until the server binds it seconds later, and meanwhile any outgoing connection (or another
# bind(0)) on the machine may take it. These come from below the ephemeral range, where the
# kernel never picks, from a slice of their own for each pytest-xdist worker (so two workers
# never hand out the same port), walked upward from a random start and never handed out twice
# by one process; each is checked free (bound, without SO_REUSEADDR) when handed out.
_EPHEMERAL_FLOOR = 32768  # Linux's default net.ipv4.ip_local_port_range starts here
_PORTS_FLOOR = 10000
_ports_lock = threading.Lock()
_ports_given: set[int] = set()
_ports_next: int | None = None


def _port_slice() -> tuple[int, int] | None:
    """This process's [low, high) ports, or None where the ephemeral range leaves too few below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = _EPHEMERAL_FLOOR
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    workers = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1), index + 1)
    span = (ephemeral_low - _PORTS_FLOOR) // workers
    if span < 2000:
        return None
    low = _PORTS_FLOOR + index * span
    return low, low + span


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback ports, free now and handed out to nobody
    else in this test run. The ``count`` ports 1000 above them are checked and kept too: an
    engine server serves /metrics there unless told otherwise (as under `pdserve up`)."""
    global _ports_next
    span = _port_slice()
    with _ports_lock:
        if span is None:  # no room below the ephemeral range: ask the kernel
            if count == 1:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    return s.getsockname()[1]
            raise RuntimeError("no port range below net.ipv4.ip_local_port_range for consecutive ports")
        low, high = span
        size = high - low
        if _ports_next is None:
            _ports_next = low + random.Random(os.getpid() ^ time.time_ns()).randrange(size)
        for _ in range(size):
            base = _ports_next
            _ports_next = low + (base + count - low) % size
            ports = [base + off + i for off in (0, 1000) for i in range(count)]
            if ports[-1] >= high or any(p in _ports_given for p in ports):
                continue
            if all(_is_free(p) for p in ports):
                _ports_given.update(ports)
                return base
        raise RuntimeError(f"no {count} free consecutive ports in {low}-{high}")


def free_port() -> int:
    """A loopback port that is free and handed out to nobody else in this test run."""
    return free_ports(1)


def metric_total(metrics_url: str, name: str) -> float:
    """Counter or gauge ``name`` of a server's Prometheus page, summed over its labels."""
    import httpx

    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))



def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Every process the helpers below start, for the session-end check (tests/conftest.py) and
# the clean-up of a failed fixture or test. Each is started in a session (so a process group)
# of its own, whose id is its pid: stopping it, or sweeping up after it, kills the whole group,
# and so the processes it started itself (tensor-parallel ranks, the servers of `pdserve up`),
# which no test starts in a session of their own. Per process: each pytest-xdist worker keeps
# its own and checks its own.
KILL_GRACE_S = 10.0  # how long a process stopped on a failure path gets after SIGTERM
_started: list["ServiceProcess"] = []
_started_lock = threading.Lock()


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2]), int(fields[19])


def _group_members(pgid: int, since: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid`` started at or after
    ``since`` (the group leader's start time: a group id reused later is not this group)."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) and st[1] == pgid and st[0] != "Z" and st[2] >= since:
            members.append(int(entry))
    return members


def started_processes() -> list["ServiceProcess"]:
    """Every ServiceProcess this process has started (in start order)."""
    with _started_lock:
        return list(_started)


def leftovers(procs: list["ServiceProcess"] | None = None) -> dict["ServiceProcess", list[int]]:
    """Of ``procs`` (default: all started), those with a process of their group still alive,
    with those pids."""
    out = {}
    for p in started_processes() if procs is None else procs:
        if members := p.group_alive():
            out[p] = members
    return out


def kill_all(procs: list["ServiceProcess"] | None = None) -> dict["ServiceProcess", list[int]]:
    """SIGKILL the groups of ``procs`` (default: all started) still alive; returns what was alive."""
    alive = leftovers(procs)
    for p in alive:
        p.kill_group()
    return alive


atexit.register(kill_all)  # an interrupted run (KeyboardInterrupt, an internal error) leaves none

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
        self.argv = [sys.executable, "-m", module, *argv]
        self.proc = subprocess.Popen(self.argv, cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=full_env, start_new_session=True)
        st = _stat(self.proc.pid)
        self._start_ticks = st[2] if st else 0
        with _started_lock:
            _started.append(self)
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

    def log_text(self) -> str:
        """All the process has logged so far."""
        self.log.flush()
        return Path(self.log.name).read_text()

    def logs(self) -> str:
        """The tail of its log, headed by its name: for a failure's message."""
        return f"--- {self.name} ({self.log.name}) ---\n" + self.log_text()[-6000:]

    def terminate(self) -> None:
        """Send SIGTERM once (a second one would kill a process that is draining)."""
        if not self._terminated and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self._terminated = True

    def group_alive(self) -> list[int]:
        """The live processes of its process group: itself and what it started (and left)."""
        return _group_members(self.proc.pid, self._start_ticks)

    def kill_group(self) -> None:
        """SIGKILL its whole process group, reap it, and wait (a few seconds at most) until
        the rest of the group (children, reaped by whoever adopted them) is gone too."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self, grace: float = KILL_GRACE_S) -> None:
        """For a failure path: SIGTERM, and SIGKILL to the whole group after ``grace`` seconds
        (or at once when it has exited and left processes of its group behind). Never raises."""
        try:
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)
        finally:
            if self.group_alive():
                self.kill_group()

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then the exit code (killed, with its group, and raising, after ``timeout``).
        Whatever its group still holds once it has exited (children it left) is killed."""
        self.terminate()
        try:
            code = self.proc.wait(timeout=timeout)
        except BaseException:  # TimeoutExpired, or an interrupt while waiting
            self.kill_group()
            raise
        if self.group_alive():
            self.kill_group()
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


def wait_for(condition, what: str, timeout: float = 30.0):
    """Poll ``condition()`` every 50 ms until it is truthy and return its value; fail naming
    ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return result


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
    except BaseException:
        for p in procs:  # every one, whatever the first's stop does
            p.kill()
        raise
    codes = stop_all(procs)
    assert codes == [0] * len(procs), [p.logs() for p in procs]


def stop_all(procs: list[ServiceProcess], timeout: float = 60.0) -> list[int]:
    """SIGTERM to every one at once (as ``pdserve up`` passes a Ctrl-C on: a prefill server
    closes its KV pairs while its decode peers stop), then ``stop()`` each in turn, every one
    stopped (killed, with its group) even where an earlier one's stop raised; the exit codes,
    or the first error once all are stopped."""
    for p in procs:
        p.terminate()
    codes, error = [], None
    for p in procs:
        try:
            codes.append(p.stop(timeout))
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others
            p.kill(grace=0)
            error = error or exc
    if error is not None:
        raise error
    return codes
