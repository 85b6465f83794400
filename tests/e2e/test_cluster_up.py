"""`pdserve up` with two prefill and two decode servers, as a user runs it:
every server's output prefixed with its name and one ready banner after all
of them; 16 concurrent gRPC streams all complete with the offline engine's
exact greedy tokens, requests spread over both servers of each tier, no KV
block stays held; a second engine server or `pdserve up` on its ports exits
naming them (tests/e2e/test_port_exclusive.py: why) and it goes on serving;
Ctrl-C with streams in flight lets each of them finish and stops every process."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest

from engine.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from rpc.health_probe import is_serving
from tests.processes import ServiceProcess, free_port, free_ports

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
SERVERS = ("prefill-0", "prefill-1", "decode-0", "decode-1", "gateway")
QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?",
             "Say hello in Spanish.", "What do bees make?", "Which planet is red?",
             "Write one word about the sea.", "What is the opposite of hot?"]
# The second servers' flags (tests/e2e/test_port_exclusive.py's too).
ENGINE = ["--kv-cache-memory", "64MiB", "--max-model-len", "512"]
EXIT_TIMEOUT_S = 90.0  # a server that wrongly starts loads its model and serves: it never exits by itself


def _port_base(count: int) -> int:
    """A base port with ``count`` consecutive free ports (and the ``count`` 1000 above them,
    the servers' metrics ports)."""
    return free_ports(count)


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


class UpProcess(ServiceProcess):
    """`pdserve up`, keeping every line of its stdout (its stderr is in ``log``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stdout_lines: list[str] = []

    def wait_ready(self) -> str:
        while not self.ready_line:
            line = self._lines.get(timeout=300)
            assert line is not None, f"pdserve up exited ({self.proc.wait()}):\n{self.logs()}"
            self.stdout_lines.append(line.rstrip("\n"))
            if line.startswith(self.ready_prefix):
                self.ready_line = line.strip()
        return self.ready_line

    def rest_of_stdout(self) -> list[str]:
        """Every stdout line after the ready line (call once the process has exited)."""
        out = []
        while (line := self._lines.get(timeout=10)) is not None:
            out.append(line.rstrip("\n"))
        return out


@pytest.fixture(scope="module")
def cluster():
    base = _port_base(6)
    ports = dict(http=base, grpc=base + 1, prefill=base + 2, decode=base + 4)
    up = UpProcess("up", "pdserve.cli", [
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


def test_16_concurrent_streams_exact_and_spread(cluster):
    up, ports = cluster
    from engine import LLM

    llm = LLM(None, kv_cache_memory="64MiB", max_model_len=MAX_MODEL_LEN)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], sp)  # one batch
    expected = {q: o.outputs[0].token_ids for q, o in zip(QUESTIONS, outs)}
    del llm

    address = f"127.0.0.1:{ports['grpc']}"
    work = QUESTIONS * 2
    with ThreadPoolExecutor(len(work)) as pool:
        results = list(pool.map(lambda q: _generate(address, q), work))
    assert [r for r in results] == [expected[q] for q in work]

    prefill = [f"127.0.0.1:{ports['prefill'] + i}" for i in range(2)]
    decode = [f"127.0.0.1:{ports['decode'] + i}" for i in range(2)]
    counts = {a: _finished(a) for a in prefill + decode}
    assert sum(counts[a] for a in decode) == len(work) and sum(counts[a] for a in prefill) == len(work)
    assert all(counts[a] >= 2 for a in prefill + decode), counts  # both servers of each tier served
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


def test_output_is_prefixed_and_the_banner_comes_once_after_every_server(cluster):
    up, _ = cluster
    before = up.stdout_lines
    assert before[-1].startswith("pdserve ready") and sum(line.startswith("pdserve ready") for line in before) == 1
    # Each engine server's own ready line, under its name, before the banner.
    for name in SERVERS[:4]:
        role = name.split("-")[0]
        assert sum(line.startswith(f"{name:<9} | {role} server ready on ") for line in before) == 1, before
    assert not any("gateway ready" in line for line in before)  # the gateway's shows in its log, once
    log = Path(up.log.name).read_text().splitlines()
    assert sum(line.startswith("gateway   | ") and "gateway ready: http://" in line for line in log) == 1
    for name in SERVERS:  # every server's log lines carry its name
        assert any(line.startswith(f"{name:<9} | ") for line in log), name


def test_the_supervisor_holds_no_pytorch(cluster):
    """pdserve up starts and watches its servers: PyTorch (~240 MiB resident) is theirs alone; the
    supervisor asks a child process whether there is a GPU (--device auto, as here)."""
    up, _ = cluster
    maps = Path(f"/proc/{up.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps
    assert any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in _children(up.proc.pid))


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
    """The first cluster: alive, its first engine server of each tier SERVING, and a completion through it."""
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


def _stream(address: str, question: str, first: threading.Event, outcomes: queue.Queue,
            progress: list[int], k: int) -> None:
    tokens, finish = [], ""
    try:
        with grpc.insecure_channel(address) as ch:
            req = gateway_pb2.GenerateRequest(
                chat=gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=question)]),
                sampling=common_pb2.SamplingParams(temperature=0, max_tokens=IN_FLIGHT_TOKENS, ignore_eos=True))
            for delta in gateway_pb2_grpc.GatewayStub(ch).Generate(req, timeout=120):
                tokens += delta.token_ids
                progress[k] = len(tokens)
                finish = delta.finish_reason or finish
                first.set()
        outcomes.put((len(tokens), finish, None))
    except grpc.RpcError as e:
        outcomes.put((len(tokens), finish, e.code()))
    finally:
        first.set()


IN_FLIGHT_TOKENS = 40


def test_ctrl_c_with_streams_in_flight_finishes_them_and_stops_every_process(cluster):
    up, ports = cluster
    children = _children(up.proc.pid)
    assert len(children) == 5  # 2 prefill + 2 decode + gateway
    address = f"127.0.0.1:{ports['grpc']}"
    outcomes: queue.Queue = queue.Queue()
    started = [threading.Event() for _ in range(8)]
    progress = [0] * 8  # tokens each stream has received so far
    threads = [threading.Thread(target=_stream, args=(address, q, ev, outcomes, progress, k))
               for k, (q, ev) in enumerate(zip(QUESTIONS, started))]
    for t in threads:
        t.start()
    for ev in started:  # every stream is decoding
        assert ev.wait(120)
    at_signal = list(progress)
    up.proc.send_signal(signal.SIGINT)
    # Each stream still had tokens to come when Ctrl-C did: the drain below had work to do
    # (a stream already done would make the check below pass without testing it).
    assert all(0 < n < IN_FLIGHT_TOKENS for n in at_signal), at_signal
    for t in threads:
        t.join(120)
    results = [outcomes.get_nowait() for _ in threads]
    # Admitted before Ctrl-C, so drained to the end: every stream gets all its tokens.
    assert results == [(IN_FLIGHT_TOKENS, "length", None)] * len(threads), results
    assert up.proc.wait(timeout=90) == 0
    after = up.rest_of_stdout()
    assert "pdserve: stopping..." in after and not any(line.startswith("pdserve ready") for line in after)
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
