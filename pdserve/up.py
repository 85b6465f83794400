"""`pdserve up`: the whole topology on one machine, one process per server.

Starts N prefill servers (ports from --prefill-port upward), M decode servers
(from --decode-port) and the gateway, waits until every one reports healthy,
prints the endpoints and a ready line. Ctrl-C (or SIGTERM) stops them all
gracefully; children also die with this process (PR_SET_PDEATHSIG), so none
is orphaned even if it is killed.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.request

from engine.config import EngineArgs
from rpc import tracing
from rpc.health_probe import is_serving

_PR_SET_PDEATHSIG = 1


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology")
    g.add_argument("--prefill", type=int, default=1, help="number of prefill servers")
    g.add_argument("--decode", type=int, default=1, help="number of decode servers")
    g.add_argument("--prefill-mode", choices=("disaggregated", "local"), default="disaggregated",
                   help="local: no prefill servers, decode servers prefill themselves (colocated baseline)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--http-port", type=int, default=8000, help="gateway OpenAI HTTP port")
    g.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    g.add_argument("--prefill-port", type=int, default=50061, help="first prefill server port")
    g.add_argument("--decode-port", type=int, default=50071, help="first decode server port")
    g.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require this bearer token on /v1/* (env PDSERVE_API_KEY)")
    g.add_argument("--disable-log-requests", action="store_true")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    g.add_argument("--devices", default=None,
                   help="comma-separated devices assigned round-robin to prefill then decode servers, "
                        "e.g. cuda:0,cuda:1 (default: each server's --device)")
    tracing.add_cli_args(p)  # every process gets them (through its environment)
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
        else:
            out += [flag, str(value)]
    return out


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _spawn(argv: list[str], threads: int | None = None, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, **(extra_env or {})}
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *argv], preexec_fn=_die_with_parent, env=env)


def cpu_threads_per_engine(args: argparse.Namespace, num_engines: int) -> int | None:
    """On CPU, engine servers split the cores instead of each taking all of
    them (which would make prefill and decode fight over every core)."""
    import torch

    on_cpu = args.device == "cpu" or (args.device == "auto" and not args.devices and not torch.cuda.is_available())
    return max(1, (os.cpu_count() or 1) // num_engines) if on_cpu else None


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
        self.prefill = [f"{args.host}:{args.prefill_port + i}" for i in range(n_prefill)]
        self.decode = [f"{args.host}:{args.decode_port + i}" for i in range(args.decode)]
        self.procs: list[tuple[str, subprocess.Popen]] = []
        # Spans always go to a local traces file too (pdserve trace reads it).
        self.traces_file = args.traces_file or str(tracing.default_traces_file())
        self.trace_env = tracing.child_env(args.otlp_traces_endpoint, self.traces_file)

    def start(self) -> None:
        a, eng = self.args, engine_flags(self.args)
        devices = a.devices.split(",") if a.devices else []
        engines = self.prefill + self.decode
        threads = cpu_threads_per_engine(a, len(engines))
        for i, addr in enumerate(engines):
            role = "prefill" if i < len(self.prefill) else "decode"
            dev = ["--device", devices[i % len(devices)]] if devices else []
            self.procs.append((f"{role}@{addr}", _spawn(
                [role, "--host", a.host, "--port", addr.rsplit(":", 1)[1], *eng, *dev], threads, self.trace_env)))
        gw = ["gateway", "--host", a.host, "--http-port", str(a.http_port), "--grpc-port", str(a.grpc_port),
              "--decode", ",".join(self.decode), "--prefill", ",".join(self.prefill)]
        for flag in ("--model", "--served-model-name", "--max-model-len"):
            value = getattr(a, flag[2:].replace("-", "_"))
            if value is not None:
                gw += [flag, str(value)]
        if a.api_key:
            gw += ["--api-key", a.api_key]
        if a.disable_log_requests:
            gw.append("--disable-log-requests")
        self.procs.append(("gateway", _spawn(gw, threads=1, extra_env=self.trace_env)))

    def dead(self) -> str | None:
        for name, p in self.procs:
            if p.poll() is not None:
                return f"{name} exited with code {p.returncode}"
        return None

    def wait_ready(self) -> None:
        deadline = time.time() + self.args.startup_timeout
        pending = set(self.prefill + self.decode)
        health = f"http://{self.args.host}:{self.args.http_port}/health"
        while time.time() < deadline:
            if (why := self.dead()) is not None:
                raise RuntimeError(why)
            pending = {a for a in pending if not is_serving(a, timeout=1.0)}
            if not pending and _http_ok(health):
                return
            time.sleep(0.5)
        raise RuntimeError(f"not ready after {self.args.startup_timeout:.0f}s: {sorted(pending) or 'gateway'}")

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


def main(args: argparse.Namespace) -> int:
    if args.model is None:  # convert the embedded model once, before three processes want it
        from engine.model_files import ensure_default_model

        ensure_default_model()
    cluster = Cluster(args)
    stop = {"signal": None}

    def on_signal(signum, _frame):
        stop["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    print(f"traces file: {cluster.traces_file}", flush=True)
    try:
        cluster.start()
        cluster.wait_ready()
        a = args
        print("pdserve is up:", flush=True)
        print(f"  OpenAI HTTP  http://{a.host}:{a.http_port}/v1", flush=True)
        print(f"  gRPC         {a.host}:{a.grpc_port} (pdserve.v1.Gateway)", flush=True)
        for addr in cluster.prefill:
            print(f"  prefill      {addr}", flush=True)
        for addr in cluster.decode:
            print(f"  decode       {addr}", flush=True)
        print(f"  traces       {cluster.traces_file} (pdserve trace <request id>)", flush=True)
        print("pdserve ready. Press Ctrl-C to stop.", flush=True)
        while (why := cluster.dead()) is None:
            time.sleep(0.5)
        print(f"pdserve: {why}; stopping the cluster", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("pdserve: stopping...", flush=True)
        return 0
    except RuntimeError as exc:
        print(f"pdserve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
