"""Tensor-parallel parts: a request's KV between engines of different TP sizes moves in
parts, straight from rank to rank, each part one share of the KV heads over a pair of
its own (nothing is gathered on one rank).

    kv_transfer_parts(src_size, dst_size, num_kv_heads)   who sends which heads to whom
    check_page_split(layout, src_size, dst_size)          refuse parts that would split a page
    receive_part(...)                                      one part into a rank's heads, accounted once
    close_on_ranks(...)                                    close what keys name on worker ranks

A part lands in a head slice of the receiving rank's cache (``cache[..., h0:h1, :]``);
the sender gathers its own head slice (see protocol.py, ``KVLayout.check_cache``).
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from engine.parallel import kv_head_range
from engine.rank_calls import RankCallError, call
from kv_transfer.canary import KVChecksumError
from kv_transfer.protocol import KVChannelClosed, KVLayout, TransferStats
from kv_transfer.receiver import KVReceiver

logger = logging.getLogger(__name__)


class KVPart(NamedTuple):
    """One piece of a request's KV between two tensor-parallel engines: what sender rank
    ``src_rank`` sends to receiver rank ``dst_rank``, as local head ranges of each one's cache."""

    src_rank: int
    dst_rank: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]


def kv_transfer_parts(src_size: int, dst_size: int, num_kv_heads: int) -> list[KVPart]:
    """Who sends which heads to whom when a TP = ``src_size`` engine hands a request's KV to a
    TP = ``dst_size`` one: every receiver rank gets each of its heads once, from the lowest
    sender rank that holds it, straight from rank to rank (nothing gathered on one rank).

    kv_transfer_parts(2, 1, 8) == [KVPart(0, 0, (0, 4), (0, 4)), KVPart(1, 0, (0, 4), (4, 8))]"""
    parts = []
    for dst in range(dst_size):
        d0, d1 = kv_head_range(dst, dst_size, num_kv_heads)
        for src in range(src_size):
            s0, s1 = kv_head_range(src, src_size, num_kv_heads)
            lo, hi = max(d0, s0), min(d1, s1)
            first_holder = src == 0 or kv_head_range(src - 1, src_size, num_kv_heads)[1] <= lo
            if lo < hi and first_holder:
                parts.append(KVPart(src, dst, (lo - s0, hi - s0), (lo - d0, hi - d0)))
    return parts


def check_state_ranks(linear_state: str, prefill_ranks: int, decode_ranks: int) -> None:
    """Raise ValueError where a channel would need a linear-attention state in parts: a hybrid
    model's state is sent by one rank into one rank (its slots are sharded by heads, and a worker
    rank's KV handlers reach its KV cache only), so both tiers must run it at
    --tensor-parallel-size 1."""
    if linear_state and (prefill_ranks > 1 or decode_ranks > 1):
        raise ValueError(f"the linear-attention state of a hybrid model is sent between tiers with one rank on "
                         f"each side only (--tensor-parallel-size 1): prefill has {prefill_ranks} rank(s), decode "
                         f"{decode_ranks}; serve it at --tensor-parallel-size 1 on both tiers, or colocated "
                         "(pdserve serve)")


def whole_pages(parts: Sequence[KVPart], src_size: int, dst_size: int, num_kv_heads: int) -> bool:
    """Whether every part moves whole pages: rank r's every KV head into rank r's, on two
    engines of one size (rank r of each holds the same heads of every layer)."""
    return src_size == dst_size and len(parts) == dst_size and all(
        p.src_rank == p.dst_rank and p.src_heads == p.dst_heads == (0, _local_heads(p.dst_rank, dst_size, num_kv_heads))
        for p in parts)


def _local_heads(rank: int, size: int, num_kv_heads: int) -> int:
    lo, hi = kv_head_range(rank, size, num_kv_heads)
    return hi - lo


def check_page_split(layout: KVLayout, prefill_ranks: int, decode_ranks: int) -> None:
    """Raise ValueError where a channel would split pages of a model whose layers store KV of
    different shapes (``KVLayout.mixed_shapes``: Gemma 4's full and sliding layers). A part
    is a share of the widest group's KV heads, cut from every page as if it were
    [block_size, num_kv_heads, head_dim]; a narrower group's page holds more tokens of other
    heads in the same bytes, so a share of it is no head of its. Pages move whole only rank to
    rank between engines of one size (``whole_pages``)."""
    if not layout.mixed_shapes or (prefill_ranks == decode_ranks == 1):
        return
    parts = kv_transfer_parts(prefill_ranks, decode_ranks, layout.num_kv_heads)
    if whole_pages(parts, prefill_ranks, decode_ranks, layout.num_kv_heads):
        return
    why = ("the tiers' tensor-parallel sizes differ" if prefill_ranks != decode_ranks else
           f"its {layout.num_kv_heads} KV heads of the widest layers are replicated over {decode_ranks} ranks, so "
           "a rank would take another rank's pages")
    raise ValueError(f"{layout.model}: its layers store KV of different shapes, whose pages cannot be split by KV "
                     f"heads between tensor-parallel ranks; prefill has {prefill_ranks} rank(s), decode "
                     f"{decode_ranks} ({why}): serve it at the same --tensor-parallel-size on both tiers "
                     "(1 always works), or colocated (pdserve serve)")


def close_on_ranks(store: dist.Store, pairs: list[tuple[int, str]], name: str, timeout: float) -> None:
    """Call handler ``name`` with ``key`` on each (rank, key) of ``pairs``, to close what that
    key names there; a rank already gone (or one that fails) is logged, not raised."""
    for rank, key in pairs:
        try:
            call(store, rank, name, {"key": key}, timeout)
        except (RankCallError, TimeoutError) as exc:
            logger.debug("closing rank %d's KV pair %s: %s", rank, key, exc)


def receive_part(receiver: KVReceiver, heads: torch.Tensor, num_parts: int, name: str,
                 admit: Callable[..., None], ended: Callable[..., None], refused: Callable[..., None],
                 rank: int = 0, draft_cache: torch.Tensor | None = None,
                 linear_states: Sequence[Any] | None = None) -> tuple[bool, TransferStats | None]:
    """Receive one part of a request's KV into ``heads`` and account for it exactly once:
    ``admit`` before any byte lands (raises to refuse: the part is drained), then ``ended``
    (landed, or failed after admission) or ``refused`` (failed before it, the request known).
    Returns (whether the pair goes on, the stats of a part that landed). A part that landed
    with other bytes than were sent (the canary's checksum, canary.py) ends failed, marked
    ``checksum_mismatch``. ``rank``: the
    receiving rank, named in the figures with the part's end (time.time()). ``draft_cache``: a
    draft model's cache, whose blocks come in the same transfer (the figures' ``draft``).
    ``linear_states``: a hybrid model's linear-attention state tensors, whose slot the
    transfer names (admitted with the blocks: ``admit``'s ``state_slot``)."""
    admitted: list[str] = []
    part = uuid.uuid4().hex  # names this part to rank 0, whose answer may come after we gave up

    def validate(request_id: str, dst_block_ids: list[int], state_slot: int = -1) -> None:
        admitted.append(request_id)
        args = dict(request_id=request_id, dst_block_ids=dst_block_ids, num_parts=num_parts, part=part)
        admit(**args, **({"state_slot": state_slot} if state_slot >= 0 else {}))

    try:
        rid, _, stats, meta = receiver.recv(heads, validate=validate, draft_cache=draft_cache,
                                               linear_states=linear_states)
    except KVChannelClosed:
        logger.info("%s: closed", name)
        return False, None
    except BaseException as exc:  # anything: the request's state must hear of it
        rid = admitted[0] if admitted else getattr(exc, "request_id", None)
        why = f"{name} failed: {str(exc) or type(exc).__name__}"
        logger.warning("%s%s", f"request {rid}: " if rid else "", why)
        if admitted:  # a checksum mismatch is counted where the request is (rank 0's scheduler side)
            ended(request_id=rid, error=why, part=part,
                  **({"checksum_mismatch": True} if isinstance(exc, KVChecksumError) else {}))
        elif rid is not None:
            refused(request_id=rid, error=why)
        return receiver.is_usable and isinstance(exc, Exception), None
    ended(request_id=rid, error=None, part=part, meta=meta, figures={
        "num_bytes": stats.num_bytes, "num_blocks": stats.num_blocks, "seconds": stats.seconds,
        "backend": stats.backend, "rank": rank, "end": time.time(), "draft": draft_cache is not None})
    return True, stats
