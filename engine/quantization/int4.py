"""int4 weight-only quantization (W4A16) of linear layers: AutoAWQ, GPTQ and
compressed-tensors ``pack-quantized`` checkpoints.

Every format is converted at load time to one internal layout, the one the
Triton kernel reads (``kernels/int4_gemm.py``; ``kernels/int4_reference.py``
is the same in PyTorch, the CPU path)::

    qweight [ceil(K/8), N] int32   packed along K: nibble k % 8 of word [k // 8, n] = q[k, n] in [0, 15]
    scales  [G, N]                 in the model dtype
    zeros   [G, N] uint8 or None   None = symmetric (z = 8 everywhere)
    perm    [K] int32 or None      act-order: internal row k multiplies x[:, perm[k]]
    g_idx   [K] int32 or None      only when a shard's groups have unequal sizes
    W^T[k, n] = (q[k, n] - z[g(k), n]) * scales[g(k), n],  g(k) = k // group_size or g_idx[k]

K is a layer's (local) input width, N its output width, y = x W^T.

The checkpoint formats (N = out_features, K = in_features, g = group size,
G = K / g; "nibble i" of an int32 word is bits 4i .. 4i+3):

AutoAWQ GEMM (``quant_method: awq``, ``version``/``format: gemm``, ``zero_point: true``)
    qweight [K, N/8] int32, packed along N in AWQ's interleaved order: nibble i of
            word [k, c] holds q[k, 8c + AWQ_ORDER[i]], AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
    qzeros  [G, N/8] int32, the same packing, z in [0, 15]
    scales  [G, N] float16
    W^T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]

GPTQ (``quant_method: gptq``; AutoGPTQ, GPTQModel, optimum)
    qweight [K/8, N] int32, packed along K in order: nibble i of word [r, n] holds q[8r + i, n]
            (already the internal layout)
    qzeros  [G, N/8] int32, packed along N in order: nibble i of word [j, c] holds the zero of column 8c + i
    scales  [G, N] float16;  G = 1 for ``group_size: -1`` (one group)
    g_idx   [K] int32, the group of each row (k // g unless act-order)
    W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
    ``checkpoint_format`` (transformers 5 calls it ``format``): "gptq" (v1, the default and
    what older configs without the field mean) stores z - 1, so z = nibble + 1, in [1, 16]
    (a zero of 0 was clamped to a stored 0 when written); "gptq_v2" stores z itself. vLLM's
    GPTQ kernels read v1 the same way (nibble + 1, no wrap-around); GPTQModel converts v1 to v2
    at load by adding 0x11111111 to each word, which carries into the next nibble where one
    held 15; its Marlin path and vLLM's Marlin never read the zeros of symmetric checkpoints.
    ``sym: true``: z = 8 (stored 7 in v1, 8 in v2); the qzeros tensor is loaded but not
    read, as in Marlin. ``desc_act: true`` (act-order): rows were quantized in order of
    decreasing activation size, so a group's rows are scattered over K (g_idx[perm[i]] = i // g).
    Here the rows are sorted by group at load time (the weight is re-packed in that order), and
    the kernel gathers x's columns through ``perm``: the groups are then contiguous and the
    GEMM is the plain one. Stacked projections (q|k|v, gate|up) share one g_idx: GPTQ gives
    layers with the same input the same order. With act-order and the input split across
    tensor-parallel ranks, a rank holds all of the scales/zeros (its rows may belong to any
    group) and, when its groups are not all of one size, the kernel reads each row's group.
    8-bit GPTQ (and 2/3-bit) is not supported.

compressed-tensors ``pack-quantized`` (``quant_method: compressed-tensors``, ``format: pack-quantized``,
    weights ``type: int``, ``num_bits: 4``, ``strategy: group`` or ``channel``)
    weight_packed     [N, ceil(K/8)] int32, packed along K in order: nibble i of word [n, c] holds
                      column 8c + i, stored as q + 8 (q is signed, in [-8, 7])
    weight_scale      [N, G] (G = 1 for ``channel``)
    weight_zero_point [ceil(N/8), G] int32, asymmetric only: packed along N (dim 0), stored as zp + 8
    weight_shape      [2] int: the unpacked (N, K)
    W[n, k] = (q[n, k] - zp[n, g]) * s[n, g] = ((q + 8) - (zp + 8)) * s
    so the internal q is the stored nibble, the internal zero the stored zp nibble (8 when
    symmetric) and the internal qweight is weight_packed transposed, word for word.
    ``actorder: group`` checkpoints (an older llm-compressor) add ``weight_g_idx`` [K] and are
    handled as GPTQ act-order; ``actorder: weight`` (static) changes nothing in the layout.

Which kernel runs: ``Int4LinearMethod.apply`` calls ``ops.int4_gemm`` where ``ops`` is
the method's ``ops`` (constructor argument or attribute), else the layer's ``ops``
attribute, else ``kernels`` (Triton) for CUDA tensors and ``kernels.reference``
elsewhere, the same choice the model runner makes for every other kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.layers.linear import LinearMethod

BITS = 4
FORMATS = ("awq", "gptq", "compressed-tensors")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


# ---- nibbles ----------------------------------------------------------------------------------------------


def unpack_nibbles(packed: torch.Tensor, count: int, dim: int = -1, order: tuple[int, ...] | None = None
                   ) -> torch.Tensor:
    """int32 words packed along ``dim`` -> ``count`` 4-bit values along that dim (int16, 0..15).
    Nibble i of word c is value 8c + i, or 8c + order[i] with ``order``."""
    t = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=t.device)
    nib = (t[..., None] >> shifts) & 0xF  # [..., words, 8], nib[..., c, i] = nibble i
    if order is not None:
        out = torch.empty_like(nib)
        out[..., list(order)] = nib
        nib = out
    return nib.flatten(-2)[..., :count].to(torch.int16).movedim(-1, dim)


def pack_nibbles(values: torch.Tensor, dim: int = -1, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of ``unpack_nibbles``: values in [0, 15] along ``dim`` (padded with 0 to
    a multiple of 8) -> int32 words."""
    t = values.to(torch.int64).movedim(dim, -1)
    pad = (-t.shape[-1]) % 8
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    nib = t.reshape(*t.shape[:-1], -1, 8)
    if order is not None:
        nib = nib[..., list(order)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=t.device)
    words = (nib << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(-1, dim).contiguous()


# ---- the internal layout ----------------------------------------------------------------------------------


@dataclass
class Int4Weights:
    """One layer's weight in the internal layout (module docstring)."""

    qweight: torch.Tensor  # [ceil(K/8), N] int32
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor | None  # [G, N] uint8
    group_size: int
    k: int
    perm: torch.Tensor | None = None  # [K] int32
    g_idx: torch.Tensor | None = None  # [K] int32

    @property
    def n(self) -> int:
        return self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense W [N, K] (y = x W^T)."""
        from kernels.int4_reference import dequantize_int4

        return dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, self.k, perm=self.perm,
                               g_idx=self.g_idx, dtype=dtype)


def _zeros_or_none(z: torch.Tensor | None) -> torch.Tensor | None:
    """[G, N] integer zeros -> uint8, or None when all are 8 (symmetric: nothing to read)."""
    if z is None or bool((z == 8).all()):
        return None
    return z.to(torch.uint8).contiguous()


def _finish(q: torch.Tensor | None, qweight: torch.Tensor | None, scales: torch.Tensor, zeros: torch.Tensor | None,
            groups: torch.Tensor | None, group_size: int, k: int, what: str) -> Int4Weights:
    """Build the internal layout from q [K, N] (or an already packed ``qweight``), scales
    and zeros [G, N] and each row's group (None: row k is in group k // group_size).

    Rows whose groups are not contiguous runs in order (act-order) are sorted by group; when
    every group then has the same number of rows c, the result is the plain layout with group
    size c (scales/zeros reduced to the groups present, in order), else ``g_idx`` is kept."""
    scales = scales.contiguous()
    if groups is None:
        if qweight is None:
            qweight = pack_nibbles(q, dim=0)
        return Int4Weights(qweight.contiguous(), scales, _zeros_or_none(zeros), group_size, k)
    g = groups.to(torch.int64)
    if g.shape != (k,):
        raise ValueError(f"{what}: g_idx has shape {tuple(g.shape)}, expected ({k},)")
    num_groups = scales.shape[0]
    if k and (int(g.min()) < 0 or int(g.max()) >= num_groups):
        raise ValueError(f"{what}: g_idx values span [{int(g.min())}, {int(g.max())}] but the scales have "
                         f"{num_groups} groups (act-order checkpoints need desc_act: true, so that a rank whose input "
                         "is split holds every group)")
    order = torch.sort(g, stable=True).indices
    sorted_g = g[order]
    present, counts = torch.unique_consecutive(sorted_g, return_counts=True)
    identity = bool((order == torch.arange(k, device=order.device)).all())
    if q is None and not identity:
        q = unpack_nibbles(qweight, k, dim=0)
    if not identity:
        qweight = pack_nibbles(q[order], dim=0)
    elif qweight is None:
        qweight = pack_nibbles(q, dim=0)
    perm = None if identity else order.to(torch.int32)
    if bool((counts == counts[0]).all()):
        c = int(counts[0])
        same_groups = present.numel() == num_groups and bool(
            (present == torch.arange(num_groups, device=present.device)).all())
        if not same_groups:
            scales = scales[present].contiguous()
            zeros = zeros[present] if zeros is not None else None
        return Int4Weights(qweight.contiguous(), scales, _zeros_or_none(zeros), c, k, perm=perm)
    # Groups of unequal sizes (a tensor-parallel shard of an act-order layer): one group per row.
    return Int4Weights(qweight.contiguous(), scales, _zeros_or_none(zeros), max(1, group_size), k, perm=perm,
                       g_idx=sorted_g.to(torch.int32).contiguous())


# ---- converters, one per checkpoint format ----------------------------------------------------------------


def convert_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                what: str = "awq") -> Int4Weights:
    """AutoAWQ GEMM -> internal layout (the format is in the module docstring)::

        qweight [K, N/8] int32 packed along N, nibble i of word [k, c] = q[k, 8c + AWQ_ORDER[i]]
        qzeros  [K/g, N/8] int32, same packing;  scales [K/g, N]
        W^T[k, n] = (q[k, n] - z[k // g, n]) * s[k // g, n]
    """
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _expect_shape(what, "qzeros", qzeros, (-(-k // group_size), n // 8))
    _expect_shape(what, "scales", scales, (-(-k // group_size), n))
    q = unpack_nibbles(qweight, n, dim=1, order=AWQ_ORDER)  # [K, N]
    z = unpack_nibbles(qzeros, n, dim=1, order=AWQ_ORDER)  # [G, N]
    return _finish(q, None, scales, z, None, group_size, k, what)


def convert_gptq(qweight: torch.Tensor, qzeros: torch.Tensor | None, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, group_size: int, *, sym: bool, checkpoint_format: str = "gptq",
                 what: str = "gptq") -> Int4Weights:
    """GPTQ -> internal layout (the format is in the module docstring)::

        qweight [K/8, N] int32 packed along K, nibble i of word [r, n] = q[8r + i, n]
        qzeros  [G, N/8] int32 packed along N; v1 ("gptq") stores z - 1, v2 ("gptq_v2") z
        scales  [G, N];  g_idx [K] the group of each row (None: k // group_size)
        W^T[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n];  sym: z = 8 (qzeros not read)

    ``group_size`` is the rows per group (K for ``group_size: -1``). ``scales`` may hold
    every group of the unsplit layer (act-order under tensor parallelism): g_idx then
    indexes them directly. Non-act-order g_idx of an input shard count groups from the
    unsplit layer's first row; with the shard's own scales they are read relative to their
    first value.
    """
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"{what}: GPTQ checkpoint_format must be one of {list(GPTQ_CHECKPOINT_FORMATS)}, "
                         f"got {checkpoint_format!r}")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    if scales.shape[1] != n:
        raise ValueError(f"{what}: scales has shape {tuple(scales.shape)}, expected [groups, {n}] "
                         f"(qweight {tuple(qweight.shape)})")
    zeros = None
    if not sym:
        if qzeros is None:
            raise ValueError(f"{what}: asymmetric GPTQ (sym: false) needs qzeros")
        _expect_shape(what, "qzeros", qzeros, (scales.shape[0], -(-n // 8)))
        zeros = unpack_nibbles(qzeros, n, dim=1) + (1 if checkpoint_format == "gptq" else 0)
    local_groups = -(-k // group_size)
    groups = None
    if g_idx is not None:
        g = g_idx.to(torch.int64)
        in_order = k > 0 and bool((g - g[0] == torch.arange(k, device=g.device) // group_size).all())
        if in_order and scales.shape[0] == local_groups:
            groups = None  # this shard's own scales: row k is in group k // group_size
        elif in_order and int(g[0]) + local_groups <= scales.shape[0]:
            lo = int(g[0])  # every group of the layer, this shard's rows in order: take its groups
            scales = scales[lo:lo + local_groups]
            zeros = zeros[lo:lo + local_groups] if zeros is not None else None
        else:
            groups = g
    elif scales.shape[0] != local_groups:
        raise ValueError(f"{what}: scales has {scales.shape[0]} groups, expected {local_groups} "
                         f"(K = {k}, group_size = {group_size})")
    return _finish(None, qweight, scales, zeros, groups, group_size, k, what)


def convert_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                               weight_zero_point: torch.Tensor | None, group_size: int, k: int, *,
                               symmetric: bool, g_idx: torch.Tensor | None = None,
                               what: str = "compressed-tensors") -> Int4Weights:
    """compressed-tensors ``pack-quantized`` int4 -> internal layout (module docstring)::

        weight_packed     [N, ceil(K/8)] int32 packed along K, nibble i of word [n, c] = q[n, 8c + i] + 8
        weight_scale      [N, G];  weight_zero_point [ceil(N/8), G] int32 packed along N, zp + 8
        W[n, k] = (q[n, k] - zp[n, g(k)]) * s[n, g(k)]

    ``group_size`` = K for the ``channel`` strategy; ``k`` is the layer's (local) K (the
    packed width rounds it up to 8); ``g_idx`` the ``weight_g_idx`` of ``actorder: group``.
    """
    n = weight_packed.shape[0]
    _expect_shape(what, "weight_packed", weight_packed, (n, -(-k // 8)))
    if weight_scale.shape[0] != n:
        raise ValueError(f"{what}: weight_scale has shape {tuple(weight_scale.shape)}, expected [{n}, groups]")
    scales = weight_scale.t()
    zeros = None
    if not symmetric:
        if weight_zero_point is None:
            raise ValueError(f"{what}: asymmetric compressed-tensors weights need weight_zero_point")
        _expect_shape(what, "weight_zero_point", weight_zero_point, (-(-n // 8), weight_scale.shape[1]))
        zeros = unpack_nibbles(weight_zero_point, n, dim=0).t()  # [G, N], zp + 8
    if g_idx is None and weight_scale.shape[1] != -(-k // group_size):
        raise ValueError(f"{what}: weight_scale has {weight_scale.shape[1]} groups, expected {-(-k // group_size)} "
                         f"(K = {k}, group_size = {group_size})")
    qweight = weight_packed.t().contiguous()  # both pack 8 consecutive K values per word, in order
    return _finish(None, qweight, scales, zeros, g_idx, group_size, k, what)


def _expect_shape(what: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")


def quantize_rtn(w: torch.Tensor, group_size: int, *, sym: bool, what: str = "int4") -> Int4Weights:
    """W [N, K] -> the internal layout by rounding to nearest per group of ``group_size``
    columns (min/max scales; symmetric: z = 8 and s = amax / 7). What random benchmark
    weights are served as (``--quantization awq|gptq --load-format dummy``); checkpoints
    carry their own quantizer's values."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"{what}: group_size {group_size} does not divide the input width {k}")
    wg = w.float().t().reshape(k // group_size, group_size, n)  # [G, g, N]
    if sym:
        scale = (wg.abs().amax(dim=1) / 7).clamp(min=1e-8)  # [G, N]
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    stored = scale.to(w.dtype)
    q = (torch.round(wg / stored.float()[:, None]) + zero[:, None]).clamp(0, 15)
    return _finish(q.reshape(k, n).to(torch.int16), None, stored, zero.to(torch.int16), None, group_size, k, what)


# ---- the linear method ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """One checkpoint tensor: its local shape and how it is split (add_param's arguments)."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out_dim: int | None
    in_dim: int | None
    out_div: int = 1
    in_div: int = 1
    per_part: bool = False  # one per stacked part ([parts, *shape])


class Int4LinearMethod(LinearMethod):
    """A linear layer whose weight is stored as 4-bit integers (one method class for the three
    formats; ``fmt`` picks the checkpoint tensors and their converter).

    fmt: "awq", "gptq" or "compressed-tensors" (pack-quantized)
    group_size: rows of K per scale; -1 = one group (GPTQ ``group_size: -1``, compressed-tensors
        ``strategy: channel``)
    sym: symmetric (no zero points read); AWQ is always asymmetric (``zero_point: true``)
    desc_act: GPTQ act-order (compressed-tensors ``actorder: group``): g_idx scatters groups over K
    bits: must be 4
    checkpoint_format: GPTQ "gptq" (v1) or "gptq_v2"
    prefix: the layer's name, used in error messages
    ops: the kernel module (``kernels`` or ``kernels.reference``); None: see the module docstring

    The layer must give ``in_size``/``out_size`` (this rank's widths) and ``add_param``; for
    act-order and ``group_size: -1`` layers whose input is split across ranks it must also
    give the unsplit input width as ``full_in_size`` (else ``in_size * layer.tp.size`` for a
    layer with a ``tp`` group, else ``in_size``). Column-parallel parts (``output_sizes``)
    packed along N (AWQ, GPTQ zeros, compressed-tensors zero points) must be multiples of 8.
    """

    def __init__(self, fmt: str, *, group_size: int, sym: bool = True, desc_act: bool = False, bits: int = 4,
                 checkpoint_format: str = "gptq", prefix: str = "", ops: ModuleType | None = None,
                 online: bool = False) -> None:
        where = f"{prefix or 'int4'}: "
        if fmt not in FORMATS:
            raise ValueError(f"{where}int4 format must be one of {list(FORMATS)}, got {fmt!r}")
        if bits != BITS:
            extra = " (8-bit GPTQ is not supported)" if fmt == "gptq" and bits == 8 else ""
            raise ValueError(f"{where}{fmt} with {bits}-bit weights is not supported: only 4-bit{extra}")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size < 1 and group_size != -1):
            raise ValueError(f"{where}group_size must be a positive int or -1, got {group_size!r}")
        if fmt == "awq" and sym:
            raise ValueError(f"{where}AWQ GEMM checkpoints are asymmetric (zero_point: true); sym is not supported")
        if fmt == "awq" and (desc_act or group_size == -1):
            raise ValueError(f"{where}AWQ GEMM needs a positive group_size and no act-order")
        if fmt == "gptq" and checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"{where}GPTQ checkpoint_format must be one of {list(GPTQ_CHECKPOINT_FORMATS)} "
                             f"(marlin-repacked and other layouts are not supported), got {checkpoint_format!r}")
        self.fmt, self.group_size, self.sym, self.desc_act = fmt, group_size, sym, desc_act
        self.checkpoint_format, self.prefix, self.ops = checkpoint_format, prefix, ops
        self.online = online  # random (dummy) 16-bit weights, quantized at load (benchmarks)

    # ---- from config.json -----------------------------------------------------------------------------
    @classmethod
    def from_awq_config(cls, cfg: dict[str, Any], *, prefix: str = "", ops: ModuleType | None = None
                        ) -> Int4LinearMethod:
        """From an AutoAWQ ``quantization_config`` (``version``, or ``format`` in transformers 5)."""
        version = str(cfg.get("version", cfg.get("format", "gemm"))).lower()
        if version != "gemm":
            raise ValueError(f"{prefix or 'awq'}: AWQ version {version!r} is not supported (only gemm)")
        if not cfg.get("zero_point", True):
            raise ValueError(f"{prefix or 'awq'}: AWQ with zero_point: false is not supported")
        return cls("awq", group_size=int(cfg.get("group_size", cfg.get("q_group_size", 128))), sym=False,
                   bits=int(cfg.get("bits", cfg.get("w_bit", 4))), prefix=prefix, ops=ops)

    @classmethod
    def from_gptq_config(cls, cfg: dict[str, Any], *, prefix: str = "", ops: ModuleType | None = None
                         ) -> Int4LinearMethod:
        """From a GPTQ ``quantization_config`` (``checkpoint_format``, or ``format`` in transformers 5;
        absent = "gptq", v1)."""
        fmt = str(cfg.get("checkpoint_format") or cfg.get("format") or "gptq").lower()
        return cls("gptq", group_size=int(cfg.get("group_size", 128)), sym=bool(cfg.get("sym", True)),
                   desc_act=bool(cfg.get("desc_act", False)), bits=int(cfg.get("bits", 4)),
                   checkpoint_format=fmt, prefix=prefix, ops=ops)

    @classmethod
    def from_compressed_tensors(cls, weights: dict[str, Any], fmt: str, *, prefix: str = "",
                                ops: ModuleType | None = None) -> Int4LinearMethod:
        """From the ``weights`` quantization args of the compressed-tensors scheme that targets
        this layer and its format (the scheme's ``format``, else the config's)."""
        where = prefix or "compressed-tensors"
        if fmt != "pack-quantized":
            raise ValueError(f"{where}: compressed-tensors format {fmt!r} is not supported here (only pack-quantized)")
        if weights.get("type", "int") != "int":
            raise ValueError(f"{where}: weight type {weights.get('type')!r} is not supported (only int)")
        if weights.get("dynamic", False):
            raise ValueError(f"{where}: dynamic weight quantization is not supported")
        strategy = weights.get("strategy", "group")
        if strategy == "group":
            group_size = int(weights["group_size"])
        elif strategy == "channel":
            group_size = -1
        else:
            raise ValueError(f"{where}: weight strategy {strategy!r} is not supported (group or channel)")
        actorder = weights.get("actorder")
        return cls("compressed-tensors", group_size=group_size, sym=bool(weights.get("symmetric", True)),
                   desc_act=actorder in ("group", "dynamic"), bits=int(weights.get("num_bits", 8)),
                   prefix=prefix, ops=ops)

    # ---- shapes -------------------------------------------------------------------------------------
    def _where(self, layer: nn.Module) -> str:
        return self.prefix or getattr(layer, "prefix", None) or type(layer).__name__

    @staticmethod
    def _full_in_size(layer: nn.Module) -> int:
        full = getattr(layer, "full_in_size", None)
        if full is not None:
            return int(full)
        tp = getattr(layer, "tp", None)
        return layer.in_size * (tp.size if tp is not None else 1)

    def _specs(self, layer: nn.Module) -> list[_Spec]:
        """The checkpoint tensors of this layer (local shapes) after checking the shapes fit."""
        where = self._where(layer)
        k, n, k_full = layer.in_size, layer.out_size, self._full_in_size(layer)
        split_in = k != k_full
        g = k_full if self.group_size == -1 else self.group_size
        scattered = self.desc_act  # groups spread over K: every rank holds all of them
        replicated = scattered or self.group_size == -1
        if self.group_size != -1 and k_full % g:
            raise ValueError(f"{where}: group_size {g} does not divide the input width {k_full}")
        if not replicated and k % g:
            raise ValueError(f"{where}: group_size {g} does not divide this rank's input width {k} "
                             f"(input {k_full} split {k_full // k} ways)")
        packs_k = self.fmt in ("gptq", "compressed-tensors")
        if packs_k and (split_in or self.fmt == "gptq") and k % 8:
            raise ValueError(f"{where}: {self.fmt} packs 8 input rows per int32: the input width {k} "
                             f"{'of this rank ' if split_in else ''}must be a multiple of 8")
        packs_n = self.fmt == "awq" or not self.sym
        if packs_n:
            for size in getattr(layer, "output_sizes", [n]):
                if size % 8:
                    raise ValueError(f"{where}: {self.fmt} packs 8 output columns per int32: every output "
                                     f"part must be a multiple of 8, got {list(getattr(layer, 'output_sizes', [n]))}")
        groups = -(-k_full // g) if replicated else k // g
        in_g, in_div_g = (None, 1) if replicated else (0, g)
        i32, f32 = torch.int32, torch.float32
        if self.fmt == "awq":
            return [_Spec("qweight", (k, n // 8), i32, 1, 0, out_div=8),
                    _Spec("qzeros", (groups, n // 8), i32, 1, in_g, out_div=8, in_div=in_div_g),
                    _Spec("scales", (groups, n), f32, 1, in_g, in_div=in_div_g)]
        if self.fmt == "gptq":
            return [_Spec("qweight", (k // 8, n), i32, 1, 0, in_div=8),
                    _Spec("qzeros", (groups, -(-n // 8)), i32, 1, in_g, out_div=8, in_div=in_div_g),
                    _Spec("scales", (groups, n), f32, 1, in_g, in_div=in_div_g),
                    _Spec("g_idx", (k,), i32, None, 0)]
        specs = [_Spec("weight_packed", (n, -(-k // 8)), i32, 0, 1, in_div=8),
                 _Spec("weight_scale", (n, groups), f32, 0, None if replicated else 1, in_div=in_div_g),
                 _Spec("weight_shape", (2,), torch.int64, None, None, per_part=True)]
        if not self.sym:
            specs.append(_Spec("weight_zero_point", (-(-n // 8), groups), i32, 0, None if replicated else 1,
                               out_div=8, in_div=in_div_g))
        if self.desc_act:
            specs.append(_Spec("weight_g_idx", (k,), i32, None, 0))
        return specs

    # ---- LinearMethod ---------------------------------------------------------------------------------
    def create_weights(self, layer: nn.Module) -> None:
        if self.online:
            LinearMethod.create_weights(self, layer)
            return
        k_full = self._full_in_size(layer)
        for spec in self._specs(layer):
            param = layer.add_param(spec.name, torch.zeros(spec.shape, dtype=spec.dtype), out_dim=spec.out_dim,
                                    in_dim=spec.in_dim, out_div=spec.out_div, in_div=spec.in_div,
                                    per_part=spec.per_part)
            if not spec.per_part:
                self._guard_loader(layer, spec, param, k_full)

    def _guard_loader(self, layer: nn.Module, spec: _Spec, param: nn.Parameter, k_full: int) -> None:
        """Check each checkpoint tensor's shape against the config before the layer's loader
        slices it: every dim but the output one must be this rank's size or, along the input,
        the unsplit layer's."""
        inner = getattr(param, "weight_loader", None)
        if inner is None:
            return
        where, method = self._where(layer), self

        def weight_loader(p: nn.Parameter, src: torch.Tensor, *args, **kwargs) -> None:
            ok = src.dim() == len(spec.shape)
            if ok:
                for d, size in enumerate(spec.shape):
                    if d == spec.out_dim:
                        continue
                    allowed = {size}
                    if d == spec.in_dim:
                        allowed.add(-(-k_full // spec.in_div))
                    ok = ok and src.shape[d] in allowed
            if not ok:
                want = list(spec.shape)
                if spec.in_dim is not None:
                    want[spec.in_dim] = -(-k_full // spec.in_div)
                if spec.out_dim is not None:
                    want[spec.out_dim] = "out"  # type: ignore[call-overload]
                raise ValueError(
                    f"{where}.{spec.name}: checkpoint tensor has shape {tuple(src.shape)}, but {method.fmt} int4 "
                    f"with group_size {method.group_size} for a layer of input width {k_full} expects "
                    f"{tuple(want)} ('out': that part's output width{', / 8' if spec.out_div == 8 else ''}); "
                    f"this rank's parameter is {tuple(spec.shape)}")
            inner(p, src, *args, **kwargs)

        param.weight_loader = weight_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        where = self._where(layer)
        k, k_full = layer.in_size, self._full_in_size(layer)
        g = k if self.group_size == -1 else self.group_size
        if self.online:
            w = quantize_rtn(layer.weight.data, g, sym=self.sym, what=where)
            delattr(layer, "weight")
            self._register(layer, w)
            return
        p = {spec.name: getattr(layer, spec.name).data for spec in self._specs(layer)}
        if self.fmt == "awq":
            w = convert_awq(p["qweight"], p["qzeros"], p["scales"], g, what=where)
        elif self.fmt == "gptq":
            w = convert_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], g, sym=self.sym,
                             checkpoint_format=self.checkpoint_format, what=where)
        else:
            for shape in p["weight_shape"].reshape(-1, 2).tolist():  # one (N, K) per stacked part
                if shape[1] != k_full:
                    raise ValueError(f"{where}: weight_shape says {shape} (N, K) but the layer's input width is "
                                     f"{k_full}")
            w = convert_compressed_tensors(p["weight_packed"], p["weight_scale"], p.get("weight_zero_point"), g, k,
                                           symmetric=self.sym, g_idx=p.get("weight_g_idx"), what=where)
        if w.n != layer.out_size or w.k != k:
            raise ValueError(f"{where}: converted weight is [{w.n}, {w.k}], the layer is [{layer.out_size}, {k}]")
        for name in p:
            delattr(layer, name)
        self._register(layer, w)

    @staticmethod
    def _register(layer: nn.Module, w: Int4Weights) -> None:
        layer.register_buffer("int4_qweight", w.qweight)
        layer.register_buffer("int4_scales", w.scales)
        layer.register_buffer("int4_zeros", w.zeros)
        layer.register_buffer("int4_perm", w.perm)
        layer.register_buffer("int4_g_idx", w.g_idx)
        layer.int4_group_size = w.group_size

    def weights(self, layer: nn.Module) -> Int4Weights:
        """The layer's weight in the internal layout (after process_weights_after_loading)."""
        return Int4Weights(layer.int4_qweight, layer.int4_scales, layer.int4_zeros, layer.int4_group_size,
                           layer.in_size, layer.int4_perm, layer.int4_g_idx)

    def warm_up_key(self, layer: nn.Module) -> tuple:
        return ("int4", tuple(layer.int4_qweight.shape), layer.int4_group_size, layer.int4_zeros is None,
                layer.int4_perm is None, layer.int4_g_idx is None)

    def warm_up(self, layer: nn.Module, max_tokens: int, dtype: torch.dtype) -> None:
        from kernels.int4_gemm import warm_up

        warm_up(layer.int4_qweight, layer.int4_scales, layer.int4_zeros, layer.int4_group_size, layer.in_size,
                max_tokens, dtype, perm=layer.int4_perm, g_idx=layer.int4_g_idx)

    def _ops(self, layer: nn.Module, x: torch.Tensor) -> ModuleType:
        ops = self.ops if self.ops is not None else getattr(layer, "ops", None)
        if ops is not None:
            return ops
        if x.is_cuda:
            import kernels

            return kernels
        from kernels import reference

        return reference

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = self._ops(layer, x).int4_gemm(x2, layer.int4_qweight, layer.int4_scales, layer.int4_zeros,
                                           layer.int4_group_size, perm=layer.int4_perm, g_idx=layer.int4_g_idx)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])
