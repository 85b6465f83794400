"""`pdserve up`: the whole topology on one machine, one process per server.

Starts N prefill servers (ports from --prefill-port upward), M decode servers
(from --decode-port) and the gateway, waits until every one reports healthy,
prints the endpoints and a ready line. A server that dies is started again
(backoff 1 s doubling to 30 s, at most --max-restarts times in a row) while
the gateway routes around it. Ctrl-C (or SIGTERM) stops them all
gracefully; children also die with this process (PR_SET_PDEATHSIG), so none
is orphaned even if it is killed.

Before it starts anything it checks every port the cluster will listen on
(the gateway's HTTP and gRPC ports, each engine server's gRPC port and its
metrics port, gRPC + 1000): if one is taken (another cluster, say) it lists
which, with the flag that moves each, and exits 1 having started nothing.
Should a server still fail to start (a port taken meanwhile), the others are
stopped first and the reason printed last.

Every server's output is shown prefixed with its name, as docker compose
does (``prefill-0 | ...``); its stdout goes to ours and its stderr (the
logs) to ours. A server counts as ready once it answers health checks and
has printed its own ready line; the banner comes once, after all of them.
The gateway's printed ready line is not echoed: its log says the same.
"""
from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from engine.config import EngineArgs
from engine.sampling_params import MAX_N
from gateway.config import add_chat_args, add_migration_args, add_runtime_lora_args
from gateway.router import GPU_HOST_HIT_CREDIT, HOST_HIT_CREDIT
from pdserve.cli.openmp_spin import LIBGOMP_SPIN
from prefill_service.flags import add_kv_send_args
from rpc import ports, tls, tracing
from rpc.health_probe import is_serving
from rpc.local_redis import LocalRedis

_PR_SET_PDEATHSIG = 1
_BACKOFF_S, _BACKOFF_MAX_S = 1.0, 30.0
_STABLE_S = 60.0  # a server up this long has its restart count reset
# The line each kind of server prints on stdout once it serves.
_READY_PREFIX = {"prefill": "prefill server ready", "decode": "decode server ready", "gateway": "gateway ready: "}
_OUTPUT_LOCK = threading.Lock()  # whole lines only, from the servers' pumps and the banner


def say(text: str, file=None) -> None:
    """Print whole lines without interleaving them with the servers' output."""
    with _OUTPUT_LOCK:
        print(text, file=file or sys.stdout, flush=True)


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology")
    g.add_argument("--prefill", type=int, default=1, help="number of prefill servers")
    g.add_argument("--decode", type=int, default=1, help="number of decode servers")
    g.add_argument("--prefill-mode", choices=("disaggregated", "local"), default="disaggregated",
                   help="local: no prefill servers, decode servers prefill themselves (colocated baseline)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--http-port", "--port", type=int, default=8000,
                   help="gateway OpenAI HTTP port (--port: vLLM's name for it)")
    g.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    g.add_argument("--prefill-port", type=int, default=50061, help="first prefill server port")
    g.add_argument("--decode-port", type=int, default=50071, help="first decode server port")
    g.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require this bearer token on /v1/* (env PDSERVE_API_KEY)")
    g.add_argument("--disable-log-requests", action="store_true")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    g.add_argument("--max-restarts", type=int, default=5,
                   help="times a server that dies is restarted (backoff 1 s doubling to 30 s) before the "
                        "cluster stops; the count starts again once it has stayed up for a minute")
    r = p.add_argument_group("prefix index (KV-aware routing)")
    r.add_argument("--redis-url", default=None,
                   help="keep the prefix index in this Redis (default: in the gateway's memory, fed over gRPC)")
    r.add_argument("--start-redis", action="store_true",
                   help="start a local Redis-protocol server on a free port for the index, stopped on exit")
    r.add_argument("--kv-overlap-score-weight", type=float, default=1.0,
                   help="gateway: weight of uncached prompt tokens against queued prefill work")
    r.add_argument("--kv-host-hit-credit", type=float, default=None,
                   help="gateway: a host-tier prefix hit's worth against a device-cache hit, in [0, 1] (default: "
                        f"{GPU_HOST_HIT_CREDIT} when the engine servers run on CUDA, {HOST_HIT_CREDIT} on CPU: "
                        "measured by bench/host_hit_cost.py)")
    r.add_argument("--max-n", type=int, default=MAX_N,
                   help="gateway: the most sequences one request may ask for (n, best_of)")
    r.add_argument("--local-prefill-threshold", type=int, default=0,
                   help="gateway: decode servers prefill prompts missing at most this many tokens from their "
                        "prefix cache (0: never)")
    add_migration_args(r)
    add_chat_args(p.add_argument_group("chat template, tool calls and reasoning (gateway)"))
    add_runtime_lora_args(p.add_argument_group("LoRA adapters at run time (gateway)"))
    pg = p.add_argument_group("prefill servers")
    add_kv_send_args(pg)
    pg.add_argument("--prefill-tensor-parallel-size", type=int, default=None, metavar="N",
                    help="the prefill servers' tensor-parallel size (default: --tensor-parallel-size, which "
                         "the decode servers keep); each rank sends its own KV heads to the decode ranks "
                         "that hold them")
    g.add_argument("--devices", default=None,
                   help="comma-separated devices assigned round-robin to prefill then decode servers, "
                        "e.g. cuda:0,cuda:1 (default: each server's --device)")
    tracing.add_cli_args(p)  # every process gets them (through its environment)
    tls.add_cli_args(p)  # every server and the gateway get them
    EngineArgs.add_cli_args(p)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Re-serialize the engine flags that differ from their defaults."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(add_help=False))
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):  # nargs="+" (--lora-modules)
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def child_env(threads: int | None = None, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """A server's environment: this one's, ``extra_env``, and on CPU (``threads``) the OpenMP
    threads it was planned, spinning as libgomp's default does (the cores are planned: a server
    alone would bound the spin, pdserve/cli/openmp_spin.py); the user's own settings win."""
    env = {**os.environ, **(extra_env or {}), "PYTHONUNBUFFERED": "1"}  # lines reach the prefixer at once
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    if threads is not None and "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        env["GOMP_SPINCOUNT"] = LIBGOMP_SPIN
    return env


def _spawn(argv: list[str], threads: int | None = None, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], preexec_fn=_die_with_parent,
                            env=child_env(threads, extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace")


def planned_ports(args: argparse.Namespace) -> list[tuple[int, str, str]]:
    """Every port the cluster will listen on: (port, what listens, the flag that moves it).
    (Redis, the KV pairs' and the tensor-parallel groups' stores take ports the OS picks.)"""
    out = [(args.http_port, "gateway HTTP", "--http-port"), (args.grpc_port, "gateway gRPC", "--grpc-port")]
    n_prefill = 0 if args.prefill_mode == "local" else args.prefill
    for role, first, count, flag in (("prefill", args.prefill_port, n_prefill, "--prefill-port"),
                                     ("decode", args.decode_port, args.decode, "--decode-port")):
        for i in range(count):
            out.append((first + i, f"{role}-{i} gRPC", flag))
        for i in range(count):
            out.append((first + i + 1000, f"{role}-{i} metrics", flag))
    return [p for p in out if p[0] != 0]  # 0: any free port


def port_problems(args: argparse.Namespace) -> list[str]:
    """One line per port the cluster cannot listen on now, or planned for two servers."""
    problems, seen = [], {}
    for port, what, flag in planned_ports(args):
        if not 0 < port <= 65535:
            problems.append(f"  {port:<5}  {what}: not a port; change {flag}")
        elif port in seen:
            other, other_flag = seen[port]
            problems.append(f"  {port:<5}  {what}: planned for {other} too; change {flag} or {other_flag}")
        else:
            seen[port] = (what, flag)
            error = ports.bind_error(args.host, port)
            if error is not None:
                why = "in use" if error.errno == errno.EADDRINUSE else (error.strerror or str(error))
                problems.append(f"  {port:<5}  {what}: {why}; change {flag}")
    return problems


def ports_message(host: str, problems: list[str], started: bool) -> str:
    head = (f"pdserve: error: cannot listen on these ports of {host} "
            f"({'the servers were stopped' if started else 'nothing was started'}):")
    foot = (["  (an engine server's metrics port is its gRPC port + 1000)"]
            if any(" metrics:" in line for line in problems) else [])
    return "\n".join([head, *problems, *foot])


class ServerOutput:
    """Copies one server's stdout and stderr to ours, each line prefixed with
    its name, and notes when the server printed its ready line."""

    def __init__(self, name: str, kind: str, proc: subprocess.Popen, width: int) -> None:
        self.name = name
        self.ready = threading.Event()
        self.last_error_line = ""  # the last line of its stderr (why it exited, when it did)
        self._prefix = f"{name:<{width}} | "
        self._ready_line = _READY_PREFIX[kind]
        self._echo_ready = kind != "gateway"  # the gateway logs its ready line as well
        self._threads = [threading.Thread(target=self._pump, args=(stream, to_stderr), name=f"output-{name}",
                                          daemon=True)
                         for stream, to_stderr in ((proc.stdout, False), (proc.stderr, True))]
        for t in self._threads:
            t.start()

    def _pump(self, stream, to_stderr: bool) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if to_stderr and line.strip():
                self.last_error_line = line.strip()
            is_ready = not to_stderr and line.startswith(self._ready_line)
            if not is_ready or self._echo_ready:
                say(self._prefix + line, file=sys.stderr if to_stderr else None)
            if is_ready:
                self.ready.set()

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)


def cpu_threads(args: argparse.Namespace, num_prefill: int, num_decode: int,
                cpu_count: int | None = None) -> tuple[int | None, int | None]:
    """On CPU, the threads of (each prefill server, each decode server); (None, None) on GPUs.
    Decode servers split every core between them: they step for every token of every stream.
    A prefill server, which computes in bursts, takes its share of the cores split between all
    engine servers. On 2 cores, one prefill and one decode server (the packed default model;
    docs/benchmarks.md, "One OpenMP team per server"): decode 2 threads and prefill 1 streamed one
    user's tokens at 8.35 ms against 11.80 for 1 + 1, and 4 streams at once 8-17% faster, their
    first tokens later; 2 + 2 made the 4 streams 14% slower."""
    if not on_cpu(args):
        return None, None
    cores = cpu_count or os.cpu_count() or 1
    return max(1, cores // max(1, num_prefill + num_decode)), max(1, cores // max(1, num_decode))


def on_cpu(args: argparse.Namespace) -> bool:
    """Whether the engine servers run on the CPU (--device cpu, or auto with no GPU)."""
    return args.device == "cpu" or (args.device == "auto" and not args.devices and not cuda_available())


def engine_devices(args: argparse.Namespace, engines: int) -> list[str | None]:
    """Each engine server's --devices entry, round robin (prefill servers first); None: none
    given, the server takes --device."""
    devices = args.devices.split(",") if args.devices else []
    return [devices[i % len(devices)] if devices else None for i in range(engines)]


def gpu_memory_shares(args: argparse.Namespace, num_prefill: int, num_decode: int) -> list[float | None]:
    """Each engine server's --gpu-memory-utilization (prefill servers first), where servers share
    a GPU: the cluster's utilization split between the servers on its busiest GPU, since each
    server sizes its KV cache on its share of the total and they start at once (two servers at
    0.9 of one GPU: the second fails to allocate). None where the server keeps the flag as given:
    a GPU of its own, --kv-cache-memory set, or CPU."""
    engines = num_prefill + num_decode
    if args.kv_cache_memory is not None or on_cpu(args):
        return [None] * engines
    used = []  # the GPU indices of each server: tensor-parallel rank r on its device's index + r
    for i, device in enumerate(engine_devices(args, engines)):
        device = device or args.device
        first = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        tp = (args.prefill_tensor_parallel_size if i < num_prefill else None) or args.tensor_parallel_size
        used.append(range(first, first + tp))
    sharing = {gpu: sum(gpu in u for u in used) for u in used for gpu in u}
    return [None if (n := max(sharing[gpu] for gpu in u)) == 1 else round(args.gpu_memory_utilization / n, 4)
            for u in used]


def host_hit_credit(args: argparse.Namespace) -> float:
    """The gateway's --kv-host-hit-credit: the flag's, else the measured credit of the engine
    servers' device (their --device, or --devices when given: any CUDA device counts as GPU)."""
    if args.kv_host_hit_credit is not None:
        return args.kv_host_hit_credit
    devices = args.devices.split(",") if args.devices else [args.device]
    on_gpu = any(d.startswith("cuda") or (d == "auto" and cuda_available()) for d in devices)
    return GPU_HOST_HIT_CREDIT if on_gpu else HOST_HIT_CREDIT


@functools.cache
def cuda_available() -> bool:
    """``torch.cuda.is_available()``, asked of a child process: the supervisor never imports
    torch, whose ~240 MiB would stay resident for the cluster's life beside the servers'."""
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        raise RuntimeError(f"could not import torch to look for a GPU:\n{probe.stderr[-2000:]}")
    return probe.stdout.strip().splitlines()[-1] == "True"


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except OSError:
        return False


class Cluster:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        n_prefill = 0 if args.prefill_mode == "local" else args.prefill
        if args.decode < 1:
            raise ValueError("--decode must be at least 1")
        if args.enable_auto_tool_choice and not args.tool_call_parser and args.reasoning_parser != "gpt_oss":
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes tool calls)")
        self.prefill = [f"{args.host}:{args.prefill_port + i}" for i in range(n_prefill)]
        self.decode = [f"{args.host}:{args.decode_port + i}" for i in range(args.decode)]
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.outputs: list[ServerOutput] = []
        self.specs: list[tuple] = []  # how each server was started, to start it again
        self.restarts: dict[int, int] = {}  # server index -> restarts since it last stayed up
        self.died_at: dict[int, float] = {}
        self.started_at: dict[int, float] = {}
        # Spans always go to a local traces file too (pdserve trace reads it).
        self.traces_file = args.traces_file or str(tracing.default_traces_file())
        self.trace_env = tracing.child_env(args.otlp_traces_endpoint, self.traces_file)
        if args.start_redis and args.redis_url:
            raise ValueError("give --redis-url or --start-redis, not both")
        self.local_redis = LocalRedis() if args.start_redis else None
        self.redis_url = self.local_redis.url if self.local_redis else args.redis_url

    def start(self) -> None:
        if self.local_redis is not None:
            self.local_redis.start()
        a, eng = self.args, engine_flags(self.args)
        engines = self.prefill + self.decode
        devices = engine_devices(a, len(engines))
        threads = dict(zip(("prefill", "decode"), cpu_threads(a, len(self.prefill), len(self.decode))))
        shares = gpu_memory_shares(a, len(self.prefill), len(self.decode))
        width = max(len("gateway"), *(len(f"{r}-{n - 1}") for r, n in (("prefill", len(self.prefill)),
                                                                       ("decode", len(self.decode))) if n))
        for i, addr in enumerate(engines):
            role = "prefill" if i < len(self.prefill) else "decode"
            name = f"{role}-{i if role == 'prefill' else i - len(self.prefill)}"
            dev = ["--device", devices[i]] if devices[i] else []
            extra = ["--redis-url", self.redis_url] if self.redis_url else []
            if role == "prefill":
                extra += ["--kv-send", a.kv_send, "--kv-pairs-per-decode", str(a.kv_pairs_per_decode)]
                if a.prefill_tensor_parallel_size is not None:
                    extra += ["--tensor-parallel-size", str(a.prefill_tensor_parallel_size)]
            if shares[i] is not None:  # after the engine flags: the last one given wins
                extra += ["--gpu-memory-utilization", str(shares[i])]
            self._launch(f"{name} ({addr})", name, role,
                         [role, "--host", a.host, "--port", addr.rsplit(":", 1)[1], *eng, *dev, *extra,
                          *tls.tls_flags(a)], threads[role],
                         self.trace_env, width)
        gw_env = dict(self.trace_env)
        if a.api_key:  # through the environment: a command line is visible to everyone in ps
            gw_env["PDSERVE_API_KEY"] = a.api_key
        self._launch("gateway", "gateway", "gateway", self.gateway_argv(), 1, gw_env, width)

    def gateway_argv(self) -> list[str]:
        """The gateway's command line (``pdserve gateway ...``) in front of this cluster."""
        a = self.args
        gw = ["gateway", "--host", a.host, "--http-port", str(a.http_port), "--grpc-port", str(a.grpc_port),
              "--decode", ",".join(self.decode), "--prefill", ",".join(self.prefill)]
        for flag in ("--model", "--served-model-name", "--max-model-len", "--chat-template", "--tool-call-parser",
                     "--reasoning-parser"):
            value = getattr(a, flag[2:].replace("-", "_"))
            if value is not None:
                gw += [flag, str(value)]
        if a.enable_auto_tool_choice:
            gw.append("--enable-auto-tool-choice")
        if a.allow_runtime_lora_updating:
            gw.append("--allow-runtime-lora-updating")
        gw += tls.tls_flags(a)
        if self.redis_url:
            gw += ["--redis-url", self.redis_url]
        gw += ["--kv-overlap-score-weight", str(a.kv_overlap_score_weight),
               "--kv-host-hit-credit", str(host_hit_credit(a)), "--max-n", str(a.max_n),
               "--local-prefill-threshold", str(a.local_prefill_threshold),
               "--migration-limit", str(a.migration_limit), "--stream-idle-timeout", str(a.stream_idle_timeout)]
        if a.disable_log_requests:
            gw.append("--disable-log-requests")
        return gw

    def _launch(self, label: str, name: str, kind: str, argv: list[str], threads: int | None,
                env: dict[str, str], width: int, index: int | None = None) -> None:
        """Start one server (``index``: in place of a dead one)."""
        proc = _spawn(argv, threads, env)
        entry, output = (label, proc), ServerOutput(name, kind, proc, width)
        if index is None:
            self.specs.append((label, name, kind, argv, threads, env, width))
            self.procs.append(entry)
            self.outputs.append(output)
        else:
            self.procs[index], self.outputs[index] = entry, output

    def supervise(self) -> str | None:
        """Restart servers that died, with backoff; None while the cluster
        lives, else why it must stop (a server kept dying)."""
        now = time.monotonic()
        for i, (label, p) in enumerate(self.procs):
            if p.poll() is None:
                if now - self.started_at.get(i, now) > _STABLE_S:
                    self.restarts.pop(i, None)  # it stayed up: a later death starts the count again
                continue
            n = self.restarts.get(i, 0)
            if n >= self.args.max_restarts:
                return f"{label} exited with code {p.returncode} and was restarted {n} times; giving up"
            due = self.died_at.setdefault(i, now) + min(_BACKOFF_MAX_S, _BACKOFF_S * 2 ** n)
            if now < due:
                continue
            say(f"pdserve: {label} exited with code {p.returncode}; restarting it "
                f"({n + 1}/{self.args.max_restarts})", file=sys.stderr)
            self.restarts[i] = n + 1
            self.died_at.pop(i, None)
            self.started_at[i] = now
            _, name, kind, argv, threads, env, width = self.specs[i]
            self._launch(label, name, kind, argv, threads, env, width, index=i)
        return None

    def dead(self) -> str | None:
        for (name, p), out in zip(self.procs, self.outputs):
            if p.poll() is not None:
                out.join(timeout=2.0)  # its last lines, for the reason
                last = f": {out.last_error_line}" if out.last_error_line else ""
                return f"{name} exited with code {p.returncode}{last}"
        return None

    def wait_ready(self) -> None:
        deadline = time.time() + self.args.startup_timeout
        pending = set(self.prefill + self.decode)
        health = f"http://{self.args.host}:{self.args.http_port}/health"
        while time.time() < deadline:
            if (why := self.dead()) is not None:
                raise RuntimeError(why)
            pending = {a for a in pending if not is_serving(a, timeout=1.0)}
            if not pending and _http_ok(health) and all(o.ready.is_set() for o in self.outputs):
                return
            time.sleep(0.5)
        waiting = sorted(pending) or [o.name for o in self.outputs if not o.ready.is_set()] or ["gateway"]
        raise RuntimeError(f"not ready after {self.args.startup_timeout:.0f}s: {', '.join(waiting)}")

    def stop(self, grace: float = 30.0) -> None:
        for _, p in reversed(self.procs):  # gateway first: stop taking requests
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + grace
        for _, p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for out in self.outputs:  # their last lines
            out.join(timeout=5.0)
        if self.local_redis is not None:
            self.local_redis.close()


def main(args: argparse.Namespace) -> int:
    if problems := port_problems(args):  # before anything starts (or converts the default model)
        say(ports_message(args.host, problems, started=False), file=sys.stderr)
        return 1
    if args.model is None:  # convert the embedded model once, before three processes want it
        from engine.model_files import ensure_default_model

        ensure_default_model()
    tls.configure(args)  # our own readiness probes speak it too
    cluster = Cluster(args)
    stop = {"signal": None}
    failure: str | None = None

    def on_signal(signum, _frame):
        stop["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # Ctrl-C stops the cluster even when this process inherited SIGINT ignored (a shell runs
    # a background job so, and Python then keeps it ignored instead of raising KeyboardInterrupt).
    signal.signal(signal.SIGINT, on_signal)
    say(f"traces file: {cluster.traces_file}")
    try:
        cluster.start()
        cluster.wait_ready()
        a = args
        banner = ["pdserve is up:",
                  f"  OpenAI HTTP  http://{a.host}:{a.http_port}/v1",
                  f"  gRPC         {a.host}:{a.grpc_port} (pdserve.v1.Gateway)"]
        banner += [f"  prefill-{i:<5}{addr}" for i, addr in enumerate(cluster.prefill)]
        banner += [f"  decode-{i:<6}{addr}" for i, addr in enumerate(cluster.decode)]
        if cluster.redis_url:
            banner.append(f"  prefix index {cluster.redis_url}")
        banner += [f"  traces       {cluster.traces_file} (pdserve trace <request id>)",
                   "pdserve ready. Press Ctrl-C to stop."]
        say("\n".join(banner))
        while (why := cluster.supervise()) is None:
            time.sleep(0.5)
        say(f"pdserve: {why}; stopping the cluster", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        say("pdserve: stopping...")
        return 0
    except RuntimeError as exc:  # a server failed to start: reported below, once the others stopped
        failure = str(exc)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
        if failure is not None:  # last on the screen, after every server's own last lines
            problems = port_problems(args)  # a port taken since the check (our servers' are free again)
            say(ports_message(args.host, problems, started=True) if problems else f"pdserve: {failure}",
                file=sys.stderr)
