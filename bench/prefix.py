"""`pdserve bench prefix`: KV-aware against load-only routing on a
prefix-heavy workload, each on a fresh `pdserve up` cluster (2 prefill
servers, 1 decode server, a local Redis for the index).

Workload: ``--system-prompts`` applications, each with its own
``--system-len``-token system prompt (together more than one prefill
server's KV cache holds, as in a real fleet), and ``--conversations``
multi-turn chats spread over them; turn t's prompt is turn t-1's prompt, a
reply and a new user message (synthetic token ids: what is measured is the
cache, not the text). A warm-up sends each system prompt once; then each
round sends the next turn of every chat, in a random order, at most
``--max-concurrency`` at a time.

Reported per mode:
- shareable tokens: for each request, the leading full blocks of its prompt
  that an earlier prompt already had (the most any prefix cache could give);
- prefill-side cache hits: the prefill servers' own ``prefix_cache_hits``
  counters, so the ratio is the share of shareable tokens not computed again;
- TTFT and end-to-end latency percentiles;
- the gateway's ``route`` span durations (prefix lookup + choice) from the
  traces file.
Load-only routing is the same cluster with ``--kv-overlap-score-weight 0``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.cluster import UpCluster
from bench.http_stream import percentile
from bench.results import metric_samples, write_result
from bench.serve import Sample, one_request
from engine.block_hash import hash_request_blocks


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system-len", type=int, default=1024, help="tokens of each shared system prompt")
    p.add_argument("--system-prompts", type=int, default=16,
                   help="distinct system prompts (applications); together more than one server's cache holds")
    p.add_argument("--conversations", type=int, default=16, help="chats, spread over the system prompts")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--user-len", type=int, default=96, help="new tokens per user message")
    p.add_argument("--reply-len", type=int, default=96, help="tokens of each earlier reply in the history")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--route-probes", type=int, default=30,
                   help="sequential requests after the run whose route spans time the routing alone")
    p.add_argument("--port-base", type=int, default=58100)
    p.add_argument("--modes", default="kv-aware,load-only")
    p.add_argument("--engine-args", default="--kv-cache-memory 512MiB --max-model-len 4096",
                   help="extra flags for the engine servers")
    p.add_argument("--output-json", default=None)


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(system prompts, prompts[turn][conversation]); conversation c uses
    system prompt c % len(system prompts)."""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    systems = [tokens(args.system_len) for _ in range(args.system_prompts)]
    history = [list(systems[c % len(systems)]) for c in range(args.conversations)]
    turns = []
    for t in range(args.turns):
        prompts = []
        for c in range(args.conversations):
            if t:
                history[c] += tokens(args.reply_len)
            history[c] += tokens(args.user_len)
            prompts.append(list(history[c]))
        turns.append(prompts)
    return systems, turns


def shareable(rounds: list[list[list[int]]], block_size: int) -> list[int]:
    """Per prompt, in send order, the tokens of its leading full blocks that a
    prompt of an earlier round already had (prompts of one round go together)."""
    seen: set[int] = set()
    out = []
    for prompts in rounds:
        for p in prompts:
            hashes = hash_request_blocks(p[:((len(p) - 1) // block_size) * block_size], block_size)
            n = 0
            while n < len(hashes) and hashes[n] in seen:
                n += 1
            out.append(n * block_size)
        for p in prompts:
            seen.update(hash_request_blocks(p, block_size))
    return out


class Cluster(UpCluster):
    def __init__(self, args: argparse.Namespace, weight: float, traces: Path) -> None:
        b = args.port_base
        self.http, self.prefill_ports = b, (b + 2, b + 3)
        super().__init__(["--prefill", "2", "--decode", "1", "--start-redis", "--http-port", str(b),
                          "--grpc-port", str(b + 1), "--prefill-port", str(b + 2), "--decode-port", str(b + 5),
                          "--kv-overlap-score-weight", str(weight), "--traces-file", str(traces),
                          "--disable-log-requests", "--block-size", str(args.block_size), *args.engine_args.split()])

    def prefill_hits(self) -> float:
        import httpx

        total = 0.0
        for port in self.prefill_ports:
            text = httpx.get(f"http://127.0.0.1:{port + 1000}/metrics", timeout=10).text
            total += sum(value for _, value in metric_samples(text, "pdserve:prefix_cache_hits_total"))
        return total


async def _run_mode(args: argparse.Namespace, cluster: Cluster, systems: list[list[int]],
                    turns: list[list[list[int]]]) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{cluster.http}") as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        def body(prompt: list[int]) -> dict:
            return {"model": model, "prompt": prompt, "max_tokens": args.output_len, "ignore_eos": True,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}

        sem = asyncio.Semaphore(args.max_concurrency)

        async def limited(prompt: list[int]) -> Sample:
            async with sem:
                return await one_request(client, "/v1/completions", body(prompt), {})

        warm = await asyncio.gather(*(limited(s + [7]) for s in systems))  # each system prompt once
        assert all(w.ok for w in warm), [w.error for w in warm]
        time.sleep(1.0)  # the index hears of the warm-up's blocks
        hits0 = cluster.prefill_hits()
        samples: list[Sample] = []
        t0 = time.perf_counter()
        order = random.Random(1)
        for prompts in turns:
            # Clients of one round arrive in a random order: a fixed order would pin each chat to one
            # server under load-only routing by accident (round robin over the same sequence).
            prompts = order.sample(prompts, len(prompts))
            samples += await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - t0
        hits = cluster.prefill_hits() - hits0
        # Routing cost on an otherwise idle cluster: one request at a time, so no
        # engine computes while the gateway routes (the route spans measure it).
        probe = {**body(turns[-1][0]), "max_tokens": 1, "stream": False}
        probe.pop("stream_options")
        for _ in range(args.route_probes):
            await client.post("/v1/completions", json=probe, timeout=600)
    ok = [s for s in samples if s.ok]

    def stats(xs: list[float]) -> dict:
        return {"p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9), "p99": percentile(xs, 0.99),
                "mean": statistics.fmean(xs) if xs else 0.0}

    return {"completed": len(ok), "failed": len(samples) - len(ok), "wall_seconds": wall,
            "prefill_cache_hit_tokens": hits, "ttft": stats([s.ttft for s in ok]), "e2e": stats([s.e2e for s in ok]),
            "errors": sorted({s.error for s in samples if s.error})[:3]}


def route_times(traces: Path, num_probes: int) -> dict:
    """Durations of the gateway's route spans: all of them (under load), and
    the last ``num_probes`` (the sequential probe requests, cluster idle)."""
    ms = []
    for line in traces.read_text().splitlines():
        span = json.loads(line)
        if span["name"] == "route" and span["service"] == "pdserve-gateway":
            ms.append((span["start_ns"], (span["end_ns"] - span["start_ns"]) / 1e6))
    ms = [d for _, d in sorted(ms)]
    idle = ms[-num_probes:] if num_probes else []
    return {"count": len(ms), "p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "max_ms": max(ms, default=0.0),
            "idle_p50_ms": percentile(idle, 0.5), "idle_p99_ms": percentile(idle, 0.99)}


async def _route_cost(args: argparse.Namespace, prompts: list[list[int]], n: int = 1000) -> dict:
    """What routing adds per request, alone: hashing the prompt's blocks off the
    event loop, one lookup in a real local Redis holding this workload's blocks
    for two prefill servers, and the choice; ``n`` sequential routes."""
    from gateway.instances import InstanceRegistry
    from gateway.prefix_index import RedisPrefixIndex
    from gateway.router import Router
    from pdserve.v1 import common_pb2
    from rpc.local_redis import LocalRedis
    from rpc.prefix_index import alive_key, block_key

    import redis as sync_redis

    ns = f"bench:{args.block_size}:float32"
    with LocalRedis() as server:
        r = sync_redis.Redis.from_url(server.url)
        pipe = r.pipeline(transaction=False)
        for i, p in enumerate(prompts):  # the workload's blocks, split over two servers
            for h in hash_request_blocks(p, args.block_size):
                pipe.sadd(block_key(ns, h), f"127.0.0.1:{1 + i % 2}#bench")
        pipe.zadd(alive_key(ns), {"127.0.0.1:1#bench": time.time() + 3600, "127.0.0.1:2#bench": time.time() + 3600})
        pipe.execute()
        registry = InstanceRegistry(("127.0.0.1:1", "127.0.0.1:2"), ("127.0.0.1:3",))
        for inst in registry:
            inst.is_healthy = True
            inst.load = common_pb2.LoadInfo(block_size=args.block_size, cache_namespace=ns, kv_blocks_total=1)
        index = RedisPrefixIndex(server.url, timeout_s=0.05)
        router = Router(registry, index)
        ms = []
        for i in range(n):
            t0 = time.perf_counter()
            await router.route(prompts[i % len(prompts)])
            ms.append((time.perf_counter() - t0) * 1e3)
        await index.close()
        await registry.close()
    return {"routes": n, "p50_ms": percentile(ms, 0.5), "p99_ms": percentile(ms, 0.99), "max_ms": max(ms)}


def main(args: argparse.Namespace) -> int:
    systems, turns = workload(args)
    flat = [p for prompts in turns for p in prompts]
    share = shareable([[s + [7] for s in systems], *turns], args.block_size)[len(systems):]
    result: dict = {"shareable_tokens": sum(share), "prompt_tokens": sum(len(p) for p in flat), "modes": {}}
    for mode in filter(None, args.modes.split(",")):
        weight = {"kv-aware": 1.0, "load-only": 0.0}[mode]
        with tempfile.TemporaryDirectory() as tmp:
            traces = Path(tmp) / "traces.jsonl"
            with Cluster(args, weight, traces) as cluster:
                r = asyncio.run(_run_mode(args, cluster, systems, turns))
            time.sleep(1.0)  # the last spans are flushed
            r["route"] = route_times(traces, args.route_probes)
        r["cached_share_of_shareable"] = r["prefill_cache_hit_tokens"] / max(1, result["shareable_tokens"])
        result["modes"][mode] = r
        print(f"{mode}: cached {r['cached_share_of_shareable']:.1%} of shareable tokens, TTFT p50 "
              f"{r['ttft']['p50'] * 1e3:.0f} ms p90 {r['ttft']['p90'] * 1e3:.0f} ms, route p99 "
              f"{r['route']['p99_ms']:.2f} ms under load, {r['route']['idle_p99_ms']:.2f} ms idle, "
              f"{r['completed']} ok / {r['failed']} failed", flush=True)
    result["route_cost"] = asyncio.run(_route_cost(args, flat))
    print(f"routing alone (hash + Redis lookup + choice), {result['route_cost']['routes']} routes: p50 "
          f"{result['route_cost']['p50_ms']:.3f} ms, p99 {result['route_cost']['p99_ms']:.3f} ms", flush=True)
    modes = result["modes"]
    if {"kv-aware", "load-only"} <= modes.keys():
        result["ttft_p50_speedup"] = modes["load-only"]["ttft"]["p50"] / max(1e-9, modes["kv-aware"]["ttft"]["p50"])
        print(f"TTFT p50 speedup of KV-aware routing: {result['ttft_p50_speedup']:.2f}x")
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    write_result(result, "prefix", args.output_json)
    return 0
