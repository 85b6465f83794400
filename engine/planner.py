"""The one place that decides a step's path: ``plan_step``.

Given the scheduler's rows and what the runner holds (``StepRuntime``), it returns a
``StepPlan``: eager or which graph, the bucket the graph is padded to, and whether the
step is queued without waiting (overlapped). The runner carries a plan out and decides
nothing; the engine loop reads schedule -> plan -> run -> update.

    the step                                   path                       overlapped
    no graphs, or its KV leaves layer by layer eager                      no
    rows with proposals                        verify graph if one fits,  no (acceptance is read
                                               else eager                  before the next schedule)
    a row held for a KV send (prefill tier)    eager                      no
    a row computing prompt logprobs            eager                      no (the extra logits are
                                                                           read before the next schedule)
    every row decodes one token                decode graph of the        --async-scheduling
                                               smallest size that holds it
    anything else (prefill chunks)             mixed-step graph of the    --async-scheduling and
                                               smallest bucket, else eager overlap_mixed_steps

A graph holds a step only where its buffers do: the rows (or tokens) within its largest
size, every block table within its width, and for a mixed-step graph one sequence spare
for the padding. A decode graph's attention split count comes from the batch's longest
context (``GraphMenu.variants``).
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

from engine.scheduler import ScheduledRequest
from engine.step_plan import GraphMenu, StepPath, StepPlan, StepRuntime

EAGER = StepPlan()


def plan_step(scheduled: Sequence[ScheduledRequest], runtime: StepRuntime, *, layerwise: bool = False) -> StepPlan:
    """How a step of ``scheduled`` rows runs. ``layerwise``: its KV is sent layer by layer as
    the forward pass goes (the prefill tier), which only an eager pass reports."""
    g = runtime.graphs
    if g is None or layerwise or not scheduled:
        return EAGER
    if any(s.prompt_logprob_positions for s in scheduled):
        return EAGER  # the logits of its prompt positions: the eager pass's hidden states hold them
    if any(s.draft_token_ids for s in scheduled):
        size = verify_bucket(scheduled, g)
        return EAGER if size is None else StepPlan(StepPath.VERIFY_GRAPH, size)
    if any(s.request.hold_kv_on_finish for s in scheduled):
        return EAGER  # the prefill tier reads each step's outcome to send its KV
    decode = decode_graph(scheduled, g)
    if decode is not None:
        size, splits = decode
        return StepPlan(StepPath.DECODE_GRAPH, size, splits, overlapped=runtime.overlap)
    overlapped = runtime.overlap and runtime.overlap_mixed
    size = mixed_bucket(scheduled, g)
    if size is None:
        return StepPlan(overlapped=overlapped)
    return StepPlan(StepPath.MIXED_GRAPH, size, overlapped=overlapped)


def padded_size(sizes: Sequence[int], n: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n``, or None."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if n >= 1 and i < len(sizes) else None


def is_pure_decode(scheduled: Sequence[ScheduledRequest]) -> bool:
    """Every request computes exactly its last known token (and samples the next)."""
    return bool(scheduled) and all(s.num_new_tokens == 1 and not s.draft_token_ids and s.samples for s in scheduled)


def is_verify_step(scheduled: Sequence[ScheduledRequest], verify_len: int) -> bool:
    """Every row decodes its pending token, with at most ``verify_len - 1`` proposals."""
    return all(not s.lookahead and s.num_new_tokens == 1 + len(s.draft_token_ids) < verify_len + 1
               and s.request.num_computed_tokens + 1 == s.request.num_tokens for s in scheduled)


def _widest(scheduled: Sequence[ScheduledRequest]) -> int:
    return max(len(t) for s in scheduled for t in s.block_ids)


def decode_graph(scheduled: Sequence[ScheduledRequest], g: GraphMenu) -> tuple[int, int | None] | None:
    """(size, attention splits) of the decode graph that holds a pure-decode step, or None."""
    size = padded_size(g.decode_sizes, len(scheduled))
    if size is None or not is_pure_decode(scheduled) or _widest(scheduled) > g.max_blocks_per_seq:
        return None
    longest = max(s.start + 1 for s in scheduled)
    variants = g.variants[size]
    return size, next((sp for ctx, sp in variants if ctx >= longest), variants[-1][1])


def verify_bucket(scheduled: Sequence[ScheduledRequest], g: GraphMenu) -> int | None:
    """The verify graph's size that holds a step of rows with proposals, or None."""
    size = padded_size(g.verify_sizes, len(scheduled))
    if size is None or not is_verify_step(scheduled, g.verify_len) or _widest(scheduled) > g.max_blocks_per_seq:
        return None
    return size


def mixed_bucket(scheduled: Sequence[ScheduledRequest], g: GraphMenu) -> int | None:
    """The token bucket of the mixed-step graph that holds a step, or None: its tokens within
    the largest bucket, a sequence to spare for the padding, no proposals, tables in width."""
    if not g.mixed_sizes:
        return None
    total = sum(s.num_new_tokens for s in scheduled)
    size = padded_size(g.mixed_sizes, total)
    if size is None or len(scheduled) >= g.max_num_seqs or any(s.draft_token_ids for s in scheduled) \
            or _widest(scheduled) > g.max_blocks_per_seq:
        return None
    return size
