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
that fails the pair's authentication, see engine/kv_transfer/pair.py, cannot
tear down a working pair by naming its peer) and at most ``max_pairs`` in all,
pairs still in setup included. (A prefill server that wants several transfers
to us at once opens further pairs as peers ``ADDRESS#1``, ``ADDRESS#2``, ...) A pair whose setup fails, or that breaks, is
closed and forgotten, and its thread exits.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from engine.kv_transfer import (KVChannelClosed, KVLayout, KVReceiver, KVTransferError, TransferStats,
                                check_compatible, choose_backend)
from engine.llm_engine import LLMEngine
from engine.outputs import Logprobs
from rpc.engine_bridge import EngineBridge
from rpc.layout_convert import layout_from_proto, layout_to_proto
from pdserve.v1 import engine_pb2

logger = logging.getLogger(__name__)


class KVReceivers:
    def __init__(self, bridge: EngineBridge, host: str, timeout: float,
                 on_transfer: Callable[[TransferStats], None] | None = None, max_pairs: int = 64) -> None:
        self.bridge = bridge
        engine = bridge.engine
        self.kv_cache: torch.Tensor = engine.kv_cache
        self.layout = KVLayout.of(self.kv_cache, engine.config.model.served_model_name)
        self.host = host
        self.timeout = timeout
        self.on_transfer = on_transfer
        self.max_pairs = max_pairs
        self._receivers: dict[str, KVReceiver] = {}  # prefill peer -> its live pair
        self._setting_up: set[KVReceiver] = set()  # listening, not yet connected
        self._lock = threading.Lock()

    @property
    def num_pairs(self) -> int:
        """Pairs set up, and pairs in setup."""
        return len(self._receivers) + len(self._setting_up)

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
        logger.info("KV channel from %s: %s", request.peer, reason)
        with self._lock:
            if self.num_pairs >= self.max_pairs:
                raise OverflowError(f"this decode server already has {self.max_pairs} KV pairs")
            try:
                receiver, port = KVReceiver.listen(self.host, self.layout, backend=backend, device=mine,
                                                   timeout=self.timeout)
            except KVTransferError as exc:
                raise ValueError(str(exc)) from exc
            self._setting_up.add(receiver)
        threading.Thread(target=self._recv_loop, args=(receiver, request.peer), daemon=True,
                         name=f"kv-recv-{request.peer}").start()
        return engine_pb2.OpenKVChannelResponse(host=self.host, port=port, layout=layout_to_proto(self.layout),
                                                backend=backend)

    def close(self) -> None:
        with self._lock:
            receivers = list(self._receivers.values()) + list(self._setting_up)
            self._receivers, self._setting_up = {}, set()
        for r in receivers:
            r.close()

    def _forget(self, receiver: KVReceiver, peer: str) -> None:
        with self._lock:
            if self._receivers.get(peer) is receiver:
                del self._receivers[peer]
        receiver.close()

    # ---- receive loop (one thread per pair) ------------------------------
    def _recv_loop(self, receiver: KVReceiver, peer: str) -> None:
        try:
            receiver.wait_connected()
        except KVTransferError as exc:
            logger.warning("KV channel from %s was not set up: %s", peer, exc)
            with self._lock:
                self._setting_up.discard(receiver)
            self._forget(receiver, peer)
            return
        with self._lock:
            self._setting_up.discard(receiver)
            old, self._receivers[peer] = self._receivers.get(peer), receiver
        if old is not None:  # the peer lost its side of the old pair; ours must go too
            old.close()
        try:
            while self._recv_one(receiver, peer):
                pass
        finally:
            self._forget(receiver, peer)

    def _recv_one(self, receiver: KVReceiver, peer: str) -> bool:
        """Receive one transfer and tell the engine how it ended. False when
        the pair is done (closed or broken)."""
        begun: list[str] = []  # the request whose receive the engine was asked to begin

        def validate(request_id: str, dst_block_ids: list[int]) -> None:
            begun.append(request_id)
            self.bridge.loop.submit(lambda e: e.begin_kv_receive(request_id, dst_block_ids)).result(self.timeout)

        try:
            rid, _, stats, meta = receiver.recv(self.kv_cache, validate=validate)
        except KVChannelClosed:
            logger.info("KV channel from %s closed", peer)
            return False
        except BaseException as exc:  # anything: the engine must hear the receive is over
            rid = getattr(exc, "request_id", None) or (begun[0] if begun else None)
            why = str(exc) or f"{type(exc).__name__} (the engine did not answer in {self.timeout:g}s)"
            logger.warning("KV transfer %sfrom %s failed: %s", f"of {rid} " if rid else "", peer, why)
            if rid is not None:
                # Runs after begin_kv_receive (commands run in order), even if that timed out here.
                message = f"KV transfer from {peer} failed: {why}"  # exc is unbound after this block
                self.bridge.submit(lambda e: e.kv_failed(rid, message))
            return receiver.is_usable and isinstance(exc, Exception)
        if self.on_transfer is not None:
            self.on_transfer(stats)
        figures = {"num_bytes": stats.num_bytes, "num_blocks": stats.num_blocks, "seconds": stats.seconds,
                   "backend": stats.backend}
        self.bridge.submit(lambda e: _arrived(e, rid, meta, figures))
        return True


def _arrived(engine: LLMEngine, request_id: str, meta: dict, figures: dict) -> None:
    lp = meta.get("logprob")
    logprob = Logprobs(lp["token_id"], lp["logprob"], lp["rank"], [tuple(t) for t in lp["top"]]) if lp else None
    engine.kv_received(request_id, int(meta["first_token"]), logprob, figures)
