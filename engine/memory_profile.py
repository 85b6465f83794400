"""How many KV blocks a runner gets: the memory profile.

On CUDA the engine's share of the GPU (``--gpu-memory-utilization`` of its memory) holds the
weights, the activation peak of a full-budget step, the CUDA graphs and the KV cache; the
cache gets what the others leave:

    KV budget = total * utilization - (weights + activation peak of a prefill of
                max_num_batched_tokens) - graphs (their activation pool, logits, buffers)

On CPU, without ``--kv-cache-memory``, the cache is sized for the model's context and a few
sequences, not for the machine: blocks for ``max(--max-model-len, CPU_KV_TOKENS)`` tokens in
every group, at most ``CPU_KV_MAX_BYTES`` (``cpu_default_blocks``). A CPU cache is resident as
it is written, and the prefix cache hands out blocks not used lately first: a server's memory
grows to the whole cache over its requests, so its size is what a laptop user pays.

``--kv-cache-memory`` or ``--num-gpu-blocks-override`` set it instead.
The forward passes measured here run on dummy inputs (``engine.cache_spec.dummy_metadata``) over a scratch
cache, never on the real one.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from engine.graph_setup import mixed_graph_sizes, verify_graph_shape
from engine.kv_cache_manager import cdiv

if TYPE_CHECKING:
    from engine.runner_parts import RunnerParts

logger = logging.getLogger(__name__)

CPU_KV_TOKENS = 8192  # the CPU default's least context: one long sequence, or a few chats
CPU_KV_MAX_BYTES = 2 ** 30


def check_free_memory(free: int, total: int, utilization: float, device: str) -> None:
    """The engine's share of a GPU, ``utilization`` of its memory (weights, activations, graphs
    and KV cache, sized on that share), must be free when it starts (``free``: free on the
    device plus what this process's allocator holds), as in vLLM: memory other processes hold
    is not this engine's to plan with. Raises ValueError naming both figures."""
    wanted = total * utilization
    if free < wanted:
        gib = 2 ** 30
        raise ValueError(f"{device}: {free / gib:.1f} GiB free of {total / gib:.1f} GiB at start-up, less than the "
                         f"{wanted / gib:.1f} GiB --gpu-memory-utilization {utilization:g} asks for (other processes "
                         f"hold {(total - free) / gib:.1f} GiB): lower it, or free the GPU")


def _scratch_cache(runner: RunnerParts, num_blocks: int) -> torch.Tensor:
    return runner.cache_spec.new_kv_cache(num_blocks, runner.device)


def determine_num_blocks(runner: RunnerParts, with_graphs: bool) -> int:
    """The KV blocks this runner's cache holds (see the module's docstring)."""
    cc = runner.config.cache
    if cc.num_gpu_blocks_override is not None:
        return cc.num_gpu_blocks_override
    state_bytes = runner.cache_spec.state_bytes  # allocated already: the CUDA profile's peak counts them
    if cc.kv_cache_memory is None and runner.device.type == "cpu":
        return cpu_default_blocks(runner)
    if cc.kv_cache_memory is not None:
        budget = cc.kv_cache_memory - state_bytes  # the flag's bytes hold the blocks and the state slots
    else:  # CUDA: total * utilization - (weights + activation peak of a full-budget step) - graphs
        peak = profile_peak_memory(runner)
        graphs = graph_memory_estimate(runner) if with_graphs else 0
        total = torch.cuda.get_device_properties(runner.device).total_memory
        budget = int(total * cc.gpu_memory_utilization) - peak - graphs
        logger.info("memory profile: peak %.2f GiB (weights + activations), CUDA graphs %.2f GiB, "
                    "KV budget %.2f GiB", peak / 2**30, graphs / 2**30, budget / 2**30)
    if state_bytes:
        logger.info("linear-attention state: %d slots, %.1f MiB", runner.cache_spec.num_state_slots,
                    state_bytes / 2**20)
    num_blocks = budget // (runner.block_bytes + runner.extra_block_bytes)
    if num_blocks < 1:
        raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, one block needs "
                         f"{runner.block_bytes}); raise --gpu-memory-utilization or --kv-cache-memory")
    return int(num_blocks)


def cpu_default_blocks(runner: RunnerParts) -> int:
    """The CPU default: the blocks one sequence of ``max(max_model_len, CPU_KV_TOKENS)`` tokens
    holds in every group (a windowed group its window's), within ``CPU_KV_MAX_BYTES`` with the
    linear-attention state slots."""
    tokens = max(runner.config.scheduler.max_model_len, CPU_KV_TOKENS)
    blocks = sum(g.blocks_needed(tokens if g.sliding_window is None else min(tokens, g.sliding_window + g.block_size))
                 for g in runner.layout.groups)
    per_block = runner.block_bytes + runner.extra_block_bytes
    fit = (CPU_KV_MAX_BYTES - runner.cache_spec.state_bytes) // per_block
    num_blocks = max(1, min(blocks, fit))
    logger.info("KV cache on CPU: %d blocks (%.0f MiB) for %d tokens of context (--kv-cache-memory sets "
                "another size)", num_blocks, num_blocks * per_block / 2**20, tokens)
    return int(num_blocks)


@torch.inference_mode()
def profile_peak_memory(runner: RunnerParts) -> int:
    """Bytes allocated at the peak of a prefill of ``max_num_batched_tokens`` tokens (weights
    included, the scratch cache not), with the logits of ``max_num_seqs`` rows."""
    sc, dev = runner.config.scheduler, runner.device
    n = min(sc.max_num_batched_tokens, sc.max_model_len)
    cache = _scratch_cache(runner, cdiv(n, runner.block_size))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    meta = runner.cache_spec.dummy_metadata([n], dev, written=True)
    hidden = runner.model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), cache, meta)
    runner.model.compute_logits(hidden[-min(n, sc.max_num_seqs):])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - cache.numel() * cache.element_size()
    del cache, hidden
    torch.cuda.empty_cache()
    return peak


@torch.inference_mode()
def graph_memory_estimate(runner: RunnerParts) -> int:
    """Bytes the CUDA graphs will hold: the activation peak of an eager pass (their private
    pool), the shared logits output, the persistent input buffers, and a margin. The pass is
    a decode step of ``max_num_seqs`` rows, or with mixed-step graphs (the pool is shared)
    their largest bucket's tokens if more, with the logits of ``max_num_seqs`` rows as those
    graphs compute them."""
    mc, sc = runner.config.model, runner.config.scheduler
    mixed = mixed_graph_sizes(runner)
    m = sc.max_num_seqs
    activations = activation_peak(runner, max(m, max(mixed)), m) if mixed else activation_peak(runner, m, None)
    max_blocks = cdiv(sc.max_model_len, runner.block_size)
    buffers = 2 * m * max_blocks * 4 + 3 * m * 8
    if mixed:  # MixedInputs: its tables; ids, positions, slots; query starts, lengths, rows
        buffers += m * max_blocks * 4 + 3 * max(mixed) * 8 + 3 * m * 8
    verify_len, verify_sizes = verify_graph_shape(runner)
    logits_rows = max(m, max(verify_sizes, default=0) * verify_len)
    return int(1.25 * activations) + logits_rows * mc.vocab_size * 4 + buffers + 64 * 2**20


def activation_peak(runner: RunnerParts, num_tokens: int, logits_rows: int | None) -> int:
    """Bytes an eager forward pass of ``num_tokens`` one-token sequences allocates at its
    peak, with the logits of every row (None) or of the first ``logits_rows``."""
    dev = runner.device
    cache = _scratch_cache(runner, 1)
    meta = runner.cache_spec.dummy_metadata([1] * num_tokens, dev, written=False)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    rows = None if logits_rows is None else torch.arange(logits_rows, device=dev)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    if rows is None:
        runner.forward_logits(ids, ids, cache, meta)
    else:
        runner.forward_rows_logits(ids, ids, cache, meta, rows)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - base
    del cache
    torch.cuda.empty_cache()
    return peak
