"""Tensor parallelism: the group of ranks that run one engine's model.

Rank 0 lives in the engine's own process and owns everything but the model
shards: the scheduler, the block tables, the sampler. Ranks 1..N-1 are
worker processes (``engine/tp_worker.py``), one per GPU (or CPU process),
each holding its shard of the weights and of the KV cache. Every step, rank 0
broadcasts the step's inputs and every rank runs the same forward pass;
row-parallel layers end in an all-reduce and the vocabulary-parallel LM
head's logits are gathered on every rank (only rank 0 samples).

    q heads        num_heads / N per rank, contiguous
    KV heads       num_kv_heads / N per rank; with fewer KV heads than ranks,
                   each is replicated on N / num_kv_heads consecutive ranks
    MLP            intermediate_size / N columns of gate and up, rows of down
                   (MoE: of every expert's; or, expert-parallel, E / N whole experts)
                   (engine/layers/ split their own parameters; Shard has the heads and vocab)
    vocabulary     cdiv(vocab, N) rows of the embedding and LM head per rank

One process group (gloo on CPU, NCCL on GPUs: one code path) built directly
on a TCPStore (never ``init_process_group``: a process may hold other groups,
such as KV pairs).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 300.0
# Read by ProcessGroupNCCL when a group is built, and only then: set around each build
# (``nccl_blocking_wait``), never for the whole process. The KV pairs turn it on
# (kv_transfer/pair.py); the TP group keeps it off: a wait then orders the caller's
# stream after the collective without blocking the host, which is what lets a step queue
# its 2 x num_layers all-reduces back to back, and lets CUDA graphs capture them.
BLOCKING_WAIT = "TORCH_NCCL_BLOCKING_WAIT"


@contextlib.contextmanager
def nccl_blocking_wait(value: str) -> Iterator[None]:
    """``TORCH_NCCL_BLOCKING_WAIT=value`` while an NCCL group is built inside the block."""
    old = os.environ.get(BLOCKING_WAIT)
    os.environ[BLOCKING_WAIT] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[BLOCKING_WAIT]
        else:
            os.environ[BLOCKING_WAIT] = old


def check_tp_size(size: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise ValueError unless a model with these heads can be split ``size`` ways."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if num_heads % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {size} and the model's {num_kv_heads} KV heads: one must "
                         "divide the other")


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds of a model (all ranges are [start, stop))."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int

    @property
    def q_heads(self) -> tuple[int, int]:
        n = self.num_heads // self.size
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_heads(self) -> tuple[int, int]:
        """This rank's KV heads; replicated when there are fewer KV heads than ranks."""
        return kv_head_range(self.rank, self.size, self.num_kv_heads)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def num_local_kv_heads(self) -> int:
        lo, hi = self.kv_heads
        return hi - lo

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.vocab_size // self.size)

    @property
    def vocab(self) -> tuple[int, int]:
        """Rows of the embedding / LM head; the last rank's may run past the vocabulary."""
        n = self.vocab_per_rank
        return self.rank * n, (self.rank + 1) * n


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """The KV heads rank ``rank`` of ``size`` holds: a contiguous share, or with fewer KV heads
    than ranks, one head each, replicated on size / num_kv_heads consecutive ranks."""
    if num_kv_heads >= size:
        n = num_kv_heads // size
        return rank * n, (rank + 1) * n
    head = rank * num_kv_heads // size
    return head, head + 1


def serve_store(host: str, size: int, timeout: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a port the OS picks (``.port``): the workers get it
    when they start, and the group forms once they all have."""
    return dist.TCPStore(host, 0, size, True, timedelta(seconds=timeout), wait_for_workers=False)


class TPGroup:
    """One rank's handle on the tensor-parallel group. Rank 0 passes the store it serves
    (``serve_store``); the other ranks connect to ``host:port``."""

    def __init__(self, rank: int, size: int, host: str, port: int, device: torch.device,
                 timeout: float = DEFAULT_TIMEOUT_S, store: dist.TCPStore | None = None) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if store is None:
            store = dist.TCPStore(host, port, size, False, timedelta(seconds=timeout))
        self.store = store  # rank 0 serves it: keep it alive with the group
        prefix = dist.PrefixStore("pdserve-tp", store)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout)
            with nccl_blocking_wait("0"):
                self.group = dist.ProcessGroupNCCL(prefix, rank, size, opts)
            # The communicator now, on this rank's GPU, rather than lazily from the first op.
            self.group.eager_connect_single_device(device)
        else:  # the ranks share a host: loopback, whatever the hostname resolves to
            gloo = dist.ProcessGroupGloo
            opts = gloo._Options()
            opts._timeout = timedelta(seconds=timeout)
            opts._devices = [gloo.create_device(hostname=host)]
            self.group = gloo(prefix, rank, size, opts)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns ``t``."""
        self.group.allreduce([t]).wait()
        return t

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank order, on every rank."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's ``t`` (same shape and dtype), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([t], opts).wait()
        return t

    def all_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def close(self) -> None:
        abort_group(self.group)


def abort_group(group: object) -> None:
    """Release a group's communicators without waiting for the peers. Never a shutdown:
    destroying an NCCL communicator waits for every peer to destroy its end, which hangs a
    process whose peers were killed or are gone (as at the end of a rank 0 process)."""
    if not hasattr(group, "abort"):
        return
    try:
        group.abort()
    except Exception:  # a peer already gone: nothing to release
        pass
