"""Wire protocol of a KV pair: layouts and their compatibility, merged block runs,
the backend choice, errors and per-transfer results."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any, NamedTuple, Sequence

import torch

logger = logging.getLogger(__name__)


_Group = Any  # a c10d ProcessGroupGloo | ProcessGroupNCCL backend, used directly (no init_process_group)

PROTOCOL_VERSION = 1
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_PAIR_NAME = "pdserve-kv"
SENDER_RANK = 0
RECEIVER_RANK = 1
_HEADER_QUEUE = "hdr"
_TAG = 0
_OK, _ABORTED = 0, 1  # trailer values
_IDLE_WAIT = timedelta(days=1)  # header wait chunk when recv(timeout=None); close() wakes it
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


class KVTransferError(RuntimeError):
    """A KV transfer or pair setup failed; the message says what and where."""

    request_id: str | None = None  # set when a started transfer of this request failed


class KVChannelClosed(KVTransferError):
    """The pair was closed (by this side or by the peer); no more transfers."""


@dataclass(frozen=True)
class KVLayout:
    """What both sides of a pair must agree on. ``num_blocks`` may differ."""

    model: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str) -> KVLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError("kv_cache must be [num_layers, num_blocks, 2, block_size, "
                             f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model=model, dtype=_dtype_name(kv_cache.dtype), block_size=block_size,
                   num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise ValueError unless ``kv_cache`` has this layout and is contiguous."""
        want = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        got = (kv_cache.shape[0], *kv_cache.shape[2:]) if kv_cache.dim() == 6 else tuple(kv_cache.shape)
        if got != want or _dtype_name(kv_cache.dtype) != self.dtype:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                             f"the pair's layout {self}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")


def check_compatible(local: KVLayout, remote: KVLayout, local_role: str = "local",
                     remote_role: str = "remote") -> None:
    """Raise KVTransferError naming every field that differs (values in (local, remote) order)."""
    diffs = _layout_diffs(local, remote)
    if diffs:
        raise KVTransferError(f"KV layout mismatch between {local_role} and {remote_role}: "
                              + "; ".join(diffs))


def _layout_diffs(a: KVLayout, b: KVLayout) -> list[str]:
    return [f"{f.name} {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
            for f in fields(KVLayout) if getattr(a, f.name) != getattr(b, f.name)]


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal runs where src and dst ids both go up by one.

    merge_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} src block ids but {len(dst_block_ids)} dst block ids")
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((int(src), int(dst), 1))
    return runs


def choose_backend(sender_device: str, receiver_device: str, same_gpu: bool) -> tuple[str, str]:
    """("nccl" | "gloo", reason for the logs). Pure: both sides compute the same answer."""
    s_cuda = torch.device(sender_device).type == "cuda"
    r_cuda = torch.device(receiver_device).type == "cuda"
    if s_cuda and r_cuda and not same_gpu:
        return "nccl", f"nccl: prefill on {sender_device}, decode on {receiver_device}"
    if s_cuda and r_cuda:
        return "gloo", (f"gloo (host-staged): prefill and decode share {sender_device}, "
                        "NCCL cannot pair two ranks on one GPU")
    if s_cuda or r_cuda:
        return "gloo", (f"gloo (host-staged): prefill on {sender_device}, decode on "
                        f"{receiver_device}; NCCL needs CUDA on both sides")
    return "gloo", "gloo: prefill and decode on CPU"


@dataclass(frozen=True)
class TransferStats:
    """One transfer as seen by one side. ``num_messages`` counts data messages
    (layers x merged runs); the single control header is not counted."""

    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    num_messages: int

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else float("inf")


class ReceivedKV(NamedTuple):
    """One received transfer: whose, into which blocks, how it went, and the
    sender's small JSON ``meta`` (e.g. the first sampled token)."""

    request_id: str
    dst_block_ids: list[int]
    stats: TransferStats
    meta: dict[str, Any]

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
