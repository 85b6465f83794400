"""Streams through a fresh `pdserve up` cluster on this machine: `pdserve bench serve`'s time
per output token and time to first token, and the CPU seconds each of the cluster's processes
spent per output token meanwhile (from /proc, so the hops' and the gateway's cost are seen).

    python -m bench.cluster_stream [--concurrency N] [--env K=V ...] [--output-json F] -- UP_FLAGS...

e.g. `python -m bench.cluster_stream --env OMP_NUM_THREADS=1 -- --model SmolLM2-135M-Instruct-GGUF
--gguf-activations q8_0`. Two warm-up requests first; then 6 requests per concurrent stream,
48 tokens in and 128 out each."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.cluster import UpCluster, server_processes

INPUT_LEN, OUTPUT_LEN, PER_STREAM = 48, 128, 6


def _cpu_seconds(up_pid: int) -> dict[str, float]:
    """User + system CPU seconds of each server process of `pdserve up` ``up_pid``, by "role-pid"."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid, role in server_processes(up_pid).items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[f"{role}-{pid}"] = (int(stat[11]) + int(stat[12])) / tick
    return out


def _serve(base_url: str, prompts: int, concurrency: int, path: str) -> dict:
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "serve", "--base-url", base_url,
                    "--max-concurrency", str(concurrency), "--num-prompts", str(prompts), "--input-len",
                    str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--output-json", path],
                   check=True, capture_output=True)
    return json.loads(Path(path).read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="for the cluster's processes")
    p.add_argument("--output-json", default=None)
    p.add_argument("--port-base", type=int, default=58400)
    p.add_argument("up_flags", nargs=argparse.REMAINDER)
    args = p.parse_args()
    flags = [f for f in args.up_flags if f != "--"]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env)}
    base = args.port_base
    ports = ["--http-port", str(base), "--grpc-port", str(base + 1), "--prefill-port", str(base + 2),
             "--decode-port", str(base + 3)]
    with UpCluster(["--disable-log-requests", *ports, *flags], env=env) as up, tempfile.TemporaryDirectory() as tmp:
        url = f"http://127.0.0.1:{base}"
        _serve(url, 2, 1, f"{tmp}/warm.json")
        before = _cpu_seconds(up.pid)
        result = _serve(url, PER_STREAM * args.concurrency, args.concurrency, f"{tmp}/run.json")
        after = _cpu_seconds(up.pid)
    tokens = PER_STREAM * args.concurrency * OUTPUT_LEN
    result["cpu_ms_per_output_token"] = {name: round(1000 * (t - before.get(name, 0.0)) / tokens, 3)
                                         for name, t in after.items()}
    result["up_flags"], result["env"] = flags, args.env
    ms = {k: round(v * 1000, 2) for k, v in result["tpot"].items()}
    ttft = {k: round(v * 1000, 1) for k, v in result["ttft"].items()}
    print(f"{args.concurrency} stream(s): {result['output_tokens_per_s']:.1f} output tok/s, TPOT {ms}, TTFT {ttft}")
    for name, value in result["cpu_ms_per_output_token"].items():
        print(f"  {name:20s} {value:7.3f} ms CPU / output token")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
