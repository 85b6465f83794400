"""A step queued on the device and not yet read: what ``ModelRunner.run`` returns."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.prompt_logprobs import PendingPromptLogprobs
from engine.sampler import PendingSample, SamplerOutput
from engine.scheduler import SchedulerOutput


class LaunchedStep:
    """A step queued on the device, not waited for: its sampled ids stay on the device
    (the inputs of a step scheduled ahead) while a copy goes to the host. ``which``: the
    rows of ``out.scheduled`` that sample, in order (every row of a decode step; none of
    a step of chunks that all stop short of their prompt's end, ``sample`` then None).
    ``done``: the outcome of a step read before ``run`` returned (rows with proposals).
    ``prompt``: the prompt logprobs its rows computed (None: no row did)."""

    def __init__(self, out: SchedulerOutput, sample: PendingSample | None, which: Sequence[int],
                 done: tuple[list, list | None] | None = None, prompt: PendingPromptLogprobs | None = None) -> None:
        self.out, self.sample, self.which, self._done = out, sample, list(which), done
        self._prompt = prompt

    @property
    def token_ids(self) -> torch.Tensor:
        """[len(which)] int64 on the device, aligned with ``which``."""
        assert self.sample is not None
        return self.sample.token_ids

    def result(self) -> tuple[list[int | None], list | None]:
        """(sampled, logprobs), aligned with ``out.scheduled``: the sampled token (None for a
        chunk that does not reach the end of its tokens; a speculating row's accepted tokens,
        as a list) and, when any row asked for them, logprobs. Waits for the step."""
        if self._done is not None:
            return self._done
        n = len(self.out.scheduled)
        if self.sample is None:
            return [None] * n, None
        return _per_row(self.sample.result(), self.which, n)

    def prompt_logprobs(self) -> list | None:
        """Aligned with ``out.scheduled``: each row's (first prompt token's index, Logprobs of
        it and the following ones) or None; None when no row computed any. Waits for the step."""
        return self._prompt.result() if self._prompt is not None else None


def _per_row(res: SamplerOutput, which: Sequence[int], n: int) -> tuple[list[int | None], list | None]:
    """The sampler's output for rows ``which`` of a step of ``n`` rows, aligned with the step:
    each row's token (None where it did not sample), and logprobs (None when no row asked)."""
    sampled: list[int | None] = [None] * n
    for j, i in enumerate(which):
        sampled[i] = res.token_ids[j]
    if all(lp is None for lp in res.logprobs):
        return sampled, None
    logprobs: list = [None] * n
    for j, i in enumerate(which):
        logprobs[i] = res.logprobs[j]
    return sampled, logprobs
