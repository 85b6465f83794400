"""Paged attention and the KV-cache write on the CPU, compiled (``cpu/paged_attention.cpp``; the
same library holds the RMSNorm and rotary embedding of ``kernels/cpu_ops.py``, ``cpu/elementwise.cpp``).

The references gather each sequence's K/V out of the paged cache before their
matmuls, and run a few dozen small ops per layer to do it. This C++ extension
reads the cache in place: one call per layer for the cache write and one for
the attention, decode rows and prefill chunks alike (online softmax over
whole cache blocks, see the source's header). Same signatures and contract
as ``kernels.reference.store_kv_cache`` / ``paged_attention``; results equal
the reference's to float32 rounding (the softmax is summed in another order).

Built with ``torch.utils.cpp_extension.load`` the first time a process needs
it (``make install`` builds it ahead: ``python -m kernels.cpu_attention``),
into torch's extension cache (``~/.cache/torch_extensions``, or
``$TORCH_EXTENSIONS_DIR``), named after the torch version and a hash of where this
source and that torch are (ninja's build file records both paths: two checkouts or two
virtualenvs sharing one folder would rebuild over each other at every load) and of this
CPU's feature flags (it is built for the machine: -march=native, ``cpu_extension.build_name``); later
processes load the cached library after ninja's up-to-date check. The engine's model
runner loads it at start-up on CPU (a build inside a step would hold the
step). Needs a C++ compiler (``$CXX``, else ``c++``) and ninja. Where either
is missing, the build fails, or the build or load has not ended within
``$PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT`` seconds (default 900), every call
goes to the reference and one log line says why.

The build and load are ``kernels/cpu_extension.py``'s (shared with the GGUF
GEMM of ``kernels/cpu_gemm.py``): torch serializes builds with a lock file in
the build folder and waits for it without bound; a build killed midway leaves
it behind. pdserve's processes build or load one at a time (an ``flock``
beside it, dropped by the kernel when its holder dies), and the one holding
it removes torch's lock file when no live process has it open (older than
``STALE_LOCK_AGE_S`` where /proc cannot tell), with a log line. Calls the
extension does not cover (other devices, a cache whose dtype is neither q's
nor e4m3, a head dim over 512) go to the reference too.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch

from kernels import cpu_extension, reference
from kernels._checks import check_sinks
from kernels._checks import FP8_KV_DTYPE, check_window

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "paged_attention.cpp")
# Built into the same library: the per-layer elementwise glue (kernels/cpu_ops.py calls it).
_ELEMENTWISE_SOURCE = os.path.join(os.path.dirname(_SOURCE), "elementwise.cpp")
_NAME = cpu_extension.build_name("pdserve_cpu_attention", [_SOURCE, _ELEMENTWISE_SOURCE], cpu_extension.DEFAULT_CFLAGS)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 512  # the extension's kMaxHeadDim

# A build or load waits at most this long (torch's lock file included), then the references run.
# The engine passes its RuntimeConfig's value (read from this variable by engine/runtime_config.py;
# ``python -m kernels.cpu_attention --build-timeout S`` for the build ahead of use).
DEFAULT_BUILD_TIMEOUT_S = cpu_extension.DEFAULT_BUILD_TIMEOUT_S
STALE_LOCK_AGE_S = cpu_extension.STALE_LOCK_AGE_S  # the build helper's (kernels/cpu_extension.py)

_lock = threading.Lock()
_state: dict = {}  # "module": the loaded extension or None; "reason": why None


def extension(build_timeout: float | None = None) -> Any:
    """The compiled module, built or loaded on the first call, waiting at most
    ``build_timeout`` s (default DEFAULT_BUILD_TIMEOUT_S); None where it cannot be (the
    reason is logged once, and kept: ``unavailable_reason()``)."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                _state["module"], _state["reason"] = _load(build_timeout or DEFAULT_BUILD_TIMEOUT_S)
                if _state["module"] is None:
                    logger.warning("compiled CPU attention unavailable (%s); using the PyTorch reference",
                                   _state["reason"])
    return _state["module"]


def unavailable_reason() -> str | None:
    """Why ``extension()`` is None (None while it is loaded or not yet tried)."""
    return _state.get("reason")


def _load(timeout: float) -> tuple[Any, str | None]:
    return cpu_extension.load_extension(_NAME, [_SOURCE, _ELEMENTWISE_SOURCE], timeout, what="compiled CPU attention",
                                        timeout_env="PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT")


def _covered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the extension takes these tensors (else the reference does)."""
    if q.device.type != "cpu" or q.dtype not in _FLOAT_DTYPES or q.dim() != 3:
        return False
    for c in (k_cache, v_cache):
        if c.device.type != "cpu" or c.dtype != k_cache.dtype or c.dim() != 4 or c.stride(3) != 1:
            return False
    return k_cache.dtype in (q.dtype, FP8_KV_DTYPE) and k_cache.shape[3] <= MAX_HEAD_DIM


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``kernels.reference.store_kv_cache``, compiled (the same bytes land in the cache)."""
    ext = extension() if _covered(key, k_cache, v_cache) else None
    if ext is None or value.dtype != key.dtype or key.shape[0] != slot_mapping.shape[0]:
        return reference.store_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale,
                                        v_scale=v_scale)
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    ext.store_kv_cache(key, value, k_cache, v_cache, slot_mapping.to(torch.int64).contiguous(),
                       float(k_scale), float(v_scale))


def step_index(block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
               step_cache: dict | None) -> list[torch.Tensor]:
    """The step's index tensors as the extension reads them (contiguous int32): made once per step
    and cache group, kept in ``step_cache`` for the step's other layers (None: not kept)."""
    meta = step_cache.get("cpu_int32") if step_cache is not None else None
    if meta is None:
        meta = [t.to(torch.int32).contiguous() for t in (block_tables, query_start_loc, seq_lens)]
        if step_cache is not None:
            step_cache["cpu_int32"] = meta
    return meta


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    step_cache: dict | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``kernels.reference.paged_attention``, compiled; ``num_splits`` changes nothing here, and
    ``step_cache`` keeps the index tensors' int32 copies for the step's other layers. ``sinks`` (float32
    [num_q_heads] or None) are folded into each row's softmax once its keys are done."""
    check_window(sliding_window)
    check_sinks("paged_attention", sinks, q)
    ext = extension() if _covered(q, k_cache, v_cache) else None
    if ext is None or q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        return reference.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                         num_splits=num_splits, step_cache=step_cache,
                                         sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
                                         sinks=sinks)
    q = q if q.stride(-1) == 1 else q.contiguous()
    meta = step_index(block_tables, query_start_loc, seq_lens, step_cache)
    return ext.paged_attention(q, k_cache, v_cache, *meta, float(scale),
                               0 if sliding_window is None else sliding_window, float(k_scale), float(v_scale),
                               sinks)


if __name__ == "__main__":  # `python -m kernels.cpu_attention`: build (or find) the extension ahead of use
    cpu_extension.prebuild_main("compiled CPU attention", extension, unavailable_reason)
