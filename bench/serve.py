"""`pdserve bench serve`: latency and throughput of a running cluster,
through the gateway's OpenAI streaming API.

Sends ``--num-prompts`` random-token prompts (``--input-len`` tokens each,
``--output-len`` generated, ignore_eos) at ``--request-rate`` req/s
(Poisson; inf = all at once) with at most ``--max-concurrency`` in flight.
Reports time to first token (TTFT), time per output token (TPOT), inter-token
latency (ITL), end-to-end latency, output tokens/s and goodput (requests/s
that met --ttft-slo and --tpot-slo).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from bench.results import write_result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="gateway HTTP address")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson); inf = burst")
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--ttft-slo", type=float, default=2.0, help="seconds, for goodput")
    p.add_argument("--tpot-slo", type=float, default=0.2, help="seconds per output token, for goodput")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=40000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


@dataclass
class Sample:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(1, self.output_tokens - 1)


async def one_request(client, url: str, body: dict, headers: dict) -> Sample:
    s, t0 = Sample(), time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=600) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    s.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if s.ttft == 0.0:
                    s.ttft = now - t0
                else:
                    s.itl.append(now - last)
                last = now
        s.e2e, s.ok = time.perf_counter() - t0, True
    except Exception as exc:  # counted as a failed request
        s.error = repr(exc)
    return s


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(samples: list[Sample], wall: float, args: argparse.Namespace) -> dict:
    ok = [s for s in samples if s.ok]
    good = [s for s in ok if s.ttft <= args.ttft_slo and s.tpot <= args.tpot_slo]

    def stats(xs: list[float]) -> dict:
        return {"mean": statistics.fmean(xs) if xs else 0.0, "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9),
                "p99": _pct(xs, 0.99)}

    return {"completed": len(ok), "failed": len(samples) - len(ok), "wall_seconds": wall,
            "request_throughput": len(ok) / wall, "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall,
            "goodput_requests_per_s": len(good) / wall, "ttft": stats([s.ttft for s in ok]),
            "tpot": stats([s.tpot for s in ok]), "itl": stats([x for s in ok for x in s.itl]),
            "e2e": stats([s.e2e for s in ok]), "errors": sorted({s.error for s in samples if s.error})[:5]}


async def run(args: argparse.Namespace) -> dict:
    import httpx

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        bodies = [{"model": model, "prompt": [rng.randrange(args.vocab_low, args.vocab_high)
                                              for _ in range(args.input_len)],
                   "max_tokens": args.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}} for _ in range(args.num_prompts)]
        sem = asyncio.Semaphore(args.max_concurrency)

        async def limited(body: dict) -> Sample:
            async with sem:
                return await one_request(client, "/v1/completions", body, headers)

        tasks, t0 = [], time.perf_counter()
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        samples = await asyncio.gather(*tasks)
        return summarize(list(samples), time.perf_counter() - t0, args)


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(json.dumps({k: result[k] for k in ("completed", "failed", "request_throughput", "output_tokens_per_s",
                                              "goodput_requests_per_s", "ttft", "tpot")}, indent=2))
    write_result(result, "serve", args.output_json)
    return 0 if result["failed"] == 0 else 1
