"""Multi-LoRA shrink and expand in PyTorch: the CPU serving path of ``lora_shrink`` and
``lora_expand`` and the oracle the Triton kernels (``kernels/lora.py``) are tested
against; ``lora_group`` is the one implementation for every device (torch ops only,
CUDA-graph capturable), re-exported by ``kernels.lora``. ``kernels.reference``
re-exports all three.

A batch's rows may use different adapters. The engine keeps up to S adapters
loaded, each in a slot, and every row names its slot (-1: no adapter). For a
linear layer y = x W^T of K inputs and N outputs with LoRA rank R (adapters of
smaller rank zero-padded to R):

    lora_a  [S, R, K]   (x's dtype)   A of slot s: t = x A^T          (the shrink)
    lora_b  [S, N, R]   (x's dtype)   B of slot s: y += t B^T         (the expand; the scaling
                                                                     alpha / r is folded into B)

Stacked layers (q|k|v, gate|up) have P parts sharing one x: the parts' A
matrices are stacked along rows, ``lora_a [S, P*R, K]`` (rows [p*R, (p+1)*R) are
part p's A), so one shrink gives ``t [T, P*R]``; ``lora_b [S, N, R]`` stacks the
parts' B along N as y's columns are, and ``part_offsets = (0, N_0, N_0 + N_1, ...,
N)`` says which columns of y (and rows of lora_b) are part p's. Part p's columns
use t[:, p*R:(p+1)*R]. P = 1 is an ordinary layer.

Once per step (shared by every layer) ``lora_group`` sorts the rows by slot:

    sorted_ids  [T] int32      row indices grouped by slot, ascending within a slot
                               (stable), rows of no slot last
    slot_starts [S + 1] int32  rows sorted_ids[slot_starts[s]:slot_starts[s+1]] use slot s;
                               sorted_ids[slot_starts[S]:] have none

Numerics: t is x A^T with float32 accumulation (16-bit products are exact in
float32), returned in float32; the expand computes t B^T in float32 from t as is
and B widened exactly, adds it to y in float32 and rounds once to y's dtype. Here
each slot's rows are gathered and multiplied in one float32 matmul; the kernels
compute the same sums in another order.
"""
from __future__ import annotations

import torch

from kernels._checks import check_dim, check_dtype, require


def lora_group(token_slots: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_slots [T] int32 (the adapter slot of each row; -1 or any value outside
    [0, num_slots): no adapter) -> (sorted_ids [T] int32, slot_starts [num_slots + 1] int32)
    as in this module's docstring, on token_slots' device.

    Torch ops of sizes fixed by T and num_slots, with no host sync (a stable sort and
    a binary search), so a CUDA graph can capture it; once per step, shared by every
    layer's ``lora_shrink`` and ``lora_expand``."""
    where = "lora_group"
    require(isinstance(num_slots, int) and not isinstance(num_slots, bool) and num_slots >= 1, where,
            f"num_slots must be an int >= 1, got {num_slots!r}")
    check_dim(where, "token_slots", token_slots, 1, "[T] int32")
    check_dtype(where, "token_slots", token_slots, (torch.int32,))
    slots = token_slots
    key = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)  # int32; no adapter: S, sorted last
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(num_slots + 1, device=slots.device, dtype=torch.int32)
    slot_starts = torch.searchsorted(sorted_key, bounds, out_int32=True)  # the first sorted row of slot >= s
    return order.to(torch.int32), slot_starts


def _segments(slot_starts: torch.Tensor, sorted_ids: torch.Tensor):
    """(slot, its rows as int64 indices) for every slot with rows (one host sync)."""
    starts = slot_starts.tolist()
    for s in range(len(starts) - 1):
        lo, hi = starts[s], starts[s + 1]
        if hi > lo:
            yield s, sorted_ids[lo:hi].long()


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor, sorted_ids: torch.Tensor,
                slot_starts: torch.Tensor) -> torch.Tensor:
    """x [T, K] float16/bfloat16/float32, lora_a [S, R, K] in x's dtype (P parts: [S, P*R, K],
    part p's A in rows [p*R, (p+1)*R)), token_slots [T] int32, (sorted_ids, slot_starts) =
    lora_group(token_slots, S) -> a new contiguous t [T, R] (P*R) float32:
    t[i] = x[i] @ lora_a[token_slots[i]].T with float32 accumulation, 0 for rows of no slot.
    Rows are read through sorted_ids / slot_starts (token_slots only gave them)."""
    t = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for s, rows in _segments(slot_starts, sorted_ids):
        t[rows] = x[rows].float() @ lora_a[s].float().t()
    return t


def lora_expand(y: torch.Tensor, t: torch.Tensor, lora_b: torch.Tensor, token_slots: torch.Tensor,
                sorted_ids: torch.Tensor, slot_starts: torch.Tensor, part_offsets: tuple[int, ...]) -> None:
    """In place: y [T, N] (x's dtype, views allowed) gains t-part @ lora_b[slot]-part.T.

    t [T, P*R] float32 (from ``lora_shrink``), lora_b [S, N, R] in y's dtype,
    part_offsets (0, ..., N): P + 1 increasing ints. Columns [part_offsets[p],
    part_offsets[p+1]) of y use t[:, p*R:(p+1)*R] and the same rows of lora_b[slot].
    The product is float32 (lora_b widened exactly), added to y in float32 and rounded
    once to y's dtype. Rows of no slot are left untouched."""
    rank = lora_b.shape[2]
    for s, rows in _segments(slot_starts, sorted_ids):
        tr = t[rows]  # [n, P*R]
        b = lora_b[s].float()  # [N, R]
        delta = torch.empty(rows.shape[0], y.shape[1], dtype=torch.float32, device=y.device)
        for p in range(len(part_offsets) - 1):
            c0, c1 = part_offsets[p], part_offsets[p + 1]
            delta[:, c0:c1] = tr[:, p * rank:(p + 1) * rank] @ b[c0:c1].t()
        y[rows] = (y[rows].float() + delta).to(y.dtype)  # index_put_ writes through a view
