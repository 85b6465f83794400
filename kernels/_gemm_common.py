"""What the int4 (``kernels/int4_gemm.py``) and FP8 (``kernels/fp8_gemm.py``) GEMMs share:
the tile config type, the split-K bookkeeping of their launchers, and two pieces of their
kernels (the GROUP_M tile order and the epilogue).

Split-K, as both run it: a launch has one program per (output tile, K split). With
SPLIT_K > 1 every split stores its float32 partial tile in ``part [SPLIT_K, M, N]`` and adds
1 to its tile's int32 counter; the split that arrives last sums the partials in split order
(the result does not depend on timing), writes the output and puts the counter back to 0.
One launch, no host sync, and the counters are all zero between calls, so a CUDA graph can
replay it. Each family keeps its own counters (``SplitKCounters``, one buffer per device);
launches that share a buffer must not run concurrently on two streams.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Callable, Hashable, Self

import torch
import triton
import triton.language as tl

from kernels._checks import require

COUNTER_SLOTS = 1 << 14  # output tiles a split launch may have: one int32 counter each
KERNELS = ("dot", "gemv")


# ---- tiles ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTiles:
    """The tiles of one launch. A family subclasses it to name its launcher (``launcher``) in
    errors; the subclasses do not compare equal, so one family's config is never taken for
    the other's."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "dot"

    launcher = "gemm"  # a class attribute, not a field

    def as_dict(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "block_k": self.block_k, "split_k": self.split_k,
                "group_m": self.group_m, "num_warps": self.num_warps, "num_stages": self.num_stages,
                "kernel": self.kernel}

    @classmethod
    def from_dict(cls, d: dict) -> Self:
        """Raises ValueError (naming ``config``) on anything that is not a valid tile config."""
        where = cls.launcher
        keys = ("block_m", "block_n", "block_k")
        require(isinstance(d, dict) and all(isinstance(d.get(key), int) for key in keys), where,
                f"config needs integer {', '.join(keys)}, got {d!r}")
        extra = set(d) - {f.name for f in fields(cls)}
        require(not extra, where, f"config has unknown keys {sorted(extra)}")
        tiles = cls(**d)
        require(tiles.kernel in KERNELS, where, f"config kernel must be one of {list(KERNELS)}, got {tiles.kernel!r}")
        gemv = tiles.kernel == "gemv"
        for value in (tiles.block_n, tiles.block_k) if gemv else (tiles.block_m, tiles.block_n, tiles.block_k):
            require(value >= 16 and value & (value - 1) == 0, where,
                    f"config block sizes must be powers of two >= 16, got {d!r}")
        require(not gemv or tiles.block_m in (1, 2, 4, 8), where,
                f"config block_m (rows per program) of the gemv kernel must be 1, 2, 4 or 8, got {d!r}")
        require(tiles.split_k >= 1 and tiles.group_m >= 1 and tiles.num_warps in (1, 2, 4, 8, 16)
                and tiles.num_stages >= 1, where, f"config has a bad split_k, group_m, num_warps or num_stages: {d!r}")
        return tiles


def first_rows_per_variant(max_tokens: int, variant: Callable[[int], Hashable]) -> list[int]:
    """The row counts m in 1..max_tokens at which ``variant(m)`` (hashable: tiles, a backend)
    is new, ascending: what a ``warm_up`` runs once each."""
    seen = set()
    rows = []
    for m in range(1, max_tokens + 1):
        v = variant(m)
        if v not in seen:
            seen.add(v)
            rows.append(m)
    return rows


# ---- split-K, on the host ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, to exercise them
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_split(tiles: int, steps: int, target: int) -> int:
    """Split K in powers of two until about ``target`` programs, keeping >= 2 steps (K tiles,
    or FP8's k-blocks) a split."""
    split = 1
    while tiles * split * 2 <= target and split * 2 <= steps // 2 and tiles * split * 2 <= COUNTER_SLOTS:
        split *= 2
    return split


def split_steps(num_steps: int, split_k: int) -> tuple[int, int]:
    """(splits, steps per split) of a launch asking for ``split_k``: at most one split per
    step, and no split left empty (5 steps asked in 4 splits run as 3 splits of 2 steps)."""
    per_split = triton.cdiv(num_steps, min(split_k, num_steps))
    return triton.cdiv(num_steps, per_split), per_split


class SplitKCounters:
    """One family's split-K tile counters: COUNTER_SLOTS int32 zeros per device, allocated on
    first use (``warm_up`` does it before any CUDA-graph capture), all zero between calls.
    ``counters(device)`` returns that device's buffer."""

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def __call__(self, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(device)
        if buf is None:
            buf = self._buffers[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        return buf


def split_k_scratch(where: str, out: torch.Tensor, split: int, num_tiles: int,
                    counters: SplitKCounters) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, counters) of a launch writing ``out [M, N]`` in ``num_tiles`` output tiles:
    a new [split, M, N] float32 and the device's counters when K is split, else ``out`` twice
    (the kernel never reads them). A ValueError naming ``where`` when the tiles outnumber the
    counters."""
    require(split == 1 or num_tiles <= COUNTER_SLOTS, where,
            f"split_k > 1 supports at most {COUNTER_SLOTS} output tiles, got {num_tiles}")
    if split == 1:
        return out, out
    m, n = out.shape
    return torch.empty((split, m, n), dtype=torch.float32, device=out.device), counters(out.device)


# ---- kernel pieces ----------------------------------------------------------------------------------------


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # (pid_m, pid_n): the output tile of program pid. Groups of GROUP_M tiles along M walk N
    # together (L2 reuse of weight tiles).
    num_m_blocks = tl.cdiv(M, BLOCK_M)
    num_n_blocks = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _scale_and_store(total, out_ptr, out_off, out_mask, row_scale_ptr, col_scale_ptr, offs_m, offs_n, m_ok, n_ok,
                     OUTER_SCALES: tl.constexpr):
    if OUTER_SCALES:
        xs = tl.load(row_scale_ptr + offs_m, mask=m_ok, other=0.0)
        ws = tl.load(col_scale_ptr + offs_n, mask=n_ok, other=0.0)
        total = total * xs[:, None] * ws[None, :]
    tl.store(out_ptr + out_off, total.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def store_tile(acc, out_ptr, part_ptr, counter_ptr, row_scale_ptr, col_scale_ptr, offs_m, offs_n, m_ok, n_ok,
               tile, pid_k, M, N, OUTER_SCALES: tl.constexpr, SPLIT_K: tl.constexpr):
    # acc: the float32 [rows, cols] sum of output tile ``tile`` (rows offs_m, columns offs_n) over
    # K split pid_k -> out [M, N] (contiguous), rounded once to out's dtype. OUTER_SCALES: the
    # whole sum is first multiplied by row_scale[m] * col_scale[n] (the scale pointers are not
    # read otherwise). SPLIT_K > 1: split-K as in this module's docstring.
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_off = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT_K > 1:
        # Every split stores its partial; the tile's last split to arrive sums them in order.
        tl.store(part_ptr + pid_k.to(tl.int64) * M * N + out_off, acc, mask=out_mask)
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in tl.static_range(SPLIT_K):
                # .cg: read from L2, where the other programs' stores are, not from this SM's L1
                total += tl.load(part_ptr + s * M * N + out_off, mask=out_mask, other=0.0, cache_modifier=".cg")
            _scale_and_store(total, out_ptr, out_off, out_mask, row_scale_ptr, col_scale_ptr, offs_m, offs_n,
                             m_ok, n_ok, OUTER_SCALES)
            tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next call
    else:
        _scale_and_store(acc, out_ptr, out_off, out_mask, row_scale_ptr, col_scale_ptr, offs_m, offs_n,
                         m_ok, n_ok, OUTER_SCALES)
