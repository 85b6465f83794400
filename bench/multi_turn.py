"""`pdserve bench multi-turn` (or ``python -m bench.multi_turn``): simulated multi-turn chats
against a running gateway's OpenAI chat API, where each turn's prompt is the whole history
again, so every turn after the first can reuse the KV of the one before.

``--conversations`` chats run side by side, each its own ``--system-words`` system message
and ``--turns`` user messages of ``--user-words`` words (random common words, seeded: text,
so the server applies its chat template as for any client), the model's reply
(``--output-len`` tokens, greedy, ignore_eos) appended to the history after each turn, and
a think time before the next (``--think-time`` seconds, scaled per turn by a seeded factor in
[0.5, 1.5]); chat ``c`` starts ``c x --stagger`` seconds in, so turns interleave.

Made to exercise the host KV tier: on a server whose device cache holds fewer histories
than there are chats (``--num-gpu-blocks-override``), the other chats' turns evict a chat's
blocks while it thinks; with ``--kv-offloading-size`` they wait in host memory and its next
turn loads them back (a host hit) instead of computing them again. For example::

    pdserve up --num-gpu-blocks-override 64 --max-model-len 2048 --kv-offloading-size 0.25
    pdserve bench multi-turn --conversations 4 --turns 4

Reports, per turn index: time to first token (TTFT) as the client sees it, prompt tokens and
cached tokens (``usage.prompt_tokens_details.cached_tokens``) and their ratio; overall: the
hit rate (cached / prompt tokens), also over turns 2.. (turn 1's prompt is new). Where the
server is pdserve (it has ``/cluster``), also what its engine servers counted by the tier a
hit came from (``pdserve:prompt_tokens_cached_by_source_total``: device, host, disk) and what
the gateway's router expected (``/cluster``'s ``routed_cached_tokens``), as the change over
the run.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

from bench.http_stream import HTTPStatusError, percentile, sse_chunks
from bench.results import metric_samples, write_result

# Common one-token words: a history of N words is about N tokens under most tokenizers.
WORDS = ("the of and to in is was for on are with as his they be at one have this from or had by but "
         "some what there we can out other were all your when up use word how said an each she which do "
         "their time if will way about many then them would write like so these her long make thing see "
         "him two has look more day could go come did my sound no most number who over know water than "
         "call first people may down side been now find any new work part take get place made live where "
         "after back little only round man year came show every good me give our under name very through "
         "just form much great think say help low line before turn cause same mean differ move right boy "
         "old too does tell sentence set three want air well also play small end put home read hand port "
         "large spell add even land here must big high such follow act why ask men change went light "
         "kind off need house picture try us again animal point mother world near build self earth father").split()


def add_workload_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The chats' shape (also under `pdserve bench serve --multi-turn`)."""
    p.add_argument("--conversations", type=int, default=4, help="chats run side by side")
    p.add_argument("--turns", type=int, default=4, help="user messages per chat")
    p.add_argument("--system-words", type=int, default=300, help="words of each chat's own system message")
    p.add_argument("--user-words", type=int, default=60, help="words of each user message")
    p.add_argument("--think-time", type=float, default=1.0,
                   help="seconds between a reply and the chat's next turn (x a seeded factor in [0.5, 1.5])")
    p.add_argument("--stagger", type=float, default=0.5, help="seconds between the chats' first turns")


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="gateway HTTP address")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    add_workload_args(p)
    p.add_argument("--output-len", type=int, default=16, help="tokens of each reply")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: one per chat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


@dataclass
class Turn:
    """One request: turn ``turn`` (1-based) of chat ``conversation``."""

    conversation: int
    turn: int
    ok: bool = False
    start: float = 0.0  # seconds since the run started
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reply: str = ""
    error: str = ""


@dataclass
class Conversation:
    """A chat's messages so far; ``next_user`` adds the next user message, ``add_reply`` the answer."""

    index: int
    rng: random.Random
    messages: list[dict] = field(default_factory=list)

    @classmethod
    def start(cls, index: int, seed: int, system_words: int) -> "Conversation":
        conv = cls(index, random.Random(seed * 1_000_003 + index))
        conv.messages.append({"role": "system", "content": f"Chat {index}. " + conv.words(system_words)})
        return conv

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def next_user(self, n: int) -> list[dict]:
        """The history with a new user message of ``n`` words: the next turn's whole prompt."""
        self.messages.append({"role": "user", "content": self.words(n)})
        return list(self.messages)

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


async def one_turn(client, body: dict, headers: dict, turn: Turn, t0: float) -> Turn:
    """Stream one chat completion; fills ``turn`` (TTFT, usage, the reply's text)."""
    sent = time.perf_counter()
    turn.start = sent - t0
    parts: list[str] = []
    try:
        async for chunk in sse_chunks(client, "/v1/chat/completions", body, headers):
            usage = chunk.get("usage")
            if usage:
                turn.prompt_tokens = usage["prompt_tokens"]
                turn.completion_tokens = usage["completion_tokens"]
                turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if turn.ttft == 0.0:
                        turn.ttft = time.perf_counter() - sent
                    parts.append(delta)
        turn.e2e, turn.ok, turn.reply = time.perf_counter() - sent, True, "".join(parts)
    except HTTPStatusError as exc:
        turn.error = str(exc)
    except Exception as exc:  # counted as a failed turn
        turn.error = repr(exc)
    return turn


def summarize(turns: list[Turn]) -> dict:
    """Per turn index and overall: TTFT, prompt and cached tokens, hit rate (cached / prompt)."""
    ok = [t for t in turns if t.ok]

    def rate(ts: list[Turn]) -> float:
        prompt = sum(t.prompt_tokens for t in ts)
        return sum(t.cached_tokens for t in ts) / prompt if prompt else 0.0

    per_turn = []
    for n in sorted({t.turn for t in turns}):
        ts = [t for t in ok if t.turn == n]
        ttfts = [t.ttft for t in ts]
        per_turn.append({
            "turn": n, "completed": len(ts), "failed": sum(1 for t in turns if t.turn == n and not t.ok),
            "ttft_mean": statistics.fmean(ttfts) if ttfts else 0.0, "ttft_p50": percentile(ttfts, 0.5),
            "ttft_max": max(ttfts, default=0.0),
            "prompt_tokens_mean": statistics.fmean(t.prompt_tokens for t in ts) if ts else 0.0,
            "cached_tokens_mean": statistics.fmean(t.cached_tokens for t in ts) if ts else 0.0,
            "hit_rate": rate(ts)})
    later = [t for t in ok if t.turn > 1]
    ttfts = [t.ttft for t in ok]
    return {"completed": len(ok), "failed": len(turns) - len(ok),
            "prompt_tokens": sum(t.prompt_tokens for t in ok), "cached_tokens": sum(t.cached_tokens for t in ok),
            "hit_rate": rate(ok), "hit_rate_after_first_turn": rate(later),
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9),
            "ttft_after_first_turn_mean": statistics.fmean(t.ttft for t in later) if later else 0.0,
            "per_turn": per_turn, "errors": sorted({t.error for t in turns if t.error})[:5]}


def cached_by_source(metrics_text: str) -> dict[str, float]:
    """An engine server's /metrics body: its ``prompt_tokens_cached_by_source`` by source."""
    out: dict[str, float] = {}
    for labels, value in metric_samples(metrics_text, "pdserve:prompt_tokens_cached_by_source_total"):
        if "source" in labels:
            out[labels["source"]] = out.get(labels["source"], 0.0) + value
    return out


def difference(after: dict, before: dict) -> dict:
    """``after`` less ``before``, key by key, nested dicts alike (a key missing before counts 0)."""
    return {k: difference(v, before.get(k) or {}) if isinstance(v, dict) else v - (before.get(k) or 0)
            for k, v in after.items()}


async def server_counters(client, headers: dict) -> dict | None:
    """pdserve's own counts (None from a server without /cluster): the router's expected cached
    tokens by tier, and the engine servers' cached tokens by source, summed per role."""
    import httpx

    try:
        r = await client.get("/cluster", headers=headers, timeout=10)
        cluster = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        cluster = None
    if not isinstance(cluster, dict):
        return None
    engines: dict[str, dict[str, float]] = {}
    for inst in cluster.get("instances", []):
        url = inst.get("metrics_url")
        if not url:
            continue
        try:
            text = (await client.get(url, timeout=10)).text
        except httpx.HTTPError:
            continue
        role = engines.setdefault(inst.get("role", "?"), {})
        for source, n in cached_by_source(text).items():
            role[source] = role.get(source, 0.0) + n
    return {"routed_cached_tokens": dict(cluster.get("routed_cached_tokens") or {}),
            "engine_cached_by_source": engines}


async def run(args: argparse.Namespace) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = asyncio.Semaphore(args.max_concurrency or args.conversations)
    async with httpx.AsyncClient(base_url=args.base_url) as client:
        model = args.model or (await client.get("/v1/models", headers=headers)).json()["data"][0]["id"]
        before = await server_counters(client, headers)
        t0 = time.perf_counter()

        async def chat(c: int) -> list[Turn]:
            conv = Conversation.start(c, args.seed, args.system_words)
            think = random.Random(args.seed * 7919 + c)
            await asyncio.sleep(c * args.stagger)
            done = []
            for n in range(1, args.turns + 1):
                body = {"model": model, "messages": conv.next_user(args.user_words), "max_tokens": args.output_len,
                        "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                async with limit:
                    turn = await one_turn(client, body, headers, Turn(c, n), t0)
                done.append(turn)
                if not turn.ok:
                    break  # (the history would miss a reply)
                conv.add_reply(turn.reply)
                if n < args.turns:
                    await asyncio.sleep(args.think_time * think.uniform(0.5, 1.5))
            return done

        turns = [t for ts in await asyncio.gather(*(chat(c) for c in range(args.conversations))) for t in ts]
        wall = time.perf_counter() - t0
        after = await server_counters(client, headers)
    result = {"model": model, "wall_seconds": wall, **summarize(turns),
              "turns": [{k: v for k, v in vars(t).items() if k != "reply"} for t in turns]}
    if before is not None and after is not None:
        result["server"] = difference(after, before)
    return result


def report(result: dict) -> str:
    lines = [f"{'turn':>4}  {'ok':>3}  {'TTFT mean':>9}  {'TTFT p50':>8}  {'prompt':>6}  {'cached':>6}  hit rate"]
    for t in result["per_turn"]:
        lines.append(f"{t['turn']:>4}  {t['completed']:>3}  {t['ttft_mean'] * 1e3:>7.0f}ms  {t['ttft_p50'] * 1e3:>6.0f}ms"
                     f"  {t['prompt_tokens_mean']:>6.0f}  {t['cached_tokens_mean']:>6.0f}  {t['hit_rate']:>7.1%}")
    lines.append(f"hit rate {result['hit_rate']:.1%} overall ({result['cached_tokens']} of {result['prompt_tokens']} "
                 f"prompt tokens cached), {result['hit_rate_after_first_turn']:.1%} over turns 2..; "
                 f"{result['completed']} ok / {result['failed']} failed in {result['wall_seconds']:.1f} s")
    server = result.get("server")
    if server:
        for role, sources in sorted(server["engine_cached_by_source"].items()):
            shown = ", ".join(f"{s} {n:.0f}" for s, n in sources.items())
            lines.append(f"{role} servers' cached prompt tokens by source: {shown or 'none'}")
        routed = ", ".join(f"{k} {v:.0f}" for k, v in server["routed_cached_tokens"].items())
        lines.append(f"router expected cached (prefix index): {routed or 'none'}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    print(report(result), flush=True)
    result["args"] = {k: v for k, v in vars(args).items() if k != "func"}
    write_result(result, "multi-turn", args.output_json)
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.multi_turn", description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    raise SystemExit(main(parser.parse_args()))
