"""Paged attention and the KV-cache write on the CPU, compiled (``cpu/paged_attention.cpp``).

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
``$TORCH_EXTENSIONS_DIR``), named after the torch version; later processes
load the cached library after ninja's up-to-date check. Needs a C++ compiler
(``$CXX``, else ``c++``) and ninja. Where either is missing or the build
fails, every call goes to the reference and one log line says why. Calls the
extension does not cover (other devices, a cache whose dtype is neither q's
nor e4m3, a head dim over 512) go to the reference too.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import torch

from kernels import reference
from kernels._checks import FP8_KV_DTYPE, check_window

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu", "paged_attention.cpp")
_NAME = "pdserve_cpu_attention_torch_" + "".join(c if c.isalnum() else "_" for c in torch.__version__)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 512  # the extension's kMaxHeadDim

_lock = threading.Lock()
_state: dict = {}  # "module": the loaded extension or None; "reason": why None


def extension() -> Any:
    """The compiled module, built or loaded on the first call; None where it cannot be
    (the reason is logged once, and kept: ``unavailable_reason()``)."""
    if "module" not in _state:
        with _lock:
            if "module" not in _state:
                _state["module"], _state["reason"] = _load()
                if _state["module"] is None:
                    logger.warning("compiled CPU attention unavailable (%s); using the PyTorch reference",
                                   _state["reason"])
    return _state["module"]


def unavailable_reason() -> str | None:
    """Why ``extension()`` is None (None while it is loaded or not yet tried)."""
    return _state.get("reason")


def _on_path(program: str) -> bool:
    if os.path.isabs(program):
        return os.access(program, os.X_OK)
    return any(os.access(os.path.join(d, program), os.X_OK) for d in os.get_exec_path())


def _load() -> tuple[Any, str | None]:
    compiler = os.environ.get("CXX", "c++")
    if not _on_path(compiler.split()[0]):
        return None, f"no C++ compiler: {compiler!r} is not on PATH"
    # torch runs `ninja` from PATH; pip's ninja (the Makefile installs it where the
    # system has none) sits in the environment's bin folder, which is not on PATH
    # when the environment's python is run directly.
    env_bin = os.path.normpath(os.path.join(os.path.dirname(torch.__file__), *[os.pardir] * 4, "bin"))
    if not _on_path("ninja") and _on_path(os.path.join(env_bin, "ninja")):
        os.environ["PATH"] = env_bin + os.pathsep + os.environ.get("PATH", "")
    if not _on_path("ninja"):
        return None, "ninja is not on PATH (pip install ninja)"
    from torch.utils import cpp_extension

    t0 = time.perf_counter()
    try:
        module = cpp_extension.load(name=_NAME, sources=[_SOURCE], extra_cflags=["-O3", "-fopenmp"],
                                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # a failed build or load: the compiler's output is in the message
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        first_error = next((ln for ln in lines if ": error:" in ln or ln.startswith("error")), lines[-1])
        return None, f"the build failed: {first_error[:300]}"
    logger.debug("compiled CPU attention loaded in %.1f s", time.perf_counter() - t0)
    return module, None


def _covered(q: torch.Tensor, *caches: torch.Tensor) -> bool:
    """Whether the extension takes these tensors (else the reference does)."""
    if q.device.type != "cpu" or q.dtype not in _FLOAT_DTYPES or q.dim() != 3:
        return False
    c = caches[0]
    return (all(t.device.type == "cpu" and t.dtype == c.dtype and t.dim() == 4 and t.stride(3) == 1
                for t in caches)
            and c.dtype in (q.dtype, FP8_KV_DTYPE) and c.shape[3] <= _MAX_HEAD_DIM)


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
) -> torch.Tensor:
    """``kernels.reference.paged_attention``, compiled; ``num_splits`` and ``step_cache``
    change nothing here (the extension needs no per-step index work)."""
    check_window(sliding_window)
    ext = extension() if _covered(q, k_cache, v_cache) else None
    if ext is None or q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        return reference.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                         num_splits=num_splits, step_cache=step_cache,
                                         sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    meta = [t.to(torch.int32).contiguous() for t in (block_tables, query_start_loc, seq_lens)]
    return ext.paged_attention(q, k_cache, v_cache, *meta, float(scale),
                               0 if sliding_window is None else sliding_window, float(k_scale), float(v_scale))


if __name__ == "__main__":  # `python -m kernels.cpu_attention`: build (or find) the extension ahead of use
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    ready = extension() is not None
    print(f"compiled CPU attention: ready ({time.perf_counter() - t0:.1f} s)" if ready
          else f"compiled CPU attention: not built ({unavailable_reason()}); CPU attention uses the reference")
