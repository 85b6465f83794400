"""Prefill side of KV transfer: one lazily opened pair per decode server.

The first transfer to a decode server asks it (gRPC ``OpenKVChannel``) for a
rendezvous, then joins a 2-rank torch.distributed group there; later
transfers reuse the pair. A failed pair is dropped and reopened next time.
Runs in worker threads (blocking sends), never in the engine thread.
"""
from __future__ import annotations

import logging
import threading

import grpc
import torch

from engine.kv_transfer import KVLayout, KVSender, KVTransferError, TransferStats
from pdserve.v1 import engine_pb2, engine_pb2_grpc
from rpc.layout_convert import layout_to_proto
from rpc import tls
from rpc.server import CHANNEL_OPTIONS

logger = logging.getLogger(__name__)


class KVSenders:
    def __init__(self, kv_cache: torch.Tensor, layout: KVLayout, my_address: str, timeout: float) -> None:
        self.kv_cache = kv_cache
        self.layout = layout
        self.my_address = my_address
        self.timeout = timeout
        self._senders: dict[tuple[str, int], KVSender] = {}  # (decode server, slot) -> its pair
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    def pair(self, decode_address: str, reuse: bool = True, slot: int = 0) -> KVSender:
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
            with tls.channel(decode_address, CHANNEL_OPTIONS) as ch:
                try:
                    resp = engine_pb2_grpc.DecodeStub(ch).OpenKVChannel(
                        engine_pb2.OpenKVChannelRequest(peer=peer, layout=layout_to_proto(self.layout),
                                                        device=str(self.kv_cache.device)),
                        timeout=self.timeout)
                except grpc.RpcError as exc:
                    raise KVTransferError(f"decode server {decode_address} refused the KV channel: "
                                          f"{exc.details() or exc.code()}") from exc
            # resp.backend may be "auto": the handshake then settles it from the two GPUs' UUIDs.
            sender = KVSender.connect(resp.host, resp.port, self.layout, backend=resp.backend or "auto",
                                      device=self.kv_cache.device, timeout=self.timeout)
            logger.info("KV channel %d to %s open at %s:%d: %s", slot, decode_address, resp.host, resp.port,
                        sender.reason)
            self._senders[key] = sender
            return sender

    def has_pair(self, decode_address: str, slot: int = 0) -> bool:
        return (decode_address, slot) in self._senders

    def send(self, decode_address: str, request_id: str, src_block_ids: list[int], dst_block_ids: list[int],
             meta: dict) -> TransferStats:
        """Blocking: returns once the blocks' data has left this process."""
        if len(src_block_ids) != len(dst_block_ids):
            raise KVTransferError(f"request {request_id}: {len(src_block_ids)} blocks computed but "
                                  f"{len(dst_block_ids)} reserved on the decode server")
        reused = self.has_pair(decode_address)
        sender = self.pair(decode_address)
        try:
            return sender.send(request_id, src_block_ids, dst_block_ids, self.kv_cache, meta=meta)
        except KVTransferError as exc:
            if not self.settle_failure(decode_address, sender, reused):
                raise
            logger.info("KV pair to %s broke (%s); opening a new one", decode_address, exc)
        sender = self.pair(decode_address, reuse=False)
        try:
            return sender.send(request_id, src_block_ids, dst_block_ids, self.kv_cache, meta=meta)
        except KVTransferError:
            self.settle_failure(decode_address, sender, reused=False)
            raise

    def settle_failure(self, decode_address: str, sender: KVSender, reused: bool, slot: int = 0) -> bool:
        """After a transfer on ``sender`` failed: drop the pair if it broke. True when sending once
        more, on a new pair, can work: a pair that had worked before broke now, which most often
        means the decode server restarted (its end of the pair is gone)."""
        if sender.is_usable:  # the transfer failed, not the pair (e.g. the decode side refused it)
            return False
        self.drop(decode_address, sender, slot)
        return reused

    def drop(self, decode_address: str, sender: KVSender, slot: int = 0) -> None:
        with self._guard:
            if self._senders.get((decode_address, slot)) is sender:
                del self._senders[(decode_address, slot)]
        sender.close()

    def close(self) -> None:
        with self._guard:
            senders, self._senders = list(self._senders.values()), {}
        for s in senders:
            s.close()
