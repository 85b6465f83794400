"""What both ends of a KV pair share: deadlines, the hello handshake, the process
group, staging buffers."""
from __future__ import annotations

import json
import logging
import socket
import time
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from engine.kv_transfer.protocol import (KVChannelClosed, KVLayout, KVTransferError, PROTOCOL_VERSION,
                                         _Group, _WILDCARD_HOSTS, _layout_diffs)

logger = logging.getLogger(__name__)


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


def _shutdown(group: _Group | None) -> None:
    if group is None:
        return
    try:
        group.shutdown()
    except Exception as e:  # already torn down by a peer error
        logger.debug("KV group shutdown: %s", e)
