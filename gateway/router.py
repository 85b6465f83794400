"""Which prefill and which decode server serve a request.

Prefill, KV-aware (as NVIDIA Dynamo's KV router weighs it): each healthy
prefill server is costed in tokens of prefill work, ::

    cost = w * (prompt tokens it would compute: not in its prefix cache)
           + prompt tokens this gateway has queued on it now

(``w`` = ``--kv-overlap-score-weight``), and the cheapest wins. The cached
lengths come from the prefix index (``gateway/prefix_index.py``); with no
match anywhere this is plain least-queued-work routing.

Decode: the fewest requests (the larger of the last polled running+waiting
count and this gateway's in-flight count, which is fresher between polls),
less the fraction of the prompt already in that server's own prefix cache
(a full hit weighs as much as one request), then the lowest KV-block usage,
then the fewest requests routed so far (ties go round-robin).

Conditional disaggregation: when the part of the prompt the chosen decode
server lacks is at most ``--local-prefill-threshold`` tokens, it prefills
the request itself and no KV moves.

A request whose KV hand-off failed is, by ``--kv-load-failure-policy``,
either failed ("fail", the default) or sent again to be prefilled by a decode
server ("recompute"; ``RequestFlow`` excludes every prefill server).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from gateway.errors import ErrorKind, GatewayError
from gateway.instances import Instance, InstanceRegistry
from gateway.prefix_index import PrefixIndex, prompt_block_hashes

logger = logging.getLogger(__name__)


@dataclass
class Route:
    decode: Instance
    prefill: Instance | None  # None: the decode server prefills (no prefill server, or a short uncached part)
    block_size: int = 0
    matched: dict[str, int] = field(default_factory=dict)  # address -> cached prompt tokens there
    reason: str = "load"  # "prefix" | "load" | "local" (conditional) | "no-prefill-server"

    def cached_tokens(self, inst: Instance | None) -> int:
        return self.matched.get(inst.address, 0) if inst is not None else 0


class Router:
    """Picks instances from the registry; owns the per-instance routed counts."""

    def __init__(self, registry: InstanceRegistry, index: PrefixIndex | None = None,
                 overlap_weight: float = 1.0, local_prefill_threshold: int = 0,
                 kv_load_failure_policy: str = "fail") -> None:
        if kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"--kv-load-failure-policy must be fail or recompute, got {kv_load_failure_policy!r}")
        self._registry = registry
        self.index = index
        self.overlap_weight = overlap_weight
        self.local_prefill_threshold = local_prefill_threshold
        self.kv_load_failure_policy = kv_load_failure_policy  # a failed KV hand-off: "fail" | "recompute"
        self._num_routed: dict[str, int] = {}

    async def route(self, prompt_token_ids: Sequence[int], exclude: Collection[str] = (),
                    hashes: list[int] | None = None,
                    exclude_prefill: Collection[str] = ()) -> tuple[Route, list[int] | None]:
        """Pick the decode and prefill servers for a prompt, never one in
        ``exclude`` / ``exclude_prefill`` (addresses that failed this request);
        also returns the prompt's block hashes (pass them back on a retry)."""
        decodes = self._healthy(self._registry.decode, exclude)
        if not decodes:
            configured = ", ".join(i.address for i in self._registry.decode) or "none found yet"
            tried = f" (tried {', '.join(exclude)})" if exclude else ""
            raise GatewayError(ErrorKind.UNAVAILABLE,
                               f"no healthy decode server is available{tried}; configured: {configured}",
                               code="no_healthy_decode_server")
        prefills = self._healthy(self._registry.prefill, exclude_prefill)
        matched, block_size = {}, 0
        if self.index is not None:
            namespace, block_size = _namespace(decodes + prefills)
            if namespace and block_size:
                if hashes is None:
                    hashes = await asyncio.get_running_loop().run_in_executor(
                        None, prompt_block_hashes, list(prompt_token_ids), block_size)
                blocks = await self.index.match(namespace, hashes)
                matched = {addr: n * block_size for addr, n in blocks.items()}
        n = len(prompt_token_ids)
        decode = self._pick(decodes, lambda i: (i.num_requests - min(1.0, matched.get(i.address, 0) / n),
                                                i.kv_usage))
        route = Route(decode, None, block_size, matched, "no-prefill-server")
        if not prefills:
            return route, hashes
        if n - matched.get(decode.address, 0) <= self.local_prefill_threshold:
            route.reason = "local"
            return route, hashes
        w = self.overlap_weight
        route.prefill = self._pick(prefills, lambda i: (w * (n - matched.get(i.address, 0)) + i.num_queued_tokens,
                                                        i.num_requests, i.kv_usage))
        route.reason = "prefix" if matched.get(route.prefill.address) else "load"
        return route, hashes

    @property
    def prefill_instances(self) -> list[Instance]:
        return list(self._registry.prefill)

    @staticmethod
    def _healthy(instances: list[Instance], exclude: Collection[str]) -> list[Instance]:
        return [i for i in instances if i.is_healthy and i.address not in exclude]

    def _pick(self, candidates: list[Instance], cost) -> Instance:
        best = min(candidates, key=lambda i: (*cost(i), self._num_routed.get(i.address, 0)))
        self._num_routed[best.address] = self._num_routed.get(best.address, 0) + 1
        return best


def _namespace(instances: list[Instance]) -> tuple[str, int]:
    """The cache namespace and block size the engine servers report."""
    for inst in instances:
        if inst.load is not None and inst.load.cache_namespace:
            return inst.load.cache_namespace, inst.load.block_size
    return "", 0


@contextlib.contextmanager
def in_flight(instance: Instance | None, tokens: int = 0) -> Iterator[None]:
    """Count a request (and ``tokens`` of prefill work) against ``instance``
    while the block runs."""
    if instance is None:
        yield
        return
    instance.num_in_flight += 1
    instance.num_queued_tokens += tokens
    try:
        yield
    finally:
        instance.num_in_flight -= 1
        instance.num_queued_tokens -= tokens
