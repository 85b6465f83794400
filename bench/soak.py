"""`pdserve bench soak`: a bounded soak of a fresh `pdserve up` cluster.

``--num-requests`` requests at ``--max-concurrency`` with mixed prompt and
output lengths; ``--cancel-fraction`` of them are abandoned by the client
after their first token; halfway through, one decode server is killed
outright (`pdserve up` starts it again). Then it checks what a user relies
on: every request completed, was cancelled by its client, or failed with a
defined error (429, 503 or 504 with an OpenAI error body); every instance in
`/cluster` is back to zero used KV blocks; and each server's resident memory
after the run against the same server's memory a quarter of the way in.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

from bench.cluster import UpCluster, server_processes
from bench.results import write_result

_DEFINED = {429, 503, 504}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=2000)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--cancel-fraction", type=float, default=0.1)
    p.add_argument("--min-input", type=int, default=8)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--max-output", type=int, default=32)
    p.add_argument("--no-kill", action="store_true", help="do not kill a decode server halfway")
    p.add_argument("--port-base", type=int, default=58200)
    p.add_argument("--engine-args", default="--kv-cache-memory 256MiB --max-model-len 1024")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _one(client, rng: random.Random, args: argparse.Namespace, model: str) -> str:
    prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(args.min_input, args.max_input))]
    cancel = rng.random() < args.cancel_fraction
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, args.max_output), "temperature": 0,
            "stream": True, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body, timeout=300) as r:
            if r.status_code != 200:
                err = json.loads(await r.aread()).get("error", {})
                return f"error {r.status_code}" if r.status_code in _DEFINED and err.get("message") else \
                    f"undefined {r.status_code}"
            async for line in r.aiter_lines():
                if cancel and line.startswith("data: {"):
                    return "cancelled"  # leaving the block closes the connection mid-stream
                if line.startswith("data: {") and '"error"' in line:
                    return "error in stream"
            return "completed"
    except Exception as exc:  # a broken connection: not a defined outcome
        return f"undefined {type(exc).__name__}"


async def _drive(args: argparse.Namespace, base: int, up_pid: int) -> dict:
    import httpx

    rng = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    rss_early: dict[str, float] = {}
    killed = None
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{base}",
                                 limits=httpx.Limits(max_connections=args.max_concurrency * 2)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency)
        done = 0

        async def run_one() -> None:
            nonlocal done, killed
            async with sem:
                outcomes[await _one(client, rng, args, model)] += 1
            done += 1
            if done == args.num_requests // 4:
                rss_early.update({f"{role}-{pid}": _rss_mib(pid) for pid, role in server_processes(up_pid).items()})
            if done == args.num_requests // 2 and not args.no_kill and killed is None:
                victim = next(pid for pid, role in server_processes(up_pid).items() if role == "decode")
                os.kill(victim, signal.SIGKILL)
                killed = victim

        t0 = time.perf_counter()
        await asyncio.gather(*(run_one() for _ in range(args.num_requests)))
        wall = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while True:  # the cluster settles: every instance healthy and holding no block
            instances = (await client.get("/cluster")).json()["instances"]
            if all(i["healthy"] for i in instances) and not any(i["kv_blocks_used"] for i in instances):
                break
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    rss_late = {f"{role}-{pid}": _rss_mib(pid) for pid, role in server_processes(up_pid).items()}
    return {"wall_seconds": wall, "outcomes": dict(outcomes), "killed_decode_pid": killed,
            "instances_after": instances, "rss_mib_quarter": rss_early, "rss_mib_end": rss_late}


def main(args: argparse.Namespace) -> int:
    b = args.port_base
    with UpCluster(["--prefill", "2", "--decode", "2", "--http-port", str(b), "--grpc-port", str(b + 1),
                    "--prefill-port", str(b + 2), "--decode-port", str(b + 5), "--disable-log-requests",
                    *args.engine_args.split()]) as up:
        result = asyncio.run(_drive(args, b, up.pid))
    undefined = {k: v for k, v in result["outcomes"].items() if k.startswith("undefined")}
    leaked = {i["address"]: i["kv_blocks_used"] for i in result["instances_after"] if i["kv_blocks_used"]}
    result.update(undefined=undefined, leaked_blocks=leaked,
                  args={k: v for k, v in vars(args).items() if k != "func"})
    print(json.dumps({k: result[k] for k in ("wall_seconds", "outcomes", "undefined", "leaked_blocks",
                                              "rss_mib_quarter", "rss_mib_end")}, indent=2))
    write_result(result, "soak", args.output_json)
    return 1 if undefined or leaked else 0
