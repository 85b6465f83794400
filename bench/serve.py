"""`pdserve bench serve`: latency and throughput of a running server,
through its OpenAI streaming completions API (any OpenAI-compatible endpoint
that takes token-id prompts: the gateway, vLLM, SGLang).

Sends ``--num-prompts`` prompts of random token ids at ``--request-rate``
req/s (Poisson; inf = all at once) with at most ``--max-concurrency`` in
flight, ignore_eos. ``--dataset``:

- ``random``: ``--input-len`` tokens in, ``--output-len`` out, every request;
- ``sharegpt``: lengths drawn from log-normal distributions shaped like chat
  traffic (medians ``--input-len`` / ``--output-len``, a long tail, clipped
  to ``--max-input-len`` / ``--max-output-len``), no text needed;
- ``shared-prefix``: ``--prefix-groups`` groups, each prompt its group's
  ``--prefix-len``-token prefix then ``--input-len`` tokens of its own.

Reports time to first token (TTFT), time per output token (TPOT),
inter-token latency (ITL) and end-to-end latency at p50/p90/p99, request and
token throughput, and goodput: requests/s that met every target of
``--goodput ttft:MS tpot:MS e2e:MS`` (vLLM's syntax; default ttft:2000
tpot:200). ``--plot FILE.png`` draws TTFT/TPOT/E2E percentiles and the
latency of every request against its start time (needs matplotlib).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
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
    p.add_argument("--dataset", choices=("random", "sharegpt", "shared-prefix"), default="random")
    p.add_argument("--max-input-len", type=int, default=4096, help="sharegpt: longest prompt")
    p.add_argument("--max-output-len", type=int, default=1024, help="sharegpt: longest output")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each group's prefix")
    p.add_argument("--prefix-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="targets a request must meet to count for goodput, e.g. ttft:500 tpot:50 (ms; "
                        "metrics ttft, tpot, e2e; default ttft:2000 tpot:200)")
    p.add_argument("--ttft-slo", type=float, default=None, help="seconds (same as --goodput ttft:MS)")
    p.add_argument("--tpot-slo", type=float, default=None, help="seconds per output token (--goodput tpot:MS)")
    p.add_argument("--plot", default=None, help="write a PNG of the latency percentiles and per-request latency")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=40000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


def parse_goodput(args: argparse.Namespace) -> dict[str, float]:
    """The goodput targets in seconds, from --goodput (ms) and the older --*-slo flags (s)."""
    targets = {"ttft": 2.0, "tpot": 0.2} if not (args.goodput or args.ttft_slo or args.tpot_slo) else {}
    for item in args.goodput or ():
        name, sep, value = item.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {item!r}")
        try:
            targets[name] = float(value) / 1e3
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
    if args.ttft_slo is not None:
        targets["ttft"] = args.ttft_slo
    if args.tpot_slo is not None:
        targets["tpot"] = args.tpot_slo
    return targets


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, for --dataset."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(max(1, n))]

    def lognormal(median: int, cap: int) -> int:
        return int(min(cap, max(1, round(rng.lognormvariate(math.log(median), 0.9)))))

    if args.dataset == "random":
        return [(tokens(args.input_len), args.output_len) for _ in range(args.num_prompts)]
    if args.dataset == "sharegpt":
        return [(tokens(lognormal(args.input_len, args.max_input_len)), lognormal(args.output_len, args.max_output_len))
                for _ in range(args.num_prompts)]
    prefixes = [tokens(args.prefix_len) for _ in range(args.prefix_groups)]
    return [(prefixes[i % len(prefixes)] + tokens(args.input_len), args.output_len) for i in range(args.num_prompts)]


@dataclass
class Sample:
    ok: bool = False
    start: float = 0.0  # seconds since the benchmark started
    input_tokens: int = 0
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
    targets = parse_goodput(args)
    good = [s for s in ok if all(getattr(s, name) <= limit for name, limit in targets.items())]

    def stats(xs: list[float]) -> dict:
        return {"mean": statistics.fmean(xs) if xs else 0.0, "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9),
                "p99": _pct(xs, 0.99)}

    return {"completed": len(ok), "failed": len(samples) - len(ok), "wall_seconds": wall,
            "request_throughput": len(ok) / wall, "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall,
            "total_tokens_per_s": sum(s.output_tokens + s.input_tokens for s in ok) / wall,
            "goodput_targets_s": targets, "goodput_requests_per_s": len(good) / wall, "ttft": stats([s.ttft for s in ok]),
            "tpot": stats([s.tpot for s in ok]), "itl": stats([x for s in ok for x in s.itl]),
            "e2e": stats([s.e2e for s in ok]), "errors": sorted({s.error for s in samples if s.error})[:5]}


async def run(args: argparse.Namespace) -> dict:
    import httpx

    parse_goodput(args)  # bad targets fail before any request
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        bodies = [{"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "temperature": 0,
                   "stream": True, "stream_options": {"include_usage": True}}
                  for prompt, out_len in make_prompts(args, rng)]
        sem = asyncio.Semaphore(args.max_concurrency)
        t0 = time.perf_counter()

        async def limited(body: dict) -> Sample:
            async with sem:
                start = time.perf_counter() - t0
                sample = await one_request(client, "/v1/completions", body, headers)
                sample.start, sample.input_tokens = start, len(body["prompt"])
                return sample

        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        samples = list(await asyncio.gather(*tasks))
        result = summarize(samples, time.perf_counter() - t0, args)
        result["samples"] = [{"start": s.start, "ok": s.ok, "ttft": s.ttft, "tpot": s.tpot, "e2e": s.e2e,
                              "input_tokens": s.input_tokens, "output_tokens": s.output_tokens} for s in samples]
        return result


def plot(result: dict, path: str) -> None:
    """Percentiles of TTFT/TPOT/E2E as bars, and each request's TTFT and E2E
    against its start time (queueing shows as a rising band)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from exc
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    names, pcts = ("ttft", "tpot", "e2e"), ("p50", "p90", "p99")
    for i, pct in enumerate(pcts):
        left.bar([j + 0.27 * (i - 1) for j in range(len(names))], [result[n][pct] * 1e3 for n in names], 0.27,
                 label=pct)
    left.set_xticks(range(len(names)), [n.upper() for n in names])
    left.set_yscale("log")
    left.set_ylabel("ms")
    left.set_title(f"{result['completed']} requests, {result['output_tokens_per_s']:.0f} output tok/s")
    left.legend()
    ok = [s for s in result["samples"] if s["ok"]]
    right.scatter([s["start"] for s in ok], [s["e2e"] * 1e3 for s in ok], s=6, label="end to end")
    right.scatter([s["start"] for s in ok], [s["ttft"] * 1e3 for s in ok], s=6, label="TTFT")
    right.set_xlabel("request start (s)")
    right.set_ylabel("ms")
    right.set_title("latency of each request")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(json.dumps({k: result[k] for k in ("completed", "failed", "request_throughput", "output_tokens_per_s",
                                              "goodput_targets_s", "goodput_requests_per_s", "ttft", "tpot", "itl",
                                              "e2e")}, indent=2))
    write_result(result, "serve", args.output_json)
    if args.plot:
        plot(result, args.plot)
    return 0 if result["failed"] == 0 else 1
