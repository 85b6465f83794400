"""Timing for the quantized GEMM benchmarks (``bench.int4_gemm``, ``bench.fp8_gemm``).

A GEMM of few rows is bound by reading its weight once, so a timing loop that reads one
weight over and over measures L2, not memory. Each case therefore makes enough copies of
its weight to fill CYCLE_BYTES and a CUDA graph cycles through them (``graph_us``); the
floors use bandwidths measured in the same run (``copy_bandwidth``, ``read_bandwidth``).
"""
from __future__ import annotations

import math
import statistics

CYCLE_BYTES = 240e6  # weight bytes cycled per graph: four times the H200's L2


def cycle_copies(bytes_per_copy: float) -> int:
    """How many copies of a weight of ``bytes_per_copy`` bytes fill CYCLE_BYTES (at least 2)."""
    return max(2, math.ceil(CYCLE_BYTES / bytes_per_copy))


def graph_us(call, copies: int) -> float:
    """Median time of one call(i) over CUDA-graph replays that cycle i through the copies."""
    import torch

    for i in range(copies):
        call(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(copies):
        call(i)
    end.record()
    torch.cuda.synchronize()
    per_call_ms = max(start.elapsed_time(end) / copies, 1e-3)
    calls = copies * max(1, min(200, round(2.0 / (per_call_ms * copies))))  # a replay of about 2 ms
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                call(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy, counting bytes read plus written."""
    import torch

    a = torch.randn(2**30, device="cuda")
    b = torch.empty_like(a)
    copy_us = min(graph_us(lambda i: b.copy_(a), 1) for _ in range(3))
    return 2 * a.numel() * 4 / (copy_us * 1e-6)


def read_bandwidth() -> float:
    """Bytes per second of a sum over 4 GiB: reads only, as a GEMV's weight stream."""
    import torch

    a = torch.randn(2**30, device="cuda")
    total = torch.empty((), device="cuda")
    read_us = min(graph_us(lambda i: torch.sum(a, dim=0, out=total), 1) for _ in range(3))
    return a.numel() * 4 / (read_us * 1e-6)


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in float32."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def fastest(timed, configs, best: tuple[float, object]) -> tuple[float, object]:
    """(us, config) of the fastest of ``best`` and ``timed(config)`` over ``configs``; a config
    that fails to run (e.g. out of shared memory) is reported and skipped."""
    for cfg in configs:
        try:
            t = timed(cfg)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"    skip {cfg}: {type(e).__name__}")
            continue
        if t < best[0]:
            best = (t, cfg)
    return best


def parse_shapes(text: str, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``"KxN,KxN"`` -> [(K, N), ...]; ``default`` when empty."""
    return default if not text else [tuple(map(int, s.split("x"))) for s in text.split(",")]


def precompile(job_fn, jobs: list) -> list:
    """Run ``job_fn`` (a module-level function: it is pickled) on every job in parallel spawned
    processes, which compiles each tile config into Triton's cache before the timing; returns
    each job's error text, or None."""
    import concurrent.futures
    import multiprocessing
    import os

    workers = max(1, min(len(jobs), (os.cpu_count() or 2) - 1, 15))
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(job_fn, jobs, chunksize=1))
