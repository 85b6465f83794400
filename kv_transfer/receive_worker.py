"""Worker side of a decode engine's KV receives: the pairs from prefill servers, one
receiver thread per pair, moving each transfer's bytes into this engine's cache (or, from
a tensor-parallel engine or into one, into a rank's share of the KV heads).

A prefill server asks for a channel (the decode service's ``OpenKVChannel``, which calls
``open``); we check the layouts, listen on a free port (a TCPStore rendezvous) and start a
thread that receives transfers for as long as the pair lives. Every transfer goes through
``tp_parts.receive_part``, which asks the scheduler side (``KVReceiveScheduler``) before
any byte lands and tells it how the part ended: the request's receive progress is there,
not here.

We keep only the pairs: at most one per prefill peer (a peer that opens a new channel
replaces its old one once the new pair is set up, so a caller that fails the pair's
authentication, see pair.py, cannot tear down a working pair by naming its peer) and at
most ``max_pairs`` in all, pairs still in setup included. (A prefill server that wants
several transfers to us at once opens further pairs as peers ``ADDRESS#1``, ``ADDRESS#2``,
...) A pair whose setup fails, or that breaks, is closed and forgotten, and its thread
exits.

A channel in parts (tensor parallelism on either side) has a pair per part
(``tp_parts.kv_transfer_parts``): rank 0 listens for its own parts here and has each worker
rank listen for its own (``rank_worker``); the workers' parts ask rank 0's scheduler side
over the group's store.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

import torch

from engine.cpu_threads import serial_thread
from engine.llm_engine import LLMEngine
from engine.rank_calls import RankCallError, call, serve_calls
from kv_transfer.channel import ChannelOffer, ChannelRequest, RankEndpoint
from kv_transfer.layout import engine_layout
from kv_transfer.protocol import KVTransferError, TransferStats, check_compatible, choose_backend
from kv_transfer.rank_worker import install_rank_handlers
from kv_transfer.receive_scheduler import KVReceiveScheduler
from kv_transfer.receiver import KVReceiver
from kv_transfer.tp_parts import (check_page_split, check_state_ranks, close_on_ranks, kv_transfer_parts,
                                  receive_part)

logger = logging.getLogger(__name__)
CLOSE_WAIT_S = 10.0  # close(): how long the receive threads of the closed pairs are waited for


class KVReceiveWorker:
    def __init__(self, engine: LLMEngine, scheduler: KVReceiveScheduler, host: str, timeout: float,
                 on_transfer: Callable[[TransferStats], None] | None = None, max_pairs: int = 64) -> None:
        """``scheduler``: the receives' scheduler side, which every part asks before it lands;
        ``host``: where pairs listen; ``on_transfer``: told each part that landed (metrics)."""
        self.scheduler = scheduler
        self.kv_cache: torch.Tensor = engine.kv_cache  # rank 0's share of the heads under TP
        self.draft_cache: torch.Tensor | None = engine.draft_kv_cache  # a draft model's (one rank only)
        # The model's layout (every KV head), whatever share of them this process holds.
        self.layout = engine_layout(engine)
        # A hybrid model's linear-attention state slots: each transfer's state lands in one
        self.linear_states = engine.linear_states if self.layout.linear_state else None
        self.host = host
        self.timeout = timeout
        self.on_transfer = on_transfer
        self.max_pairs = max_pairs
        self._receivers: dict[str, KVReceiver] = {}  # prefill peer -> its live pair
        self._setting_up: set[KVReceiver] = set()  # listening, not yet connected
        # prefill peer -> its worker ranks' pairs (rank, key): live, and of a channel still in setup
        self._remote: dict[str, list[tuple[int, str]]] = {}
        self._remote_next: dict[str, list[tuple[int, str]]] = {}
        self._channels = itertools.count()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []  # the pairs' receive threads, joined by close()
        self.tp = engine.tp if engine.tp is not None and engine.tp.size > 1 else None
        self._ranks_ready = False  # the worker ranks' KV handlers installed
        if self.tp is not None:  # the workers' parts ask before landing and report how they ended
            serve_calls(self.tp.store, 0, scheduler.handlers())

    @property
    def num_pairs(self) -> int:
        """Pairs set up, and pairs in setup (the worker ranks' included)."""
        return (len(self._receivers) + len(self._setting_up) + sum(map(len, self._remote.values()))
                + sum(map(len, self._remote_next.values())))

    # ---- pair setup (gRPC executor thread) ------------------------------
    def open(self, request: ChannelRequest) -> ChannelOffer:
        """Listen for a prefill server's channel (every part of it); where to dial. Raises
        ValueError when the layouts or devices do not fit, the parts would split what cannot
        be split (a linear-attention state, pages of layers of different KV shapes), or
        listening fails, and OverflowError when this server has ``max_pairs`` pairs already."""
        ranks = max(1, request.tensor_parallel_size)
        check_state_ranks(self.layout.linear_state or request.layout.linear_state, ranks,
                          self.tp.size if self.tp else 1)
        try:
            check_compatible(self.layout, request.layout, "decode", "prefill")
        except KVTransferError as exc:
            raise ValueError(str(exc)) from exc
        check_page_split(self.layout, ranks, self.tp.size if self.tp else 1)
        mine = str(self.kv_cache.device)
        theirs_on_gpu, mine_on_gpu = request.device.startswith("cuda"), mine.startswith("cuda")
        if theirs_on_gpu and mine_on_gpu:
            # Device strings cannot tell one GPU from two (in containers every GPU is cuda:0):
            # the pair's handshake compares the GPUs' UUIDs and settles NCCL or host-staged gloo.
            backend, reason = "auto", "GPUs on both sides: backend settled by GPU UUID in the handshake"
        else:  # a cache in host memory: gloo whatever the GPUs (no UUID needed to know that)
            backend, reason = choose_backend("gpu" if theirs_on_gpu else None, "gpu" if mine_on_gpu else None)
        parts = kv_transfer_parts(ranks, self.tp.size if self.tp else 1, self.layout.num_kv_heads)
        logger.info("KV channel from %s (%d prefill rank(s), %d pair(s)): %s", request.peer, ranks, len(parts),
                    reason)
        local: list[tuple[KVReceiver, str, torch.Tensor]] = []
        remote: list[tuple[int, str]] = []
        endpoints: list[RankEndpoint] = []
        try:
            with self._lock:
                if self.num_pairs + len(parts) > self.max_pairs:
                    raise OverflowError(f"this decode server already has {self.num_pairs} of {self.max_pairs} "
                                        "KV pairs")
            for i, part in enumerate(parts):
                name = request.peer if len(parts) == 1 else f"{request.peer}@part{i}"
                layout = dataclasses.replace(self.layout, num_kv_heads=part.dst_heads[1] - part.dst_heads[0])
                if part.dst_rank == 0:
                    heads = self.kv_cache[..., part.dst_heads[0]:part.dst_heads[1], :]
                    receiver, port = KVReceiver.listen(self.host, layout, backend=backend, device=mine,
                                                       timeout=self.timeout)
                    with self._lock:
                        self._setting_up.add(receiver)
                    local.append((receiver, name, heads))
                else:
                    assert self.tp is not None
                    if not self._ranks_ready:  # the worker ranks' KV handlers, installed once
                        install_rank_handlers(self.tp, 2 * self.timeout)
                        self._ranks_ready = True
                    key = f"{name}/{next(self._channels)}"  # a new channel's pair never shares a key
                    port = call(self.tp.store, part.dst_rank, "kv_listen", dict(
                        key=key, host=self.host, layout=layout.to_dict(), heads=list(part.dst_heads),
                        backend=backend, timeout=self.timeout, num_parts=len(parts)), 2 * self.timeout)
                    remote.append((part.dst_rank, key))
                endpoints.append(RankEndpoint(part.src_rank, part.src_heads, port))
        except (KVTransferError, RankCallError, TimeoutError) as exc:
            for receiver, _, _ in local:
                with self._lock:
                    self._setting_up.discard(receiver)
                receiver.close()
            self._stop(remote)
            raise ValueError(f"could not listen for the KV channel: {exc}") from exc
        with self._lock:  # they replace the peer's old ones once rank 0's pair of the channel is up
            stale, self._remote_next[request.peer] = self._remote_next.get(request.peer, []), remote
        self._stop(stale)
        for receiver, name, heads in local:
            thread = threading.Thread(target=self._recv_loop, args=(receiver, name, heads, len(parts), request.peer),
                                      daemon=True, name=f"kv-recv-{name}")
            with self._lock:
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()
        return ChannelOffer(self.host, endpoints[0].port, self.layout, backend,
                            tuple(endpoints) if len(parts) > 1 else ())

    def _stop(self, remote: list[tuple[int, str]]) -> None:
        if remote:
            assert self.tp is not None
            close_on_ranks(self.tp.store, remote, "kv_stop_listening", self.timeout)

    def close(self) -> None:
        """Close every pair and wait (``CLOSE_WAIT_S`` in all) for the receive threads to end: one
        that saw its peer leave first may still hold its pair's process group (a frame, an
        exception's traceback) or be tearing it down, and a process that exits meanwhile
        aborts in the group's destructor (kv_transfer/pair.py, ``_Teardowns``)."""
        with self._lock:
            receivers = list(self._receivers.values()) + list(self._setting_up)
            self._receivers, self._setting_up = {}, set()
            remote = [r for pairs in (self._remote, self._remote_next) for rs in pairs.values() for r in rs]
            self._remote, self._remote_next = {}, {}
            threads, self._threads = self._threads, []
        for r in receivers:
            r.close()
        self._stop(remote)
        deadline = time.monotonic() + CLOSE_WAIT_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _forget(self, receiver: KVReceiver, peer: str) -> None:
        with self._lock:
            if self._receivers.get(peer) is receiver:
                del self._receivers[peer]
        receiver.close()

    # ---- receive loop (one thread per pair) ------------------------------
    def _recv_loop(self, receiver: KVReceiver, peer: str, heads: torch.Tensor, num_parts: int,
                   channel: str) -> None:
        """``peer``: this pair's name; ``channel``: the prefill peer whose channel it belongs to."""
        serial_thread()
        try:
            receiver.wait_connected()
        except KVTransferError as exc:
            logger.warning("KV channel from %s was not set up: %s", peer, exc)
            with self._lock:
                self._setting_up.discard(receiver)
                failed = self._remote_next.pop(channel, [])
            self._stop(failed)
            self._forget(receiver, peer)
            return
        with self._lock:
            self._setting_up.discard(receiver)
            old, self._receivers[peer] = self._receivers.get(peer), receiver
            new = self._remote_next.pop(channel, None)
            stale = self._remote.get(channel, []) if new is not None else []
            if new is not None:
                self._remote[channel] = new
        if old is not None:  # the peer lost its side of the old pair; ours must go too
            old.close()
        self._stop(stale)  # so did the old channel's worker pairs
        try:
            while self._recv_one(receiver, peer, heads, num_parts):
                pass
        finally:
            self._forget(receiver, peer)

    def _recv_one(self, receiver: KVReceiver, peer: str, heads: torch.Tensor, num_parts: int) -> bool:
        """Receive one transfer (one part of a request's KV) into ``heads`` (this cache, or its
        share of the KV heads). False when the pair is done (closed or broken)."""
        go, stats = receive_part(receiver, heads, num_parts, f"KV transfer from {peer}", self.scheduler.admit,
                                 self.scheduler.ended, self.scheduler.refused, draft_cache=self.draft_cache,
                                 linear_states=self.linear_states)
        if stats is not None and self.on_transfer is not None:
            self.on_transfer(stats)
        return go
