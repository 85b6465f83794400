"""Reading a server's streamed OpenAI answers, for the benchmarks that time them (bench.serve,
bench.multi_turn, bench.prefix), and the percentile they report."""
from __future__ import annotations

import json


class HTTPStatusError(Exception):
    """A streamed request answered with another status than 200 (the body's start in the message)."""


async def sse_chunks(client, url: str, body: dict, headers: dict):
    """The JSON chunks of one streamed OpenAI request, ``data: [DONE]`` left out; raises
    HTTPStatusError for another status than 200."""
    async with client.stream("POST", url, json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            raise HTTPStatusError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]
