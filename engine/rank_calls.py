"""Calls from rank 0 to the other ranks of a tensor-parallel group, beside the steps.

A worker's main thread runs the steps rank 0 broadcasts (``ModelRunner.serve_steps``).
Work that is not a step, such as sending the worker's share of a request's KV, comes as
calls over the group's TCPStore: rank 0 pushes ``{"id", "name", "args"}`` (JSON) onto the
queue ``calls/<rank>``; the worker's call thread runs the named handler in a thread of
its pool and sets ``reply/<id>`` to ``{"result": ...}`` or ``{"error", "message"}``.

The engine knows no handler but one: ``install``. A layer above the engine (the KV
transfer's worker side, kv_transfer/rank_worker.py) names a factory, ``"module:function"``,
which the worker imports and calls once with its ``RankContext``; the handlers it returns
serve from then on (``install_on_ranks``). So the worker process runs what that layer
needs without the engine importing it.
"""
from __future__ import annotations

import importlib
import json
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

_PREFIX = "pdserve-tp-calls"
_IDLE_WAIT = timedelta(days=1)
Handler = Callable[..., Any]


@dataclass(frozen=True)
class RankContext:
    """What an installed handler factory gets on a worker rank: the rank, the group's
    store (to call rank 0 back) and this rank's shard of the KV cache
    ``[num_layers, num_blocks, 2, block_size, num_local_kv_heads, head_dim]``."""

    rank: int
    store: dist.Store
    kv_cache: torch.Tensor


class RankCallError(RuntimeError):
    """A handler raised on the called rank (``kind``: its exception's type name)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind, self.message = kind, message


def call(store: dist.Store, rank: int, name: str, args: dict[str, Any], timeout: float) -> Any:
    """Run handler ``name`` on ``rank`` with keyword ``args`` (JSON values); its result.
    Raises RankCallError if the handler raised, and TimeoutError past ``timeout`` seconds."""
    calls = dist.PrefixStore(_PREFIX, store).clone()  # a connection of its own: this call waits on it
    call_id = uuid.uuid4().hex
    calls.queue_push(f"calls/{rank}", json.dumps({"id": call_id, "name": name, "args": args}))
    key = f"reply/{call_id}"
    try:
        calls.wait([key], timedelta(seconds=timeout))
    except Exception as e:
        raise TimeoutError(f"rank {rank} did not answer {name} within {timeout:g}s: {e}") from e
    reply = json.loads(calls.get(key))
    calls.delete_key(key)
    if "error" in reply:
        raise RankCallError(reply["error"], reply["message"])
    return reply["result"]


def install_on_ranks(store: dist.Store, ranks: list[int], factory: str, timeout: float) -> None:
    """Install the handlers ``factory`` (``"module:function"``, called with the rank's
    ``RankContext``) on each of ``ranks``; a factory already installed there is kept as it is."""
    for rank in ranks:
        call(store, rank, "install", {"factory": factory}, timeout)


def serve_calls(store: dist.Store, rank: int, handlers: dict[str, Handler], max_workers: int = 8,
                context: RankContext | None = None) -> None:
    """Start this rank's call thread (a daemon: it ends with the process). ``context``: a
    worker rank's, for the factories ``install`` calls (without it there is no ``install``)."""
    calls = dist.PrefixStore(_PREFIX, store)
    handlers = dict(handlers)  # installed factories add to this copy
    if context is not None:
        handlers["install"] = _installer(handlers, context)
    pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"rank{rank}-call")
    replies = calls.clone()
    lock = threading.Lock()  # one reply at a time on the shared connection

    def run(message: dict[str, Any]) -> None:
        try:
            reply: dict[str, Any] = {"result": handlers[message["name"]](**message["args"])}
        except Exception as e:  # reported to the caller
            reply = {"error": type(e).__name__, "message": str(e)}
        with lock:
            replies.set(f"reply/{message['id']}", json.dumps(reply))

    def loop() -> None:
        incoming = calls.clone()
        incoming.set_timeout(_IDLE_WAIT)
        while True:
            try:
                message = json.loads(incoming.queue_pop(f"calls/{rank}", True))
            except Exception as e:
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue  # idle for a day: wait again
                logger.debug("rank %d calls end: %s", rank, e)  # rank 0's store is gone
                return
            pool.submit(run, message)

    threading.Thread(target=loop, name=f"rank{rank}-calls", daemon=True).start()


def _installer(handlers: dict[str, Handler], context: RankContext) -> Handler:
    """The ``install`` handler: adds a factory's handlers to ``handlers`` (once per factory)."""
    installed: set[str] = set()
    lock = threading.Lock()

    def install(factory: str) -> None:
        module, _, name = factory.partition(":")
        with lock:
            if factory in installed:
                return
            made = getattr(importlib.import_module(module), name)(context)
            handlers.update(made)
            installed.add(factory)

    return install
