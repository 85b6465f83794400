"""Decode steps under CUDA graphs.

A decode step of a Python engine launches a few hundred small kernels; at
~10 us each the launches, not the GPU, set the step time. A CUDA graph
replays the whole forward pass (and the logits) as one launch. A graph
freezes every tensor address and shape, so:

- the step's inputs live in persistent device buffers (``DecodeInputs``),
  refilled before each replay from pinned host memory without a host sync;
- graphs are captured for a few padded batch sizes (``capture_sizes``); a
  batch of ``n`` runs the smallest captured size ``>= n`` and its padding
  rows write nowhere (slot -1) and read one key of block 0 (any block:
  their outputs are thrown away);
- block tables are ``[max_num_seqs, cdiv(max_model_len, block_size)]``, so
  one graph serves every context length; the attention's split-K count is
  fixed in a graph, so a size may have two graphs (``variants``): one with
  the split count for short contexts, used while the batch's longest
  context fits it, and one for contexts up to ``max_model_len`` (on an
  H200, one 32k sequence reads its keys 1.9x faster with 64 splits than
  16, while 64 splits slow a 1k-context step); the partial buffers come
  from the graphs' private memory pool, allocated at capture and reused by
  every replay;
- the logits are a static output, read by the sampler after the replay.

Which graph a step replays, if any, is the step planner's decision
(``engine/planner.py``); this module holds the graphs and fills their buffers
for a plan. Pure decode steps replay a graph of padded rows; steps with
prefill chunks, with mixed-step buckets (``MixedInputs``,
``RuntimeConfig.mixed_graph_sizes``), the graph of a token bucket. With speculative
decoding (``verify_len`` = k + 1) the small sizes also get verify graphs: every
row is k + 1 query tokens, its pending token and its proposals, padded at its
end with tokens that write nowhere (slot -1) and whose outputs are thrown away;
a row's seq_len counts its padding, so its real queries keep their causal
positions (the attention places a row's queries at the end of its keys). The
runner owns this object; nothing else touches its buffers.

Padded batch of a replay (``n`` real requests, size ``b``)::

    row          ids      positions   slot                seq_len   block table row
    [0, n)       token    p = n_comp  table[p//bs]*bs+p%bs  p + 1     the request's blocks, 0 after
    [n, b)       0        0           -1 (skip the write)   1         0 (reads block 0, key 0)
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine import gemm_backend
from engine.layers.attention import AttentionMetadata
from engine.scheduler import ScheduledRequest
from engine.step_inputs import step_arrays
from engine.step_plan import GraphMenu

logger = logging.getLogger(__name__)

# Batch sizes up to 8 are captured one power of two at a time; above that
# at 2^k and 1.5 * 2^k, so padding wastes at most a third of a batch.
_SMALL_SIZES = (1, 2, 4, 8)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes to capture, ascending; the last is ``max_num_seqs``."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = {s for s in _SMALL_SIZES if s <= max_num_seqs}
    k = 16
    while k <= max_num_seqs:
        sizes.add(k)
        if k * 3 // 2 <= max_num_seqs:
            sizes.add(k * 3 // 2)
        k *= 2
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeInputs:
    """Persistent input buffers of a padded decode batch, and their host
    staging. ``fill`` writes a batch into pinned host memory; ``upload``
    queues the copies to the device on the current stream (no host sync).
    Two host stagings are used in turn, each rewritten only after its last
    copies ran (an event a staging; with steps overlapped, the host fills
    step N+1 while step N's copies may still wait in the stream).

    A row may be a step ahead of the host (``ScheduledRequest.lookahead``):
    its position counts the positions the step in flight computes, and its
    input id is that token, which ``upload`` copies from the device
    (``ahead_ids``) over the placeholder ``fill`` wrote.

    Device layout (views are what a graph captures), with G KV cache groups:
        i64  [2 + G, M]   ids | positions | each group's slots
        i32  [2M + G*M*W] seq_lens | state slots | block-table staging (group x bucket x width, packed)
        qsl  [M + 1]      0, 1, ..., M (one query per row, constant)
        tables [G, M, W]  block tables, W = cdiv(max_model_len, block_size)
    Padding rows use the scratch state slot (``state_scratch``: writes nowhere that matters).
    """

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int | Sequence[int],
                 device: torch.device, max_query_len: int = 1, state_scratch: int | None = None) -> None:
        m, w, q = max_num_seqs, max_blocks_per_seq, max_query_len
        self.block_sizes = (block_size,) if isinstance(block_size, int) else tuple(block_size)
        self.block_size = min(self.block_sizes)
        g = self.num_groups = len(self.block_sizes)
        self.max_num_seqs, self.max_blocks_per_seq = m, w
        self.max_query_len = q
        self.state_scratch = state_scratch  # None: the model has no linear-attention state
        self.device = device
        pin = device.type == "cuda"
        self._staging = [(torch.zeros(2 + g, m * q, dtype=torch.int64, pin_memory=pin),
                          torch.zeros(2 * m + g * m * w, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        # each staging's last upload (an event never recorded is complete)
        self._copied = [torch.cuda.Event(), torch.cuda.Event()] if pin else None
        self._turn = 0
        self._use_staging(0)
        self.i64 = torch.zeros(2 + g, m * q, dtype=torch.int64, device=device)
        self.i32 = torch.zeros(2 * m + g * m * w, dtype=torch.int32, device=device)
        self.i32[:m] = 1
        self.i32[m:2 * m] = state_scratch or 0
        # query_start_loc of rows of one query (0, 1, ..., M), and of verify rows of q
        self.qsl = torch.arange(m + 1, dtype=torch.int32, device=device)
        self.qsl_verify = self.qsl * q
        # A verify row's padding reaches up to q - 1 positions past the last real one: the
        # extra columns keep its (discarded) block lookups inside the buffer.
        self.tables = torch.zeros(g, m, w + -(-(q - 1) // self.block_size), dtype=torch.int32, device=device)
        self.i64[2:] = -1  # before any fill: every row is padding

    def _use_staging(self, turn: int) -> None:
        self._turn = turn
        self.host_i64, self.host_i32 = self._staging[turn]
        self._h64 = self.host_i64.numpy()  # shares memory
        self._h32 = self.host_i32.numpy()

    def views(self, size: int, num_splits: int | None = None, query_len: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids, positions, metadata) of a padded batch of ``size`` rows of ``query_len``
        tokens each (1, or the verify length)."""
        n, m = size * query_len, self.max_num_seqs
        qsl = self.qsl if query_len == 1 else self.qsl_verify
        meta = AttentionMetadata(slot_mapping=self.i64[2:, :n], block_tables=self.tables[:, :size],
                                 query_start_loc=qsl[:size + 1], seq_lens=self.i32[:size],
                                 state_slots=self.i32[m:m + size] if self.state_scratch is not None else None,
                                 num_splits=num_splits)
        return self.i64[0, :n], self.i64[1, :n], meta

    def _width(self, scheduled: Sequence[ScheduledRequest]) -> int:
        width = max(len(t) for s in scheduled for t in s.block_ids)
        if width > self.max_blocks_per_seq:
            raise ValueError(f"a block table has {width} blocks; the buffers hold {self.max_blocks_per_seq}")
        return width

    def _fill_tables_and_slots(self, scheduled: Sequence[ScheduledRequest], size: int, width: int) -> None:
        h32, m, g_count = self._h32, self.max_num_seqs, self.num_groups
        staged = h32[2 * m:2 * m + g_count * size * width].reshape(g_count, size, width)
        staged.fill(0)
        for i, s in enumerate(scheduled):
            for g, t in enumerate(s.block_ids):
                staged[g, i, :len(t)] = t
        h32[m:m + size] = self.state_scratch or 0
        if self.state_scratch is not None:
            h32[m:m + len(scheduled)] = [s.state_slot for s in scheduled]

    def fill(self, scheduled: Sequence[ScheduledRequest], size: int) -> int:
        """Write a pure-decode batch, padded to ``size`` rows, into the host
        buffers. Returns the block-table width used (the longest table)."""
        n, m = len(scheduled), self.max_num_seqs
        if not 1 <= n <= size <= m:
            raise ValueError(f"batch of {n} does not fit a padded size of {size} (at most {m})")
        width = self._width(scheduled)
        self._use_staging(1 - self._turn)
        if self._copied is not None:
            self._copied[self._turn].synchronize()  # its copies were queued two steps ago: done, in practice
        h64, h32 = self._h64, self._h32
        pos = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=n)
        h64[1, :n] = pos
        known = [s.request.all_token_ids[p] if not s.lookahead else 0 for s, p in zip(scheduled, pos.tolist())]
        h64[0, :n] = known
        for g, bs in enumerate(self.block_sizes):
            h64[2 + g, :n] = np.fromiter((s.block_ids[g][p // bs] for s, p in zip(scheduled, pos.tolist())),
                                         dtype=np.int64, count=n) * bs + pos % bs
        h64[0, n:size] = 0
        h64[1, n:size] = 0
        h64[2:, n:size] = -1
        h32[:n] = pos + 1
        h32[n:size] = 1
        self._fill_tables_and_slots(scheduled, size, width)
        return width

    def fill_verify(self, scheduled: Sequence[ScheduledRequest], size: int) -> int:
        """Write a verify batch (each row: its pending token, then its proposals) padded to
        ``size`` rows of ``max_query_len`` tokens into the host buffers; the table width."""
        n, m, q = len(scheduled), self.max_num_seqs, self.max_query_len
        if not 1 <= n <= size <= m:
            raise ValueError(f"batch of {n} does not fit a padded size of {size} (at most {m})")
        width = self._width(scheduled)
        self._use_staging(1 - self._turn)
        if self._copied is not None:
            self._copied[self._turn].synchronize()
        h64, h32 = self._h64, self._h32
        ids = np.zeros((size, q), dtype=np.int64)
        pos = np.zeros((size, q), dtype=np.int64)
        slots = np.full((self.num_groups, size, q), -1, dtype=np.int64)
        lens = np.full(size, q, dtype=np.int32)  # padding rows: q queries over keys 0..q-1 of block 0
        for i, s in enumerate(scheduled):
            p0, drafts = s.request.num_computed_tokens, s.draft_token_ids
            real = 1 + len(drafts)
            ids[i, 0] = s.request.all_token_ids[p0]
            ids[i, 1:real] = drafts
            pos[i] = np.arange(p0, p0 + q)
            where = pos[i, :real]
            for g, bs in enumerate(self.block_sizes):
                slots[g, i, :real] = np.asarray(s.block_ids[g], dtype=np.int64)[where // bs] * bs + where % bs
            lens[i] = p0 + q
        h64[0, :size * q], h64[1, :size * q] = ids.ravel(), pos.ravel()
        h64[2:, :size * q] = slots.reshape(self.num_groups, -1)
        h32[:size] = lens
        self._fill_tables_and_slots(scheduled, size, width)
        return width

    def upload(self, size: int, width: int, ahead_ids: torch.Tensor | None = None) -> None:
        """Queue the host -> device copies of a filled batch (non-blocking). ``ahead_ids``:
        the input ids of the leading rows that are a step ahead, on the device (the step in
        flight's sampled ids; a failed row's -1 becomes 0: that row's output is discarded)."""
        self.i64.copy_(self.host_i64, non_blocking=True)
        end = self.staged_i32(size, width)
        end.copy_(self.host_i32[:end.numel()], non_blocking=True)
        if self._copied is not None:
            self._copied[self._turn].record()
        if ahead_ids is not None:
            torch.clamp(ahead_ids, min=0, out=self.i64[0, :ahead_ids.numel()])
        self.place_tables(size, width)

    def staged_i32(self, size: int, width: int) -> torch.Tensor:
        """The device i32 buffer's used part for a batch: seq_lens, state slots, the staged tables."""
        return self.i32[:2 * self.max_num_seqs + self.num_groups * size * width]

    def place_tables(self, size: int, width: int) -> None:
        """Staged block tables -> the [G, M, W] tables the graphs read (on the device)."""
        m, g = self.max_num_seqs, self.num_groups
        self.tables[:, :size, :width].copy_(self.i32[2 * m:2 * m + g * size * width].view(g, size, width))


class MixedInputs:
    """Persistent buffers of a mixed step (prefill chunks, with or without decode rows) padded
    to a token bucket of ``size`` tokens and to ``max_num_seqs`` sequences, so that one graph
    serves any such step of at most ``size`` tokens:

        sequence      tokens                  seq_len         block table row
        [0, n)        its chunk or decode row its context     its blocks, 0 after
        n (padding)   the bucket's spare ones pad (p = 0..)   0 (block 0; writes nowhere, slot -1)
        (n, M)        none (q_len 0)          0               0

    The paged kernel numbers its tiles from query_start_loc without a host sync and the tiles
    of an empty sequence exit at once, so the padding costs a few programs. ``rows``: the
    positions whose logits are sampled (each sampling row's last), padded with 0. Filled on the
    host, uploaded from pinned memory without a sync (the caching host allocator keeps each
    staging tensor until its copy ran)."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int, block_size: int | Sequence[int],
                 device: torch.device, max_tokens: int, state_scratch: int | None = None) -> None:
        m, w = max_num_seqs, max_blocks_per_seq
        self.block_sizes = (block_size,) if isinstance(block_size, int) else tuple(block_size)
        g = len(self.block_sizes)
        self.max_num_seqs, self.max_blocks_per_seq = m, w
        self.max_tokens, self.device = max_tokens, device
        self.state_scratch = state_scratch  # padding sequences' state slot (None: no linear layers)
        self.i64 = torch.zeros(2 + g, max_tokens, dtype=torch.int64, device=device)  # ids | positions | slots
        self.i64[2:] = -1
        self.qsl = torch.zeros(m + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(m, dtype=torch.int32, device=device)
        self.state_slots = torch.full((m,), state_scratch or 0, dtype=torch.int32, device=device)
        self.tables = torch.zeros(g, m, w, dtype=torch.int32, device=device)
        self.rows = torch.zeros(m, dtype=torch.int64, device=device)

    def views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        meta = AttentionMetadata(slot_mapping=self.i64[2:, :size], block_tables=self.tables,
                                 query_start_loc=self.qsl, seq_lens=self.seq_lens, num_splits=1,
                                 state_slots=self.state_slots if self.state_scratch is not None else None)
        return self.i64[0, :size], self.i64[1, :size], meta, self.rows

    def fill_and_upload(self, scheduled: Sequence[ScheduledRequest], size: int,
                        ahead_ids: torch.Tensor | None = None) -> None:
        """The step (a mixed-step plan's: ``engine.planner.mixed_bucket``) into the buffers; ``ahead_ids``: as ``DecodeInputs.upload`` (the
        leading rows a step ahead are one token each, so row i's token is token i)."""
        n, m = len(scheduled), self.max_num_seqs
        # the step as an eager one runs it, then padded
        a = step_arrays(scheduled, self.block_sizes, linear_state=self.state_scratch is not None)
        total = a.ids.shape[0]
        qsl = np.full(m + 1, size, dtype=np.int32)  # the padding sequence takes the spare tokens, the rest none
        qsl[:n + 1] = a.query_start_loc
        lens = np.zeros(m, dtype=np.int32)
        lens[:n] = a.seq_lens
        lens[n] = size - total
        i64 = np.zeros((2 + len(self.block_sizes), size), dtype=np.int64)
        i64[0, :total], i64[1, :total], i64[2:, :total] = a.ids, a.positions, a.slots
        i64[1, total:] = np.arange(size - total)
        i64[2:, total:] = -1
        tables = np.zeros((len(self.block_sizes), m, self.max_blocks_per_seq), dtype=np.int32)
        tables[:, :n, :a.tables.shape[2]] = a.tables
        rows = np.zeros(m, dtype=np.int64)
        rows[:len(a.sample_idx)] = a.sample_idx
        states = np.full(m, self.state_scratch or 0, dtype=np.int32)
        if a.state_slots is not None:
            states[:n] = a.state_slots
        for dst, src in ((self.i64[:, :size], i64), (self.qsl, qsl), (self.seq_lens, lens), (self.tables, tables),
                         (self.rows, rows), (self.state_slots, states)):
            host = torch.from_numpy(src)
            dst.copy_(host.pin_memory() if self.device.type == "cuda" else host, non_blocking=True)
        if ahead_ids is not None:
            torch.clamp(ahead_ids, min=0, out=self.i64[0, :ahead_ids.numel()])


class GraphStep(NamedTuple):
    """Which graph a prepared decode step replays, and its block-table width."""

    size: int
    splits: int | None
    width: int
    query_len: int = 1  # tokens a row: 1, or the verify length


# (input_ids [B], positions [B], kv_cache, metadata) -> logits [B, V] float32
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
# (input_ids [T], positions [T], kv_cache, metadata, rows [M]) -> logits [M, V] float32 of the rows
MixedForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Captured decode graphs, one per padded batch size.

    ``forward`` is the model's forward pass followed by its logits. With
    ``use_graphs=False`` (CPU tests) ``run`` calls it eagerly on the same
    persistent buffers, so everything but the capture itself is testable
    without a GPU.
    """

    def __init__(self, forward: ForwardFn, kv_cache: torch.Tensor, inputs: DecodeInputs,
                 sizes: Sequence[int], variants: dict[int, list[tuple[int, int | None]]] | None = None,
                 use_graphs: bool = True, other_threads_may_use_cuda: bool = False,
                 verify_sizes: Sequence[int] = (), mixed: tuple[MixedForwardFn, MixedInputs] | None = None,
                 mixed_sizes: Sequence[int] = (), decode_blas: str | None = None) -> None:
        """``variants[size]``: [(longest context, attention splits)], ascending by context; a
        batch replays the first whose context holds its longest. Default: one graph a size,
        the kernel's own split choice. ``verify_sizes``: the sizes that also get a verify
        graph (rows of ``inputs.max_query_len`` tokens; the kernel's split choice).
        ``decode_blas``: the BLAS library each graph is captured under (engine/gemm_backend.py)."""
        if max(sizes) > inputs.max_num_seqs:
            raise ValueError(f"capture size {max(sizes)} exceeds the buffers' {inputs.max_num_seqs} rows")
        self.forward, self.kv_cache, self.inputs = forward, kv_cache, inputs
        self.sizes = sorted(sizes)
        self.verify_len = inputs.max_query_len
        self.verify_sizes = sorted(verify_sizes) if self.verify_len > 1 else []
        unbounded = inputs.max_blocks_per_seq * min(inputs.block_sizes)
        self.variants = {s: sorted((variants or {}).get(s) or [(unbounded, None)]) for s in self.sizes}
        self.use_graphs = use_graphs
        self.decode_blas = decode_blas
        # A capture fails when any thread makes an unsafe CUDA call meanwhile ("global" mode);
        # with collectives inside the graphs, NCCL's own threads may: only this thread counts.
        self._capture_mode = "thread_local" if other_threads_may_use_cuda else "global"
        self.graphs: dict[tuple[int, int | None, int], torch.cuda.CUDAGraph] = {}  # (size, splits, query_len)
        self.last_splits: int | None = None  # the variant the last run used (for tests and logs)
        self.logits: torch.Tensor | None = None  # static output [max size, V] float32, shared by all sizes
        self.num_replays = 0
        self.memory_bytes = 0  # device memory the capture took (pool + graphs), measured
        # Mixed steps (MixedInputs): one graph per token bucket, when given.
        self.mixed_forward, self.mixed_inputs = mixed if mixed is not None else (None, None)
        self.mixed_sizes = sorted(mixed_sizes) if mixed is not None else []
        self.mixed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_mixed_replays = 0

    def _forward(self, size: int, splits: int | None, query_len: int = 1) -> torch.Tensor:
        ids, positions, meta = self.inputs.views(size, splits, query_len)
        return self.forward(ids, positions, self.kv_cache, meta)

    def _forward_into_output(self, size: int, splits: int | None, query_len: int = 1) -> None:
        # One shared output outside the graphs' pool: per-size outputs would
        # each stay allocated (hundreds of MiB at a 128k vocabulary).
        self._into_output(self._forward(size, splits, query_len))

    def _into_output(self, logits: torch.Tensor) -> None:
        if self.logits is None:
            rows = max(self.sizes[-1], max(self.verify_sizes, default=0) * self.verify_len,
                       self.mixed_inputs.max_num_seqs if self.mixed_inputs is not None else 0)
            self.logits = torch.empty((rows, logits.shape[1]), dtype=torch.float32, device=logits.device)
        self.logits[:logits.shape[0]].copy_(logits)

    def _forward_mixed_into_output(self, size: int) -> None:
        assert self.mixed_forward is not None and self.mixed_inputs is not None
        ids, positions, meta, rows = self.mixed_inputs.views(size)
        self._into_output(self.mixed_forward(ids, positions, self.kv_cache, meta, rows))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels of each shape) and capture
        every size, largest first so the smaller ones reuse its pool. The
        buffers hold padding rows only, so capture writes nothing to the KV
        cache. Python's garbage collector runs first and waits until the end:
        a collection inside a capture can free another engine's CUDA objects
        (pinned host buffers, events: in a process that made an engine before),
        calls a capture does not allow, and the capture fails."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            self._capture_all()
        finally:
            if enabled:
                gc.enable()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        dev = self.inputs.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(dev)[0]
        pool = torch.cuda.graph_pool_handle()
        # on this engine's GPU: torch.cuda.graph's default capture stream is made once per
        # process, on the device current then (another engine's, in a process with two)
        stream = torch.cuda.Stream(dev)
        self._capture_mixed(pool, stream)  # (the largest activations first: the pool is theirs)
        shapes = [(size, splits, 1) for size in reversed(self.sizes) for _, splits in self.variants[size]]
        shapes += [(size, None, self.verify_len) for size in reversed(self.verify_sizes)]
        for size, splits, q in sorted(shapes, key=lambda x: -x[0] * x[2]):  # largest first: one pool
            def capture_one(size=size, splits=splits, q=q) -> torch.cuda.CUDAGraph:
                self._forward_into_output(size, splits, q)  # warm-up outside the graph: Triton compiles here
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=self._capture_mode):
                    self._forward_into_output(size, splits, q)
                return graph
            # under the BLAS library RuntimeConfig.decode_blas names for its rows (unset: as before)
            self.graphs[(size, splits, q)] = gemm_backend.capture(capture_one, size * q, dev, self.decode_blas)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # the warm-ups' blocks; the graphs' pool stays
        used = free_before - torch.cuda.mem_get_info(dev)[0]
        self.memory_bytes = used
        logger.info("captured %d decode graphs (batch sizes %s; attention splits by longest context %s%s) "
                    "in %.1f s, %.0f MiB", len(self.graphs), ",".join(map(str, self.sizes)),
                    {s: self.variants[s] for s in self.sizes},
                    f"; verify graphs of {self.verify_len} tokens a row at sizes "
                    f"{','.join(map(str, self.verify_sizes))}" if self.verify_sizes else "",
                    time.perf_counter() - t0, used / 2**20)

    def _capture_mixed(self, pool, stream: torch.cuda.Stream) -> None:
        """One graph per mixed-step bucket, largest first; a capture that fails (a kernel that
        reads a size back to the host, say) turns mixed graphs off with a warning."""
        dev = self.inputs.device
        try:
            for size in reversed(self.mixed_sizes):
                def capture_one(size=size) -> torch.cuda.CUDAGraph:
                    self._forward_mixed_into_output(size)  # warm-up outside the graph
                    torch.cuda.synchronize(dev)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=self._capture_mode):
                        self._forward_mixed_into_output(size)
                    return graph
                self.mixed_graphs[size] = gemm_backend.capture(capture_one, size, dev, self.decode_blas)
        except RuntimeError as exc:
            logger.warning("mixed-step graphs off: capturing a %d-token step failed (%s)", size, exc)
            torch.cuda.synchronize(dev)
            self.mixed_graphs.clear()
            self.mixed_sizes = []
        if self.mixed_graphs:
            logger.info("captured mixed-step graphs of %s tokens", ",".join(map(str, self.mixed_sizes)))

    def fill_mixed(self, scheduled: Sequence[ScheduledRequest], size: int,
                   ahead_ids: torch.Tensor | None = None) -> None:
        """Fill and upload a step that a mixed-step graph of ``size`` tokens holds (the plan's)."""
        assert self.mixed_inputs is not None
        self.mixed_inputs.fill_and_upload(scheduled, size, ahead_ids)

    def replay_mixed(self, size: int) -> torch.Tensor:
        """Run the mixed-step graph of ``size`` tokens on the inputs already uploaded; the static
        logits, row j the j-th sampling row's (``MixedInputs.rows``)."""
        if self.use_graphs:
            self.mixed_graphs[size].replay()
        else:
            self._forward_mixed_into_output(size)
        self.num_mixed_replays += 1
        assert self.logits is not None
        return self.logits

    @property
    def menu(self) -> GraphMenu:
        """What these graphs hold, for the step planner (after capture: a failed mixed-step
        capture leaves none)."""
        return GraphMenu(decode_sizes=tuple(self.sizes), max_num_seqs=self.inputs.max_num_seqs,
                         max_blocks_per_seq=self.inputs.max_blocks_per_seq,
                         variants={s: tuple(v) for s, v in self.variants.items()}, verify_len=self.verify_len,
                         verify_sizes=tuple(self.verify_sizes), mixed_sizes=tuple(self.mixed_sizes))

    def fill_decode(self, scheduled: Sequence[ScheduledRequest], size: int, splits: int | None,
                    ahead_ids: torch.Tensor | None = None) -> GraphStep:
        """Fill and upload the inputs of a pure-decode step that the graph of ``size`` rows holds
        (the plan's). ``ahead_ids``: see ``DecodeInputs.upload`` (its length is the number of
        leading rows a step ahead)."""
        width = self.inputs.fill(scheduled, size)
        self.inputs.upload(size, width, ahead_ids)
        return GraphStep(size, splits, width)

    def fill_verify(self, scheduled: Sequence[ScheduledRequest], size: int) -> GraphStep:
        """Fill and upload a verify step that the verify graph of ``size`` rows holds."""
        width = self.inputs.fill_verify(scheduled, size)
        self.inputs.upload(size, width)
        return GraphStep(size, None, width, self.verify_len)

    def replay(self, size: int, splits: int | None, query_len: int = 1) -> torch.Tensor:
        """Run the graph of (size, splits, query_len) on the inputs already in the device
        buffers; the static logits [rows, V] (row i's query j at i * query_len + j)."""
        self.last_splits = splits
        if self.use_graphs:
            self.graphs[(size, splits, query_len)].replay()
        else:
            self._forward_into_output(size, splits, query_len)
        self.num_replays += 1
        assert self.logits is not None
        return self.logits
