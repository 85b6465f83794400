"""The tensor-parallel wire: how rank 0 tells the other ranks what to run.

Rank 0 drives (its runner plans and runs each step); every other rank runs ``serve_steps``,
a loop that takes rank 0's broadcasts in order and does the same work on its share of the
model. Each message is a 5-int64 header, then its payload:

    command     header                                payload
    _STEP       [1, tokens T, rows B, table width W,  int64: ids[T] positions[T] slots[T]
                 sampled rows S]                       tables[B*W] query_start_loc[B+1] seq_lens[B]
                                                       sample_idx[S] (+ adapter slots[T] with LoRA)
    _GRAPH      [2, size, splits (-1: none), width, 0] the decode graph's int64 and staged int32 buffers
                                                       (+ the rows' adapter slots with LoRA)
    _LORA_SLOT  [3, slot, bytes N, 0, 0]              uint8[N]: the adapter (JSON name, path, fingerprint)
    _STOP       [0, 0, 0, 0, 0]                       none

Broadcasts keep their order, so a slot fill reaches every rank before any step that reads
it. Headers go up from pinned memory: a pageable copy would wait for the step in flight.
"""
from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

import torch

from engine.layers.attention import AttentionMetadata
from engine.sampler import to_device

if TYPE_CHECKING:
    from engine.cuda_graphs import GraphStep
    from engine.lora.config import LoRAInfo
    from engine.runner_parts import RunnerParts

logger = logging.getLogger(__name__)

_STOP, _STEP, _GRAPH, _LORA_SLOT = 0, 1, 2, 3


class TPWire:
    """Rank 0's side (``broadcast_step``, ``share_graph_step``, ``share_lora_slot``, ``stop``)
    and the other ranks' side (``serve_steps``) of one runner's tensor-parallel group. It reads
    the runner's model, KV cache, graphs and adapters; it owns only the message format."""

    def __init__(self, runner: RunnerParts) -> None:
        assert runner.tp is not None
        self.runner, self.tp, self.device = runner, runner.tp, runner.device

    def _header(self, *values: int) -> None:
        self.tp.broadcast(to_device(torch.tensor(values, dtype=torch.int64), self.device))

    # ---- rank 0 -------------------------------------------------------------
    def broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       sample_idx: torch.Tensor) -> None:
        """An eager step's inputs to every other rank (a header, then one int64 payload)."""
        _, b, w = meta.block_tables.shape  # [G, B, W]: G is the layout's, known to every rank
        self._header(_STEP, input_ids.shape[0], b, w, sample_idx.shape[0])
        parts = [input_ids, positions, meta.slot_mapping.flatten(), meta.block_tables.flatten(), meta.query_start_loc,
                 meta.seq_lens, sample_idx]
        if meta.state_slots is not None:
            parts.append(meta.state_slots)
        lora = self.runner.lora
        if lora is not None:  # each token's adapter slot (-1 throughout: none)
            parts.append(lora.batch.token_slots[:input_ids.shape[0]] if lora.batch.active
                         else torch.full_like(input_ids, -1))
        self.tp.broadcast(torch.cat([p.to(torch.int64) for p in parts]))

    def share_graph_step(self, step: GraphStep) -> None:
        """Which decode graph this step replays, then the inputs rank 0 uploaded (the other
        ranks place the block tables themselves)."""
        self._header(_GRAPH, step.size, -1 if step.splits is None else step.splits, step.width, 0)
        self._broadcast_graph_inputs(step.size, step.width)

    def share_lora_slot(self, slot: int, info: LoRAInfo) -> None:
        """Rank 0 filled ``slot`` with ``info``: every other rank does the same."""
        data = json.dumps({"name": info.name, "path": info.path, "fingerprint": info.fingerprint}).encode()
        self._header(_LORA_SLOT, slot, len(data), 0, 0)
        self.tp.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def stop(self) -> None:
        """Tell the other ranks to leave ``serve_steps`` (a rank already gone is logged)."""
        try:
            self._header(_STOP, 0, 0, 0, 0)
        except Exception as e:
            logger.info("tensor-parallel stop: %s", e)

    def _broadcast_graph_inputs(self, size: int, width: int) -> None:
        """Rank 0's uploaded decode-graph inputs into every rank's buffers (the same call on all)."""
        graphs = self.runner.graphs
        assert graphs is not None
        self.tp.broadcast(graphs.inputs.i64)
        self.tp.broadcast(graphs.inputs.staged_i32(size, width))
        if self.runner.lora is not None:  # the rows' adapter slots, which the graph reads
            self.tp.broadcast(self.runner.lora.batch.token_slots[:size])

    # ---- ranks > 0 ------------------------------------------------------------
    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Run every step rank 0 broadcasts, until it says stop."""
        assert self.tp.rank > 0
        r, dev = self.runner, self.device
        while True:
            cmd, t, b, w, s = self.tp.broadcast(torch.empty(5, dtype=torch.int64, device=dev)).tolist()
            if cmd == _STOP:
                return
            if cmd == _GRAPH:  # the inputs into this rank's buffers (adapter slots too), then the same graph
                assert r.graphs is not None
                self._broadcast_graph_inputs(t, w)
                r.graphs.inputs.place_tables(t, w)
                r.graphs.replay(t, None if b < 0 else b)
                continue
            if cmd == _LORA_SLOT:  # rank 0 filled slot t: the same adapter into this rank's slot
                data = bytes(self.tp.broadcast(torch.empty(b, dtype=torch.uint8, device=dev)).cpu().tolist())
                r.lora.follow_slot(t, data)
                continue
            lora_t = t if r.lora is not None else 0
            g = r.layout.num_groups
            states = b if r.cache_spec.num_state_slots else 0
            payload = self.tp.broadcast(torch.empty(2 * t + g * t + g * b * w + 2 * b + 1 + s + states + lora_t,
                                                    dtype=torch.int64, device=dev))
            ids, pos, slots, tables, qsl, lens, idx, state_slots, lora_slots = payload.split(
                [t, t, g * t, g * b * w, b + 1, b, s, states, lora_t])
            meta = AttentionMetadata(slot_mapping=slots.view(g, t), block_tables=tables.view(g, b, w).to(torch.int32),
                                     query_start_loc=qsl.to(torch.int32), seq_lens=lens.to(torch.int32),
                                     state_slots=state_slots.to(torch.int32) if states else None)
            if r.lora is not None:
                r.lora.batch.set_device(lora_slots.to(torch.int32))
            hidden = r.model(ids, pos, r.kv_cache, meta)
            if s:
                r.model.compute_logits(hidden[idx])  # takes part in the gather
