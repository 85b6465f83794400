"""Which prefill and which decode server serve a request.

Least loaded among healthy instances: fewest requests (the larger of the
last polled running+waiting count and this gateway's own in-flight count,
which is fresher between polls), then the lowest KV-block usage, then the
fewest requests routed so far (spreads ties round-robin).

Not yet: prefix-cache-aware prefill routing (the Redis prefix index of the
architecture doc).
"""
from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator

from gateway.errors import ErrorKind, GatewayError
from gateway.instances import Instance, InstanceRegistry


class Router:
    """Picks instances from the registry; owns the per-instance routed counts."""

    def __init__(self, registry: InstanceRegistry) -> None:
        self._registry = registry
        self._num_routed: dict[str, int] = {}

    def pick_decode(self, exclude: Collection[str] = ()) -> Instance:
        """The least loaded healthy decode server not in ``exclude`` (addresses);
        raises UNAVAILABLE when there is none."""
        candidates = [i for i in self._registry.decode if i.is_healthy and i.address not in exclude]
        if not candidates:
            configured = ", ".join(i.address for i in self._registry.decode)
            tried = f" (tried {', '.join(exclude)})" if exclude else ""
            raise GatewayError(ErrorKind.UNAVAILABLE,
                               f"no healthy decode server is available{tried}; configured: {configured}",
                               code="no_healthy_decode_server")
        return self._least_loaded(candidates)

    def pick_prefill(self) -> Instance | None:
        """The least loaded healthy prefill server, or None (the decode server
        then prefills locally)."""
        candidates = [i for i in self._registry.prefill if i.is_healthy]
        return self._least_loaded(candidates) if candidates else None

    def _least_loaded(self, candidates: list[Instance]) -> Instance:
        best = min(candidates, key=lambda i: (i.num_requests, i.kv_usage, self._num_routed.get(i.address, 0)))
        self._num_routed[best.address] = self._num_routed.get(best.address, 0) + 1
        return best


@contextlib.contextmanager
def in_flight(instance: Instance | None) -> Iterator[None]:
    """Count a request against ``instance`` while the block runs."""
    if instance is None:
        yield
        return
    instance.num_in_flight += 1
    try:
        yield
    finally:
        instance.num_in_flight -= 1
