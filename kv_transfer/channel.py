"""What a prefill server and a decode server say to set up a KV channel, as plain values.

The services carry these over gRPC (``OpenKVChannel``; rpc/layout_convert.py converts);
the KV transfer itself never sees protobuf. A channel is one pair, or with tensor
parallelism on either side one pair per part (``tp_parts.kv_transfer_parts``), each
between one rank of each engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kv_transfer.protocol import KVLayout


@dataclass(frozen=True)
class ChannelRequest:
    """A prefill server asks a decode server for a channel. ``peer`` names the channel
    (``ADDRESS`` or ``ADDRESS#slot`` for a further pair to the same decode server);
    ``device``: where the prefill cache lives ("cpu", "cuda:0", ...)."""

    peer: str
    layout: KVLayout  # the prefill model's whole layout (every KV head)
    device: str
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class RankEndpoint:
    """One part of a channel in parts: prefill rank ``src_rank`` sends its local heads
    ``src_heads`` to the pair listening at ``port``."""

    src_rank: int
    src_heads: tuple[int, int]
    port: int


@dataclass(frozen=True)
class ChannelOffer:
    """The decode server's answer: where to dial (``host:port``, or each of ``parts``), the
    backend it asks for ("auto": the handshake settles it) and its layout (informational:
    each pair's handshake compares the layouts itself)."""

    host: str
    port: int
    layout: KVLayout | None
    backend: str
    parts: tuple[RankEndpoint, ...] = ()  # empty: one pair

    @property
    def in_parts(self) -> bool:
        return bool(self.parts)


# (decode server address, request, timeout in seconds) -> the decode server's offer; raises
# KVTransferError when it refuses or cannot be reached (the prefill service asks over gRPC)
OpenChannel = Callable[[str, ChannelRequest, float], ChannelOffer]
