"""Which BLAS library a decode graph's GEMMs are captured under.

A decode step's GEMMs are F.linear calls of M = batch rows against fixed
weights; PyTorch sends them to cuBLAS or to cuBLASLt by a process-wide
preference (``torch.backends.cuda.preferred_blas_library``), read at each
call. The two pick their kernels (tiles, split-K and its separate reduce
kernel) by different heuristics, and which is faster depends on M. A CUDA
graph keeps the kernels launched while it was captured, so each padded batch
size can be captured under its own library and replayed with it for good,
while eager steps (prefill, mixed) keep the process's default. Set by
``PDSERVE_DECODE_BLAS`` (``RuntimeConfig.decode_blas``, engine/runtime_config.py; unset:
nothing changes):

    cublas | cublaslt | default     every decode graph under that library
    8:cublaslt,256:cublas           a table: graphs of up to 8 rows under cuBLASLt, up to
                                    256 under cuBLAS; larger ones under the last entry's
                                    (``python -m bench.gemm_choice`` prints one from its timings)
    auto                            capture each graph under the process's library, cuBLAS
                                    and cuBLASLt, time a few replays of each, keep the
                                    fastest (the process's unless another is at least
                                    AUTO_MARGIN faster): each graph captured two or three
                                    times (a few seconds more start-up), no more memory held
                                    (one pool; the losers are dropped)

Capture runs with padding rows only (attention reads one key a row), so an
``auto`` replay times the GEMMs and the small kernels, not the KV read, which
the library does not change. Off CUDA nothing is set (``capture`` and ``prefer``
do nothing there). Seen on an H200 (torch 2.11, Llama-3.1-8B shape, 2026-12-02):
both libraries run the same kernels for most shapes (bit-equal outputs), cuBLASLt
others at 32-64 rows (the o and down projections), and ``auto`` took cuBLASLt
for the graphs of 32-192 rows: the decode step at 32 rows 6.13 -> 5.95 ms, at 64
7.26 -> 7.01 ms, 1 / 128 / 256 unchanged within noise. Off by default until
measured on more shapes and under tensor parallelism.
"""
from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable, Iterator

import torch

from engine.runtime_config import BLAS_ENV, BLAS_LIBRARIES, parse_blas_setting

logger = logging.getLogger(__name__)

# The setting's parser lives with the runtime config (torch-free: validated at start-up).
LIBRARIES = BLAS_LIBRARIES
parse = parse_blas_setting
AUTO_MARGIN = 0.01  # auto: another library must beat the default one by this much (timing noise)
AUTO_ROUNDS = 5  # auto: rounds of AUTO_REPLAYS replays per candidate, interleaved, median kept
AUTO_REPLAYS = 3

# rows -> the library its graph was captured under, of the last capture (logs and tests)
chosen: dict[int, str] = {}


def library_for(setting: str | list[tuple[int, str]] | None, rows: int) -> str | None:
    """The library a graph of ``rows`` rows is captured under: None (leave the process's
    preference), "auto", or a library name."""
    if setting is None or isinstance(setting, str):
        return setting
    return next((lib for limit, lib in setting if rows <= limit), setting[-1][1])


def table_text(winners: dict[int, str]) -> str:
    """{M: library} -> the shortest ``PDSERVE_DECODE_BLAS`` table that gives every M its
    library (sizes between two measured Ms take the larger one's)."""
    runs: list[tuple[int, str]] = []
    for m in sorted(winners):
        if runs and runs[-1][1] == winners[m]:
            runs[-1] = (m, winners[m])
        else:
            runs.append((m, winners[m]))
    return runs[0][1] if len(runs) == 1 else ",".join(f"{m}:{lib}" for m, lib in runs)


def current() -> str:
    """The process's preferred library, by name."""
    now = torch.backends.cuda.preferred_blas_library()
    return next(name for name in ("default", "cublas", "cublaslt", "ck")
                if name in torch.backends.cuda._BlasBackends and torch.backends.cuda._BlasBackends[name] == now)


@contextlib.contextmanager
def prefer(library: str | None, device: torch.device | str = "cuda") -> Iterator[None]:
    """Run the block with ``library`` preferred, then put back the preference found. Does
    nothing for None or off CUDA. Raises RuntimeError (from PyTorch) when the build lacks it."""
    if library is None or torch.device(device).type != "cuda":
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _replay_ms(graph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(AUTO_REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / AUTO_REPLAYS


def fastest(graphs: dict[str, object], time_ms: Callable[[object], float] | None = None) -> str:
    """The library of the fastest of ``graphs`` ({library: graph}, the default one first),
    timed in interleaved rounds (the same number of replays of each, in the same order on
    every rank: graphs holding collectives stay matched across ranks); the first one unless
    another is at least AUTO_MARGIN faster."""
    time_ms = time_ms or _replay_ms
    names = list(graphs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(AUTO_ROUNDS):
        for n in names:
            times[n].append(time_ms(graphs[n]))
    med = {n: statistics.median(t) for n, t in times.items()}
    best = min(names, key=med.__getitem__)
    return best if med[best] < med[names[0]] * (1 - AUTO_MARGIN) else names[0]


def available(library: str) -> bool:
    """Whether this build can prefer ``library`` (a CPU or ROCm build may lack cuBLASLt)."""
    before = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library(library)
    except RuntimeError:
        return False
    finally:
        torch.backends.cuda.preferred_blas_library(before)
    return True


def capture(capture_one: Callable[[], object], rows: int, device: torch.device | str = "cuda",
            setting: str | None = None):
    """``capture_one()`` (warm up and capture one decode graph of ``rows`` rows, return it)
    under the library that ``setting`` (``RuntimeConfig.decode_blas``; None: the process's) gives ``rows``; under
    ``auto``, once per library, keeping the fastest graph. A library this build lacks is
    skipped with a warning (then the graph is captured under the process's preference)."""
    library = library_for(parse(setting), rows)
    if library is None or torch.device(device).type != "cuda":
        return capture_one()
    base = current()
    wanted = [base] + [lib for lib in ("cublas", "cublaslt") if lib != base] if library == "auto" else [library]
    candidates = [lib for lib in wanted if available(lib)]
    if candidates != wanted:
        logger.warning("decode graph of %d rows: this build cannot prefer %s", rows,
                       ", ".join(sorted(set(wanted) - set(candidates))))
    if not candidates:
        return capture_one()
    graphs = {}
    for lib in candidates:
        with prefer(lib, device):
            graphs[lib] = capture_one()
    pick = fastest(graphs) if len(graphs) > 1 else candidates[0]
    chosen[rows] = pick
    if library == "auto":
        logger.info("decode graph of %d rows: GEMMs under %s (auto, of %s)", rows, pick, ", ".join(candidates))
    return graphs[pick]
