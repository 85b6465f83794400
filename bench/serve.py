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

A rate sweep: ``--request-rate 4,8,12,16`` runs each rate in turn against
the same server and writes one JSON: ``{"model", "request_rates",
"goodput_targets_s", "sweep": [one entry per rate], "args"}``, each entry
what a one-rate run's JSON holds (less ``args``) plus ``request_rate``
(offered), ``num_prompts``, ``seed``, ``arrival_rate_per_s`` (as sent),
``goodput_fraction`` (of the prompts sent) and ``settle`` (the wait before
it; null for the first). Rate i draws its prompts and arrival gaps from
``--seed`` + i: the same distribution, new prompts (repeats would hit the
prefix cache). ``--duration S`` sends S x rate prompts at each finite rate
instead of ``--num-prompts``. Before each rate after the first the sweep
waits until the server has been idle for ``--settle-seconds`` in a row
(pdserve's ``/cluster``: nothing running, waiting or in flight on any
healthy instance, no KV block held; a server without ``/cluster`` gets a
plain pause of that long). ``--plot`` then draws goodput and completed rate,
and the TTFT and TPOT percentiles, against the offered rate. One rate runs
and writes exactly as before.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass, field

from bench.http_stream import HTTPStatusError, percentile, sse_chunks
from bench.results import write_result


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="gateway HTTP address")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--request-rate", type=parse_rates, default="inf", metavar="RATE[,RATE...]",
                   help="req/s (Poisson); inf = burst; several (4,8,12,16): a sweep, one rate after another")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="send S x rate prompts at each finite rate instead of --num-prompts (a sweep of "
                        "S-second runs)")
    p.add_argument("--settle-seconds", type=float, default=2.0,
                   help="sweep: before each next rate, the server must be idle this long (/cluster)")
    p.add_argument("--settle-timeout", type=float, default=120.0,
                   help="sweep: go on to the next rate after this many seconds even if the server is busy")
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
    p.add_argument("--plot", default=None, help="write a PNG of the latency percentiles and per-request latency "
                                                "(a sweep: goodput and latency against the offered rate)")
    p.add_argument("--vocab-low", type=int, default=100)
    p.add_argument("--vocab-high", type=int, default=40000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--kill-decode-pid", type=int, default=None, metavar="PID",
                   help="SIGKILL this decode server once --kill-at of the requests have finished (one run, not a "
                        "sweep); the result's 'kill' part gives the streams in flight then, their seam (the "
                        "inter-token gap across the kill), and their TTFT/TPOT against the other requests'")
    p.add_argument("--kill-at", type=float, default=0.5, metavar="FRACTION",
                   help="with --kill-decode-pid: the fraction of the requests finished when the kill comes")
    g = p.add_argument_group("multi-turn chats (--multi-turn: `pdserve bench multi-turn` with this command's "
                             "--output-len and --max-concurrency)")
    g.add_argument("--multi-turn", action="store_true",
                   help="chats of several turns with think time between them, each turn's prompt the whole "
                        "history: TTFT and cached tokens per turn and per KV tier")
    from bench import multi_turn  # (it reads streams with this module's helpers)

    multi_turn.add_workload_args(g)


def parse_rates(text: str | float) -> list[float]:
    """--request-rate: one rate or a comma list, each > 0 req/s or inf."""
    rates = []
    for item in str(text).split(","):
        try:
            rate = float(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not a rate (req/s, or inf)") from None
        if not rate > 0:  # also NaN
            raise argparse.ArgumentTypeError(f"request rates must be > 0 req/s (or inf), got {item.strip()!r}")
        rates.append(rate)
    return rates


def request_rates(args: argparse.Namespace) -> list[float]:
    """The rates asked for (a Namespace built by hand may hold one number)."""
    rate = args.request_rate
    return [float(rate)] if isinstance(rate, (int, float)) else list(rate)


def num_prompts(args: argparse.Namespace, rate: float) -> int:
    """Prompts to send at ``rate``: --duration x rate where both are finite, else --num-prompts."""
    if args.duration is not None and math.isfinite(rate):
        return max(1, round(args.duration * rate))
    return args.num_prompts


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
        async for chunk in sse_chunks(client, url, body, headers):
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
    except HTTPStatusError as exc:
        s.error = str(exc)
    except Exception as exc:  # counted as a failed request
        s.error = repr(exc)
    return s


def within_targets(samples: list[Sample], targets: dict[str, float]) -> list[Sample]:
    """The completed requests that met every goodput target."""
    return [s for s in samples if s.ok and all(getattr(s, name) <= limit for name, limit in targets.items())]


def summarize(samples: list[Sample], wall: float, args: argparse.Namespace) -> dict:
    ok = [s for s in samples if s.ok]
    targets = parse_goodput(args)
    good = within_targets(samples, targets)

    def stats(xs: list[float]) -> dict:
        return {"mean": statistics.fmean(xs) if xs else 0.0, "p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9),
                "p99": percentile(xs, 0.99)}

    return {"completed": len(ok), "failed": len(samples) - len(ok), "wall_seconds": wall,
            "request_throughput": len(ok) / wall, "output_tokens_per_s": sum(s.output_tokens for s in ok) / wall,
            "total_tokens_per_s": sum(s.output_tokens + s.input_tokens for s in ok) / wall,
            "goodput_targets_s": targets, "goodput_requests_per_s": len(good) / wall, "ttft": stats([s.ttft for s in ok]),
            "tpot": stats([s.tpot for s in ok]), "itl": stats([x for s in ok for x in s.itl]),
            "e2e": stats([s.e2e for s in ok]), "errors": sorted({s.error for s in samples if s.error})[:5]}


def _bodies(args: argparse.Namespace, model: str, rng: random.Random, n: int) -> list[dict]:
    prompts = make_prompts(argparse.Namespace(**{**vars(args), "num_prompts": n}), rng)
    return [{"model": model, "prompt": prompt, "max_tokens": out_len, "ignore_eos": True, "temperature": 0,
             "stream": True, "stream_options": {"include_usage": True}} for prompt, out_len in prompts]


async def _drive(client, bodies: list[dict], rate: float, args: argparse.Namespace, rng: random.Random,
                 headers: dict) -> tuple[list[Sample], float, float]:
    """Send ``bodies`` at ``rate`` (Poisson gaps from ``rng``); the samples, the wall time from the
    first send to the last answer, and the seconds from the first send to the last."""
    sem = asyncio.Semaphore(args.max_concurrency)
    t0 = time.perf_counter()

    kill = _Kill(args, len(bodies), t0) if getattr(args, "kill_decode_pid", None) else None

    async def limited(body: dict) -> Sample:
        async with sem:
            start = time.perf_counter() - t0
            sample = await one_request(client, "/v1/completions", body, headers)
            sample.start, sample.input_tokens = start, len(body["prompt"])
            if kill is not None:
                kill.finished()
            return sample

    tasks, last_send = [], 0.0
    for body in bodies:
        last_send = time.perf_counter() - t0
        tasks.append(asyncio.create_task(limited(body)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    samples = list(await asyncio.gather(*tasks))
    if kill is not None:
        args.kill_seconds = kill.at
    return samples, time.perf_counter() - t0, last_send


class _Kill:
    """--kill-decode-pid: SIGKILL the decode server once ``--kill-at`` of ``n`` requests finished."""

    def __init__(self, args: argparse.Namespace, n: int, t0: float) -> None:
        self.pid, self.t0, self.at = args.kill_decode_pid, t0, None
        self.remaining = max(1, math.ceil(args.kill_at * n))

    def finished(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            os.kill(self.pid, signal.SIGKILL)
            self.at = time.perf_counter() - self.t0


def kill_report(samples: list[Sample], at: float | None) -> dict:
    """What a decode server's death at ``at`` (seconds into the run) cost: the streams in flight
    then (started before it, their last token after it), each one's seam (the gap between its
    tokens across the kill: detection, routing, the prefill of prompt + tokens so far, the next
    token), and TTFT/TPOT of those streams against the requests the kill did not touch."""
    if at is None:
        return {"killed": False}
    hit, others, seams = [], [], []
    for s in samples:
        if not s.ok or s.ttft == 0.0:
            continue
        times = list(itertools.accumulate([s.start + s.ttft, *s.itl]))
        if s.start < at < times[-1]:
            hit.append(s)
            after = next((i for i, t in enumerate(times) if t > at), None)
            if after:
                seams.append(times[after] - times[after - 1])
        else:
            others.append(s)

    def stats(xs: list[float]) -> dict:
        return {"mean": statistics.fmean(xs) if xs else 0.0, "p50": percentile(xs, 0.5), "max": max(xs, default=0.0)}

    return {"killed": True, "at_s": at, "streams_in_flight": len(hit), "seam_s": stats(seams),
            "ttft_in_flight": stats([s.ttft for s in hit]), "ttft_others": stats([s.ttft for s in others]),
            "tpot_in_flight": stats([s.tpot for s in hit]), "tpot_others": stats([s.tpot for s in others]),
            "itl_others": stats([x for s in others for x in s.itl])}


def _samples_json(samples: list[Sample]) -> list[dict]:
    return [{"start": s.start, "ok": s.ok, "ttft": s.ttft, "tpot": s.tpot, "e2e": s.e2e,
             "input_tokens": s.input_tokens, "output_tokens": s.output_tokens} for s in samples]


async def _model(client, args: argparse.Namespace, headers: dict) -> str:
    return args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]


async def run(args: argparse.Namespace, rate: float | None = None) -> dict:
    """One run at ``rate`` (default: the one --request-rate)."""
    import httpx

    if rate is None:
        rates = request_rates(args)
        if len(rates) != 1:
            raise ValueError(f"run() takes one request rate, got {rates}: sweep() runs several")
        rate = rates[0]
    parse_goodput(args)  # bad targets fail before any request
    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url) as client:
        bodies = _bodies(args, await _model(client, args, headers), rng, num_prompts(args, rate))
        samples, wall, _ = await _drive(client, bodies, rate, args, rng, headers)
        result = summarize(samples, wall, args)
        if getattr(args, "kill_decode_pid", None):
            result["kill"] = kill_report(samples, getattr(args, "kill_seconds", None))
        result["samples"] = _samples_json(samples)
        return result


def _busy(instances: list[dict]) -> list[str]:
    """The healthy instances (of a /cluster body) that run, queue or hold anything, as text."""
    return [f"{i.get('role')} {i.get('address')}: {i.get('num_running', 0)} running, {i.get('num_waiting', 0)} "
            f"waiting, {i.get('num_in_flight', 0)} in flight, {i.get('kv_blocks_used', 0)} KV blocks"
            for i in instances if i.get("healthy", True)
            and (i.get("num_running") or i.get("num_waiting") or i.get("num_in_flight") or i.get("kv_blocks_used"))]


async def settle(client, headers: dict, quiet_s: float, timeout_s: float) -> dict:
    """Wait until the server has been idle for ``quiet_s`` seconds in a row, by pdserve's
    /cluster (polled every 0.1 s; its load figures are the gateway's last poll of each
    instance, every 0.5 s by default, and ``num_in_flight`` is live). A server without
    /cluster gets a plain pause of ``quiet_s``. Gives up after ``timeout_s`` (``idle``
    false, with what was still busy)."""
    t0 = time.perf_counter()
    idle_since: float | None = None
    for polls in itertools.count():
        try:
            r = await client.get("/cluster", headers=headers, timeout=10)
            instances = r.json().get("instances") if r.status_code == 200 else None
        except Exception:  # not JSON, or the connection failed
            instances = None
        now = time.perf_counter()
        if instances is None and polls == 0:  # not a pdserve gateway
            await asyncio.sleep(quiet_s)
            return {"seconds": time.perf_counter() - t0, "idle": None}
        busy = _busy(instances) if instances is not None else ["/cluster did not answer"]
        if busy:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if idle_since is not None and now - idle_since >= quiet_s:
            return {"seconds": now - t0, "idle": True}
        if now - t0 >= timeout_s:
            return {"seconds": now - t0, "idle": False, "busy": busy}
        await asyncio.sleep(0.1)
    raise AssertionError("unreachable")


async def sweep(args: argparse.Namespace) -> dict:
    """Every --request-rate in turn against one server, idle in between (``settle``)."""
    import httpx

    targets = parse_goodput(args)
    rates = request_rates(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    runs = []
    async with httpx.AsyncClient(base_url=args.base_url) as client:
        model = await _model(client, args, headers)
        for i, rate in enumerate(rates):
            settled: dict | None = None  # nothing ran before the first rate
            if i:
                settled = await settle(client, headers, args.settle_seconds, args.settle_timeout)
                if settled["idle"] is False:
                    print(f"warning: still busy after {settled['seconds']:.0f} s, going on to {rate:g} req/s: "
                          + "; ".join(settled["busy"]), flush=True)
            rng = random.Random(args.seed + i)
            n = num_prompts(args, rate)
            samples, wall, last_send = await _drive(client, _bodies(args, model, rng, n), rate, args, rng, headers)
            summary = summarize(samples, wall, args)
            good = len(within_targets(samples, targets))
            runs.append({"request_rate": rate, "num_prompts": n, "seed": args.seed + i,
                         "arrival_rate_per_s": (n - 1) / last_send if n > 1 and last_send > 0 else float("inf"),
                         "goodput_fraction": good / n, "settle": settled, **summary,
                         "samples": _samples_json(samples)})
            r = runs[-1]
            print(f"{rate:g} req/s offered: {r['completed']}/{n} done, {r['failed']} failed, "
                  f"{r['request_throughput']:.2f} req/s completed, goodput {r['goodput_requests_per_s']:.2f} "
                  f"req/s, TTFT p50 {r['ttft']['p50'] * 1e3:.0f} ms, TPOT p50 {r['tpot']['p50'] * 1e3:.1f} ms",
                  flush=True)
    return {"model": model, "request_rates": rates, "goodput_targets_s": targets, "sweep": runs}


def _targets_text(targets: dict[str, float]) -> str:
    return ", ".join(f"{name.upper()} <= {limit * 1e3:g} ms" for name, limit in targets.items())


def sweep_table(result: dict) -> str:
    """The sweep as a Markdown table, one row per rate."""
    def ms(stats: dict) -> str:
        return " / ".join(f"{stats[p] * 1e3:.0f}" if stats[p] >= 0.1 else f"{stats[p] * 1e3:.1f}"
                          for p in ("p50", "p90", "p99"))

    rows = [f"| offered req/s | sent req/s | done req/s | failed | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms "
            f"| goodput req/s ({_targets_text(result['goodput_targets_s'])}) |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["sweep"]:
        rows.append(f"| {r['request_rate']:g} | {r['arrival_rate_per_s']:.2f} | {r['request_throughput']:.2f} | "
                    f"{r['failed']} | {ms(r['ttft'])} | {ms(r['tpot'])} | {r['goodput_requests_per_s']:.2f} "
                    f"({100 * r['goodput_fraction']:.0f}%) |")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    from bench import serve_plot

    if args.multi_turn:
        from bench import multi_turn

        return multi_turn.main(args)

    rates = request_rates(args)
    parse_goodput(args)
    if args.plot:
        serve_plot.pyplot()  # no matplotlib: say so before the benchmark, not after it
    if len(rates) > 1 and args.kill_decode_pid:
        raise SystemExit("pdserve bench serve: --kill-decode-pid takes one --request-rate, not a sweep")
    if len(rates) > 1:
        result = asyncio.run(sweep(args))
        result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
        print(sweep_table(result))
        write_result(result, "serve-sweep", args.output_json)
        if args.plot:
            serve_plot.plot_sweep(result, args.plot)
        return 0 if all(r["failed"] == 0 for r in result["sweep"]) else 1
    args.request_rate = rates[0]  # the JSON's args hold the one number, as before sweeps
    result = asyncio.run(run(args))
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(json.dumps({k: result[k] for k in ("completed", "failed", "request_throughput", "output_tokens_per_s",
                                              "goodput_targets_s", "goodput_requests_per_s", "ttft", "tpot", "itl",
                                              "e2e", "kill") if k in result}, indent=2))
    write_result(result, "serve", args.output_json)
    if args.plot:
        serve_plot.plot_run(result, args.plot)
    return 0 if result["failed"] == 0 else 1
