"""The worker side of KV transfer on a tensor-parallel engine's ranks 1..N-1.

Every rank sends its own share of a request's KV heads, and receives its own share, over
pairs of its own, from or into its own cache (``kv_transfer.tp_parts``): nothing is
gathered on one rank. Rank 0 opens the pairs and drives them; a worker rank does its part
through the handlers here, called over the group's store (``engine.rank_calls``). The
engine's worker process knows none of them: the KV transfer's roles install them on the
workers when they are built (``install_rank_handlers``), and the worker's call thread
imports this module then.

    sending     kv_connect, kv_send, kv_close          (RankSenders)
    receiving   kv_listen, kv_stop_listening           (RankReceivers); each part asks rank 0
                kv_admit before it lands and tells it kv_ended / kv_refused (tp_parts.receive_part)
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.cpu_threads import serial_thread
from engine.parallel import TPGroup
from engine.rank_calls import RankContext, call, install_on_ranks
from kv_transfer.protocol import KVLayout, KVTransferError
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from kv_transfer.tp_parts import receive_part

logger = logging.getLogger(__name__)
_FACTORY = f"{__name__}:rank_handlers"


def install_rank_handlers(tp: TPGroup | None, timeout: float) -> None:
    """Install this module's handlers on every worker rank of ``tp`` (nothing to do without
    one, or at size 1). Installing again changes nothing. A worker answers once its model
    runner is built (which may be after rank 0's engine is up): call this with the bound of
    the first call that needs the handlers, right before it."""
    if tp is not None and tp.size > 1:
        install_on_ranks(tp.store, list(range(1, tp.size)), _FACTORY, timeout)


def rank_handlers(context: RankContext) -> dict[str, Callable[..., Any]]:
    """The handlers of one worker rank (called there, once, by ``engine.rank_calls``)."""
    return {**RankSenders(context.kv_cache).handlers(),
            **RankReceivers(context.kv_cache, context.store, context.rank).handlers()}


class RankSenders:
    """This rank's sending pairs, by the key rank 0 gave them, each with the heads it sends."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        self._pairs: dict[str, tuple[KVSender, tuple[int, int]]] = {}
        self._lock = threading.Lock()

    def handlers(self) -> dict[str, Callable[..., Any]]:
        return {"kv_connect": self.connect, "kv_send": self.send, "kv_close": self.close}

    def connect(self, key: str, host: str, port: int, layout: dict, heads: list[int], backend: str,
                timeout: float) -> str:
        """Join the pair a receiver listens for at host:port; the backend's reason."""
        self.close(key)
        sender = KVSender.connect(host, port, KVLayout.from_dict(layout), backend=backend,
                                  device=self.kv_cache.device, timeout=timeout)
        with self._lock:
            self._pairs[key] = (sender, (heads[0], heads[1]))
        return sender.reason

    def send(self, key: str, request_id: str, src: list[int], dst: list[int], meta: dict) -> dict:
        """Send this rank's heads of blocks ``src`` into the receiver's ``dst``; the stats."""
        with self._lock:
            pair = self._pairs.get(key)
        if pair is None:
            raise KVTransferError(f"no KV pair {key} on this rank")
        sender, (lo, hi) = pair
        if not sender.is_usable:
            raise KVTransferError(f"KV pair {key} is broken")
        stats = sender.send(request_id, src, dst, self.kv_cache[..., lo:hi, :], meta=meta)
        return {k: v for k, v in dataclasses.asdict(stats).items() if k not in ("marks", "parts")}

    def close(self, key: str) -> None:
        with self._lock:
            pair = self._pairs.pop(key, None)
        if pair is not None:
            pair[0].close()


class RankReceivers:
    """This rank's receiving pairs, by the key rank 0 gave them; each fills the heads it was
    opened for, on a thread of its own, and leaves the request's state to rank 0."""

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
        serial_thread()
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
