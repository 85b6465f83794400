"""KV cache groups: which layers share a block table, and where each layer's KV lives.

Layers are grouped by what their cache holds:

    kind       holds                                       frees
    full       KV blocks for the whole context             at the end of the request
    sliding    KV blocks for the last ``window`` keys      each block once it falls behind the window
    linear     a fixed-size state slot per sequence        at the end (engine/kv_cache_manager.py)
    (shared)   nothing: the layer reads an earlier layer's KV (Gemma 4's "reuse" layers)

One block pool serves every attention group. A block is one page of every *slot*: the KV
cache is ``[num_slots, num_blocks, 2, block_size, H_kv, D]`` and a block taken by group g
holds, in slot s, the KV of group g's s-th layer. A group has at most ``num_slots`` layers;
the kinds' layers are cut into groups of that many (the smallest kind's count), so a model
with 8 full and 40 windowed layers has six groups of eight, and a request at 32k tokens holds
32k tokens of blocks in one group and a window's worth in five. A model with one kind has one
group of every layer: the cache is ``[num_layers, ...]`` and group 0's table is the table.

Groups whose layers store a different shape per token (Gemma 4's full layers: other head
counts and sizes) keep the page and change its block size: a group whose token takes half the
elements fits twice the tokens in a block.

Torch-free: the gateway and the scheduler read it (the runner allocates what it says).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

FULL, SLIDING, LINEAR = "full", "sliding", "linear"


@dataclass(frozen=True)
class KVCacheGroup:
    kind: str  # full | sliding (attention groups; linear layers have no group, see KVCacheLayout)
    layers: tuple[int, ...]  # the decoder layers whose KV it holds, slot s = layers[s]
    block_size: int  # tokens per block of this group
    sliding_window: int | None = None  # sliding: keys a query sees, itself included
    num_kv_heads: int = 0
    head_dim: int = 0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    num_slots: int  # layers a block holds: the cache's leading dimension
    # per decoder layer: (group, slot) of the KV it reads; None for a linear-attention layer
    places: tuple[tuple[int, int] | None, ...]
    # per decoder layer: whether it writes its KV (False: a shared layer reads another's)
    stores: tuple[bool, ...]
    linear_layers: tuple[int, ...] = ()  # layers with a recurrent state instead of KV

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def has_linear(self) -> bool:
        return bool(self.linear_layers)

    @property
    def is_simple(self) -> bool:
        """One full-attention group of every layer: the layout every model had before groups."""
        return len(self.groups) == 1 and self.groups[0].kind == FULL and not self.linear_layers

    def describe(self) -> str:
        parts = []
        for g in self.groups:
            w = f" window={g.sliding_window}" if g.kind == SLIDING else ""
            parts.append(f"{g.kind}[{len(g.layers)} layers, block {g.block_size}{w}]")
        if self.linear_layers:
            parts.append(f"linear[{len(self.linear_layers)} layers, one state slot per sequence]")
        shared = sum(1 for s, p in zip(self.stores, self.places) if not s and p is not None)
        if shared:
            parts.append(f"shared[{shared} layers]")
        return " ".join(parts)

    def check_prefix(self, num_tokens: int, prompt_tokens: int) -> None:
        """ValueError unless a prefix of ``num_tokens`` tokens is a whole number of every group's
        blocks and leaves some of a ``prompt_tokens``-token prompt (0 always is)."""
        if not 0 <= num_tokens < prompt_tokens or any(num_tokens % g.block_size for g in self.groups):
            raise ValueError(f"a prefix of {num_tokens} tokens is not a whole number of every cache group's blocks "
                             f"({', '.join(str(g.block_size) for g in self.groups)} tokens) within the "
                             f"{prompt_tokens}-token prompt")

    def blocks_past(self, block_ids: Sequence[int], num_tokens: int, skip_tokens: int) -> list[int]:
        """Of a request's ``block_ids`` (every group's table in group order, each holding the
        blocks of ``num_tokens`` tokens: what a reservation takes for a prompt), those past its
        first ``skip_tokens`` tokens: each group's table less its blocks of them, in the same
        order (the blocks a KV transfer moves when the receiver holds that prefix). 0: all of
        them, unchecked. ValueError when ``skip_tokens`` is not a whole number of every group's
        blocks below ``num_tokens``, or the ids are not such tables."""
        if skip_tokens == 0:
            return list(block_ids)
        self.check_prefix(skip_tokens, num_tokens)
        lengths = [g.blocks_needed(num_tokens) for g in self.groups]
        if sum(lengths) != len(block_ids):
            raise ValueError(f"{len(block_ids)} block ids, but the cache groups' tables of {num_tokens} tokens hold "
                             f"{' + '.join(map(str, lengths))}")
        out: list[int] = []
        start = 0
        for g, n in zip(self.groups, lengths):
            out.extend(block_ids[start + skip_tokens // g.block_size:start + n])
            start += n
        return out

    def field_list(self, with_shapes: bool = False) -> list[tuple[str, Any]]:
        """The layout as (name, value) pairs: what both ends of a KV transfer compare;
        ``with_shapes``: each group's KV heads and head size too."""
        out: list[tuple[str, Any]] = [("num_slots", self.num_slots), ("linear_layers", list(self.linear_layers))]
        for i, g in enumerate(self.groups):
            out += [(f"group{i}.kind", g.kind), (f"group{i}.layers", list(g.layers)),
                    (f"group{i}.block_size", g.block_size), (f"group{i}.sliding_window", g.sliding_window)]
            if with_shapes:
                out += [(f"group{i}.kv_heads", g.num_kv_heads), (f"group{i}.head_dim", g.head_dim)]
        return out


def build_layout(layer_kinds: Sequence[str], windows: Sequence[int | None], block_size: int,
                 kv_shapes: Sequence[tuple[int, int]] | None = None,
                 kv_sources: Sequence[int | None] | None = None) -> KVCacheLayout:
    """The layout of a model whose layer i is ``layer_kinds[i]`` ("full_attention",
    "sliding_attention" or "linear_attention") with window ``windows[i]``.

    ``kv_shapes[i]``: (KV heads, head size) of layer i (default: one shape for all);
    ``kv_sources[i]``: the earlier layer whose KV layer i reads instead of its own (None: its own).
    """
    n = len(layer_kinds)
    kv_shapes = list(kv_shapes) if kv_shapes is not None else [(0, 0)] * n
    kv_sources = list(kv_sources) if kv_sources is not None else [None] * n
    linear = tuple(i for i, k in enumerate(layer_kinds) if k == "linear_attention")
    # Attention layers that hold KV, by what they hold: (kind, window, shape) -> layers
    kinds: dict[tuple[str, int | None, tuple[int, int]], list[int]] = {}
    for i, k in enumerate(layer_kinds):
        if k == "linear_attention" or kv_sources[i] is not None:
            continue
        if k == "sliding_attention":
            key = (SLIDING, windows[i], kv_shapes[i])
        elif k == "full_attention":
            key = (FULL, None, kv_shapes[i])
        else:
            raise ValueError(f"layer {i}: unknown layer type {k!r}")
        kinds.setdefault(key, []).append(i)
    if not kinds:
        raise ValueError("the model has no attention layer: a KV cache needs one")
    num_slots = min(len(v) for v in kinds.values())
    elems = {shape: shape[0] * shape[1] for (_, _, shape) in kinds}
    widest = max(elems.values())
    groups: list[KVCacheGroup] = []
    places: list[tuple[int, int] | None] = [None] * n
    # Full groups first: group 0 is the one whose blocks cover the whole context.
    for (kind, window, shape), layers in sorted(kinds.items(), key=lambda kv: (kv[0][0] != FULL, kv[1][0])):
        ratio, rem = divmod(widest, elems[shape]) if elems[shape] else (1, 0)
        if rem:
            raise ValueError(f"layers {layers[:3]}...: KV of {shape[0]} heads x {shape[1]} does not divide the "
                             f"widest layer's page ({widest} elements per token)")
        for start in range(0, len(layers), num_slots):
            chunk = tuple(layers[start:start + num_slots])
            for s, layer in enumerate(chunk):
                places[layer] = (len(groups), s)
            groups.append(KVCacheGroup(kind, chunk, block_size * ratio, window, *shape))
    stores = [True] * n
    for i, src in enumerate(kv_sources):
        if src is not None:
            if places[src] is None:
                raise ValueError(f"layer {i} reads the KV of layer {src}, which holds none")
            places[i], stores[i] = places[src], False
    for i in linear:
        stores[i] = False
    return KVCacheLayout(tuple(groups), num_slots, tuple(places), tuple(stores), linear)


def needs_groups(model_config) -> bool:
    """Whether the model's layers cannot share one table: linear-attention layers, layers that
    read another's KV, or layers of different KV shapes."""
    mc = model_config
    return ("linear_attention" in mc.layer_types or any(s is not None for s in mc.layer_kv_sources)
            or len(set(mc.layer_kv_shapes)) > 1)


def model_layout(model_config, block_size: int, hybrid: bool = True) -> KVCacheLayout:
    """The layout of a served model (``model_config``: engine.config.ModelConfig), from its
    config (per-layer shapes and KV sources where the family has them).

    ``hybrid`` False (``--disable-hybrid-kv-cache-manager``): one group of every layer, whose
    blocks every layer keeps (windowed only where every layer has the same window), as before
    groups; models with linear-attention or shared-KV layers, or layers of different KV shapes,
    cannot be served so."""
    mc = model_config
    kinds = mc.layer_types or ("full_attention",) * mc.num_layers
    windows = [mc.sliding_window if k == "sliding_attention" else None for k in kinds]
    if not hybrid:
        if needs_groups(mc):
            raise ValueError(f"{mc.architecture} needs KV cache groups (linear-attention, shared-KV or "
                             "differently shaped layers): drop --disable-hybrid-kv-cache-manager")
        one = "sliding_attention" if len(set(windows)) == 1 and windows[0] is not None else "full_attention"
        return build_layout([one] * mc.num_layers, [windows[0]] * mc.num_layers, block_size)
    return build_layout(kinds, windows, block_size, mc.layer_kv_shapes, mc.layer_kv_sources)
