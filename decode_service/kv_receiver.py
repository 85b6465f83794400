"""Decode side of KV transfer: one receiver thread per prefill peer.

A prefill server calls ``OpenKVChannel``; we check the layouts, open a
torch.distributed rendezvous and start a thread that receives transfers into
this engine's KV cache for as long as the pair lives. Each transfer names its
request and destination blocks; the engine checks (``begin_kv_receive``, in
its own thread) that those blocks are reserved for that request before any
byte lands in them, and hears how every begun receive ended
(``kv_received`` or ``kv_failed``): the request's state is the engine's, not
ours.

We keep only the pairs: at most one per prefill peer (a peer that opens a
new channel replaces its old one once the new pair is set up, so a caller
that fails the pair's authentication, see kv_transfer/pair.py, cannot
tear down a working pair by naming its peer) and at most ``max_pairs`` in all,
pairs still in setup included. (A prefill server that wants several transfers
to us at once opens further pairs as peers ``ADDRESS#1``, ``ADDRESS#2``, ...) A pair whose setup fails, or that breaks, is
closed and forgotten, and its thread exits.

A prefill engine with several tensor-parallel ranks sends every request in
parts, one per rank, each over a pair of its own into this cache's share of
the KV heads (``kv_transfer.tp_parts.kv_transfer_parts``). The parts of one
request come together here: the first to arrive asks the engine to begin
the receive, the others wait for its answer, and the engine hears once, when
every part has ended (so no part still lands in blocks the engine freed), or
when some part has not come within the transfer timeout and none is landing.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

import torch

from engine.llm_engine import LLMEngine
from engine.outputs import Logprobs
from engine.rank_calls import RankCallError, call, serve_calls
from kv_transfer import KVReceiver, KVTransferError, TransferStats, check_compatible, choose_backend
from kv_transfer.layout import engine_layout
from kv_transfer.rank_worker import install_rank_handlers
from kv_transfer.tp_parts import close_on_ranks, kv_transfer_parts, receive_part
from rpc.engine_bridge import EngineBridge
from rpc.layout_convert import layout_from_proto, layout_to_proto
from pdserve.v1 import engine_pb2

logger = logging.getLogger(__name__)


class KVReceivers:
    def __init__(self, bridge: EngineBridge, host: str, timeout: float,
                 on_transfer: Callable[[TransferStats], None] | None = None, max_pairs: int = 64) -> None:
        self.bridge = bridge
        engine = bridge.engine
        self.kv_cache: torch.Tensor = engine.kv_cache  # rank 0's share of the heads under TP
        self.draft_cache: torch.Tensor | None = engine.draft_kv_cache  # a draft model's (one rank only)
        # The model's layout (every KV head), whatever share of them this process holds.
        self.layout = engine_layout(engine)
        self.host = host
        self.timeout = timeout
        self.on_transfer = on_transfer
        self.max_pairs = max_pairs
        self._parts = _Parts(bridge, timeout)
        self._receivers: dict[str, KVReceiver] = {}  # prefill peer -> its live pair
        self._setting_up: set[KVReceiver] = set()  # listening, not yet connected
        # prefill peer -> its worker ranks' pairs (rank, key): live, and of a channel still in setup
        self._remote: dict[str, list[tuple[int, str]]] = {}
        self._remote_next: dict[str, list[tuple[int, str]]] = {}
        self._channels = itertools.count()
        self._lock = threading.Lock()
        self.tp = engine.tp if engine.tp is not None and engine.tp.size > 1 else None
        self._ranks_ready = False  # the worker ranks' KV handlers installed
        if self.tp is not None:  # the workers' parts ask before landing and report how they ended
            serve_calls(self.tp.store, 0, {"kv_admit": self._parts.admit, "kv_ended": self._parts.ended,
                                           "kv_refused": self._parts.refused})

    @property
    def num_pairs(self) -> int:
        """Pairs set up, and pairs in setup (the worker ranks' included)."""
        return (len(self._receivers) + len(self._setting_up) + sum(map(len, self._remote.values()))
                + sum(map(len, self._remote_next.values())))

    # ---- pair setup (gRPC executor thread) ------------------------------
    def open(self, request: engine_pb2.OpenKVChannelRequest) -> engine_pb2.OpenKVChannelResponse:
        remote = layout_from_proto(request.layout)
        try:
            check_compatible(self.layout, remote, "decode", "prefill")
        except KVTransferError as exc:
            raise ValueError(str(exc)) from exc
        mine = str(self.kv_cache.device)
        theirs_on_gpu, mine_on_gpu = request.device.startswith("cuda"), mine.startswith("cuda")
        if theirs_on_gpu and mine_on_gpu:
            # Device strings cannot tell one GPU from two (in containers every GPU is cuda:0):
            # the pair's handshake compares the GPUs' UUIDs and settles NCCL or host-staged gloo.
            backend, reason = "auto", "GPUs on both sides: backend settled by GPU UUID in the handshake"
        else:  # a cache in host memory: gloo whatever the GPUs (no UUID needed to know that)
            backend, reason = choose_backend("gpu" if theirs_on_gpu else None, "gpu" if mine_on_gpu else None)
        ranks = max(1, request.tensor_parallel_size)
        parts = kv_transfer_parts(ranks, self.tp.size if self.tp else 1, self.layout.num_kv_heads)
        logger.info("KV channel from %s (%d prefill rank(s), %d pair(s)): %s", request.peer, ranks, len(parts),
                    reason)
        local: list[tuple[KVReceiver, str, torch.Tensor]] = []
        remote: list[tuple[int, str]] = []
        endpoints = []
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
                endpoints.append(engine_pb2.KVRankEndpoint(src_rank=part.src_rank, src_head_start=part.src_heads[0],
                                                           src_head_end=part.src_heads[1], port=port))
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
            threading.Thread(target=self._recv_loop, args=(receiver, name, heads, len(parts), request.peer),
                             daemon=True, name=f"kv-recv-{name}").start()
        return engine_pb2.OpenKVChannelResponse(
            host=self.host, port=endpoints[0].port, layout=layout_to_proto(self.layout), backend=backend,
            parts=endpoints if len(parts) > 1 else [])

    def _stop(self, remote: list[tuple[int, str]]) -> None:
        if remote:
            assert self.tp is not None
            close_on_ranks(self.tp.store, remote, "kv_stop_listening", self.timeout)

    def close(self) -> None:
        with self._lock:
            receivers = list(self._receivers.values()) + list(self._setting_up)
            self._receivers, self._setting_up = {}, set()
            remote = [r for pairs in (self._remote, self._remote_next) for rs in pairs.values() for r in rs]
            self._remote, self._remote_next = {}, {}
        for r in receivers:
            r.close()
        self._stop(remote)

    def _forget(self, receiver: KVReceiver, peer: str) -> None:
        with self._lock:
            if self._receivers.get(peer) is receiver:
                del self._receivers[peer]
        receiver.close()

    # ---- receive loop (one thread per pair) ------------------------------
    def _recv_loop(self, receiver: KVReceiver, peer: str, heads: torch.Tensor, num_parts: int,
                   channel: str) -> None:
        """``peer``: this pair's name; ``channel``: the prefill peer whose channel it belongs to."""
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
        go, stats = receive_part(receiver, heads, num_parts, f"KV transfer from {peer}", self._parts.admit,
                                 self._parts.ended, self._parts.refused, draft_cache=self.draft_cache)
        if stats is not None and self.on_transfer is not None:
            self.on_transfer(stats)
        return go


class _Assembly:
    """The parts of one request's KV: how many there are, which have ended, how it went."""

    def __init__(self, num_parts: int, dst_block_ids: list[int]) -> None:
        self.num_parts, self.dst_block_ids = num_parts, dst_block_ids
        self.begun: Future = Future()  # the engine's answer to begin_kv_receive
        self.in_flight = 0  # admitted, not ended: may still write into the blocks
        self.num_ended = 0
        self.failed: str | None = None
        self.reported = False
        self.meta: dict = {}
        self.figures: dict | None = None
        self.timer: threading.Timer | None = None


class _Parts:
    """Parts of requests in flight to this engine (one part a request unless the prefill
    engine is tensor-parallel), and what the engine hears about each request, once."""

    def __init__(self, bridge: EngineBridge, timeout: float) -> None:
        self.bridge, self.timeout = bridge, timeout
        self._assemblies: dict[str, _Assembly] = {}
        self._admitted: set[str] = set()  # parts (receive_part's ids) counted in flight
        # parts whose end came before their admission (a worker gave up waiting for it): the
        # admission, when it comes, is refused, so nothing counts it in flight (id -> when)
        self._ended_first: dict[str, float] = {}
        self._lock = threading.Lock()

    def admit(self, request_id: str, dst_block_ids: list[int], num_parts: int, part: str | None = None) -> None:
        """A part's header came: may it land in ``dst_block_ids``? The request's first part asks
        the engine (begin_kv_receive); the others wait for that answer. Raises if not."""
        with self._lock:
            if part is not None and self._ended_first.pop(part, None) is not None:
                raise KVTransferError(f"request {request_id}: a KV part's admission came after it ended")
            if part is not None:
                self._admitted.add(part)
            a = self._assemblies.get(request_id)
            first = a is None
            if first:
                a = self._assemblies[request_id] = _Assembly(num_parts, dst_block_ids)
                self._arm(request_id, a, forget=False)
            a.in_flight += 1  # ended() is called for every admitted part, whatever happens
            if a.failed is not None:
                raise KVTransferError(f"request {request_id}: {a.failed}")
            if (a.num_parts, a.dst_block_ids) != (num_parts, dst_block_ids):
                raise KVTransferError(f"request {request_id}: parts disagree on the destination blocks")
        if first:
            try:
                self.bridge.loop.submit(lambda e: e.begin_kv_receive(request_id, dst_block_ids)).result(self.timeout)
            except BaseException as exc:
                a.begun.set_exception(exc)
                raise
            a.begun.set_result(None)
        else:
            a.begun.result(self.timeout)  # the first part's answer (raises its error)

    def ended(self, request_id: str, error: str | None, meta: dict | None = None,
              figures: dict | None = None, part: str | None = None) -> None:
        """An admitted part ended: landed (error None) or not. A part whose admission has not
        been taken yet (its caller gave up waiting for the answer) ends as refused, and its
        admission is refused when it comes."""
        with self._lock:
            early = part is not None and part not in self._admitted
            if early:
                now = time.monotonic()
                self._ended_first = {p: t for p, t in self._ended_first.items() if now - t < 10 * self.timeout}
                self._ended_first[part] = now
            else:
                self._admitted.discard(part)
                a = self._assemblies.get(request_id)
                if a is None:
                    return
                a.in_flight -= 1
                if error is None:
                    a.meta.update(meta or {})
                    a.figures = _merged(a.figures, figures or {})
                tell = self._part_over(request_id, a, error)
        if early:
            self.refused(request_id, error or "the KV part ended before its admission")
            return
        self._report(request_id, a, tell)

    def refused(self, request_id: str, error: str) -> None:
        """A part of the request failed before it was admitted (nothing of it landed)."""
        with self._lock:
            a = self._assemblies.get(request_id)
            tell = a is not None and self._part_over(request_id, a, error)
        if a is None:  # no part of it admitted: nothing can land, the engine hears now
            self.bridge.submit(lambda e: e.kv_failed(request_id, error))
            return
        self._report(request_id, a, tell)

    def _expire(self, request_id: str, forget: bool = False) -> None:
        """The transfer timeout passed since the first part: the parts not here yet fail it.
        One more timeout later (``forget``), the request's entry goes once no part of it is
        landing: a part later still is taken for a new transfer, which the engine refuses."""
        with self._lock:
            a = self._assemblies.get(request_id)
            if a is None:
                return
            tell = False
            if forget and not a.in_flight:
                del self._assemblies[request_id]
                return
            if not forget:
                a.failed = a.failed or (f"only {a.num_ended + a.in_flight} of {a.num_parts} KV parts came "
                                        f"within {self.timeout:g}s")
                tell = self._take_report(a, complete=False)
            self._arm(request_id, a, forget=True)
        self._report(request_id, a, tell)

    def _arm(self, request_id: str, a: _Assembly, forget: bool) -> None:
        """``_expire`` (with ``forget``) one transfer timeout from now."""
        a.timer = threading.Timer(self.timeout, self._expire, (request_id, forget))
        a.timer.daemon = True
        a.timer.start()

    def _part_over(self, request_id: str, a: _Assembly, error: str | None) -> bool:
        """One more part of the request has ended (lock held; ``error`` None: it landed). The
        entry goes with its last part; True when the engine is to hear now."""
        a.num_ended += 1
        if error is not None and a.failed is None:
            a.failed = error
        complete = a.num_ended == a.num_parts
        if complete:
            del self._assemblies[request_id]
            if a.timer is not None:
                a.timer.cancel()
        return self._take_report(a, complete)

    @staticmethod
    def _take_report(a: _Assembly, complete: bool) -> bool:
        """Whether the engine is to hear now (lock held): once, when no part can still land."""
        if a.reported or a.in_flight or not (complete or a.failed is not None):
            return False
        a.reported = True
        return True

    def _report(self, request_id: str, a: _Assembly, tell: bool) -> None:
        if not tell:
            return
        if a.failed is not None:
            message = a.failed
            self.bridge.submit(lambda e: e.kv_failed(request_id, message))
        else:
            meta, figures = a.meta, a.figures or {}
            self.bridge.submit(lambda e: _arrived(e, request_id, meta, figures))


def _merged(total: dict | None, part: dict) -> dict:
    """Figures of a request's transfer from its parts': bytes add up, the slowest part's time,
    and each part as (receiving rank, start, end (time.time()), bytes) for the trace."""
    end = part.pop("end", None)
    rank = part.pop("rank", 0)
    this = [(rank, end - part["seconds"], end, part["num_bytes"])] if end is not None else []
    if total is None:
        return dict(part, parts=this)
    return dict(total, num_bytes=total["num_bytes"] + part["num_bytes"],
                seconds=max(total["seconds"], part["seconds"]), parts=total["parts"] + this)


def _arrived(engine: LLMEngine, request_id: str, meta: dict, figures: dict) -> None:
    lp = meta.get("logprob")
    logprob = Logprobs(lp["token_id"], lp["logprob"], lp["rank"], [tuple(t) for t in lp["top"]]) if lp else None
    engine.kv_received(request_id, int(meta["first_token"]), logprob, figures)
