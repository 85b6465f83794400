"""An engine process's CPU threads: one OpenMP team, the engine thread's.

PyTorch runs a CPU op's parallel regions on an OpenMP team that belongs to the thread that
calls it, and libgomp keeps a thread's team as long as the thread lives. Once a process holds
more OpenMP threads than it has CPUs (two teams of two on two cores), libgomp stops letting
idle workers spin and parks them, and every parallel region then wakes its workers through the
kernel: on 2 cores an elementwise op went from 11 to 72 us, and a decode step of the packed
default model from 7-8 to 13-14 ms, once a second thread of the process had run a parallel op
(docs/benchmarks.md, "One OpenMP team per server").

So a server keeps one team: the engine thread's, which builds the engine and then steps it
(engine/engine_loop.py ``EngineThread``), and the threads that move KV blocks or do other side
work call ``serial_thread`` first, which runs their ops on the thread itself.

``torch.set_num_threads`` would not do for them: it also sets the count every thread takes
when it first asks for one, and each compiled extension asks again for itself (its own copy of
PyTorch's once-per-thread set-up), so the engine thread's first call into the CPU kernels
would take 1 from it. ``serial_thread`` sets the calling thread's count in the OpenMP runtime
alone."""
from __future__ import annotations

import ctypes
import functools

import torch


def serial_thread() -> None:
    """This thread's CPU ops run on this thread alone: it never starts an OpenMP team.
    A no-op where PyTorch's OpenMP runtime is not found."""
    torch.get_num_threads()  # PyTorch's set-up of this thread's count: now, not over ours later
    runtime = _openmp()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime loaded in this process (PyTorch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if any(
                name in line for name in ("/libgomp", "/libiomp", "/libomp"))})
    except OSError:
        return None
    for path in paths:
        try:
            runtime = ctypes.CDLL(path)
            runtime.omp_set_num_threads.argtypes = [ctypes.c_int]
            return runtime
        except (OSError, AttributeError):
            continue
    return None
