"""Wire protocol of a KV pair: layouts and their compatibility, merged block runs,
the backend choice, the message plan of a transfer, errors and per-transfer results."""
from __future__ import annotations

import base64
import itertools
import json
import logging
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)


_Group = Any  # a c10d ProcessGroupGloo | ProcessGroupNCCL backend, used directly (no init_process_group)

# 2: backend from GPU UUIDs, chunked message plan; 3: meta in the trailer; 4: the layout has the KV
# scales and the model's dtype; 5: a draft model's cache (``KVLayout.draft``) travels in the same
# transfer, its chunks after the target's (the header's "draft" plan); 6: a hybrid model's
# linear-attention state (``KVLayout.linear_state``) travels after the KV, one message before the
# trailer, into the header's "state" slot; 7: the trailer ends with the canary's checksums of sampled
# blocks (kv_transfer/canary.py), which the receiver checks
PROTOCOL_VERSION = 7
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_PAIR_NAME = "pdserve-kv"
SENDER_RANK = 0
RECEIVER_RANK = 1
_HEADER_QUEUE = "hdr"
_TAG = 0
_OK, _ABORTED = 0, 1  # trailer status values
TRAILER_BYTES = 8192  # int64 status, uint32 length, the sender's meta as JSON; the canary's sums at the end
_TRAILER_CANARY_BYTES = 1024  # canary.CANARY_BYTES (checked there)
_IDLE_WAIT = timedelta(days=1)  # header wait chunk when recv(timeout=None); close() wakes it
BACKENDS = ("auto", "gloo", "nccl")  # what a side may ask for; "auto" = decide from the GPU UUIDs
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


class KVTransferError(RuntimeError):
    """A KV transfer or pair setup failed; the message says what and where."""

    request_id: str | None = None  # set when a started transfer of this request failed


class KVChannelClosed(KVTransferError):
    """The pair was closed (by this side or by the peer); no more transfers."""


@dataclass(frozen=True)
class KVLayout:
    """What both sides of a pair must agree on. ``num_blocks`` may differ.

    ``dtype`` is the cache's element type, the KV dtype: the model's, or float8_e4m3fn
    (``--kv-cache-dtype fp8``), whose values are K / k_scale and V / v_scale with one scale
    of each per layer: two FP8 caches pair only with the same scales (the bytes would mean
    other values), given in full so that a refusal names both sides' values. A cache in the
    model's dtype has no scales (empty). ``model_dtype`` is the dtype the model computes K
    and V in; it defaults to ``dtype`` (a cache in the model's dtype) and differs from it
    only for an FP8 cache, where it must still match: two FP8 caches of a bfloat16 and a
    float32 model hold the same kind of bytes, but the servers do not run the same model.
    ``weights`` is the weight quantization the KV was computed with ("" for the model
    dtype's weights; else engine/quantization's description of it): a prefill server with
    FP8 or int4 weights computes other K and V than a 16-bit decode server would.

    ``draft``: speculative decoding with a draft model (``--speculative-config`` method
    ``draft_model``) keeps a second cache, the draft's, with a block for each of the
    target's; its layout is part of the pair's, and every transfer moves the same blocks of
    both caches. A pair matches only if both sides run the same draft (or neither does):
    a decode server that drafts needs the draft's KV of each prompt from its prefill server.

    ``linear_state``: a hybrid model's linear-attention layers keep a fixed-size state per
    sequence (a slot of each layer's conv and ssm tensors) instead of KV; every transfer moves
    the request's slot after its blocks. "" for a model without; else the JSON field list
    ``describe_state`` writes (the layers, and each slot's shapes and dtypes, the whole model's:
    every head), compared field by field."""

    model: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16", "float8_e4m3fn"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_scales: tuple[float, ...] = ()  # FP8: per layer
    v_scales: tuple[float, ...] = ()
    model_dtype: str = ""  # "": the same as dtype
    weights: str = ""  # the weight quantization ("": none)
    draft: KVLayout | None = None  # a draft model's cache, sent beside this one
    # The KV cache groups (engine/kv_cache_groups.py): "" for one group of every layer (then
    # num_layers is the model's), else each group's kind, layers and block size, and the
    # slots (num_layers counts slots: a block holds a page of each); JSON (name, value) pairs,
    # compared field by field. Where the groups' layers store KV of more than one shape per
    # token (Gemma 4), each group's KV heads and head size too ("group1.kv_heads", ...):
    # num_kv_heads, head_dim and block_size above are then the widest group's (a narrower
    # group's page is the same bytes at its own block size), and a page cannot be split by
    # KV heads between tensor-parallel ranks (tp_parts.check_page_split).
    groups: str = ""
    linear_state: str = ""  # describe_state's JSON ("": no linear-attention layers)

    def __post_init__(self) -> None:
        if isinstance(self.draft, dict):  # from JSON (the pair's hello)
            object.__setattr__(self, "draft", KVLayout.from_dict(self.draft))
        if self.draft is not None and (self.draft.draft is not None or self.draft.block_size != self.block_size):
            raise ValueError(f"KVLayout.draft must have the target's block size ({self.block_size}) and no "
                             f"draft of its own, got {self.draft}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        for name in ("k_scales", "v_scales"):  # lists from JSON or protobuf: kept as tuples of floats
            scales = tuple(float(x) for x in getattr(self, name))
            object.__setattr__(self, name, scales)
            if scales and len(scales) != self.num_layers:
                raise ValueError(f"KVLayout.{name} must have one scale per layer ({self.num_layers}), "
                                 f"got {len(scales)}")
        is_fp8 = self.dtype == _dtype_name(torch.float8_e4m3fn)
        if is_fp8 != bool(self.k_scales) or is_fp8 != bool(self.v_scales):
            raise ValueError(f"KVLayout: a {self.dtype} cache must have {'its' if is_fp8 else 'no'} KV scales, "
                             f"got k_scales {_show(self.k_scales)}, v_scales {_show(self.v_scales)}")
        if not self.model_dtype:
            object.__setattr__(self, "model_dtype", self.dtype)
        if self.linear_state:
            state_specs(self.linear_state)  # raises ValueError when malformed
        if self.groups:
            group_shapes(self.groups)  # raises ValueError when malformed

    @classmethod
    def of(cls, kv_cache: torch.Tensor, model: str,
           scales: tuple[Sequence[float], Sequence[float]] = ((), ()), model_dtype: str = "",
           weights: str = "", draft: KVLayout | None = None) -> KVLayout:
        """The layout of ``kv_cache``; ``scales``: an FP8 cache's per-layer (k, v) scales;
        ``model_dtype``: the model's dtype (default: the cache's); ``weights``: the weight
        quantization ("": none); ``draft``: a draft model's cache's layout."""
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError("kv_cache must be [num_layers, num_blocks, 2, block_size, "
                             f"num_kv_heads, head_dim], got {tuple(kv_cache.shape)}")
        num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        return cls(model=model, dtype=_dtype_name(kv_cache.dtype), block_size=block_size,
                   num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   k_scales=tuple(scales[0]), v_scales=tuple(scales[1]), model_dtype=model_dtype, weights=weights,
                   draft=draft)

    @property
    def mixed_shapes(self) -> bool:
        """Whether the cache groups hold KV of more than one shape per token (then each
        group's page is [its block size, its KV heads, its head size], not this layout's)."""
        return len(set(group_shapes(self.groups))) > 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # the draft's layout as a nested dict

    def describe(self) -> str:
        """One line for logs and errors."""
        state = f", {len(state_specs(self.linear_state))} linear-attention layers" if self.linear_state else ""
        return (f"{self.model}: {self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim}, "
                f"{self.dtype}, blocks of {self.block_size}{state}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise ValueError unless ``kv_cache`` has this layout and is contiguous, or is a head
        slice of a contiguous cache (``cache[..., h0:h1, :]``: one rank's share of the KV heads
        when the two sides are split differently by tensor parallelism)."""
        want = (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        got = (kv_cache.shape[0], *kv_cache.shape[2:]) if kv_cache.dim() == 6 else tuple(kv_cache.shape)
        if got != want or _dtype_name(kv_cache.dtype) != self.dtype:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} {kv_cache.dtype} does not match "
                             f"the pair's layout {self}")
        if not (kv_cache.is_contiguous() or is_head_slice(kv_cache)):
            raise ValueError("kv_cache must be contiguous, or a slice of a contiguous cache's KV heads")

    def check_caches(self, kv_cache: torch.Tensor, draft_cache: torch.Tensor | None) -> None:
        """``check_cache`` of the target's cache, and of the draft model's, which is given
        exactly when this layout has a draft (contiguous, on the target cache's device)."""
        self.check_cache(kv_cache)
        if (draft_cache is None) != (self.draft is None):
            raise ValueError("the pair's layout has a draft model's cache: give draft_cache" if draft_cache is None
                             else "draft_cache given, but the pair's layout has no draft model")
        if draft_cache is not None:
            assert self.draft is not None
            self.draft.check_cache(draft_cache)
            if not draft_cache.is_contiguous() or draft_cache.device != kv_cache.device:
                raise ValueError("the draft model's cache must be contiguous, on the target cache's device")

    def check_state(self, states: Sequence[Any] | None) -> None:
        """The linear-attention state tensors (``.conv``, ``.ssm`` of each linear layer, slots
        first: the engine's ``linear_states``) are given exactly when this layout has a state,
        one per linear layer, each slot of this layout's shapes and dtypes, contiguous."""
        if (states is None) != (not self.linear_state):
            raise ValueError("the pair's layout has a linear-attention state: give the state tensors"
                             if states is None else "state tensors given, but the pair's layout has no "
                             "linear-attention state")
        if states is None:
            return
        specs = state_specs(self.linear_state)
        got = [(tuple(st.conv.shape[1:]), _dtype_name(st.conv.dtype), tuple(st.ssm.shape[1:]),
                _dtype_name(st.ssm.dtype)) for st in states]
        if got != specs:
            raise ValueError(f"linear-attention state slots {got} do not match the pair's layout {specs}")
        if not all(st.conv.is_contiguous() and st.ssm.is_contiguous() for st in states):
            raise ValueError("the linear-attention state tensors must be contiguous")


# One linear layer's state slot: (conv shape, conv dtype, ssm shape, ssm dtype)
StateSpec = tuple[tuple[int, ...], str, tuple[int, ...], str]
_STATE_KEYS = ("conv_shape", "conv_dtype", "ssm_shape", "ssm_dtype")


def describe_state(layers: Sequence[int], specs: Sequence[StateSpec]) -> str:
    """``KVLayout.linear_state`` of a model whose decoder layers ``layers`` are linear-attention
    layers with state slots ``specs`` (one each): a JSON list of (name, value) pairs, the
    layers, then one shared spec ("conv_shape", ...) or, where the layers differ, each one's
    ("layer3.conv_shape", ...). "" without linear layers."""
    if len(layers) != len(specs):
        raise ValueError(f"{len(specs)} state specs for {len(layers)} linear-attention layers")
    if not layers:
        return ""
    fields: list[tuple[str, Any]] = [("layers", list(layers))]
    per_layer = [(list(c), cd, list(s), sd) for c, cd, s, sd in specs]
    if all(spec == per_layer[0] for spec in per_layer):
        fields += list(zip(_STATE_KEYS, per_layer[0]))
    else:
        fields += [(f"layer{layer}.{k}", v) for layer, spec in zip(layers, per_layer)
                   for k, v in zip(_STATE_KEYS, spec)]
    return json.dumps(fields)


def _state_fields(text: str) -> dict[str, Any]:
    try:
        fields = {name: value for name, value in json.loads(text)}
    except (ValueError, TypeError) as e:
        raise ValueError(f"KVLayout.linear_state is not a JSON list of (name, value) pairs: {text!r}") from e
    if not isinstance(fields.get("layers"), list):
        raise ValueError(f"KVLayout.linear_state names no layers: {text!r}")
    return fields


def _group_fields(text: str) -> dict[str, Any]:
    """``KVLayout.groups`` as {name: value}."""
    try:
        return {name: value for name, value in json.loads(text)}
    except (ValueError, TypeError) as e:
        raise ValueError(f"KVLayout.groups is not a JSON list of (name, value) pairs: {text!r}") from e


def group_shapes(text: str) -> list[tuple[int, int]]:
    """Each cache group's (KV heads, head size) that ``KVLayout.groups`` names, in group order;
    [] where it names none (one group, or groups whose layers all store the layout's shape)."""
    if not text:
        return []
    fields = _group_fields(text)
    shapes = []
    for i in itertools.count():
        if f"group{i}.kind" not in fields:
            return shapes
        heads, size = fields.get(f"group{i}.kv_heads"), fields.get(f"group{i}.head_dim")
        if heads is None and size is None:
            continue
        if not (isinstance(heads, int) and isinstance(size, int) and heads > 0 and size > 0):
            raise ValueError(f"KVLayout.groups: group {i}'s kv_heads {heads!r} and head_dim {size!r} must be "
                             "positive ints")
        shapes.append((heads, size))


def state_specs(text: str) -> list[StateSpec]:
    """The state spec of each linear layer, in layer order, from ``describe_state``'s text."""
    fields = _state_fields(text)
    out: list[StateSpec] = []
    for layer in fields["layers"]:
        values = []
        for k in _STATE_KEYS:
            value = fields.get(k, fields.get(f"layer{layer}.{k}"))
            if value is None:
                raise ValueError(f"KVLayout.linear_state has no {k} for layer {layer}: {text!r}")
            values.append(value)
        c, cd, s, sd = values
        out.append((tuple(int(x) for x in c), str(cd), tuple(int(x) for x in s), str(sd)))
    return out


def state_nbytes(text: str) -> int:
    """Bytes of one sequence's state (every linear layer's conv and ssm slot)."""
    def size(shape: tuple[int, ...], dtype: str) -> int:
        return int(np.prod(shape, dtype=np.int64)) * getattr(torch, dtype).itemsize
    return sum(size(c, cd) + size(s, sd) for c, cd, s, sd in state_specs(text))


class StateMove(NamedTuple):
    """A request's linear-attention state in a transfer: slot ``src_slot`` of each linear
    layer's ``.conv`` and ``.ssm`` in ``states`` (the engine's ``linear_states``, slots first)
    goes into the receiver's slot ``dst_slot``."""

    states: Sequence[Any]
    src_slot: int
    dst_slot: int


def state_views(states: Sequence[Any], slot: int) -> list[torch.Tensor]:
    """Slot ``slot`` of every linear layer's conv and ssm, as flat bytes (views: writing them
    writes the slot), in wire order."""
    return [t[slot].view(torch.uint8).reshape(-1) for st in states for t in (st.conv, st.ssm)]


def is_head_slice(kv_cache: torch.Tensor) -> bool:
    """Whether a 6-d cache view is ``parent[..., h0:h1, :]`` of a contiguous parent."""
    layers, blocks, two, block_size, heads, head_dim = kv_cache.shape
    s = kv_cache.stride()
    row = s[3]  # the parent's heads x head_dim
    return (s[5] == 1 and s[4] == head_dim and row >= heads * head_dim and row % head_dim == 0
            and s[2] == block_size * row and s[1] == two * s[2] and s[0] == blocks * s[1])


def check_compatible(local: KVLayout, remote: KVLayout, local_role: str = "local",
                     remote_role: str = "remote") -> None:
    """Raise KVTransferError naming every field that differs (values in (local, remote) order)."""
    diffs = _layout_diffs(local, remote)
    if diffs:
        raise KVTransferError(f"KV layout mismatch between {local_role} and {remote_role}: "
                              + "; ".join(diffs))


def _layout_diffs(a: KVLayout, b: KVLayout, prefix: str = "") -> list[str]:
    """Each field that differs, with both values (``dtype`` is the KV dtype: the cache's).
    ``model_dtype`` is named only where a side's cache is not in its model's dtype (else
    the ``dtype`` difference says it all). Two drafts are compared field by field
    ("draft.num_layers ..."); a draft on one side only is named as such."""
    implied = a.model_dtype == a.dtype and b.model_dtype == b.dtype
    diffs = [f"{prefix}{f.name} {_show(getattr(a, f.name))} != {_show(getattr(b, f.name))}"
             for f in fields(KVLayout) if f.name not in ("draft", "linear_state", "groups")
             and getattr(a, f.name) != getattr(b, f.name) and not (f.name == "model_dtype" and implied)]
    diffs += _group_diffs(a.groups, b.groups, prefix)
    diffs += _state_diffs(a.linear_state, b.linear_state, prefix)
    if a.draft is not None and b.draft is not None:
        diffs += _layout_diffs(a.draft, b.draft, prefix + "draft.")
    elif a.draft != b.draft:
        diffs.append(f"{prefix}draft model {_show(a.draft)} != {_show(b.draft)} (speculative decoding with a draft "
                     "model needs it on both tiers: the prefill server computes the draft's KV of the prompt)")
    return diffs


def _group_diffs(a: str, b: str, prefix: str) -> list[str]:
    """The cache groups' fields that differ ("groups.group1.block_size 8 != 4"), or groups on
    one side only (the other's cache is one group of every layer)."""
    return _record_diffs(a, b, prefix + "groups", _group_fields,
                         "KV cache groups on one side only: both tiers must lay the cache out alike, "
                         "--disable-hybrid-kv-cache-manager on both or neither")


def _state_diffs(a: str, b: str, prefix: str) -> list[str]:
    """The linear-attention state's fields that differ ("linear_state.ssm_shape [4, 8, 12] !=
    [2, 8, 12]"), or the state on one side only."""
    return _record_diffs(a, b, prefix + "linear_state", _state_fields,
                         "a model with linear-attention layers on one side only")


def _record_diffs(a: str, b: str, name: str, fields: Callable[[str], dict[str, Any]], one_side: str) -> list[str]:
    """The fields of two JSON (name, value) records that differ ("<name>.<field> x != y"), or,
    where one side has none, both records whole and ``one_side``'s explanation."""
    if a == b:
        return []
    if not a or not b:
        def show(text: str) -> str:
            return "none" if not text else "(" + ", ".join(f"{k} {_show_value(v)}" for k, v in json.loads(text)) + ")"
        return [f"{name} {show(a)} != {show(b)} ({one_side})"]
    fa, fb = fields(a), fields(b)
    names = list(dict.fromkeys([*fa, *fb]))
    return [f"{name}.{n} {_show_value(fa.get(n))} != {_show_value(fb.get(n))}" for n in names
            if fa.get(n) != fb.get(n)]


def _show_value(value: Any) -> str:
    """A JSON value of a layout field list: lists as lists, "none" when absent."""
    if value is None:
        return "none"
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else repr(value)


def _show(value: Any) -> str:
    """A layout value for an error message; scales as lists, "none" for a cache without
    (and for unquantized weights, and a side without a draft model)."""
    if value is None:
        return "none"
    if isinstance(value, KVLayout):
        return f"({value.describe()})"
    if isinstance(value, tuple):
        return "[" + ", ".join(repr(x) for x in value) + "]" if value else "none"
    return repr(value) if value != "" else "none"


def run_array(src_block_ids: Sequence[int] | np.ndarray, dst_block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """``merge_runs`` as an int64 array [runs, 3]: what the transfer code carries around (a
    16k-token prompt has up to 1024 runs, and this is on the critical path)."""
    src, dst = np.asarray(src_block_ids, dtype=np.int64), np.asarray(dst_block_ids, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"{len(src_block_ids)} src block ids but {len(dst_block_ids)} dst block ids")
    if src.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    starts = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.append(starts, src.size))
    return np.stack([src[starts], dst[starts], lengths], axis=1)


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) for maximal runs where src and dst ids both go up by one.

    merge_runs([4, 5, 6, 9], [0, 1, 7, 8]) == [(4, 0, 2), (6, 7, 1), (9, 8, 1)]"""
    return [tuple(r) for r in run_array(src_block_ids, dst_block_ids).tolist()]


def expand_runs(runs: Sequence[tuple[int, int, int]] | np.ndarray, side: int) -> np.ndarray:
    """The block ids of one side of ``runs`` (0: src, 1: dst), in order, as int64."""
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    if not r.size:
        return np.zeros(0, dtype=np.int64)
    starts, lengths = r[:, side], r[:, 2]
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(int(lengths.sum()), dtype=np.int64) - offsets


def has_repeats(ids: np.ndarray) -> bool:
    """Whether any id occurs twice (a sort: cheaper than np.unique at these sizes)."""
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def encode_runs(runs: Sequence[tuple[int, int, int]] | np.ndarray) -> str:
    """Runs as base64 of int64 triples: a header stays small and quick to parse at any length."""
    return base64.b64encode(np.asarray(runs, dtype=np.int64).reshape(-1).tobytes()).decode()


def decode_runs(text: str) -> np.ndarray:
    """The [runs, 3] int64 array ``encode_runs`` encoded."""
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int64)
    if flat.size % 3:
        raise ValueError(f"runs must come in (src, dst, length) triples, got {flat.size} numbers")
    return flat.reshape(-1, 3)


def gpu_uuid(device: str | torch.device) -> str | None:
    """The UUID of the GPU behind ``device`` (None for host memory).

    Device strings cannot say whether two processes share a GPU: in containers every
    process calls its GPU ``cuda:0``. The UUID names the physical device."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def choose_backend(prefill_gpu: str | None, decode_gpu: str | None) -> tuple[str, str]:
    """("nccl" | "gloo", reason for the logs) from the GPU UUID of each side's KV cache
    (None: the cache is in host memory). Pure: both sides compute the same answer."""
    if prefill_gpu and decode_gpu and prefill_gpu != decode_gpu:
        return "nccl", f"nccl: prefill on GPU {prefill_gpu[:8]}, decode on GPU {decode_gpu[:8]}"
    if prefill_gpu and decode_gpu:
        return "gloo", (f"gloo (host-staged): prefill and decode share GPU {prefill_gpu[:8]}, "
                        "NCCL cannot pair two ranks on one GPU")
    if prefill_gpu or decode_gpu:
        where = "prefill" if prefill_gpu else "decode"
        return "gloo", f"gloo (host-staged): only {where} is on a GPU; NCCL needs GPUs on both sides"
    return "gloo", "gloo: prefill and decode on CPU"


def resolve_backend(prefill_asks: str, decode_asks: str, prefill_gpu: str | None,
                    decode_gpu: str | None) -> tuple[str, str]:
    """The backend of a pair from what each side asks for ("auto" | "gloo" | "nccl") and
    where each cache lives. Pure, run by both sides on the exchanged hellos.
    Raises KVTransferError if the sides insist on different backends, or on NCCL where
    it cannot work (one GPU for both, or a cache in host memory)."""
    for asks in (prefill_asks, decode_asks):
        if asks not in BACKENDS:
            raise KVTransferError(f"unknown KV transfer backend {asks!r} (expected one of {BACKENDS})")
    if "auto" not in (prefill_asks, decode_asks) and prefill_asks != decode_asks:
        raise KVTransferError(f"KV backend mismatch: prefill asks for {prefill_asks}, decode for {decode_asks}")
    auto, reason = choose_backend(prefill_gpu, decode_gpu)
    wanted = decode_asks if prefill_asks == "auto" else prefill_asks
    if wanted in ("auto", auto):
        return auto, reason
    if wanted == "nccl":
        raise KVTransferError(f"backend nccl was asked for, but {reason.split(': ', 1)[1]}")
    return wanted, f"{wanted} (asked for; the automatic choice would be {reason})"


def host_staged(backend: str, prefill_gpu: str | None, decode_gpu: str | None) -> bool:
    """Whether a pair's KV goes through host memory though a cache is on a GPU: gloo with a
    GPU on either side (the degraded mode the gateway counts). Pure, like ``choose_backend``."""
    return backend != "nccl" and bool(prefill_gpu or decode_gpu)


def slow_path(backend: str, prefill_gpu: str | None, decode_gpu: str | None) -> str | None:
    """Why a pair whose two caches are both on GPUs moves its KV slower than it could (for
    a warning at setup), or None: two GPUs over gloo (host-staged) where NCCL would go GPU
    to GPU, or one GPU for both sides, whose KV goes through host memory (no device-to-device
    path between two processes on one GPU is built)."""
    if not (prefill_gpu and decode_gpu) or backend == "nccl":
        return None
    if prefill_gpu != decode_gpu:
        return (f"the KV of this pair goes through host memory (gloo, as asked) though both caches are on "
                f"GPUs ({prefill_gpu[:8]}, {decode_gpu[:8]}): NCCL would move it GPU to GPU (ask for auto or nccl)")
    return (f"prefill and decode share GPU {prefill_gpu[:8]}: the KV of this pair is copied through host memory "
            "(gloo), out of the GPU and back; give each server its own GPU for NCCL")


class WirePlan(NamedTuple):
    """How the sender lays one transfer's data on the wire; travels in the header, so the
    receiver posts exactly the matching messages.

    The layers are cut into chunks of ``chunk_layers`` consecutive layers. Each chunk is one
    batch of messages (one NCCL group): either one message per merged run and layer
    (``pack`` False: zero-copy views of the cache) or one message holding the chunk's
    blocks gathered into a staging buffer (``pack`` True), then scattered on arrival."""

    pack: bool
    chunk_layers: int


def chunk_ranges(num_layers: int, chunk_layers: int) -> list[tuple[int, int]]:
    """[(first_layer, end_layer)] covering 0..num_layers-1 in order.

    chunk_ranges(5, 2) == [(0, 2), (2, 4), (4, 5)]"""
    if chunk_layers <= 0:
        raise ValueError(f"chunk_layers must be positive, got {chunk_layers}")
    return [(l0, min(l0 + chunk_layers, num_layers)) for l0 in range(0, num_layers, chunk_layers)]


def plane_chunks(planes: Sequence[tuple[torch.Tensor, WirePlan]]) -> list[tuple[int, int, int]]:
    """A transfer's chunks in wire order: (plane, first_layer, end_layer), the target cache's
    (plane 0) first, then a draft model's, each cut by its own plan."""
    return [(i, l0, l1) for i, (kv, plan) in enumerate(planes) for l0, l1 in chunk_ranges(kv.shape[0], plan.chunk_layers)]


def plane_block_bytes(planes: Sequence[tuple[torch.Tensor, Any]]) -> int:
    """Bytes one block moves, over every layer of every plane."""
    return sum(kv.shape[0] * kv[0, 0].numel() * kv.element_size() for kv, _ in planes)


# NCCL message plan, from two H200s over NVLink (docs/benchmarks.md): every message costs
# host time to post and NCCL time to run, so runs go in place only when long (16k tokens in
# one run: 64 MiB a layer, 78% of a raw send in place vs 70-74% gathered); shorter runs are
# gathered into chunks of about _PACK_CHUNK_BYTES, two staging slots a side, so that
# gathering chunk k+1 overlaps sending chunk k (in place, 1k tokens in 64 one-block runs
# took 30 ms; gathered, 1.1 ms).
_DIRECT_MIN_RUN_BYTES = 16 << 20
_DIRECT_MAX_MESSAGES = 256
_PACK_CHUNK_BYTES = 64 << 20


def plan_transfer(runs: Sequence[tuple[int, int, int]] | np.ndarray, num_layers: int, layer_block_bytes: int,
                  backend: str, cache_on_gpu: bool, overlap: bool = False) -> WirePlan:
    """The sender's choice of WirePlan. ``layer_block_bytes``: bytes of one block in one layer.

    gloo from host memory sends the runs in place, a layer at a time (no copies); gloo from a
    GPU cache stages each layer through pinned host memory as one message. NCCL sends long
    runs in place, every layer in one group, and gathers short runs into chunks. ``overlap``
    (layers given as prefill computes them): chunks of about _PACK_CHUNK_BYTES whichever way,
    so that only the last chunk is left to send when prefill ends; not smaller, since posting
    a chunk costs host time that the prefill's own launches need too (posting every layer of a
    1k-token prompt of the 8B shape slowed its prefill from 27 to 62 ms on an H200)."""
    runs = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
    num_blocks = int(runs[:, 2].sum())
    if not len(runs):
        return WirePlan(pack=False, chunk_layers=max(num_layers, 1))
    if backend != "nccl":
        return WirePlan(pack=cache_on_gpu, chunk_layers=1)
    direct = (num_blocks * layer_block_bytes >= len(runs) * _DIRECT_MIN_RUN_BYTES
              and len(runs) * num_layers <= _DIRECT_MAX_MESSAGES)
    if direct and not overlap:
        return WirePlan(pack=False, chunk_layers=num_layers)
    layer_bytes = num_blocks * layer_block_bytes
    return WirePlan(pack=not direct, chunk_layers=max(1, min(num_layers, _PACK_CHUNK_BYTES // layer_bytes)))


@dataclass(frozen=True)
class TransferStats:
    """One transfer as seen by one side. ``num_messages`` counts data messages
    (layers x merged runs); the single control header is not counted."""

    num_blocks: int
    num_bytes: int
    seconds: float
    backend: str
    num_messages: int
    # (event, time.perf_counter()) through the transfer: CLOCK_MONOTONIC on Linux, so the two
    # sides' marks compare across processes of one host (bench.kv_transfer's phase table)
    marks: tuple[tuple[str, float], ...] = ()
    # A transfer in parts (tensor-parallel ranks): (sending rank, start, end (time.time()), bytes) each
    parts: tuple[tuple[int, float, float, int], ...] = ()
    # The pair's KV went through host memory though a cache is on a GPU (``host_staged``)
    host_staged: bool = False

    @property
    def bytes_per_second(self) -> float:
        return self.num_bytes / self.seconds if self.seconds > 0 else float("inf")


def encode_trailer(status: int, meta: dict[str, Any] | None) -> torch.Tensor:
    """The transfer's last message: its status and the sender's ``meta``, known only once
    prefill is done (e.g. the first sampled token); its last bytes are left for the canary's
    sums (``canary.seal``). Raises ValueError if meta does not fit."""
    body = json.dumps(meta or {}).encode()
    if len(body) > TRAILER_BYTES - 12 - _TRAILER_CANARY_BYTES:
        raise ValueError(f"transfer meta of {len(body)} bytes does not fit the {TRAILER_BYTES}-byte trailer")
    out = np.zeros(TRAILER_BYTES, dtype=np.uint8)
    out[:8] = np.frombuffer(np.int64(status).tobytes(), dtype=np.uint8)
    out[8:12] = np.frombuffer(np.uint32(len(body)).tobytes(), dtype=np.uint8)
    out[12:12 + len(body)] = np.frombuffer(body, dtype=np.uint8)
    return torch.from_numpy(out)


def decode_trailer(data: torch.Tensor) -> tuple[int, dict[str, Any]]:
    """(status, meta) from a received trailer; ValueError if it is malformed."""
    raw = data.cpu().numpy().tobytes()
    status = int(np.frombuffer(raw[:8], dtype=np.int64)[0])
    length = int(np.frombuffer(raw[8:12], dtype=np.uint32)[0])
    if length > TRAILER_BYTES - 12 - _TRAILER_CANARY_BYTES:
        raise ValueError(f"trailer meta length {length} out of range")
    meta = json.loads(raw[12:12 + length]) if length else {}
    if not isinstance(meta, dict):
        raise ValueError("trailer meta is not a JSON object")
    return status, meta


class ReceivedKV(NamedTuple):
    """One received transfer: whose, into which blocks (a linear-attention state's slot is
    given to the receiver's ``validate``), how it went, and the sender's small JSON ``meta``
    (e.g. the first sampled token)."""

    request_id: str
    dst_block_ids: list[int]
    stats: TransferStats
    meta: dict[str, Any]

def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
