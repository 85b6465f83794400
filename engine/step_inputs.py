"""A step's flat inputs on the host: what every path that runs a step (eager, or a mixed-step
graph's padded buffers) builds from the schedule. Per request a slice or a row; per token only
vectorised work (an 8k-token prefill step is 8k positions and slots)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from engine.layers.attention import AttentionMetadata
from engine.sampler import to_device
from engine.scheduler import ScheduledRequest


@dataclass
class StepArrays:
    ids: np.ndarray  # [T] int64; a row a step ahead: 0 (its input is the token in flight, on the device)
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [G, T] int64 cache slot of each token, per KV cache group
    tables: np.ndarray  # [G, n, longest table] int32, 0 after each row's blocks
    query_start_loc: np.ndarray  # [n + 1] int64
    seq_lens: np.ndarray  # [n] int64
    counts: np.ndarray  # [n] int64 tokens of each row
    sample_idx: list[int]  # the last position of each sampling row; every position of a speculating row
    state_slots: np.ndarray | None = None  # [n] int32 linear-attention state slots (None: no such layers)


def step_arrays(scheduled: Sequence[ScheduledRequest], block_sizes: Sequence[int],
                linear_state: bool = False) -> StepArrays:
    """``block_sizes``: each KV cache group's; ``linear_state``: the rows carry state slots."""
    n = len(scheduled)
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=n)
    counts = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=n)
    ends = starts + counts
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=qsl[1:])
    total = int(qsl[-1])
    # A speculating row's inputs: its pending token, then the proposals to verify. A row a
    # step ahead takes the token in flight: a placeholder here.
    ids = np.fromiter(itertools.chain.from_iterable(
        (s.request.all_token_ids[a:b] if not s.draft_token_ids and not s.lookahead else
         (0,) if s.lookahead else itertools.chain(s.request.all_token_ids[a:a + 1], s.draft_token_ids))
        for s, a, b in zip(scheduled, starts.tolist(), ends.tolist())), dtype=np.int64, count=total)
    row = np.repeat(np.arange(n), counts)  # each token's request
    positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - starts, counts)
    g_count = len(block_sizes)
    width = max(len(t) for s in scheduled for t in s.block_ids)
    tables = np.zeros((g_count, n, width), dtype=np.int32)
    for i, s in enumerate(scheduled):
        for g, t in enumerate(s.block_ids):
            tables[g, i, :len(t)] = t
    slots = np.empty((g_count, total), dtype=np.int64)
    for g, bs in enumerate(block_sizes):
        slots[g] = tables[g, row, positions // bs].astype(np.int64) * bs + positions % bs
    state_slots = (np.fromiter((s.state_slot for s in scheduled), dtype=np.int32, count=n)
                   if linear_state else None)
    sample_idx = [p for i, s in enumerate(scheduled) if s.samples
                  for p in (range(int(qsl[i]), int(qsl[i + 1])) if s.draft_token_ids else (int(qsl[i + 1]) - 1,))]
    return StepArrays(ids, positions, slots, tables, qsl, ends, counts, sample_idx, state_slots)


def device_inputs(a: StepArrays, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(input ids, positions, attention metadata, sampled positions) of an eager step on the
    device. Through pinned memory: from pageable memory the copy may wait for the stream, and
    with steps overlapped the step before is still on it. The sampled positions go up as a
    device index: indexing the hidden states with a Python list copies it to the device
    synchronously, making the host wait for the whole forward pass."""
    def up(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return to_device(torch.from_numpy(x).to(dtype), device)

    meta = AttentionMetadata(slot_mapping=up(a.slots, torch.long), block_tables=up(a.tables, torch.int32),
                             query_start_loc=up(a.query_start_loc, torch.int32), seq_lens=up(a.seq_lens, torch.int32),
                             state_slots=None if a.state_slots is None else up(a.state_slots, torch.int32))
    rows = up(np.asarray(a.sample_idx, dtype=np.int64), torch.long)
    return up(a.ids, torch.long), up(a.positions, torch.long), meta, rows
