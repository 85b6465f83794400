"""Which prefill and which decode server serve a request.

Prefill, KV-aware (as NVIDIA Dynamo's KV router weighs it): each healthy
prefill server is costed in tokens of prefill work, ::

    cost = w * (prompt tokens it would compute, less its credited cached tokens)
           + prompt tokens this gateway has queued on it now
    credited cached tokens = (tokens of its device hit) + HOST_HIT_CREDIT * (tokens of its host hit)

(``w`` = ``--kv-overlap-score-weight``), and the cheapest wins. The cached
lengths per tier come from the prefix index (``gateway/prefix_index.py``:
the blocks in a server's device cache, then those in its host tier,
``--kv-offloading-size``); with no match anywhere this is plain
least-queued-work routing. A host hit is loaded back before the step that
uses it, which costs a little of what recomputing it would: it is credited at
``HOST_HIT_CREDIT`` (below, measured; ``GPU_HOST_HIT_CREDIT`` on GPUs) of a device hit, so with equal load a
server holding the prefix on device beats one holding it on host, which beats
one holding none.

Decode: the fewest requests (the larger of the last polled running+waiting
count and this gateway's in-flight count, which is fresher between polls),
less the credited fraction of the prompt already in that server's own prefix
cache (a full device hit weighs as much as one request), then the lowest
KV-block usage, then the fewest requests routed so far (ties go round-robin).

Conditional disaggregation: when the part of the prompt the chosen decode
server lacks in both tiers is at most ``--local-prefill-threshold`` tokens,
it prefills the request itself and no KV moves.

A prefill tier configured (``--prefill``) but no prefill server usable for a
request (none found, none healthy, each failed it, none holds its adapter copy
or the decode server's draft model): the decode server prefills it, and
``on_local_prefill_fallback`` counts it by that cause
(``pdserve:gateway_local_prefill_fallbacks_total``, /cluster's ``degraded``).

A request whose KV hand-off failed is, by ``--kv-load-failure-policy``,
either failed ("fail", the default) or sent again to be prefilled by a decode
server ("recompute"; ``RequestFlow`` excludes every prefill server).

LoRA (a request under adapter ``X``; the base model is unaffected):

- Candidates: only servers whose LoadInfo lists ``X``, decode and prefill
  alike. No healthy decode server lists it: UNAVAILABLE naming ``X``. A
  prefill server is a candidate only if it holds ``X`` with the chosen decode
  server's fingerprint (another copy would send KV of other weights); none
  left: the decode server prefills (reason "no-prefill-server").
- Slots: a server where ``X`` is in a device slot, or where a slot is free
  (in-slot adapters < ``max_loras``), always beats one where ``X`` would first
  have to take another adapter's slot (``Instance.needs_lora_swap``; the
  engine runs at most ``max_loras`` adapters a step, so that may mean waiting):
  it is the first key of both costs above, which then decide among equals.
  Always, not weighed: a swap's cost is unknown here, and the polled view is
  at most a poll old; one server keeping ``X`` in a slot may therefore draw
  all of ``X``'s requests while the others' slots are full.
- Prefix: the prompt's block hashes chain from ``X``'s ``root_hash`` (block
  0's parent, as the engine hashes them), which depends on the copy's
  fingerprint: servers are matched per root hash, each with its own chain.

Speculative decoding with a draft model: the prefill tier computes the draft's
KV of each prompt and sends it with the target's, so a prefill server is a
candidate only if it runs the chosen decode server's draft model (LoadInfo's
``draft_model``; "" on both sides without one). None left: the decode server
prefills (reason "no-prefill-server"). n-gram speculation needs nothing of the
prefill tier.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

from engine.block_hash import NONE_HASH
from gateway.errors import ErrorKind, GatewayError
from gateway.instances import Instance, InstanceRegistry
from gateway.prefix_index import PrefixIndex, TierMatch, prompt_block_hashes

# A prompt's block hashes by block 0's parent (NONE_HASH, or an adapter copy's root hash),
# computed once per request and handed back to ``route`` on a retry.
BlockHashes = dict[int, list[int]]

logger = logging.getLogger(__name__)

# What a prefix hit in a server's host tier is worth against one in its device cache:
# 1 - (time to load a block back) / (time to recompute it). ``python -m bench.host_hit_cost``
# measures both (docs/benchmarks.md, "Host KV tier: what a hit there is worth"): on CPU, the
# default model's 720 KiB block loads in 0.07-0.6 ms and recomputes in 150-380 ms (runs on a
# busy 2-core machine), a ratio of 0.0002-0.004. Rounded down to two places (a device hit
# stays ahead of a host hit at equal load by 1% of the hit's tokens). On a
# GPU the copy over PCIe is a larger share (estimated ~10-20% for a Llama-3.1-8B block before
# loads overlap compute): run the same script there and pass its credit to ``Router``.
HOST_HIT_CREDIT = 0.99
# The same on an H100 (Llama-3.1-8B shape, bf16, 2 MiB blocks, 2,048-token prompts): a block loads in
# 0.054 ms and recomputes in 0.251 ms, a credit of 0.79 (with 512-token prompts the prefill costs
# hardly more than a device hit's step and a host hit saves nothing). ``pdserve up`` passes this one
# when its engine servers run on CUDA; a gateway started alone takes --kv-host-hit-credit.
GPU_HOST_HIT_CREDIT = 0.79


@dataclass
class Route:
    decode: Instance
    prefill: Instance | None  # None: the decode server prefills (no prefill server, or a short uncached part)
    block_size: int = 0
    matched: dict[str, int] = field(default_factory=dict)  # address -> cached prompt tokens there (both tiers)
    reason: str = "load"  # "prefix" | "load" | "local" (conditional) | "no-prefill-server"
    matched_host: dict[str, int] = field(default_factory=dict)  # address -> of those, tokens in its host tier

    def cached_tokens(self, inst: Instance | None) -> int:
        return self.matched.get(inst.address, 0) if inst is not None else 0

    def host_cached_tokens(self, inst: Instance | None) -> int:
        """Of ``cached_tokens``, those in the instance's host tier (loaded back before use)."""
        return self.matched_host.get(inst.address, 0) if inst is not None else 0


class Router:
    """Picks instances from the registry; owns the per-instance routed counts."""

    def __init__(self, registry: InstanceRegistry, index: PrefixIndex | None = None,
                 overlap_weight: float = 1.0, local_prefill_threshold: int = 0,
                 kv_load_failure_policy: str = "fail",
                 on_local_prefill_fallback: Callable[[str], None] | None = None,
                 stream_idle_timeout: float | None = None, host_hit_credit: float = HOST_HIT_CREDIT) -> None:
        if kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError(f"--kv-load-failure-policy must be fail or recompute, got {kv_load_failure_policy!r}")
        self._registry = registry
        self.index = index
        self.overlap_weight = overlap_weight
        if not 0.0 <= host_hit_credit <= 1.0:
            raise ValueError(f"the host hit credit must be within [0, 1], got {host_hit_credit}")
        self.host_hit_credit = host_hit_credit  # a host-tier hit's worth against a device hit's
        # Prompt tokens the prefix index credited the chosen prefill server with (or the decode
        # server, where it prefills), by tier: "device" | "host" (/cluster, metrics).
        self.routed_cached_tokens: dict[str, int] = {"device": 0, "host": 0}
        self.local_prefill_threshold = local_prefill_threshold
        self.kv_load_failure_policy = kv_load_failure_policy  # a failed KV hand-off: "fail" | "recompute"
        # --stream-idle-timeout: seconds a decode stream may send nothing before RequestFlow takes its
        # server as hung and moves the request (None: no such deadline)
        self.stream_idle_timeout = stream_idle_timeout
        self._num_routed: dict[str, int] = {}
        # Called with the cause whenever no prefill server is usable for a request, so its decode
        # server prefills it (the metric; counted here, where it is decided). None where no prefill
        # tier is configured (prefilling on the decode server is then the plan, not a fallback).
        self._on_local_prefill_fallback = on_local_prefill_fallback

    async def route(self, prompt_token_ids: Sequence[int], exclude: Collection[str] = (),
                    hashes: BlockHashes | None = None, exclude_prefill: Collection[str] = (),
                    lora_name: str | None = None) -> tuple[Route, BlockHashes | None]:
        """Pick the decode and prefill servers for a prompt (under LoRA adapter
        ``lora_name``, None: the base model), never one in ``exclude`` /
        ``exclude_prefill`` (addresses that failed this request); also returns
        the prompt's block hashes (pass them back on a retry)."""
        decodes = self._healthy(self._registry.decode, exclude)
        if not decodes:
            configured = ", ".join(i.address for i in self._registry.decode) or "none found yet"
            tried = f" (tried {', '.join(exclude)})" if exclude else ""
            raise GatewayError(ErrorKind.UNAVAILABLE,
                               f"no healthy decode server is available{tried}; configured: {configured}",
                               code="no_healthy_decode_server")
        prefills = self._healthy(self._registry.prefill, exclude_prefill)
        # Why no prefill server is usable, as the candidates run out (None: some still are).
        unusable = (None if prefills else "no_prefill_server" if not self._registry.prefill else
                    "prefill_failed" if self._healthy(self._registry.prefill, ()) else "no_healthy_prefill_server")
        if lora_name is not None:
            decodes = self._holding(decodes, lora_name, exclude)
            prefills = [i for i in prefills if i.lora_adapter(lora_name) is not None]
        matched, on_host, block_size = {}, {}, 0
        if self.index is not None:
            namespace, block_size = _namespace(decodes + prefills)
            if namespace and block_size:
                matched, on_host, hashes = await self._match(namespace, block_size, prompt_token_ids,
                                                             decodes + prefills, lora_name, hashes)
        n = len(prompt_token_ids)
        c = self.host_hit_credit

        def credited(i: Instance) -> float:  # cached tokens, a host hit's at its credit
            return matched.get(i.address, 0) - (1.0 - c) * on_host.get(i.address, 0)

        decode = self._pick(decodes, lambda i: (i.needs_lora_swap(lora_name),
                                                i.num_requests - min(1.0, credited(i) / n),
                                                i.kv_usage))
        route = Route(decode, None, block_size, matched, "no-prefill-server", on_host)
        if lora_name is not None:
            fingerprint = decode.lora_adapter(lora_name).fingerprint
            prefills = [i for i in prefills if i.lora_adapter(lora_name).fingerprint == fingerprint]
        unusable = unusable or (None if prefills else "lora_adapter")
        # A draft model's KV moves with the target's: only a prefill server with the decode
        # server's draft (or, for one without, none) can feed it; else it prefills itself.
        prefills = [i for i in prefills if i.draft_model == decode.draft_model]
        if not prefills:
            if self._on_local_prefill_fallback is not None:
                self._on_local_prefill_fallback(unusable or "draft_model")
            return self._count(route, decode), hashes
        if n - matched.get(decode.address, 0) <= self.local_prefill_threshold:
            route.reason = "local"
            return self._count(route, decode), hashes
        w = self.overlap_weight
        route.prefill = self._pick(prefills, lambda i: (i.needs_lora_swap(lora_name),
                                                        w * (n - credited(i)) + i.num_queued_tokens,
                                                        i.num_requests, i.kv_usage))
        route.reason = "prefix" if matched.get(route.prefill.address) else "load"
        return self._count(route, route.prefill), hashes

    def _count(self, route: Route, prefiller: Instance) -> Route:
        """Add what the index credits ``prefiller`` (the instance that prefills) with, per tier."""
        host = route.host_cached_tokens(prefiller)
        self.routed_cached_tokens["device"] += route.cached_tokens(prefiller) - host
        self.routed_cached_tokens["host"] += host
        return route

    def _holding(self, decodes: list[Instance], lora_name: str, exclude: Collection[str]) -> list[Instance]:
        """The healthy decode servers that serve ``lora_name``; UNAVAILABLE naming it when none does."""
        holding = [i for i in decodes if i.lora_adapter(lora_name) is not None]
        if holding:
            return holding
        elsewhere = [i.address for i in self._registry.decode if i.lora_adapter(lora_name) is not None]
        held = (f"it is listed only by decode servers that are unhealthy or failed this request: "
                f"{', '.join(elsewhere)}" if elsewhere else "no decode server lists it")
        tried = f" (tried {', '.join(exclude)})" if exclude else ""
        raise GatewayError(ErrorKind.UNAVAILABLE, f"no healthy decode server serves LoRA adapter `{lora_name}`"
                           f"{tried}: {held}; healthy decode servers: {', '.join(i.address for i in decodes)}",
                           code="no_healthy_decode_server")

    async def _match(self, namespace: str, block_size: int, prompt_token_ids: Sequence[int],
                     candidates: list[Instance], lora_name: str | None,
                     hashes: BlockHashes | None) -> tuple[dict[str, int], dict[str, int], BlockHashes]:
        """Cached prompt tokens per address (both tiers), and of those, the ones in its host
        tier. Under an adapter, servers are grouped by its root hash there (one group when
        every copy agrees): each group is matched with the chain from its own root and
        credited only with that. An index without tiers (only ``match``) counts all as device."""
        groups: dict[int, set[str] | None] = {NONE_HASH: None}  # root -> addresses (None: any)
        if lora_name is not None:
            groups = {}
            for inst in candidates:
                root = inst.lora_adapter(lora_name).root_hash
                groups.setdefault(root, set()).add(inst.address)
        hashes = dict(hashes or {})
        matched: dict[str, int] = {}
        on_host: dict[str, int] = {}
        match_tiers = getattr(self.index, "match_tiers", None)
        for root, members in groups.items():
            if root not in hashes:
                hashes[root] = await asyncio.get_running_loop().run_in_executor(
                    None, prompt_block_hashes, list(prompt_token_ids), block_size, root)
            if match_tiers is not None:
                tiers = await match_tiers(namespace, hashes[root])
            else:
                tiers = {a: TierMatch(k, 0) for a, k in (await self.index.match(namespace, hashes[root])).items()}
            for addr, m in tiers.items():
                if members is None or addr in members:
                    matched[addr] = m.total * block_size
                    if m.host:
                        on_host[addr] = m.host * block_size
        return matched, on_host, hashes

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
