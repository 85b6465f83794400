"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``): the logprob of each prompt
token given the ones before it, read from the logits of the position before it, with its
rank and the top-N. Prompt token 0 has none.

A step's rows that want them (``ScheduledRequest.prompt_logprob_positions``) get the LM head
over those positions of the eager pass's hidden states, besides the sampled positions (the
planner runs such steps eagerly: a graph keeps only the sampled rows). The positions go
through the head a slice at a time, at most ``_SLICE_ELEMENTS`` logits at once, so that a
2k-token chunk at a 150k vocabulary never holds its [2k, V] float32 logits (1.2 GB) whole.
Log-softmax in float32 of the raw logits (no temperature, penalties or bias), as the
sampled tokens' logprobs (engine/sampler.py). The values stay on the device until
``result()``: one copy to the host for the step.

    position p of a row's chunk   ->  logits[p]  ->  logprob of prompt token p + 1
    positions computed            =   [max(start, recorded), min(end, len(prompt) - 1))
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from engine.outputs import Logprobs
from engine.sampler import logprob_table, table_logprobs
from engine.scheduler import ScheduledRequest

_SLICE_ELEMENTS = 1 << 24  # logits (float32) computed at once: 64 MiB, and as much for their log-softmax


class PendingPromptLogprobs:
    """A step's prompt logprobs on the device. ``spans``: per row that computed some, (row
    index, its first prompt token's index, those tokens' ids, top-N); ``packed``: their
    positions in order, [sum of counts, 2 + 2 * top_n] float64 (logprob, rank, top ids, top
    logprobs), which holds ids and ranks exactly."""

    def __init__(self, num_rows: int, spans: Sequence[tuple[int, int, list[int], int]], packed: torch.Tensor,
                 top_n: int) -> None:
        self._num_rows, self._spans, self._packed, self._top_n = num_rows, list(spans), packed, top_n

    def result(self) -> list[tuple[int, list[Logprobs]] | None]:
        """Aligned with the step's rows: None, or (first prompt token's index, its Logprobs and
        the following ones'). Waits for the step."""
        host = self._packed.tolist()
        per_row: list[tuple[int, list[Logprobs]] | None] = [None] * self._num_rows
        at, m = 0, self._top_n
        for i, first, tokens, n in self._spans:
            rows = host[at:at + len(tokens)]
            at += len(tokens)
            per_row[i] = (first, [table_logprobs(tok, r, m, n) for tok, r in zip(tokens, rows)])
        return per_row


def prompt_logprobs_async(hidden: torch.Tensor, scheduled: Sequence[ScheduledRequest],
                          compute_logits: Callable[[torch.Tensor], torch.Tensor],
                          vocab_size: int) -> PendingPromptLogprobs | None:
    """The prompt logprobs of the rows of ``scheduled`` that want some, from ``hidden``
    ([T, hidden], the step's tokens in row order), queued; None when no row wants any."""
    spans: list[tuple[int, int, list[int], int]] = []
    index: list[int] = []
    at = 0
    for i, s in enumerate(scheduled):
        pos = s.prompt_logprob_positions
        if pos:
            tokens = list(s.request.all_token_ids[pos.start + 1:pos.stop + 1])
            spans.append((i, pos.start + 1, tokens, s.request.sampling_params.prompt_logprobs))
            base = at - s.start  # position p of this row is hidden[base + p]
            index.extend(range(base + pos.start, base + pos.stop))
        at += s.num_new_tokens
    if not spans:
        return None
    top_n = max(n for *_, n in spans)
    device = hidden.device
    index_t = torch.tensor(index, dtype=torch.long, device=device)
    targets_t = torch.tensor([t for _, _, tokens, _ in spans for t in tokens], dtype=torch.long, device=device)
    step = max(1, _SLICE_ELEMENTS // vocab_size)
    parts = []
    for a in range(0, len(index), step):
        lp = torch.log_softmax(compute_logits(hidden[index_t[a:a + step]]).float(), dim=-1)  # [k, V]
        parts.append(logprob_table(lp, targets_t[a:a + step], top_n))
    return PendingPromptLogprobs(len(scheduled), spans, torch.cat(parts), top_n)
