"""Argument checks shared by the launchers: each failure is a ValueError that
names the launcher and the argument, so a wrong call from the engine is
diagnosed at the call site rather than as garbage or an illegal access.

They run on every launch (an eager 8B step makes ~1,800 of them), so each
tests first and formats its message only when the test fails."""
from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# FP8 KV cache: e4m3 (OCP "fn": no infinities, one NaN code, max 448), per-tensor scales.
FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


INDEX_DTYPES = (torch.int32, torch.int64)


def require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {message}")


def check_window(sliding_window: int | None) -> None:
    """A paged attention's ``sliding_window``: None, or a positive int (keys a query sees)."""
    require(
        sliding_window is None
        or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool) and sliding_window >= 1),
        "paged_attention",
        f"sliding_window must be None or an int >= 1, got {sliding_window!r}",
    )


def check_runnable(where: str, **tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device can run Triton here."""
    devices = [t.device for t in tensors.values()]
    first = devices[0]
    if any(d != first for d in devices):
        require(False, where, "all tensors must be on one device, got "
                + ", ".join(f"{n}={t.device}" for n, t in tensors.items()))
    # TRITON_INTERPRET is read by triton.jit when the kernels are defined;
    # checking it here turns a confusing launch failure into a clear message.
    if first.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        require(False, where, f"Triton kernels need CUDA tensors (got {first}); on CPU call the "
                "same-named function in kernels.reference, or set TRITON_INTERPRET=1 "
                "before importing kernels")


def check_dim(where: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        require(False, where, f"{name} must be {layout}, got shape {tuple(t.shape)}")


def check_dtype(where: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        require(False, where, f"{name} must have dtype in {[str(d) for d in allowed]}, got {t.dtype}")


def check_inner_contiguous(where: str, name: str, t: torch.Tensor) -> None:
    """The last dim must have stride 1 (rows load as vectors); other strides are free."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        require(False, where, f"{name} must have stride 1 in its last dim, got strides {t.stride()}")


def check_contiguous(where: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        require(False, where, f"{name} must be contiguous, got strides {t.stride()}")


def check_varlen_rows(where: str, state_slots: torch.Tensor, query_start_loc: torch.Tensor,
                      has_initial_state: torch.Tensor) -> int:
    """The rows of a varlen batch with per-sequence state (the linear-attention ops): [B] int
    state slots, [B+1] int query_start_loc, [B] bool has_initial_state. Returns B."""
    B = state_slots.shape[0]
    check_dim(where, "state_slots", state_slots, 1, "[num_seqs]")
    check_dtype(where, "state_slots", state_slots, INDEX_DTYPES)
    check_dtype(where, "query_start_loc", query_start_loc, INDEX_DTYPES)
    require(query_start_loc.shape == (B + 1,), where,
            f"query_start_loc must be [{B + 1}] for {B} sequences, got {tuple(query_start_loc.shape)}")
    require(has_initial_state.shape == (B,) and has_initial_state.dtype == torch.bool, where,
            f"has_initial_state must be a [{B}] bool tensor, got {has_initial_state.dtype} "
            f"{tuple(has_initial_state.shape)}")
    return B


def check_kv_cache_dtype(where: str, name: str, cache: torch.Tensor, model_dtype: torch.dtype,
                         k_scale: float, v_scale: float) -> None:
    """A KV cache holds the model's dtype, or FP8 (e4m3) with a scale for K and one for V;
    scales are positive finite floats, and 1.0 unless the cache is FP8."""
    if cache.dtype != model_dtype and cache.dtype != FP8_KV_DTYPE:
        require(False, where, f"{name} dtype {cache.dtype} is neither the model's ({model_dtype}) nor {FP8_KV_DTYPE}")
    for scale_name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale == 1.0 and type(scale) in (float, int):  # (True == 1.0: bool is refused below)
            continue
        number = isinstance(scale, (int, float)) and not isinstance(scale, bool)
        require(number and 0.0 < scale < float("inf"), where,
                f"{scale_name} must be a positive finite float, got {scale!r}")
        require(cache.dtype == FP8_KV_DTYPE or scale == 1.0, where,
                f"{scale_name} {scale} given for a {cache.dtype} cache (scales apply to FP8 caches only)")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_sinks(where: str, sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """``sinks``: None, or float32 [num_q_heads] (q.shape[1]) with stride 1, on q's device."""
    if sinks is None:
        return
    require(isinstance(sinks, torch.Tensor), where, f"sinks must be a tensor or None, got {type(sinks).__name__}")
    require(sinks.dtype == torch.float32, where, f"sinks must have dtype torch.float32, got {sinks.dtype}")
    require(sinks.dim() == 1 and sinks.shape[0] == q.shape[1], where,
            f"sinks must be [num_q_heads] = [{q.shape[1]}], got {list(sinks.shape)}")
    require(sinks.stride(0) == 1 or sinks.shape[0] <= 1, where, "sinks must have stride 1")
    require(sinks.device == q.device, where, f"sinks are on {sinks.device}, q on {q.device}")
