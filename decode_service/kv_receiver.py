"""Decode side of KV transfer: one receiver thread per prefill peer.

A prefill server calls ``OpenKVChannel``; we check the layouts, open a
torch.distributed rendezvous and start a thread that receives transfers into
this engine's KV cache for as long as the pair lives. Each transfer names its
request and destination blocks; we check (in the engine thread) that those
blocks are reserved for that request before any byte lands in them.

State owned by the engine thread: ``receiving`` (requests whose blocks are
being written now) and ``abort_after_receive`` (aborted meanwhile: their
blocks are freed only when the write ends, never under it).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

from engine.kv_transfer import (KVChannelClosed, KVLayout, KVReceiver, KVTransferError, TransferStats,
                                check_compatible, choose_backend)
from engine.llm_engine import LLMEngine
from engine.sampler import Logprobs
from rpc.convert import layout_from_proto, layout_to_proto
from rpc.engine_bridge import EngineBridge
from pdserve.v1 import engine_pb2

logger = logging.getLogger(__name__)


class KVReceivers:
    def __init__(self, bridge: EngineBridge, host: str, timeout: float,
                 on_transfer: Callable[[TransferStats], None] | None = None) -> None:
        self.bridge = bridge
        engine = bridge.engine
        self.kv_cache: torch.Tensor = engine.runner.kv_cache
        self.layout = KVLayout.of(self.kv_cache, engine.config.model.served_model_name)
        self.host = host
        self.timeout = timeout
        self.on_transfer = on_transfer
        self.receiving: set[str] = set()
        self.abort_after_receive: set[str] = set()
        self._receivers: list[KVReceiver] = []
        self._lock = threading.Lock()

    # ---- pair setup (gRPC executor thread) ------------------------------
    def open(self, request: engine_pb2.OpenKVChannelRequest) -> engine_pb2.OpenKVChannelResponse:
        remote = layout_from_proto(request.layout)
        try:
            check_compatible(self.layout, remote, "decode", "prefill")
        except KVTransferError as exc:
            raise ValueError(str(exc)) from exc
        mine = str(self.kv_cache.device)
        same_gpu = mine.startswith("cuda") and request.device == mine
        backend, reason = choose_backend(request.device or "cpu", mine, same_gpu)
        logger.info("KV channel from %s: %s", request.peer, reason)
        try:
            receiver, port = KVReceiver.listen(self.host, self.layout, backend=backend, device=mine,
                                               timeout=self.timeout)
        except KVTransferError as exc:
            raise ValueError(str(exc)) from exc
        with self._lock:
            self._receivers.append(receiver)
        threading.Thread(target=self._recv_loop, args=(receiver, request.peer), daemon=True,
                         name=f"kv-recv-{request.peer}").start()
        return engine_pb2.OpenKVChannelResponse(host=self.host, port=port, layout=layout_to_proto(self.layout),
                                                backend=backend)

    def close(self) -> None:
        with self._lock:
            receivers, self._receivers = self._receivers, []
        for r in receivers:
            r.close()

    # ---- receive loop (one thread per pair) ------------------------------
    def _recv_loop(self, receiver: KVReceiver, peer: str) -> None:
        while True:
            try:
                rid, _, stats, meta = receiver.recv(self.kv_cache, validate=self._validate)
            except KVChannelClosed:
                logger.info("KV channel from %s closed", peer)
                return
            except KVTransferError as exc:
                logger.warning("KV transfer from %s failed: %s", peer, exc)
                rid = getattr(exc, "request_id", None)
                if rid:
                    self.bridge.submit(lambda e, rid=rid: self._failed(e, rid))
                if not receiver.is_usable:
                    return
                continue
            except Exception as exc:  # validation refused it: data drained, pair fine
                logger.warning("KV transfer from %s refused: %s", peer, exc)
                continue
            if self.on_transfer is not None:
                self.on_transfer(stats)
            self.bridge.submit(lambda e, rid=rid, meta=meta: self._arrived(e, rid, meta))

    def _validate(self, request_id: str, dst_block_ids: list[int]) -> None:
        """Receiver thread: ask the engine thread whether the blocks are ours."""
        self.bridge.loop.submit(lambda e: self._check_reserved(e, request_id, dst_block_ids)).result(self.timeout)

    # ---- engine thread ---------------------------------------------------
    def _check_reserved(self, engine: LLMEngine, request_id: str, dst: list[int]) -> None:
        if request_id not in engine.scheduler.reserved:
            raise ValueError(f"request {request_id} has no reserved blocks here (aborted or unknown)")
        req, kv = engine.scheduler.reserved[request_id], engine.scheduler.kv
        have = kv.get_block_ids(request_id)
        skipped = len(have) - len(dst)  # leading blocks this cache already had (prefix hits)
        if not 0 <= skipped * kv.block_size <= req.num_cached_tokens or dst != have[skipped:]:
            raise ValueError(f"request {request_id}: KV sent to blocks {dst}, reserved {have} "
                             f"({req.num_cached_tokens} tokens cached here)")
        self.receiving.add(request_id)

    def _arrived(self, engine: LLMEngine, request_id: str, meta: dict) -> None:
        self.receiving.discard(request_id)
        if request_id in self.abort_after_receive:
            self.abort_after_receive.discard(request_id)
            engine.abort_request(request_id)
            return
        lp = meta.get("logprob")
        logprob = Logprobs(lp["token_id"], lp["logprob"], lp["rank"], [tuple(t) for t in lp["top"]]) if lp else None
        req = engine.scheduler.kv_arrived(request_id, int(meta["first_token"]), logprob)
        self.bridge.post(self.bridge.snapshot(req))

    def _failed(self, engine: LLMEngine, request_id: str) -> None:
        self.receiving.discard(request_id)
        self.abort_after_receive.discard(request_id)
        self.bridge.abort_in_engine(engine, request_id)

    def defer_abort_if_receiving(self, request_id: str) -> bool:
        if request_id in self.receiving:
            self.abort_after_receive.add(request_id)
            return True
        return False
