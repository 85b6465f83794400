"""Worker side of a prefill engine's KV sends: the pairs to each decode server, and the
bytes of a transfer over them.

The first transfer to a decode server asks it for a channel (``open_channel``: the
prefill service's ``OpenKVChannel`` call over gRPC), then joins a 2-rank
torch.distributed group there; later transfers reuse the pair. A failed pair is dropped
and reopened next time. Runs in worker threads (blocking sends), never in the engine
thread.

A tensor-parallel engine, or one that sends to a tensor-parallel decode engine, opens a
pair per part instead (``RankPairs``): the decode server answers with one endpoint per
part, rank 0 joins its own and has each worker rank join its own
(``kv_transfer.rank_worker``), and every send goes out part by part, each rank's KV heads
from its own cache.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import torch

from engine.cpu_threads import serial_thread
from engine.parallel import TPGroup
from engine.rank_calls import RankCallError, call
from kv_transfer.channel import ChannelOffer, ChannelRequest, OpenChannel
from kv_transfer.protocol import KVLayout, KVTransferError, StateMove, TransferStats
from kv_transfer.rank_worker import install_rank_handlers
from kv_transfer.sender import KVSender
from kv_transfer.tp_parts import check_state_ranks, close_on_ranks

logger = logging.getLogger(__name__)


def check_block_counts(request_id: str, src_block_ids: list[int], dst_block_ids: list[int]) -> None:
    """The prefill side computed as many blocks as the decode side reserved (else KVTransferError)."""
    if len(src_block_ids) != len(dst_block_ids):
        raise KVTransferError(f"request {request_id}: {len(src_block_ids)} blocks computed but "
                              f"{len(dst_block_ids)} reserved on the decode server")


class RankPairs:
    """One channel to a decode server in parts, used like one KVSender by KVSendWorker: each
    part moves some of the KV heads, between a rank of this engine and a rank of the decode
    engine (``tp_parts.kv_transfer_parts``). Rank 0's parts are this process's own pairs (its
    heads of this cache); a worker rank's are its own (``rank_worker.RankSenders``)."""

    def __init__(self, local: list[tuple[KVSender, tuple[int, int]]], store, remote: list[tuple[int, str]],
                 timeout: float) -> None:
        self.local, self.store, self.remote, self.timeout = local, store, remote, timeout
        self.reason = local[0][0].reason if local else "parts sent by worker ranks"
        self._broken = False
        self._pool = ThreadPoolExecutor(max_workers=len(local) + len(remote), thread_name_prefix="kv-part-send",
                                        initializer=serial_thread)

    @property
    def is_usable(self) -> bool:
        return not self._broken and all(sender.is_usable for sender, _ in self.local)

    def send(self, request_id: str, src_block_ids: list[int], dst_block_ids: list[int], kv_cache: torch.Tensor,
             meta: dict | None = None) -> TransferStats:
        """Every part at once; the request's figures (bytes of all parts, the slowest part)."""
        args = dict(request_id=request_id, src=list(src_block_ids), dst=list(dst_block_ids), meta=meta or {})

        def timed(rank: int, send: Callable[[], TransferStats | dict]) -> tuple[int, float, float, TransferStats]:
            start = time.time()
            result = send()
            return rank, start, time.time(), result if isinstance(result, TransferStats) else TransferStats(**result)

        jobs = [(f"rank 0's part {i}", self._pool.submit(timed, 0, lambda s=sender, h=heads: s.send(
                    request_id, src_block_ids, dst_block_ids, kv_cache[..., h[0]:h[1], :], meta=meta)))
                for i, (sender, heads) in enumerate(self.local)]
        jobs += [(f"rank {rank}'s part", self._pool.submit(timed, rank, lambda r=rank, k=key: call(
                    self.store, r, "kv_send", dict(args, key=k), 2 * self.timeout)))
                 for rank, key in self.remote]
        errors, parts = [], []
        for what, job in jobs:
            try:
                parts.append(job.result())
            except (KVTransferError, RankCallError, TimeoutError) as exc:
                errors.append(f"{what}: {exc}")
        if errors:
            self._broken = True  # the decode side fails the request; the next send opens new pairs
            raise KVTransferError(f"request {request_id}: " + "; ".join(errors))
        stats = [p[3] for p in parts]
        return TransferStats(num_blocks=len(src_block_ids), num_bytes=sum(s.num_bytes for s in stats),
                             seconds=max(s.seconds for s in stats), backend=stats[0].backend,
                             num_messages=sum(s.num_messages for s in stats),
                             parts=tuple((rank, start, end, s.num_bytes) for rank, start, end, s in parts),
                             host_staged=any(s.host_staged for s in stats))

    def begin(self, request_id: str, *args, **kwargs) -> None:
        raise KVTransferError(f"request {request_id}: a KV channel in parts is sent after prefill, not layer "
                              "by layer")

    def close(self) -> None:
        for sender, _ in self.local:
            sender.close()
        close_on_ranks(self.store, self.remote, "kv_close", self.timeout)
        self._pool.shutdown(wait=False)


class KVSendWorker:
    """The pairs of one prefill engine to the decode servers, by (decode server, slot), and
    the sends over them. Thread-safe: one setup per pair at a time, one transfer per pair at
    a time (the pair's own lock)."""

    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, my_address: str, timeout: float,
                 open_channel: OpenChannel | None = None, tp: TPGroup | None = None,
                 draft_cache: torch.Tensor | None = None, linear_states: Sequence[Any] | None = None) -> None:
        """``layout``: the model's (every KV head); ``open_channel``: how to ask a decode
        server for a channel (the service's gRPC call; None: pairs are only ever given, as
        in tests); ``tp``: the engine's tensor-parallel group, whose ranks each send their
        own heads (None: this process holds them all); ``draft_cache``: a draft model's
        cache (``layout.draft``), sent beside the target's; ``linear_states``: a hybrid model's
        linear-attention state slots (``layout.linear_state``), a request's slot sent after its
        blocks."""
        layout.check_state(linear_states)
        self.kv_cache = kv_cache
        self.linear_states = linear_states
        self.open_channel = open_channel
        self.draft_cache = draft_cache
        self.layout = layout
        self.my_address = my_address
        self.timeout = timeout
        self.tp = tp if tp is not None and tp.size > 1 else None
        self._ranks_ready = False  # the worker ranks' KV handlers installed
        self._senders: dict[tuple[str, int], KVSender | RankPairs] = {}  # (decode server, slot) -> its pair
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    def pair(self, decode_address: str, reuse: bool = True, slot: int = 0) -> KVSender | RankPairs:
        """The open pair to that decode server, set up now if there is none (or it broke).
        ``slot`` > 0: another pair to the same server, so that several transfers to it can
        run at once (the decode server knows it as a peer of its own: ``ADDRESS#slot``)."""
        key = (decode_address, slot)
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:  # one setup per pair at a time
            sender = self._senders.get(key)
            if sender is not None and sender.is_usable and reuse:
                return sender
            if sender is not None:
                sender.close()
            self._senders.pop(key, None)
            peer = self.my_address if slot == 0 else f"{self.my_address}#{slot}"
            if self.open_channel is None:
                raise KVTransferError(f"no KV pair to {decode_address}, and no way to ask it for one")
            try:  # this side's part of the decode server's check (which knows both sides' ranks)
                check_state_ranks(self.layout.linear_state, self.tp.size if self.tp else 1, 1)
            except ValueError as exc:
                raise KVTransferError(f"no KV channel to {decode_address}: {exc}") from exc
            offer = self.open_channel(decode_address, ChannelRequest(
                peer=peer, layout=self.layout, device=str(self.kv_cache.device),
                tensor_parallel_size=self.tp.size if self.tp else 1), self.timeout)
            # offer.backend may be "auto": the handshake then settles it from the two GPUs' UUIDs.
            sender = self._connect_parts(offer, peer) if offer.in_parts else KVSender.connect(
                offer.host, offer.port, self.layout, backend=offer.backend or "auto", device=self.kv_cache.device,
                timeout=self.timeout)
            logger.info("KV channel %d to %s open at %s:%d: %s", slot, decode_address, offer.host, offer.port,
                        sender.reason)
            self._senders[key] = sender
            return sender

    def _connect_parts(self, offer: ChannelOffer, key: str) -> RankPairs:
        """Each part's sending rank joins the pair the decode server opened for it."""
        backend, store = offer.backend or "auto", self.tp.store if self.tp else None
        local: list[tuple[KVSender, tuple[int, int]]] = []
        remote: list[tuple[int, str]] = []
        try:
            for i, part in enumerate(offer.parts):
                heads = part.src_heads
                layout = dataclasses.replace(self.layout, num_kv_heads=heads[1] - heads[0])
                if part.src_rank == 0:
                    local.append((KVSender.connect(offer.host, part.port, layout, backend=backend,
                                                   device=self.kv_cache.device, timeout=self.timeout), heads))
                elif self.tp is None or part.src_rank >= self.tp.size:
                    raise KVTransferError(f"the decode server expects rank {part.src_rank}'s heads; this engine "
                                          f"has {self.tp.size if self.tp else 1} rank(s)")
                else:
                    if not self._ranks_ready:  # the worker ranks' KV handlers, installed once
                        install_rank_handlers(self.tp, 2 * self.timeout)
                        self._ranks_ready = True
                    part_key = f"{key}/part{i}"
                    call(self.tp.store, part.src_rank, "kv_connect", dict(
                        key=part_key, host=offer.host, port=part.port, layout=layout.to_dict(),
                        heads=list(heads), backend=backend, timeout=self.timeout), 2 * self.timeout)
                    remote.append((part.src_rank, part_key))
        except (KVTransferError, RankCallError, TimeoutError) as exc:
            RankPairs(local, store, remote, self.timeout).close()  # the parts joined so far
            raise KVTransferError(f"KV pairs to {offer.host}: {exc}") from exc
        return RankPairs(local, store, remote, self.timeout)

    def sends_in_parts(self, decode_address: str) -> bool:
        """Whether the open channel to that decode server goes in parts (RankPairs)."""
        return isinstance(self._senders.get((decode_address, 0)), RankPairs)

    def has_pair(self, decode_address: str, slot: int = 0) -> bool:
        return (decode_address, slot) in self._senders

    def state_move(self, request_id: str, state_slots: tuple[int, int]) -> StateMove | None:
        """What a transfer moves of a hybrid model's linear-attention state: slot
        ``state_slots[0]`` here into ``state_slots[1]`` on the decode server (None for a model
        without; KVTransferError where a slot is missing)."""
        if self.linear_states is None:
            return None
        src, dst = state_slots
        if src < 0 or dst < 0:
            raise KVTransferError(f"request {request_id}: the model has linear-attention layers, but its state "
                                  f"{'slot here' if src < 0 else 'slot on the decode server'} is not known")
        return StateMove(self.linear_states, src, dst)

    def send(self, decode_address: str, request_id: str, src_block_ids: list[int], dst_block_ids: list[int],
             meta: dict, state_slots: tuple[int, int] = (-1, -1)) -> TransferStats:
        """Blocking: returns once the blocks' data (and a linear-attention state: slot
        ``state_slots[0]`` into the decode server's ``state_slots[1]``) has left this process."""
        check_block_counts(request_id, src_block_ids, dst_block_ids)
        state = self.state_move(request_id, state_slots)
        reused = self.has_pair(decode_address)
        sender = self.pair(decode_address)
        try:
            return self._send_on(sender, request_id, src_block_ids, dst_block_ids, meta, state)
        except KVTransferError as exc:
            if not self.settle_failure(decode_address, sender, reused):
                raise
            logger.info("KV pair to %s broke (%s); opening a new one", decode_address, exc)
        sender = self.pair(decode_address, reuse=False)
        try:
            return self._send_on(sender, request_id, src_block_ids, dst_block_ids, meta, state)
        except KVTransferError:
            self.settle_failure(decode_address, sender, reused=False)
            raise

    def _send_on(self, sender: KVSender | RankPairs, request_id: str, src_block_ids: list[int],
                 dst_block_ids: list[int], meta: dict, state: StateMove | None = None) -> TransferStats:
        if isinstance(sender, RankPairs):  # a draft model runs at one rank only (engine/draft_model.py)
            if state is not None:  # (refused at channel open: check_state_ranks)
                raise KVTransferError(f"request {request_id}: a linear-attention state is not sent in parts")
            return sender.send(request_id, src_block_ids, dst_block_ids, self.kv_cache, meta=meta)
        return sender.send(request_id, src_block_ids, dst_block_ids, self.kv_cache, meta=meta,
                           draft_cache=self.draft_cache, state=state)

    def settle_failure(self, decode_address: str, sender: KVSender | RankPairs, reused: bool,
                       slot: int = 0) -> bool:
        """After a transfer on ``sender`` failed: drop the pair if it broke. True when sending once
        more, on a new pair, can work: a pair that had worked before broke now, which most often
        means the decode server restarted (its end of the pair is gone)."""
        if sender.is_usable:  # the transfer failed, not the pair (e.g. the decode side refused it)
            return False
        self.drop(decode_address, sender, slot)
        return reused

    def drop(self, decode_address: str, sender: KVSender | RankPairs, slot: int = 0) -> None:
        with self._guard:
            if self._senders.get((decode_address, slot)) is sender:
                del self._senders[(decode_address, slot)]
        sender.close()

    def close(self) -> None:
        with self._guard:
            senders, self._senders = list(self._senders.values()), {}
        for s in senders:
            s.close()
