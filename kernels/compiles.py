"""Kernel compilations after start-up. Triton compiles a kernel again for every new
specialization it meets (constexpr values, and whether an integer argument is 1 or a
multiple of 16), and the launch that meets one waits for the compiler: a step that
stalls for most of a second. The engine warms its kernels up before serving; this
reports any compile that still happens later, so a stall can be told from a slow step."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from triton import knobs

_local = threading.local()
count = 0  # compiles seen since watch() (all threads)
_lock = threading.Lock()


def _before(**kw: Any) -> bool:
    _local.start = time.perf_counter()
    return False  # go on and compile


def watch(logger: logging.Logger) -> None:
    """Log every Triton compile from now on in this process (once per process)."""
    def after(*, fn: Any, repr: str, **kw: Any) -> None:
        global count
        took = time.perf_counter() - getattr(_local, "start", time.perf_counter())
        with _lock:
            count += 1
        logger.info("kernels: compiled %s after start-up in %.2f s (the launch waited for it; "
                    "its specialization is logged at DEBUG)", getattr(fn, "name", fn), took)
        logger.debug("kernels: %s", repr)

    knobs.runtime.jit_cache_hook = _before
    knobs.runtime.jit_post_compile_hook = after
