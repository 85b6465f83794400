"""KV-cache block transfer from a prefill process (sender) to a decode process (receiver).

A *pair* is one (prefill, decode) couple with its own 2-rank torch.distributed
group, created lazily the first time the prefill server sends to that decode
server (never ``init_process_group``: one process holds many pairs).

Setup (addresses travel over gRPC; that is the services' job, not this module's)::

    decode:  KVReceiver.listen(host, layout)  -> (receiver, port)   TCPStore server on a free port,
                                                                    the rest runs in a thread
    prefill: KVSender.connect(host, port, layout)                   blocks until the pair is up
    both:    hello/<rank> = {"protocol", "backend", "layout"} (JSON, through the store)
             both compare, both raise KVTransferError on a mismatch, before any process group exists
             ProcessGroupGloo|NCCL(PrefixStore(pair_name, store), rank, 2)   rank 0 = sender, 1 = receiver
             one 1-element warm-up message (NCCL builds its communicator on the first op)

One transfer (the receiver needs to know nothing in advance)::

    control  store queue "hdr"   {"request_id", "src": [...], "dst": [...]}   (JSON, one message)
    data     process group       for layer in 0..L-1, for (s, d, n) in merge_runs(src, dst):
                                     sender kv_cache[layer, s:s+n]  ->  receiver kv_cache[layer, d:d+n]

Why the header goes through the store and not the process group: the receiver
waits for the next header for as long as the pair is idle. An idle gloo recv
that times out closes the pair ("Application timeout caused pair closure"), and
an idle NCCL recv trips the watchdog, which tears the process down. A store
queue wait has no such side effect, and ``close()`` can wake it.

Tensors: ``kv_cache: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]``
(K at 0, V at 1), contiguous, so ``kv_cache[l, s:s+n]`` is one contiguous chunk
and goes on the wire without a copy (gloo on CPU, NCCL on GPU). gloo with a CUDA
cache stages each layer through pinned host buffers (two, used alternately).
At most two layers are in flight: posting layer l waits for layer l-1.

Failure model: every blocking step has a deadline. A data-plane error (timeout,
peer gone) marks the pair broken; later calls raise and the services build a new
pair. A transfer the decode side rejects (``validate`` raises, or a block id out
of range) is still received, into scratch memory, so the pair stays in sync.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
_Group = Any  # a c10d ProcessGroupGloo | ProcessGroupNCCL backend, used directly (no init_process_group)

PROTOCOL_VERSION = 1
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_PAIR_NAME = "pdserve-kv"
SENDER_RANK = 0
RECEIVER_RANK = 1
_HEADER_QUEUE = "hdr"
_TAG = 0
_OK, _ABORTED = 0, 1  # trailer values
_IDLE_WAIT = timedelta(days=1)  # header wait chunk when recv(timeout=None); close() wakes it
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


class KVTransferError(RuntimeError):
    """A KV transfer or pair setup failed; the message says what and where."""

    request_id: str | None = None  # set when a started transfer of this request failed


class KVChannelClosed(KVTransferError):
    """The pair was closed (by this side or by the peer); no more transfers."""


@dataclass(frozen=True)
class KVLayout:
    """What both sides of a pair must agree on. ``num_blocks`` may differ."""

    model: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str) -> KVLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError("kv_cache must be [num_layers, num_blocks, 2, block_size, "
                             f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model=model, dtype=_dtype_name(kv_cache.dtype), block_size=block_size,
                   num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise ValueError unless ``kv_cache`` has this layout and is contiguous."""
        want = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        got = (kv_cache.shape[0], *kv_cache.shape[2:]) if kv_cache.dim() == 6 else tuple(kv_cache.shape)
        if got != want or _dtype_name(kv_cache.dtype) != self.dtype:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                             f"the pair's layout {self}")
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous")


def check_compatible(local: KVLayout, remote: KVLayout, local_role: str = "local",
                     remote_role: str = "remote") -> None:
    """Raise KVTransferError naming every field that differs (values in (local, remote) order)."""
    diffs = _layout_diffs(local, remote)
    if diffs:
        raise KVTransferError(f"KV layout mismatch between {local_role} and {remote_role}: "
                              + "; ".join(diffs))


def _layout_diffs(a: KVLayout, b: KVLayout) -> list[str]:
    return [f"{f.name} {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
            for f in fields(KVLayout) if getattr(a, f.name) != getattr(b, f.name)]


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal runs where src and dst ids both go up by one.

    merge_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} src block ids but {len(dst_block_ids)} dst block ids")
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_block_ids, dst_block_ids):
        if runs:
            s, d, n = runs[-1]
            if src == s + n and dst == d + n:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((int(src), int(dst), 1))
    return runs


def choose_backend(sender_device: str, receiver_device: str, same_gpu: bool) -> tuple[str, str]:
    """("nccl" | "gloo", reason for the logs). Pure: both sides compute the same answer."""
    s_cuda = torch.device(sender_device).type == "cuda"
    r_cuda = torch.device(receiver_device).type == "cuda"
    if s_cuda and r_cuda and not same_gpu:
        return "nccl", f"nccl: prefill on {sender_device}, decode on {receiver_device}"
    if s_cuda and r_cuda:
        return "gloo", (f"gloo (host-staged): prefill and decode share {sender_device}, "
                        "NCCL cannot pair two ranks on one GPU")
    if s_cuda or r_cuda:
        return "gloo", (f"gloo (host-staged): prefill on {sender_device}, decode on "
                        f"{receiver_device}; NCCL needs CUDA on both sides")
    return "gloo", "gloo: prefill and decode on CPU"


@dataclass(frozen=True)
class TransferStats:
    """One transfer as seen by one side. ``num_messages`` counts data messages
    (layers x merged runs); the single control header is not counted."""

    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    num_messages: int

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else float("inf")


class ReceivedKV(NamedTuple):
    """One received transfer: whose, into which blocks, how it went, and the
    sender's small JSON ``meta`` (e.g. the first sampled token)."""

    request_id: str
    dst_block_ids: list[int]
    stats: TransferStats
    meta: dict[str, Any]


# --------------------------------------------------------------------------- shared plumbing

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _remaining(deadline: float, what: str) -> timedelta:
    left = deadline - time.monotonic()
    if left <= 0:
        raise KVTransferError(f"{what}: deadline exceeded")
    return timedelta(seconds=left)


def _hello(layout: KVLayout, backend: str, **extra: Any) -> str:
    return json.dumps({"protocol": PROTOCOL_VERSION, "backend": backend,
                       "layout": layout.to_dict(), **extra})


def _check_hello(prefill: dict[str, Any], decode: dict[str, Any]) -> None:
    """Same check, same message, on both sides (values in (prefill, decode) order)."""
    if prefill.get("closed") or decode.get("closed"):
        raise KVChannelClosed("KV pair closed during setup")
    problems = []
    if prefill["protocol"] != decode["protocol"]:
        problems.append(f"protocol {prefill['protocol']} != {decode['protocol']}")
    if prefill["backend"] != decode["backend"]:
        problems.append(f"backend {prefill['backend']} != {decode['backend']}")
    problems += _layout_diffs(KVLayout.from_dict(prefill["layout"]), KVLayout.from_dict(decode["layout"]))
    if problems:
        raise KVTransferError("KV layout mismatch between prefill and decode: " + "; ".join(problems))


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


def _make_group(store: dist.Store, rank: int, backend: str, timeout: timedelta,
                bind_host: str | None) -> _Group:
    if backend == "nccl":
        if not dist.is_nccl_available():
            raise KVTransferError("backend nccl requested but this torch build has no NCCL")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    if backend != "gloo":
        raise ValueError(f"unknown KV transfer backend {backend!r}")
    gloo = dist.ProcessGroupGloo
    device = None
    if bind_host and bind_host not in _WILDCARD_HOSTS:
        try:
            device = gloo.create_device(hostname=bind_host)
        except RuntimeError as e:  # not a local address: let gloo pick (GLOO_SOCKET_IFNAME)
            logger.warning("gloo cannot bind %s (%s); using the default interface", bind_host, e)
    opts = gloo._Options()
    opts._timeout = timeout
    opts._devices = [device or gloo.create_default_device()]
    return gloo(store, rank, 2, opts)


class _Pair:
    """State shared by both ends: store, group, health, staging buffers."""

    def __init__(self, layout: KVLayout, backend: str, timeout: float, device: str | torch.device) -> None:
        self.layout = layout
        self.backend = backend
        self.timeout = timeout
        self.device = torch.device(device)
        self._store: dist.Store | None = None
        self._group: _Group | None = None
        self._broken: str | None = None
        self._closed = False
        self._staging: list[torch.Tensor | None] = [None, None]

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

    def _is_staged(self, kv_cache: torch.Tensor) -> bool:
        return self.backend == "gloo" and kv_cache.device.type != "cpu"

    def _staging_views(self, slot: int, kv_cache: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
        """Views [n, 2, block_size, heads, head_dim] into pinned host buffer ``slot``, one per run."""
        block_shape = kv_cache.shape[2:]
        block_numel = kv_cache[0, 0].numel()
        need = sum(lengths) * block_numel
        buf = self._staging[slot]
        if buf is None or buf.numel() < need or buf.dtype != kv_cache.dtype:
            buf = torch.empty(need, dtype=kv_cache.dtype, pin_memory=True)
            self._staging[slot] = buf
        views, offset = [], 0
        for n in lengths:
            views.append(buf[offset:offset + n * block_numel].view(n, *block_shape))
            offset += n * block_numel
        return views

    def _wait(self, works: Sequence[dist.Work], deadline: float, what: str) -> None:
        try:
            for work in works:
                work.wait(_remaining(deadline, what))
        except Exception as e:
            self._broken = f"{what}: {e}"
            raise KVTransferError(f"{what} failed: {e}") from e


# --------------------------------------------------------------------------- sender

class KVSender(_Pair):
    """Prefill end of one pair. Thread-safe: transfers are serialized by a lock."""

    def __init__(self, layout: KVLayout, backend: str, timeout: float, device: str | torch.device) -> None:
        super().__init__(layout, backend, timeout, device)
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, host: str, port: int, layout: KVLayout, *, backend: str = "gloo",
                device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT_S,
                pair_name: str = DEFAULT_PAIR_NAME) -> KVSender:
        """Join the pair a KVReceiver listens for at host:port. Raises KVTransferError within
        ``timeout`` if nobody listens, the layouts differ, or the group cannot be built."""
        deadline = time.monotonic() + timeout
        self = cls(layout, backend, timeout, device)
        where = f"KV pair setup with decode at {host}:{port}"
        _wait_for_listener(host, port, deadline)
        try:
            store = dist.TCPStore(host, port, None, False, _remaining(deadline, where),
                                  wait_for_workers=False)
            self._store = dist.PrefixStore(pair_name, store)
            self._store.set("hello/0", _hello(layout, backend, dialed_host=host))
            self._store.wait(["hello/1"], _remaining(deadline, where))
            theirs = json.loads(self._store.get("hello/1"))
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{where}: {e}") from e
        _check_hello(json.loads(_hello(layout, backend)), theirs)
        try:
            self._group = _make_group(self._store, SENDER_RANK, backend, _remaining(deadline, where),
                                      _local_addr_toward(host, port))
            ping = torch.ones(1, device=self.wire_device)
            self._wait([self._group.send([ping], RECEIVER_RANK, _TAG)], deadline, where)
        except KVTransferError:
            raise
        except Exception as e:
            raise KVTransferError(f"{where}: {e}") from e
        logger.info("KV pair up: sending to %s:%d over %s", host, port, backend)
        return self

    def begin(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
              kv_cache: torch.Tensor, meta: dict[str, Any] | None = None) -> KVSendTransfer:
        """Start one transfer: takes the pair's lock and sends the header. Then call
        ``send_layer(l)`` for l = 0..L-1 in order (e.g. as prefill finishes each layer)
        and ``finish()``; use it as a context manager."""
        self.layout.check_cache(kv_cache)
        src, dst = [int(b) for b in src_block_ids], [int(b) for b in dst_block_ids]
        runs = merge_runs(src, dst)
        if any(not 0 <= b < kv_cache.shape[1] for b in src):
            raise ValueError(f"src block ids out of range [0, {kv_cache.shape[1]}): {src}")
        if len(set(dst)) != len(dst):
            raise ValueError(f"duplicate dst block ids: {dst}")
        if self.backend == "nccl" and kv_cache.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA kv_cache")
        if not self._lock.acquire(timeout=self.timeout):
            raise KVTransferError(f"request {request_id}: KV pair busy for {self.timeout}s")
        try:
            self._check_usable()
            assert self._store is not None
            self._store.queue_push(_HEADER_QUEUE, json.dumps(
                {"request_id": request_id, "src": src, "dst": dst, "meta": meta or {}}))
        except Exception as e:
            self._lock.release()
            if isinstance(e, KVTransferError):
                raise
            self._broken = f"header: {e}"
            raise KVTransferError(f"request {request_id}: sending KV header failed: {e}") from e
        return KVSendTransfer(self, request_id, runs, kv_cache)

    def send(self, request_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
             kv_cache: torch.Tensor, meta: dict[str, Any] | None = None) -> TransferStats:
        """Send kv_cache[:, src_block_ids] into the receiver's dst_block_ids; returns when
        the data has left this process's memory (the blocks may then be freed)."""
        with self.begin(request_id, src_block_ids, dst_block_ids, kv_cache, meta) as transfer:
            for layer in range(self.layout.num_layers):
                transfer.send_layer(layer)
        return transfer.finish()

    def close(self) -> None:
        """Tell the receiver we are gone (its recv raises KVChannelClosed) and drop the group."""
        if self._closed:
            return
        locked = self._lock.acquire(timeout=self.timeout)
        try:
            if self._store is not None and not self._broken:
                try:
                    self._store.queue_push(_HEADER_QUEUE, json.dumps({"closed": True}))
                except Exception as e:  # receiver already gone
                    logger.debug("KV sender close: %s", e)
            self._closed = True
            _shutdown(self._group)
            self._group = self._store = None
        finally:
            if locked:
                self._lock.release()


class KVSendTransfer:
    """One request's transfer in flight. Holds the pair's lock until ``finish()``."""

    def __init__(self, sender: KVSender, request_id: str, runs: list[tuple[int, int, int]],
                 kv_cache: torch.Tensor) -> None:
        self.request_id = request_id
        self._sender = sender
        self._runs = runs
        self._kv_cache = kv_cache
        self._next_layer = 0
        self._inflight: list[dist.Work] = []
        self._start = time.perf_counter()
        self._deadline = time.monotonic() + sender.timeout
        self._stats: TransferStats | None = None
        self._done = False

    def send_layer(self, layer: int) -> None:
        """Post layer ``layer``'s runs, then wait for the previous layer's (two layers in flight)."""
        sender, kv = self._sender, self._kv_cache
        if self._done:
            raise KVTransferError(f"request {self.request_id}: send_layer after finish()")
        if layer != self._next_layer:
            raise ValueError(f"send_layer({layer}) out of order: expected layer {self._next_layer}")
        group = sender._check_usable()
        what = f"request {self.request_id}: sending KV layer {layer}"
        if sender._is_staged(kv):
            # Slot layer % 2 was last used by layer - 2, whose sends finished during layer - 1.
            views = sender._staging_views(layer % 2, kv, [n for _, _, n in self._runs])
            for view, (s, _, n) in zip(views, self._runs):
                view.copy_(kv[layer, s:s + n], non_blocking=True)
            torch.cuda.current_stream(kv.device).synchronize()
        else:
            views = [kv[layer, s:s + n] for s, _, n in self._runs]  # contiguous views, no copy
        try:
            works = [group.send([v], RECEIVER_RANK, _TAG) for v in views]
        except Exception as e:
            sender._broken = f"{what}: {e}"
            raise KVTransferError(f"{what} failed: {e}") from e
        sender._wait(self._inflight, self._deadline, what)
        self._inflight = works
        self._next_layer += 1

    def finish(self) -> TransferStats:
        """Send the trailer, wait for everything, release the pair, return the stats.

        Called before every layer was sent (the caller failed mid-prefill), it sends the
        remaining layers anyway so the receiver stays in sync, marks the trailer "aborted"
        (the receiver's recv raises) and raises KVTransferError. Idempotent once it succeeded.
        """
        if self._done:
            if self._stats is None:
                raise KVTransferError(f"request {self.request_id}: transfer already finished (failed)")
            return self._stats
        sender, num_layers = self._sender, self._sender.layout.num_layers
        aborted = self._next_layer < num_layers
        what = f"request {self.request_id}: sending KV"
        try:
            for layer in range(self._next_layer, num_layers):
                self.send_layer(layer)
            trailer = torch.tensor([_ABORTED if aborted else _OK], dtype=torch.int64,
                                   device=sender.wire_device)
            try:
                self._inflight.append(sender._check_usable().send([trailer], RECEIVER_RANK, _TAG))
            except KVTransferError:
                raise
            except Exception as e:
                sender._broken = f"{what}: {e}"
                raise KVTransferError(f"{what} failed: {e}") from e
            sender._wait(self._inflight, self._deadline, what)
        finally:
            self._inflight = []
            self._next_layer = num_layers
            self._done = True
            sender._lock.release()
        if aborted:
            raise KVTransferError(f"{what}: finished before every layer was sent; "
                                  "the receiver was told the transfer is aborted")
        num_blocks = sum(n for _, _, n in self._runs)
        block_bytes = self._kv_cache[0, 0].numel() * self._kv_cache.element_size()
        self._stats = TransferStats(
            num_blocks=num_blocks, num_bytes=num_blocks * block_bytes * num_layers,
            seconds=time.perf_counter() - self._start, backend=sender.backend,
            num_messages=len(self._runs) * num_layers)
        return self._stats

    def __enter__(self) -> KVSendTransfer:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._done:
            return
        try:
            self.finish()
        except KVTransferError:
            if exc_type is None:
                raise


# --------------------------------------------------------------------------- receiver

class KVReceiver(_Pair):
    """Decode end of one pair. ``recv`` is meant for one thread (the pair's receive loop)."""

    def __init__(self, layout: KVLayout, backend: str, timeout: float, device: str | torch.device) -> None:
        super().__init__(layout, backend, timeout, device)
        self.host = ""
        self.port = 0
        self._ready = threading.Event()
        self._setup_error: BaseException | None = None
        self._setup_thread: threading.Thread | None = None
        self._recv_lock = threading.Lock()
        self._peer_closed = False

    @classmethod
    def listen(cls, host: str, layout: KVLayout, *, port: int = 0, backend: str = "gloo",
               device: str | torch.device = "cpu", timeout: float = DEFAULT_TIMEOUT_S,
               pair_name: str = DEFAULT_PAIR_NAME) -> tuple[KVReceiver, int]:
        """Open a TCPStore at host:port (0 = a free port) and return at once with the port to
        hand to the prefill side. The handshake and group setup run in a background thread,
        bounded by ``timeout``; ``wait_connected()`` / ``recv()`` raise its error, if any."""
        self = cls(layout, backend, timeout, device)
        try:
            store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout),
                                  wait_for_workers=False)
        except Exception as e:
            raise KVTransferError(f"cannot open KV store at {host}:{port}: {e}") from e
        self.host, self.port = host, store.port
        self._store = dist.PrefixStore(pair_name, store)
        self._store.set("hello/1", _hello(layout, backend))
        self._setup_thread = threading.Thread(target=self._setup, name=f"kv-listen-{self.port}",
                                              daemon=True)
        self._setup_thread.start()
        return self, self.port

    def _setup(self) -> None:
        deadline = time.monotonic() + self.timeout
        where = f"KV pair setup at {self.host}:{self.port}"
        try:
            assert self._store is not None
            try:
                self._store.wait(["hello/0"], _remaining(deadline, where))
            except KVTransferError:
                raise
            except Exception as e:
                raise KVTransferError(f"{where}: no prefill server connected within "
                                      f"{self.timeout}s") from e
            theirs = json.loads(self._store.get("hello/0"))
            _check_hello(theirs, json.loads(_hello(self.layout, self.backend)))
            bind = self.host if self.host not in _WILDCARD_HOSTS else theirs.get("dialed_host")
            try:
                self._group = _make_group(self._store, RECEIVER_RANK, self.backend,
                                          _remaining(deadline, where), bind)
                ping = torch.zeros(1, device=self.wire_device)
                self._wait([self._group.recv([ping], SENDER_RANK, _TAG)], deadline, where)
            except KVTransferError:
                raise
            except Exception as e:
                raise KVTransferError(f"{where}: {e}") from e
            if self._closed:
                raise KVChannelClosed("KV pair closed during setup")
            logger.info("KV pair up: receiving at %s:%d over %s", self.host, self.port, self.backend)
        except BaseException as e:
            self._setup_error = e
            if not isinstance(e, KVChannelClosed):
                logger.warning("%s", e)
        finally:
            self._ready.set()

    @property
    def is_connected(self) -> bool:
        return self._ready.is_set() and self._setup_error is None

    def wait_connected(self, timeout: float | None = None) -> None:
        """Block until setup is done (at most the listen timeout); raise its error if it failed."""
        if not self._ready.wait(self.timeout + 5.0 if timeout is None else timeout):
            raise KVTransferError(f"KV pair at {self.host}:{self.port} not connected yet")
        if self._setup_error is not None:
            raise self._setup_error

    def recv(self, kv_cache: torch.Tensor, validate: Callable[[str, list[int]], None] | None = None,
             timeout: float | None = None) -> ReceivedKV:
        """Receive the next transfer into ``kv_cache``: (request_id, dst_block_ids, stats).

        Waits up to ``timeout`` s (None: until a transfer comes or the pair closes) for the
        header, then calls ``validate(request_id, dst_block_ids)``. If it raises (or a dst id
        is out of range / repeated), the data is drained into scratch memory, ``kv_cache`` is
        not modified and the exception is re-raised; the pair stays usable."""
        self.layout.check_cache(kv_cache)
        if self.backend == "nccl" and kv_cache.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA kv_cache")
        with self._recv_lock:
            self.wait_connected()
            header = self._next_header(timeout)
            start = time.perf_counter()
            request_id, src, dst = header["request_id"], header["src"], header["dst"]
            runs = merge_runs(src, dst)
            try:
                bad = [b for b in dst if not 0 <= b < kv_cache.shape[1]]
                if bad or len(set(dst)) != len(dst):
                    raise KVTransferError(f"request {request_id}: dst block ids out of range "
                                          f"[0, {kv_cache.shape[1]}) or repeated: {dst}")
                if validate is not None:
                    validate(request_id, list(dst))
            except Exception:
                self._recv_layers(request_id, runs, kv_cache, drain=True)
                raise
            try:
                status = self._recv_layers(request_id, runs, kv_cache, drain=False)
            except KVTransferError as e:
                e.request_id = request_id
                raise
            if status != _OK:
                err = KVTransferError(f"request {request_id}: the prefill side aborted the transfer; "
                                      f"blocks {dst} hold partial data")
                err.request_id = request_id
                raise err
        block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
        return ReceivedKV(request_id, list(dst), TransferStats(
            num_blocks=len(dst), num_bytes=len(dst) * block_bytes * self.layout.num_layers,
            seconds=time.perf_counter() - start, backend=self.backend,
            num_messages=len(runs) * self.layout.num_layers), header.get("meta") or {})

    def _next_header(self, timeout: float | None) -> dict[str, Any]:
        store = self._store
        if store is None or self._closed:
            raise KVChannelClosed("KV pair is closed")
        if self._peer_closed:
            raise KVChannelClosed("the prefill side closed the KV pair")
        self._check_usable()
        while True:
            try:
                store.wait([_HEADER_QUEUE], _IDLE_WAIT if timeout is None else timedelta(seconds=timeout))
                header = json.loads(store.queue_pop(_HEADER_QUEUE, False))
                break
            except Exception as e:
                if self._closed:
                    raise KVChannelClosed("KV pair is closed") from e
                if timeout is not None:
                    raise KVTransferError(f"no KV transfer arrived within {timeout}s: {e}") from e
        if self._closed or header.get("closed"):
            self._peer_closed = self._peer_closed or not self._closed
            raise KVChannelClosed("KV pair is closed" if self._closed
                                  else "the prefill side closed the KV pair")
        return header

    def _recv_layers(self, request_id: str, runs: list[tuple[int, int, int]],
                     kv_cache: torch.Tensor, drain: bool) -> int:
        """Layer by layer, two in flight, straight into kv_cache[l, d:d+n] unless staged or
        drained; then the trailer, whose value (_OK or _ABORTED) is returned."""
        group = self._check_usable()
        deadline = time.monotonic() + self.timeout
        what = f"request {request_id}: receiving KV" + (" (draining a rejected transfer)" if drain else "")
        staged = self._is_staged(kv_cache) and not drain
        lengths = [n for _, _, n in runs]
        scratch, offsets = None, [sum(lengths[:i]) for i in range(len(lengths))] if drain else []
        if drain:  # [2 slots, blocks in the transfer, 2, block_size, heads, head_dim]
            scratch = torch.empty((2, sum(lengths), *kv_cache.shape[2:]), dtype=kv_cache.dtype,
                                  device=self.wire_device)
        events: list[Any] = [None, None]
        prev: tuple[int, list[dist.Work], list[torch.Tensor]] | None = None
        for layer in range(self.layout.num_layers + 1):
            current = None
            if layer < self.layout.num_layers:
                if scratch is not None:
                    views = [scratch[layer % 2, o:o + n] for o, n in zip(offsets, lengths)]
                elif staged:
                    if events[layer % 2] is not None:  # H2D copy of layer - 2 out of this slot
                        events[layer % 2].synchronize()
                    views = self._staging_views(layer % 2, kv_cache, lengths)
                else:
                    views = [kv_cache[layer, d:d + n] for _, d, n in runs]
                try:
                    current = (layer, [group.recv([v], SENDER_RANK, _TAG) for v in views], views)
                except Exception as e:
                    self._broken = f"{what}: {e}"
                    raise KVTransferError(f"{what} failed: {e}") from e
            if prev is not None:
                done_layer, works, views = prev
                self._wait(works, deadline, f"{what} layer {done_layer}")
                if staged:
                    for view, (_, d, n) in zip(views, runs):
                        kv_cache[done_layer, d:d + n].copy_(view, non_blocking=True)
                    events[done_layer % 2] = torch.cuda.Event()
                    events[done_layer % 2].record(torch.cuda.current_stream(kv_cache.device))
            prev = current
        trailer = torch.empty(1, dtype=torch.int64, device=self.wire_device)
        try:
            work = group.recv([trailer], SENDER_RANK, _TAG)
        except Exception as e:
            self._broken = f"{what}: {e}"
            raise KVTransferError(f"{what} failed: {e}") from e
        self._wait([work], deadline, what)
        if staged:
            torch.cuda.current_stream(kv_cache.device).synchronize()
        return int(trailer.item())

    def close(self) -> None:
        """Stop receiving: a blocked ``recv`` raises KVChannelClosed; the port is released."""
        if self._closed:
            return
        self._closed = True
        if self._store is not None:
            try:  # wake a recv blocked on the header queue, or the setup thread on hello/0
                waker = self._store.clone()
                waker.queue_push(_HEADER_QUEUE, json.dumps({"closed": True}))
                if not self._ready.is_set():
                    waker.set("hello/0", json.dumps({"closed": True}))
            except Exception as e:
                logger.debug("KV receiver close: %s", e)
        if self._setup_thread is not None:
            self._setup_thread.join(self.timeout)
        locked = self._recv_lock.acquire(timeout=self.timeout)
        try:
            _shutdown(self._group)
            self._group = self._store = None
        finally:
            if locked:
                self._recv_lock.release()


def _shutdown(group: _Group | None) -> None:
    if group is None:
        return
    try:
        group.shutdown()
    except Exception as e:  # already torn down by a peer error
        logger.debug("KV group shutdown: %s", e)
