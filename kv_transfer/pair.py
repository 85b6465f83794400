"""What both ends of a KV pair share: deadlines, the hello handshake, the process
group, the pair's CUDA stream and staging buffers, posting, waiting and aborting.

Authentication. Before any process group exists, both ends prove they know the
shared secret in ``PDSERVE_KV_SECRET`` (read when a pair is made; unset means
the empty secret, so servers without it pair only with each other): each side
puts a fresh nonce in the store, then an HMAC-SHA256 of both nonces and its
rank under the secret, and checks the peer's. The secret never travels and a
proof is worth nothing in another pair. A peer that fails it gets no group,
so it can neither read nor write a block. This keeps strangers out; it does
not encrypt the KV data, which crosses the network in the clear."""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from engine.parallel import BLOCKING_WAIT, nccl_blocking_wait
from kv_transfer.protocol import (KVChannelClosed, KVLayout, KVTransferError, PROTOCOL_VERSION, _Group,
                                  _TAG, _WILDCARD_HOSTS, _layout_diffs, gpu_uuid, resolve_backend, slow_path)

logger = logging.getLogger(__name__)

# A KV pair's NCCL group is built with TORCH_NCCL_BLOCKING_WAIT=1 (``_make_group``): it then
# starts no watchdog thread, hence no heartbeat monitor: a failed or timed-out NCCL op surfaces
# in the thread that waits for it, and nothing in the background ends the process (the
# watchdog's default on a timeout or a peer's death). Deadlines stay ours: _Pair._wait polls
# and aborts the group. A value the user set is kept, with a warning.

# An NCCL transfer is polled without sleeping for _SPIN_S (a 16k-token prompt of an 8B model
# moves in ~6 ms; a sleep would add its own granularity to every transfer), then every _POLL_S.
_SPIN_S = 0.05
_POLL_S = 0.0005
_NCCL_PING_BYTES = 32 << 20  # >= p2p channels (32 on H200 pairs) x NCCL's 512 KiB p2p chunk
KV_SECRET_ENV = "PDSERVE_KV_SECRET"
_AUTH_POLL_S = 0.005


class _Teardowns:
    """The pairs' process groups being torn down, and the exit waiting for them. A group's
    teardown (gloo's shutdown and its destructor, which joins the group's threads) may run on
    a pair's daemon thread, the one that noticed the peer leave, while the process exits: a
    daemon thread that comes back to Python once the interpreter is finalizing is ended
    mid-destructor, and the C++ runtime aborts the process (SIGABRT at a clean shutdown).
    ``at_exit`` (registered with atexit: it runs before finalizing) waits for the teardowns
    under way, up to ``EXIT_WAIT_S``."""

    EXIT_WAIT_S = 10.0

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with self._idle:
            self._count += 1
        try:
            yield
        finally:
            with self._idle:
                self._count -= 1
                self._idle.notify_all()

    def at_exit(self) -> None:
        with self._idle:
            if not self._idle.wait_for(lambda: self._count == 0, self.EXIT_WAIT_S):
                logger.warning("exiting with %d KV pair teardown(s) still running", self._count)


_teardowns = _Teardowns()
atexit.register(_teardowns.at_exit)


def _auth_proof(secret: bytes, rank: int, challenge: str, own_nonce: str) -> bytes:
    """What ``rank`` answers to the peer's ``challenge`` nonce (its own nonce included, so a
    proof from one pair or one direction never fits another)."""
    text = f"pdserve-kv-auth|{rank}|{challenge}|{own_nonce}".encode()
    return hmac.new(secret, text, hashlib.sha256).hexdigest().encode()


def _remaining(deadline: float, what: str) -> timedelta:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError(f"{what}: deadline exceeded")
    return timedelta(seconds=left)


_T = TypeVar("_T")


def _within(fn: Callable[[], _T], seconds: float, what: str, on_late: Callable[[_T], None]) -> _T:
    """fn()'s result if it returns within ``seconds``, its error if it raises; else a
    KVTransferError naming ``what``. For calls that take no deadline of their own (a blocking
    NCCL communicator's creation waits for the peer without end, and cannot be aborted while it
    runs): fn runs in a daemon thread, which a timeout leaves behind; if fn returns after all,
    ``on_late(result)`` disposes of the result in that thread."""
    lock = threading.Lock()
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            with lock:
                box["error"] = e
        else:
            with lock:
                late = box.get("late", False)
                if not late:
                    box["result"] = result
            if late:
                on_late(result)
        finally:
            done.set()

    threading.Thread(target=run, name=f"kv-bounded-{what[:40]}", daemon=True).start()
    done.wait(max(0.0, seconds))
    with lock:
        if "result" not in box and "error" not in box:
            box["late"] = True
            raise KVTransferError(f"{what}: not done within {seconds:.1f}s (the peer never joined)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _abort_quietly(group: _Group) -> None:
    try:
        group.abort()
    except Exception as e:  # noqa: BLE001 - nothing left to tell
        logger.debug("KV group abort after a late start: %s", e)


def _gather_blocks(blocks: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """out[:, i] = blocks[:, index[i]] for [layers, blocks, ...] tensors; ``out`` contiguous,
    ``blocks`` contiguous or a head slice of a cache."""
    blocks, out = _bytes_of_fp8(blocks), _bytes_of_fp8(out)
    if blocks.is_contiguous():
        torch.index_select(_as_rows(blocks), 1, index, out=_as_rows(out))
    else:
        torch.index_select(blocks, 1, index, out=out)


def _scatter_blocks(blocks: torch.Tensor, index: torch.Tensor, data: torch.Tensor) -> None:
    """blocks[:, index[i]] = data[:, i]: the inverse of ``_gather_blocks``."""
    blocks, data = _bytes_of_fp8(blocks), _bytes_of_fp8(data)
    if blocks.is_contiguous():
        _as_rows(blocks).index_copy_(1, index, _as_rows(data))
    else:
        blocks.index_copy_(1, index, data)


def _bytes_of_fp8(t: torch.Tensor) -> torch.Tensor:
    """An FP8 cache (or its staging) as uint8, same strides: the copies move bytes, and some
    of torch's CPU kernels (index_copy_) have no float8 version."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _as_rows(blocks: torch.Tensor) -> torch.Tensor:
    """[layers, blocks, ...] contiguous -> [layers, blocks, row] viewed as int64 when the row's
    bytes allow: gather and scatter kernels then move 8 bytes per element, not 2."""
    rows = blocks.view(blocks.shape[0], blocks.shape[1], -1)
    if rows.element_size() < 8 and rows.shape[-1] * rows.element_size() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _hello(layout: KVLayout, asks: str, device: torch.device, **extra: Any) -> dict[str, Any]:
    """What one side tells the other before any process group exists. ``gpu`` is the UUID
    of the GPU holding this side's cache (None: host memory): it decides the backend."""
    return {"protocol": PROTOCOL_VERSION, "backend": asks, "gpu": gpu_uuid(device),
            "layout": layout.to_dict(), **extra}


def _settle(prefill: dict[str, Any], decode: dict[str, Any]) -> tuple[str, str]:
    """Both sides run this on the two hellos (values in (prefill, decode) order): the same
    checks, the same error message, the same (backend, reason)."""
    if prefill.get("closed") or decode.get("closed"):
        raise KVChannelClosed("KV pair closed during setup")
    problems = []
    if prefill["protocol"] != decode["protocol"]:
        problems.append(f"protocol {prefill['protocol']} != {decode['protocol']}")
    else:
        problems += _layout_diffs(KVLayout.from_dict(prefill["layout"]), KVLayout.from_dict(decode["layout"]))
    if problems:
        raise KVTransferError("KV layout mismatch between prefill and decode: " + "; ".join(problems))
    return resolve_backend(prefill["backend"], decode["backend"], prefill.get("gpu"), decode.get("gpu"))


def _log_pair_up(what: str, backend: str, reason: str, prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """The transport a pair chose and why; a warning where both caches are on GPUs and a
    faster path exists (``slow_path``)."""
    logger.info("KV pair up: %s, %s", what, reason)
    slow = slow_path(backend, prefill.get("gpu"), decode.get("gpu"))
    if slow:
        logger.warning("KV pair %s: %s", what, slow)


def _wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Poll with plain TCP connects: TCPStore's own client retries can overrun its timeout ~2x."""
    last: OSError | None = None
    while time.monotonic() < deadline:
        try:
            left = max(0.05, deadline - time.monotonic())
            socket.create_connection((host, port), timeout=min(left, 2.0)).close()
            return
        except OSError as e:
            last = e
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
    raise KVTransferError(f"no KV receiver listening at {host}:{port}: {last}")


def _local_addr_toward(host: str, port: int) -> str:
    """The local address the kernel would use to reach host (no packet is sent)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


def _make_group(store: dist.Store, rank: int, backend: str, timeout: timedelta, bind_host: str | None,
                device: torch.device) -> _Group:
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise KVTransferError("backend nccl requested but this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        wait = os.environ.get(BLOCKING_WAIT, "1")
        if wait != "1":
            logger.warning("%s=%s: NCCL's watchdog may end this process when a KV peer dies", BLOCKING_WAIT, wait)
        with nccl_blocking_wait(wait):
            group = dist.ProcessGroupNCCL(store, rank, 2, opts)
        # Build the pair's one communicator now, on this cache's GPU, while both sides are in
        # setup. Otherwise the first op builds it lazily, from whatever thread and current
        # device sends first, and a single (unbatched) op would build a second one. Its
        # creation waits for the peer with no deadline of its own: bounded here (a peer that
        # authenticated and then never built its end fails the pair within the KV deadline).
        def connect() -> None:
            with torch.cuda.device(device):  # a new thread starts on device 0
                group.eager_connect_single_device(device)

        _within(connect, timeout.total_seconds(), "NCCL communicator creation", lambda _: _abort_quietly(group))
        return group
    if backend != "gloo":
        raise ValueError(f"unknown KV transfer backend {backend!r}")
    gloo = dist.ProcessGroupGloo
    gloo_device = None
    if bind_host and bind_host not in _WILDCARD_HOSTS:
        try:
            gloo_device = gloo.create_device(hostname=bind_host)
        except RuntimeError as e:  # not a local address: let gloo pick (GLOO_SOCKET_IFNAME)
            logger.warning("gloo cannot bind %s (%s); using the default interface", bind_host, e)
    opts = gloo._Options()
    opts._timeout = timeout
    opts._devices = [gloo_device or gloo.create_default_device()]
    return gloo(store, rank, 2, opts)


class _Pair:
    """State shared by both ends: header store, group, health, CUDA stream, staging buffers.

    All data work of a pair runs on the pair's own CUDA stream (``_on_stream``): NCCL waits
    for it, and neither side's engine stream ever waits for a transfer."""

    _peer_rank: int  # set by the subclass

    def __init__(self, layout: KVLayout, asks: str, timeout: float, device: str | torch.device) -> None:
        self.layout = layout
        self.asks = asks  # the backend this side asked for: "auto" | "gloo" | "nccl"
        self.backend = asks  # settled by the handshake
        self.host_staged = False  # sender: the KV goes through host memory though a cache is on a GPU
        self.reason = ""  # why that backend, for the logs
        self.timeout = timeout
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._store: dist.Store | None = None  # header channel; the group has its own clone
        self._group: _Group | None = None
        self._broken: str | None = None
        self._closed = False
        self._aborted = False
        self._stream: torch.cuda.Stream | None = None
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}  # staging, by (kind, slot)
        self._secret = os.environ.get(KV_SECRET_ENV, "").encode()

    @property
    def wire_device(self) -> torch.device:
        """Where data messages live: the cache's device for NCCL, host memory for gloo."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_usable(self) -> bool:
        return not self._closed and not self._broken

    def _check_usable(self) -> _Group:
        if self._closed:
            raise KVChannelClosed("KV pair is closed")
        if self._broken:
            raise KVTransferError(f"KV pair is broken ({self._broken}); build a new pair")
        assert self._group is not None
        return self._group

    @contextlib.contextmanager
    def _on_stream(self, after_caller: bool = False) -> Iterator[None]:
        """Current device and stream for this pair's data work (nothing on CPU). ``after_caller``:
        first order this stream after the calling thread's current stream (the engine's writes
        to the cache, or its last reads of blocks about to be overwritten)."""
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        caller = torch.cuda.current_stream(self.device) if after_caller else None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            if caller is not None:
                self._stream.wait_stream(caller)
            yield

    def _buffer(self, kind: str, slot: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat staging buffer of at least ``numel``, kept for the pair's life (two slots a
        kind, used alternately). Host buffers are pinned when the cache is on a GPU."""
        buf = self._buffers.get((kind, slot))
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            pin = device.type == "cpu" and self.device.type == "cuda"
            buf = torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)
            self._buffers[(kind, slot)] = buf
        return buf[:numel]

    def _index_on_device(self, ids: np.ndarray, device: torch.device, kind: str = "index") -> torch.Tensor:
        """Block ids (1-d) as an int64 tensor on ``device``, copied on this pair's stream from a
        pinned buffer: a copy from pageable memory would wait for the GPU with this thread (and
        may hold up the engine thread's launches meanwhile). Transfers on a pair never overlap, so
        the buffer is free again when the next one starts; ``kind`` names the buffer of each
        index a transfer places."""
        host = torch.from_numpy(ids)
        if device.type != "cuda":
            return host
        staged = self._buffer(kind, 0, ids.size, torch.int64, torch.device("cpu"))
        staged.copy_(host)
        return staged.to(device, non_blocking=True)

    def _post(self, tensors: Sequence[torch.Tensor], send: bool, what: str) -> list[Any]:
        """Post one batch of messages to the peer, in order. NCCL: one group (a single Work);
        gloo: one Work per message."""
        group = self._check_usable()
        op = group.send if send else group.recv
        try:
            if self.backend != "nccl":
                return [op([t], self._peer_rank, _TAG) for t in tensors]
            group._start_coalescing()  # ncclGroupStart: one kernel launch for the whole batch
            try:
                for t in tensors:
                    op([t], self._peer_rank, _TAG)
            finally:
                work = group._end_coalescing()
            return [work]
        except Exception as e:
            self._fail(what, e)
            raise KVTransferError(f"{what} failed: {e}") from e

    def _wait(self, works: Sequence[Any], deadline: float, what: str,
              done: torch.cuda.Event | None = None) -> None:
        """Until every work (and the event ``done``) has completed, or the deadline passes:
        then the pair is broken and its group aborted. gloo blocks in ``wait``; NCCL is
        polled from here, since a blocking NCCL wait sleeps in coarse steps."""
        try:
            if self.backend != "nccl":
                for work in works:
                    work.wait(_remaining(deadline, what))
                return
            pending, start = list(works), time.monotonic()
            while True:
                still = []
                for work in pending:
                    if work.is_completed():
                        work.wait()  # raises the op's error, if it failed
                    else:
                        still.append(work)
                pending = still
                if not pending and (done is None or done.query()):
                    return
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"not done within {self.timeout}s (peer gone or stalled)")
                time.sleep(0 if now - start < _SPIN_S else _POLL_S)
        except KVTransferError:
            raise
        except Exception as e:
            self._fail(what, e)
            raise KVTransferError(f"{what} failed: {e}") from e

    def _fail(self, what: str, error: BaseException) -> None:
        """A data-plane error: the pair is broken for good (the peer may be mid-message) and an
        NCCL group is aborted now, which ends its kernels still waiting on the peer."""
        self._broken = self._broken or f"{what}: {error}"
        if self.backend == "nccl":
            self._abort()

    def _abort(self) -> None:
        if self._aborted or self._group is None:
            return
        self._aborted = True
        try:
            self._group.abort()
        except Exception as e:  # already torn down by a peer error
            logger.debug("KV group abort: %s", e)

    def _build_group(self, rank: int, deadline: float, where: str, bind_host: str | None) -> None:
        """The process group on a clone of the store, then one message each way, so both sides
        know the data path works before the first transfer."""
        assert self._store is not None
        try:
            self._authenticate(rank, deadline, where)
            with self._on_stream():
                self._group = _make_group(self._store.clone(), rank, self.backend, _remaining(deadline, where),
                                          bind_host, self.device)
                # NCCL connects a peer's channels on first use, and only those a message needs;
                # connecting needs the peer's help. A ping that spreads over every channel does it
                # now, while the peer is known to be there.
                ping = torch.ones(_NCCL_PING_BYTES if self.backend == "nccl" else 1, dtype=torch.uint8,
                                  device=self.wire_device)
                works = self._post([ping], send=rank == 0, what=where)
                self._wait(works, deadline, where)
        except KVTransferError:
            self._teardown()
            raise
        except Exception as e:
            self._teardown()
            raise KVTransferError(f"{where}: {e}") from e

    def _authenticate(self, rank: int, deadline: float, where: str) -> None:
        """Mutual challenge-response on the store (see the module docstring); raises
        KVTransferError when the peer's proof is wrong, KVChannelClosed when closed meanwhile."""
        store, peer = self._store, 1 - rank
        assert store is not None
        mine = secrets.token_hex(16)
        store.set(f"auth/nonce/{rank}", mine)
        theirs = self._poll_key(f"auth/nonce/{peer}", deadline, where).decode()
        store.set(f"auth/proof/{rank}", _auth_proof(self._secret, rank, theirs, mine))
        proof = self._poll_key(f"auth/proof/{peer}", deadline, where)
        if not hmac.compare_digest(proof, _auth_proof(self._secret, peer, mine, theirs)):
            raise KVTransferError(f"{where}: the peer failed KV pair authentication (the two servers' "
                                  f"{KV_SECRET_ENV} differ, or one has none)")

    def _poll_key(self, key: str, deadline: float, where: str) -> bytes:
        """The store's value of ``key`` once set; polled so that close() is noticed at once."""
        assert self._store is not None
        while not self._store.check([key]):
            if self._closed:
                raise KVChannelClosed("KV pair closed during setup")
            _remaining(deadline, where)  # raises once the deadline has passed
            time.sleep(_AUTH_POLL_S)
        return self._store.get(key)

    def _teardown(self) -> None:
        """Drop the group. NCCL is aborted, never shut down: shutdown() destroys the communicator,
        which waits for the peer to destroy its end too (it hangs while the peer lives on)."""
        group, self._group = self._group, None
        if group is None:
            return
        with _teardowns.running():  # an exit waits for it (_Teardowns)
            try:
                if self.backend == "nccl":
                    if not self._aborted:
                        self._aborted = True
                        group.abort()
                else:
                    group.shutdown()
            except Exception as e:  # already torn down by a peer error
                logger.debug("KV group teardown: %s", e)
            del group  # its destructor runs here, counted
