"""Which CUDA graphs a runner builds: whether any, the decode sizes and their attention split
variants, the verify graphs' shape, and the mixed-step token buckets. Decided once, when the
runner is built, from the runtime config (engine/runtime_config.py) and the model; which
graph a given step replays is the step planner's (engine/planner.py)."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.cuda_graphs import DecodeGraphs, DecodeInputs, MixedInputs, capture_sizes
from engine.kv_cache_manager import cdiv
from engine.runtime_config import DEFAULT_MIXED_GRAPHS, MIXED_GRAPHS_ENV

if TYPE_CHECKING:
    from engine.runner_parts import RunnerParts

logger = logging.getLogger(__name__)

_MAX_VERIFY_GRAPH_SIZE = 64  # past it a verify step is compute-bound and speculation stops paying
_SHORT_CONTEXT = 4096  # decode graphs: a second split count for batches whose contexts all fit this


def graphs_wanted(runner: RunnerParts) -> bool:
    """Whether this runner captures CUDA graphs: on CUDA with the Triton kernels, unless
    --enforce-eager or the prefill tier (the reason is logged)."""
    if runner.device.type != "cuda":
        return False
    if runner.runtime.enforce_eager:
        logger.info("CUDA graphs off (--enforce-eager)")
        return False
    if runner.config.prefill_only:
        logger.info("CUDA graphs off: a prefill server's steps hold their KV for a send and replay none")
        return False
    if runner.ops.__name__ != "kernels":
        logger.info("CUDA graphs off: the reference kernels synchronise with the host")
        return False
    return True


def mixed_graph_sizes(runner: RunnerParts) -> list[int]:
    """The token buckets of ``RuntimeConfig.mixed_graph_sizes`` that a step can fill (at most
    ``max_num_batched_tokens``); unset, ``DEFAULT_MIXED_GRAPHS`` where decode graphs are
    captured (those below a smaller budget, and the budget); none under tensor parallelism
    or LoRA."""
    sizes = runner.runtime.mixed_graph_sizes
    budget = runner.config.scheduler.max_num_batched_tokens
    if sizes is None:
        if not runner.use_cuda_graphs or runner.tp is not None or runner.lora is not None:
            return []
        if budget >= DEFAULT_MIXED_GRAPHS[-1]:
            return list(DEFAULT_MIXED_GRAPHS)
        return [n for n in DEFAULT_MIXED_GRAPHS if n < budget] + [budget]
    if not sizes:
        return []
    if runner.tp is not None or runner.lora is not None:
        logger.warning("%s ignored: not with tensor parallelism or LoRA", MIXED_GRAPHS_ENV)
        return []
    return [n for n in sizes if n <= budget] or [budget]


def verify_graph_shape(runner: RunnerParts) -> tuple[int, list[int]]:
    """Speculative decoding: the tokens of a verify row (k + 1) and the batch sizes that get
    verify graphs (up to _MAX_VERIFY_GRAPH_SIZE); (1, []) without speculation or with
    tensor parallelism."""
    spec = runner.config.speculative
    if spec is None or runner.tp is not None:
        return 1, []
    sizes = capture_sizes(runner.config.scheduler.max_num_seqs)
    return 1 + spec.num_speculative_tokens, [b for b in sizes if b <= _MAX_VERIFY_GRAPH_SIZE]


def build_decode_graphs(runner: RunnerParts, use_graphs: bool) -> DecodeGraphs:
    """The graphs over the runner's model and KV cache, not yet captured. ``use_graphs=False``
    runs the same buffers eagerly (for tests, also on CPU)."""
    mc, sc = runner.config.model, runner.config.scheduler
    sizes = capture_sizes(sc.max_num_seqs)
    max_blocks = cdiv(sc.max_model_len, runner.block_size)
    verify_len, verify_sizes = verify_graph_shape(runner)
    spec = runner.cache_spec
    scratch = spec.num_state_slots if spec.num_state_slots else None  # the slot padding rows write
    inputs = DecodeInputs(sc.max_num_seqs, max_blocks, spec.block_sizes, runner.device, verify_len, scratch)
    variants: dict[int, list[tuple[int, int | None]]] = {}
    if runner.ops.__name__ == "kernels":
        from kernels.paged_attention import paged_attention_num_splits

        longest = max_blocks * runner.block_size
        short = min(_SHORT_CONTEXT, longest)
        heads = runner.model.shard.num_local_heads  # what this rank's attention runs
        for b in sizes:
            s_short, s_long = (paged_attention_num_splits(b, b, heads, runner.kv_heads, mc.head_dim, ctx,
                                                          runner.device) for ctx in (short, longest))
            variants[b] = [(longest, s_long)] if s_short == s_long else [(short, s_short), (longest, s_long)]
    mixed_sizes = mixed_graph_sizes(runner)
    mixed = None
    if mixed_sizes:
        mixed = (runner.forward_rows_logits,
                 MixedInputs(sc.max_num_seqs, max_blocks, spec.block_sizes, runner.device, max(mixed_sizes), scratch))
    return DecodeGraphs(runner.forward_logits, runner.kv_cache, inputs, sizes, variants, use_graphs=use_graphs,
                        other_threads_may_use_cuda=runner.tp is not None, verify_sizes=verify_sizes,
                        mixed=mixed, mixed_sizes=mixed_sizes, decode_blas=runner.runtime.decode_blas)
