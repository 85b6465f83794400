"""Every switch that changes a step's path or the kernels it runs, typed, in one place.

A step's path (eager, a decode graph, a verify graph, a mixed-step graph; queued ahead or
read at once) is decided by ``engine.planner.plan_step`` from the scheduler's output and
the values here, resolved once when the engine is built and shown in its "engine config:"
log line. The flags set the switches users set (``--enforce-eager``,
``--async-scheduling``); the tuning switches below keep the environment variables they
always had, and this module is the only one that reads them, once, at start:

    variable                      field                  meaning
    PDSERVE_KERNELS               kernels                auto | triton | reference
    PDSERVE_MIXED_GRAPHS          mixed_graph_sizes      token buckets of mixed-step graphs ("0": none)
    PDSERVE_OVERLAP_MIXED_STEPS   overlap_mixed_steps    1 | 0: steps with prefill chunks overlap too
    PDSERVE_DECODE_BLAS           decode_blas            the BLAS library of each decode graph
    PDSERVE_DENSE_PREFILL         dense_prefill          0: fresh prompts through the paged kernel

and the process settings beside them (``log_level()``; ``cpu_attention_build_timeout``:
PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT, seconds the compiled CPU attention's build may take;
``kv_corruption_test_hook()``: PDSERVE_TEST_CORRUPT_KV_EVERY, a test-only fault hook of the
KV transfer canary, kv_transfer/canary.py).
Outside this module only secrets (PDSERVE_API_KEY, PDSERVE_KV_SECRET) and file locations
(PDSERVE_CACHE_DIR, PDSERVE_TRACES_FILE) are read from the environment; a test keeps it so.

``graphs_without_capture`` (the decode-graph path run eagerly, on any device) is a test
setting: only code sets it (``LLM(..., graphs_without_capture=True)``, an engine server's
hidden flag), so a served process cannot inherit it. ``PDSERVE_DECODE_GRAPHS``, which
used to set it, is refused at start with a message that says so.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

KERNELS_ENV = "PDSERVE_KERNELS"
MIXED_GRAPHS_ENV = "PDSERVE_MIXED_GRAPHS"
OVERLAP_MIXED_ENV = "PDSERVE_OVERLAP_MIXED_STEPS"
BLAS_ENV = "PDSERVE_DECODE_BLAS"
DENSE_PREFILL_ENV = "PDSERVE_DENSE_PREFILL"
CPU_BUILD_TIMEOUT_ENV = "PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT"
LOG_LEVEL_ENV = "PDSERVE_LOG_LEVEL"
REMOVED_GRAPHS_ENV = "PDSERVE_DECODE_GRAPHS"
TEST_CORRUPT_KV_ENV = "PDSERVE_TEST_CORRUPT_KV_EVERY"  # tests only: see kv_corruption_test_hook
KERNEL_CHOICES = ("auto", "triton", "reference")
BLAS_LIBRARIES = ("cublas", "cublaslt", "default")
# Past ~2k tokens a step of an 8B model is compute-bound and its launches are a few percent.
DEFAULT_MIXED_GRAPHS = (256, 512, 1024, 2048)


@dataclass(frozen=True)
class RuntimeConfig:
    enforce_eager: bool = False  # --enforce-eager: no CUDA graphs
    async_scheduling: bool = True  # --async-scheduling: queue step N+1 before reading step N's tokens
    kernels: str = "auto"  # auto: Triton on CUDA, the PyTorch references elsewhere
    mixed_graph_sizes: tuple[int, ...] | None = None  # None: DEFAULT_MIXED_GRAPHS where decode graphs are captured
    overlap_mixed_steps: bool | None = None  # None: where mixed-step graphs are captured
    decode_blas: str | None = None  # None: every graph under the process's library (engine/gemm_backend.py)
    dense_prefill: bool = True  # chunks with no cached prefix on the dense prefill kernel
    graphs_without_capture: bool = False  # tests: the decode-graph path run eagerly, on any device
    cpu_attention_build_timeout: float | None = None  # None: the kernel's default (kernels/cpu_attention.py)

    def __post_init__(self) -> None:
        if self.kernels not in KERNEL_CHOICES:
            raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {self.kernels!r}")
        if self.mixed_graph_sizes is not None and any(n < 1 for n in self.mixed_graph_sizes):
            raise ValueError(f"{MIXED_GRAPHS_ENV} must be positive token counts, got {self.mixed_graph_sizes}")
        if self.cpu_attention_build_timeout is not None and not self.cpu_attention_build_timeout > 0:
            raise ValueError(f"{CPU_BUILD_TIMEOUT_ENV} must be a positive number of seconds, got "
                             f"{self.cpu_attention_build_timeout}")
        if self.decode_blas is not None:
            parse_blas_setting(self.decode_blas)  # ValueError naming the variable

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields) -> "RuntimeConfig":
        """The switches of ``fields`` (the flags), the rest from the environment (read here
        only). Raises ValueError on a malformed value, or on a variable no longer read."""
        env = os.environ if environ is None else environ
        if REMOVED_GRAPHS_ENV in env:
            raise ValueError(f"{REMOVED_GRAPHS_ENV} is no longer read: CUDA graphs are on wherever they can "
                             "be captured (--enforce-eager turns them off); running the graph path without "
                             "capture is a test setting (EngineArgs.graphs_without_capture). Unset it.")
        found: dict = {}
        if env.get(KERNELS_ENV):
            found["kernels"] = env[KERNELS_ENV]
        if MIXED_GRAPHS_ENV in env:
            found["mixed_graph_sizes"] = parse_mixed_graph_sizes(env[MIXED_GRAPHS_ENV])
        if OVERLAP_MIXED_ENV in env:
            found["overlap_mixed_steps"] = env[OVERLAP_MIXED_ENV] == "1"
        if (env.get(BLAS_ENV) or "").strip():
            found["decode_blas"] = env[BLAS_ENV].strip()
        if DENSE_PREFILL_ENV in env:
            found["dense_prefill"] = env[DENSE_PREFILL_ENV] != "0"
        if env.get(CPU_BUILD_TIMEOUT_ENV):
            try:
                found["cpu_attention_build_timeout"] = float(env[CPU_BUILD_TIMEOUT_ENV])
            except ValueError:
                raise ValueError(f"{CPU_BUILD_TIMEOUT_ENV} must be a number of seconds, got "
                                 f"{env[CPU_BUILD_TIMEOUT_ENV]!r}") from None
        return cls(**{**found, **fields})

    def replace(self, **changes) -> "RuntimeConfig":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """Every resolved switch, for the engine's config line."""
        mixed = "default" if self.mixed_graph_sizes is None else ",".join(map(str, self.mixed_graph_sizes)) or "0"
        overlap = "default" if self.overlap_mixed_steps is None else self.overlap_mixed_steps
        text = (f"enforce_eager={self.enforce_eager} async_scheduling={self.async_scheduling} "
                f"kernels={self.kernels} mixed_graphs={mixed} overlap_mixed_steps={overlap} "
                f"decode_blas={self.decode_blas or 'default'} dense_prefill={self.dense_prefill}")
        if self.cpu_attention_build_timeout is not None:
            text += f" cpu_attention_build_timeout={self.cpu_attention_build_timeout:g}"
        if self.graphs_without_capture:
            text += " graphs_without_capture=True (tests)"
        return text


def log_level(environ: Mapping[str, str] | None = None) -> str:
    """A server process's log level: ``PDSERVE_LOG_LEVEL`` (default INFO)."""
    return (os.environ if environ is None else environ).get(LOG_LEVEL_ENV, "INFO").upper()


def kv_corruption_test_hook(environ: Mapping[str, str] | None = None) -> int:
    """TESTS ONLY. ``PDSERVE_TEST_CORRUPT_KV_EVERY=N``: a receiving process corrupts one block
    the KV transfer canary samples in every N-th transfer it receives, after it landed, so
    that tests can see a checksum mismatch end to end (kv_transfer/canary.py). 0 (unset): off."""
    text = (os.environ if environ is None else environ).get(TEST_CORRUPT_KV_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"{TEST_CORRUPT_KV_ENV} (a test hook) must be a count of transfers, got {text!r}")
    return int(text)


def parse_mixed_graph_sizes(text: str) -> tuple[int, ...]:
    """``PDSERVE_MIXED_GRAPHS``: token counts separated by commas, ascending, or "0"/"" for none."""
    text = text.strip()
    if text in ("", "0"):
        return ()
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{MIXED_GRAPHS_ENV} must be token counts separated by commas, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{MIXED_GRAPHS_ENV} must be positive token counts, got {text!r}")
    return tuple(sizes)


def parse_blas_setting(text: str | None) -> str | list[tuple[int, str]] | None:
    """The setting: None (off), "auto", a library name, or a table [(max rows, library)]
    ascending by rows. Raises ValueError on anything else."""
    text = (text or "").strip().lower()
    if not text:
        return None
    if text == "auto" or text in BLAS_LIBRARIES:
        return text
    table = []
    for part in text.split(","):
        rows, sep, lib = part.partition(":")
        if not sep or not rows.strip().isdigit() or lib.strip() not in BLAS_LIBRARIES:
            raise ValueError(f"{BLAS_ENV}={text!r}: expected auto, one of {', '.join(BLAS_LIBRARIES)}, "
                             f"or rows:library pairs such as 8:cublaslt,256:cublas")
        table.append((int(rows), lib.strip()))
    return sorted(table)
