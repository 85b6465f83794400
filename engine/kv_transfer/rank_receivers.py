"""The KV pairs of a tensor-parallel worker on the receiving side, driven by rank 0.

A tensor-parallel decode engine receives each request's KV in parts, every rank its own
share of the KV heads into its own cache (``engine.parallel.kv_transfer_parts``). Rank 0
has a worker listen for its parts (``kv_listen``, over ``engine.rank_calls``); the worker
receives on a thread of its own, and asks rank 0 before any byte lands (``kv_admit``) and
tells it how each part ended (``kv_ended``): the request's state stays with rank 0.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.kv_transfer.protocol import KVChannelClosed, KVLayout, TransferStats
from engine.kv_transfer.receiver import KVReceiver
from engine.rank_calls import call

logger = logging.getLogger(__name__)


class RankReceivers:
    def __init__(self, kv_cache: torch.Tensor, store: dist.Store, rank: int) -> None:
        self.kv_cache, self.store, self.rank = kv_cache, store, rank
        self._receivers: dict[str, KVReceiver] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {"kv_listen": self.listen, "kv_stop_listening": self.close}

    def listen(self, key: str, host: str, layout: dict, heads: list[int], backend: str, timeout: float,
               num_parts: int) -> int:
        """Listen for a pair that fills this rank's heads ``heads``; the port to dial."""
        self.close(key)
        receiver, port = KVReceiver.listen(host, KVLayout.from_dict(layout), backend=backend,
                                           device=self.kv_cache.device, timeout=timeout)
        with self._lock:
            self._receivers[key] = receiver
        view = self.kv_cache[..., heads[0]:heads[1], :]
        threading.Thread(target=self._loop, args=(key, receiver, view, num_parts, timeout), daemon=True,
                         name=f"kv-recv-{key}").start()
        return port

    def close(self, key: str) -> None:
        with self._lock:
            receiver = self._receivers.pop(key, None)
        if receiver is not None:
            receiver.close()

    def _loop(self, key: str, receiver: KVReceiver, view: torch.Tensor, num_parts: int, timeout: float) -> None:
        try:
            receiver.wait_connected()
            while self._recv_one(key, receiver, view, num_parts, timeout):
                pass
        except Exception as e:  # setup failed, or rank 0 is gone
            logger.warning("KV pair %s: %s", key, e)
        finally:
            self.close(key)

    def _recv_one(self, key: str, receiver: KVReceiver, view: torch.Tensor, num_parts: int,
                  timeout: float) -> bool:
        def on_rank0(name: str) -> Callable[..., None]:
            return lambda **args: call(self.store, 0, name, args, 2 * timeout)

        go, _ = receive_part(receiver, view, num_parts, f"KV part {key}", on_rank0("kv_admit"),
                             on_rank0("kv_ended"), on_rank0("kv_refused"), self.rank)
        return go


def receive_part(receiver: KVReceiver, heads: torch.Tensor, num_parts: int, name: str,
                 admit: Callable[..., None], ended: Callable[..., None], refused: Callable[..., None],
                 rank: int = 0, draft_cache: torch.Tensor | None = None) -> tuple[bool, TransferStats | None]:
    """Receive one part of a request's KV into ``heads`` and account for it exactly once:
    ``admit`` before any byte lands (raises to refuse: the part is drained), then ``ended``
    (landed, or failed after admission) or ``refused`` (failed before it, the request known).
    Returns (whether the pair goes on, the stats of a part that landed). ``rank``: the
    receiving rank, named in the figures with the part's end (time.time()). ``draft_cache``: a
    draft model's cache, whose blocks come in the same transfer (the figures' ``draft``)."""
    admitted: list[str] = []
    part = uuid.uuid4().hex  # names this part to rank 0, whose answer may come after we gave up

    def validate(request_id: str, dst_block_ids: list[int]) -> None:
        admitted.append(request_id)
        admit(request_id=request_id, dst_block_ids=dst_block_ids, num_parts=num_parts, part=part)

    try:
        rid, _, stats, meta = receiver.recv(heads, validate=validate, draft_cache=draft_cache)
    except KVChannelClosed:
        logger.info("%s: closed", name)
        return False, None
    except BaseException as exc:  # anything: the request's state must hear of it
        rid = admitted[0] if admitted else getattr(exc, "request_id", None)
        why = f"{name} failed: {str(exc) or type(exc).__name__}"
        logger.warning("%s%s", f"request {rid}: " if rid else "", why)
        if admitted:
            ended(request_id=rid, error=why, part=part)
        elif rid is not None:
            refused(request_id=rid, error=why)
        return receiver.is_usable and isinstance(exc, Exception), None
    ended(request_id=rid, error=None, part=part, meta=meta, figures={
        "num_bytes": stats.num_bytes, "num_blocks": stats.num_blocks, "seconds": stats.seconds,
        "backend": stats.backend, "rank": rank, "end": time.time(), "draft": draft_cache is not None})
    return True, stats
