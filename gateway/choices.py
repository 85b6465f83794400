"""A request's choices: OpenAI's ``n`` and vLLM's ``best_of``.

Each choice is a request of its own on the engine servers (``SamplingParams.choice``: one
sequence, seed + index when seeded), so choice i is exactly the single request with that
seed, and a choice whose decode server dies migrates alone, as any request does. The prompt
is prefilled, and its KV transferred, once: choice 0 goes through the prefill tier as usual;
the others wait until its first delta has come from its decode server (the prompt's KV has
landed there and is in that server's prefix cache), then go to that same server, which
prefills them locally: each takes the prompt's full blocks as a prefix-cache hit, shared with
choice 0 by reference count, and computes only the last partial block's tokens (at most
``block_size - 1``) and its own first token. (A decode server started with
``--no-enable-prefix-caching`` computes each further choice's prompt itself.)

``ChoiceStreams`` merges the choices' delta streams into one, each delta tagged with its
choice's ``index`` and interleaved as they come (OpenAI's streaming of ``n``). A choice's
last delta carries the request's usage so far: the prompt once, the completion tokens of
every choice finished, the cached tokens of choice 0; the stream's last delta carries the
whole request's. With ``best_of`` > ``n`` (never streamed) every sequence runs to its end,
and the ``n`` with the highest cumulative logprob (the sum of its sampled tokens'; ties: the
lower index) come out, re-indexed in that order, as vLLM ranks them.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from gateway.output_processor import GenerationDelta, Usage
from gateway.request_flow import PreparedRequest, RequestFlow

# One choice's stream, given its prepared request and flow.
RunChoice = Callable[[PreparedRequest, RequestFlow], AsyncIterator[GenerationDelta]]
MakeFlow = Callable[[PreparedRequest, Any], RequestFlow]  # (choice, decode server to pin or None)


def choice_requests(req: PreparedRequest) -> list[PreparedRequest]:
    """The request's choices: choice 0 keeps its ids (and so its prefix-routing and trace
    identity), choice i > 0 is ``<internal id>-c<i>`` on the engine servers."""
    n = req.sampling.num_sequences
    return [dataclasses.replace(req, sampling=req.sampling.choice(i),
                                internal_id=req.internal_id if i == 0 else f"{req.internal_id}-c{i}")
            for i in range(n)]


class ChoiceStreams:
    """Owns the choices' tasks of one request; ``deltas()`` is their merged stream."""

    def __init__(self, req: PreparedRequest, make_flow: MakeFlow, run: RunChoice) -> None:
        self._req = req
        self._choices = choice_requests(req)
        self._make_flow, self._run = make_flow, run
        self.flows: list[RequestFlow] = []
        self._queue: asyncio.Queue[tuple[int, GenerationDelta | BaseException]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._completion_tokens = 0
        self._cached_tokens = 0
        self.num_output_tokens = 0  # every choice's, for the request's log line and trace

    async def deltas(self) -> AsyncIterator[GenerationDelta]:
        ranked = self._req.sampling.num_sequences > self._req.sampling.n
        held: dict[int, list[GenerationDelta]] = {}  # best_of: every delta, ranked at the end
        try:
            first = self._make_flow(self._choices[0], None)
            self.flows.append(first)
            self._start(0, first)
            self._tasks.append(asyncio.create_task(self._start_others(first)))
            finished = 0
            while finished < len(self._choices):
                index, item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                item.index = index
                if item.finish_reason:
                    finished += 1
                    item.usage = self._usage(index, item.usage)
                if ranked:
                    held.setdefault(index, []).append(item)
                else:
                    yield item
            if ranked:
                for d in self._best(held):
                    yield d
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, index: int, flow: RequestFlow) -> None:
        self._tasks.append(asyncio.create_task(self._pump(index, self._choices[index], flow)))

    async def _start_others(self, first: RequestFlow) -> None:
        """The other choices, once choice 0's prompt is on its decode server (or choice 0
        ended without one: then they are routed as any request)."""
        if len(self._choices) == 1:
            return
        ready = asyncio.ensure_future(first.decode_ready.wait())
        await asyncio.wait({ready, self._tasks[0]}, return_when=asyncio.FIRST_COMPLETED)
        ready.cancel()
        pin = first.ready_decode if first.decode_ready.is_set() else None
        for index in range(1, len(self._choices)):
            flow = self._make_flow(self._choices[index], pin)
            self.flows.append(flow)
            self._start(index, flow)

    async def _pump(self, index: int, req: PreparedRequest, flow: RequestFlow) -> None:
        try:
            async with aclosing(self._run(req, flow)) as deltas:
                async for d in deltas:
                    self._queue.put_nowait((index, d))
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the request's end: deltas() raises it
            self._queue.put_nowait((index, e))

    def _usage(self, index: int, usage: Usage | None) -> Usage:
        """The request's usage once choice ``index`` has finished (``usage``: its own)."""
        if usage is not None:
            self._completion_tokens += usage.completion_tokens
            if index == 0:
                self._cached_tokens = usage.cached_tokens
        self.num_output_tokens = self._completion_tokens
        return Usage(len(self._req.prompt_token_ids), self._completion_tokens, self._cached_tokens)

    def _best(self, held: dict[int, list[GenerationDelta]]) -> list[GenerationDelta]:
        """The ``n`` best sequences' deltas (``SamplingParams.best``), re-indexed by rank; the
        last one carries the request's usage (every sequence's tokens)."""
        usage = max((d.usage for ds in held.values() for d in ds if d.usage is not None),
                    key=lambda u: u.completion_tokens)
        scores = [sum(lp.logprob for d in held[i] for lp in d.logprobs) for i in range(len(self._choices))]
        best = self._req.sampling.best(scores)
        out = []
        for rank, i in enumerate(best):
            for d in held[i]:
                d.index = rank
                out.append(d)
        out[-1].usage = usage
        return out
