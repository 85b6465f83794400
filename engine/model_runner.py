"""The model runner owns the device: the model's weights, the KV cache
tensor and the per-step input tensors. It turns a ``SchedulerOutput`` into
one forward pass and samples the rows that reached the end of their tokens.

KV cache layout: ``[num_layers, num_blocks, 2, block_size, num_kv_heads,
head_dim]`` — for each layer a run of consecutive blocks is one contiguous
chunk holding both K and V (what the KV transfer sends). Its dtype is the
model's, or float8_e4m3fn with ``--kv-cache-dtype fp8`` (one byte an element:
twice the blocks of a 16-bit cache in the same memory), each layer then
quantizing with its ``kv_scales`` (engine/kv_cache_dtype.py).

Kernels: the Triton launchers of ``kernels`` on CUDA, their PyTorch
references (``kernels.reference``) elsewhere; ``RuntimeConfig.kernels``
(engine/runtime_config.py, ``PDSERVE_KERNELS``) overrides that choice:

    auto       (default) triton on CUDA, reference elsewhere
    triton     the Triton kernels; on CPU only under Triton's interpreter
               (TRITON_INTERPRET=1 set before anything imports kernels/):
               far too slow to serve, it lets CPU tests run the kernels
               inside a real forward pass
    reference  the PyTorch references, also on CUDA

CUDA graphs (``engine/cuda_graphs.py``): on CUDA with the Triton kernels, the
runner captures decode graphs (one per padded batch size, verify graphs
with speculation) and mixed-step graphs (one per token bucket: by default
256, 512, 1,024 and 2,048 tokens within ``max_num_batched_tokens``; not with
tensor parallelism or LoRA). The graphs' memory is taken from the KV cache's
budget: a decode pass of ``max_num_seqs`` rows is profiled with the prefill
pass. CPU, the references, the prefill tier and ``--enforce-eager`` capture
none. ``RuntimeConfig.graphs_without_capture`` (tests) builds the graph
buffers without capturing: steps take the graph path (persistent buffers,
padding, and under tensor parallelism the inputs rank 0 shares with the
other ranks) and run it eagerly, on any device.

Which path a step takes (eager, a decode, verify or mixed-step graph;
queued ahead or read at once) is decided by ``engine.planner.plan_step``
from ``step_runtime()`` (what this runner holds); ``run`` carries the plan
out. Measured on an H200 (docs/benchmarks.md, "Colocated goodput"): an eager
step of the 8B shape with 32 decode rows and a 480-token chunk costs ~31 ms
of host time for ~17 ms of GPU work under its graph, and colocated goodput
at 12 req/s of 2,048-token prompts went from 6.5 req/s (graphs, one at a
time) to 11.0 (graphs, overlapped).

Under tensor parallelism every rank captures the same graphs, in the same
order (their all-reduces and the logits' all-gather are inside them). For a
graph step rank 0 broadcasts which graph and its input buffers; every rank
then places the block tables and replays.

Fault injection, for tests only: ``arm_forward_fault(N)`` (an engine server's
hidden ``--inject-forward-fault N`` flag, which ``pdserve up`` never passes)
makes the runners built afterwards in this process run the forward pass N
times, then raise ``InjectedFault`` from every later ``execute``, as a device
error would. Tests use it to kill a real server's engine loop. Nothing in the
environment turns it on: an inherited variable cannot crash a cluster.
"""
from __future__ import annotations

import json
import logging
import os
from types import ModuleType
from typing import Callable, Sequence

import numpy as np
import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, DecodeInputs, GraphStep, MixedInputs, capture_sizes
from engine.kv_cache_dtype import KVScales, load_kv_scales
from engine.kv_cache_manager import cdiv
from engine.model_loader import load_model
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.linear import LinearBase
from engine.lora.config import LoRAConfig, LoRAInfo
from engine.lora.manager import LoRAManager
from engine.parallel import TPGroup
from engine.sampler import PendingSample, Sampler, SamplerOutput, SamplingRow, to_device, verify_async
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.runtime_config import DEFAULT_MIXED_GRAPHS, KERNEL_CHOICES, KERNELS_ENV, MIXED_GRAPHS_ENV
from engine.step_inputs import step_arrays
from engine.step_plan import GraphMenu, StepPath, StepPlan, StepRuntime

logger = logging.getLogger(__name__)


_MAX_VERIFY_GRAPH_SIZE = 64
_SHORT_CONTEXT = 4096  # decode graphs: a second split count for batches whose contexts all fit this
_armed_forward_fault: int | None = None  # arm_forward_fault(); None = off


def select_ops(device: torch.device, choice: str = "auto") -> ModuleType:
    """The kernel module for ``device``: ``kernels`` (Triton) or
    ``kernels.reference``, by ``choice`` (``RuntimeConfig.kernels``)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    use_triton = device.type == "cuda" if choice == "auto" else choice == "triton"
    if not use_triton:
        from kernels import reference

        return reference
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{KERNELS_ENV}=triton on {device} needs Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before the process imports kernels/ (slow; meant for tests)")
    import kernels

    return kernels


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


class InjectedFault(RuntimeError):
    """The failure ``arm_forward_fault`` asks for."""


def arm_forward_fault(after: int | None) -> None:
    """Tests only: runners built from now on in this process fail every forward pass after
    the first ``after`` (None: disarm)."""
    global _armed_forward_fault
    if after is not None and after < 0:
        raise ValueError(f"a forward fault comes after a number of passes >= 0, got {after}")
    _armed_forward_fault = after


def _forward_fault_budget() -> int | None:
    if _armed_forward_fault is not None:
        logger.warning("fault injection armed: the forward pass will fail after %d step(s)", _armed_forward_fault)
    return _armed_forward_fault


# tensor parallel: what rank 0 broadcasts to the other ranks (each step; _LORA_SLOT when it fills a slot)
_STOP, _STEP, _GRAPH, _LORA_SLOT = 0, 1, 2, 3


class LaunchedStep:
    """A step queued on the device, not waited for: its sampled ids stay on the device
    (the inputs of a step scheduled ahead) while a copy goes to the host. ``which``: the
    rows of ``out.scheduled`` that sample, in order (every row of a decode step; none of
    a step of chunks that all stop short of their prompt's end, ``sample`` then None).
    ``done``: the outcome of a step read before ``run`` returned (rows with proposals)."""

    def __init__(self, out: SchedulerOutput, sample: PendingSample | None, which: Sequence[int],
                 done: tuple[list, list | None] | None = None) -> None:
        self.out, self.sample, self.which, self._done = out, sample, list(which), done

    @property
    def token_ids(self) -> torch.Tensor:
        """[len(which)] int64 on the device, aligned with ``which``."""
        assert self.sample is not None
        return self.sample.token_ids

    def result(self) -> tuple[list[int | None], list | None]:
        """(sampled, logprobs), aligned with ``out.scheduled``: the sampled token (None for a
        chunk that does not reach the end of its tokens; a speculating row's accepted tokens,
        as a list) and, when any row asked for them, logprobs. Waits for the step."""
        if self._done is not None:
            return self._done
        n = len(self.out.scheduled)
        if self.sample is None:
            return [None] * n, None
        return _per_row(self.sample.result(), self.which, n)


def _per_row(res: SamplerOutput, which: Sequence[int], n: int) -> tuple[list[int | None], list | None]:
    """The sampler's output for rows ``which`` of a step of ``n`` rows, aligned with the step:
    each row's token (None where it did not sample), and logprobs (None when no row asked)."""
    sampled: list[int | None] = [None] * n
    for j, i in enumerate(which):
        sampled[i] = res.token_ids[j]
    if all(lp is None for lp in res.logprobs):
        return sampled, None
    logprobs: list = [None] * n
    for j, i in enumerate(which):
        logprobs[i] = res.logprobs[j]
    return sampled, logprobs


def _sampling_row(s: ScheduledRequest) -> SamplingRow:
    r = s.request
    return SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids, s.lookahead,
                       s.bitmask)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, extra_block_bytes: int = 0) -> None:
        """``extra_block_bytes``: what each KV block costs beside this cache's own (a draft
        model's block for each of ours), counted when the number of blocks is chosen."""
        self.extra_block_bytes = extra_block_bytes
        self._forwards_before_fault = _forward_fault_budget()
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            cc = config.cache
            if cc.kv_cache_memory is None and cc.num_gpu_blocks_override is None:
                free, total = torch.cuda.mem_get_info(self.device)
                # What this process's allocator holds is ours to reuse (an earlier engine here).
                free += torch.cuda.memory_reserved(self.device)
                check_free_memory(free, total, cc.gpu_memory_utilization, str(self.device))
        self.runtime = config.runtime
        self.ops = select_ops(self.device, self.runtime.kernels)
        logger.info("kernels: %s", self.ops.__name__)
        mc, cc = config.model, config.cache
        self.block_size = cc.block_size
        self.tp = tp
        self.model = load_model(mc, self.device, self.ops, tp, expert_parallel=config.enable_expert_parallel)
        self.kv_heads = self.model.shard.num_local_kv_heads  # this rank's share of every block
        self.kv_dtype: torch.dtype = getattr(torch, config.kv_dtype)
        self.kv_scales: KVScales | None = self._set_kv_scales()  # None unless the cache is FP8
        for layer in self.model.modules():  # PDSERVE_DENSE_PREFILL=0: fresh prompts on the paged kernel
            if isinstance(layer, Attention):
                layer.dense_prefill = self.runtime.dense_prefill
        self._configure_moe()
        self.lora: LoRAManager | None = None  # --enable-lora: the adapters' slots beside every linear layer
        if config.lora is not None:
            self.lora = self._make_lora(config.lora)
        graphs_eager = self.runtime.graphs_without_capture
        if graphs_eager:
            logger.warning("graphs_without_capture: CUDA graphs are off; steps run the graph path eagerly "
                           "(a test setting)")
        self.use_cuda_graphs = not graphs_eager and self._graphs_wanted()
        self.graph_sizes = capture_sizes(config.scheduler.max_num_seqs) if self.use_cuda_graphs else []
        self.num_blocks = self._determine_num_blocks()
        if tp is not None:  # every rank holds the same blocks: the smallest cache decides
            self.num_blocks = tp.all_min(self.num_blocks)
        self.kv_cache = torch.zeros(mc.num_layers, self.num_blocks, 2, cc.block_size, self.kv_heads,
                                    mc.head_dim, dtype=self.kv_dtype, device=self.device)
        self.sampler = Sampler()
        self._warm_up_kernels()
        self.graphs: DecodeGraphs | None = None
        if self.use_cuda_graphs or graphs_eager:
            self.graphs = self.build_decode_graphs(use_graphs=self.use_cuda_graphs)
        if self.use_cuda_graphs:
            assert self.graphs is not None
            self.graphs.capture()
        self.graph_menu: GraphMenu | None = self.graphs.menu if self.graphs is not None else None
        overlap = self.runtime.overlap_mixed_steps  # default: where mixed-step graphs hold such steps
        self.overlap_mixed = overlap if overlap is not None else bool(self.graphs and self.graphs.mixed_sizes)
        if self.overlap_mixed:
            logger.info("steps with prefill chunks overlap too (PDSERVE_OVERLAP_MIXED_STEPS=0 runs them one at a "
                        "time)")
        if self.device.type == "cuda" and self.ops.__name__ == "kernels":
            from kernels import compiles

            compiles.watch(logger)  # from here on, a compile is a stall worth a log line

    @torch.inference_mode()
    def _warm_up_kernels(self) -> None:
        """Compile, before serving, the kernel variants an eager step can meet (Triton compiles
        a variant the first time a launch needs it, stalling that step ~1 s): one mixed step (a
        3-token prefill chunk beside a decode row; slot -1 writes nowhere, block 0 is read),
        and every split variant of paged attention. Decode graphs compile theirs at capture.

        On CPU, the compiled CPU attention the attention layers call is built or loaded here
        (well under a second when built, about a minute to build): done lazily, inside the
        first step, it held that step, and every abort and deadline queued behind it, for as
        long as the build took."""
        if self.device.type == "cpu" and self.ops.__name__ == "kernels.reference":
            from kernels import cpu_attention

            cpu_attention.extension(self.runtime.cpu_attention_build_timeout)  # None where it cannot build
            return
        if self.device.type != "cuda" or self.ops.__name__ != "kernels":
            return
        mc, dev = self.config.model, self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((4,), -1, dtype=torch.long, device=dev),
            block_tables=torch.zeros(2, 1, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([3, 1], dtype=torch.int32, device=dev))
        ids = torch.zeros(4, dtype=torch.long, device=dev)
        hidden = self.model(ids, torch.tensor([0, 1, 2, 0], device=dev), self.kv_cache, meta)
        self.model.compute_logits(hidden[[2, 3]])
        from kernels.paged_attention import warm_up

        shard = self.model.shard
        for window in sorted(set(mc.layer_windows), key=lambda w: w or 0):
            warm_up(mc.torch_dtype, shard.num_local_heads, shard.num_local_kv_heads, mc.head_dim, self.block_size,
                    dev, sliding_window=window, kv_dtype=self.kv_dtype)
        warmed = set()  # quantized linear layers: one warm-up per kernel variant set
        for layer in self.model.modules():
            key = layer.method.warm_up_key(layer) if isinstance(layer, LinearBase) else None
            if key is not None and key not in warmed:
                warmed.add(key)
                layer.method.warm_up(layer, self.config.scheduler.max_num_batched_tokens, mc.torch_dtype)
        if self.lora is not None:  # the adapters' shrink and expand, once per layer shape
            from kernels.lora import warm_up as lora_warm_up

            shapes = set()
            for lora in self.lora.layers.values():
                key = (tuple(lora.a.shape), tuple(lora.b.shape), lora.part_offsets)
                if key not in shapes:
                    shapes.add(key)
                    lora_warm_up(lora.a, lora.b, lora.part_offsets, self.config.scheduler.max_num_batched_tokens)
        moe = self.model.moe_layers()
        if moe:  # every MoE layer has the same shape and config: one warm-up serves all
            moe[0].method.warm_up(moe[0], self.config.scheduler.max_num_batched_tokens, mc.torch_dtype)
        torch.cuda.synchronize(dev)

    def _make_lora(self, lc: LoRAConfig) -> LoRAManager:
        """The adapter slots (device memory taken before the KV cache is sized) and the
        adapters of --lora-modules, read and checked now."""
        mc = self.config.model
        sc = self.config.scheduler
        spec = self.config.speculative
        rows = sc.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))  # verify graphs
        lora = LoRAManager(self.model, lc.max_loras, lc.max_lora_rank, lc.cpu_loras,
                           max(sc.max_num_batched_tokens, rows), self.device, mc.torch_dtype, self.ops)
        if self.tp is not None and self.tp.rank == 0:
            lora.on_slot_filled = self._share_lora_slot
        if self.tp is None or self.tp.rank == 0:  # the other ranks follow rank 0's slots
            for name, path in lc.modules:
                lora.register(name, path)
        return lora

    def _set_kv_scales(self) -> KVScales | None:
        """An FP8 cache: each attention layer's k_scale and v_scale, the checkpoint's or 1.0,
        said once in the log (by rank 0). Other caches keep the layers' 1.0."""
        mc, cc = self.config.model, self.config.cache
        if cc.cache_dtype == "auto":
            return None
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if len(layers) != mc.num_layers:
            raise ValueError(f"--kv-cache-dtype {cc.cache_dtype}: found {len(layers)} attention layers in a "
                             f"model of {mc.num_layers}")
        scales = load_kv_scales(mc.path, mc.hf_config, mc.num_layers, mc.load_format)
        for layer, k, v in zip(layers, scales.k, scales.v):
            layer.k_scale, layer.v_scale = k, v
        if self.tp is None or self.tp.rank == 0:
            logger.info("KV cache dtype %s (%s): %s", cc.cache_dtype, self.config.kv_dtype, scales.describe())
        return scales

    def _configure_moe(self) -> None:
        """The fused-MoE kernel's tile configs for this model's expert shape on this GPU: tuned
        the first time (minutes at most), then read from the cache (engine/moe_configs.py)."""
        moe = self.model.moe_layers()
        if not moe or self.device.type != "cuda" or self.ops.__name__ != "kernels":
            return
        from engine.moe_configs import moe_kernel_config

        m = moe[0]
        w13 = m.experts.gate_up_proj  # [E_local, 2 * I_local, H]
        config = moe_kernel_config(w13.shape[0], w13.shape[2], w13.shape[1] // 2, m.top_k, w13.dtype, self.device,
                                   block_size=m.method.block_size)
        for layer in moe:
            layer.kernel_config = config
        torch.cuda.empty_cache()

    def _graphs_wanted(self) -> bool:
        if self.device.type != "cuda":
            return False
        if self.config.enforce_eager:
            logger.info("CUDA graphs off (--enforce-eager)")
            return False
        if self.config.prefill_only:
            logger.info("CUDA graphs off: a prefill server's steps hold their KV for a send and replay none")
            return False
        if self.ops.__name__ != "kernels":
            logger.info("CUDA graphs off: the reference kernels synchronise with the host")
            return False
        return True

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        if self.lora is None:
            return self.model.compute_logits(self.model(input_ids, positions, kv_cache, meta))
        self.lora.batch.begin(input_ids.shape[0])  # a decode graph: its rows' slots are in the buffer
        try:
            return self.model.compute_logits(self.model(input_ids, positions, kv_cache, meta))
        finally:
            self.lora.batch.active = False  # eager steps set their own

    def build_decode_graphs(self, use_graphs: bool) -> DecodeGraphs:
        """The decode-graph runner over this runner's model and KV cache, not
        yet captured. ``use_graphs=False`` runs the same buffers eagerly
        (for tests, also on CPU)."""
        mc, sc = self.config.model, self.config.scheduler
        sizes = self.graph_sizes or capture_sizes(sc.max_num_seqs)
        max_blocks = cdiv(sc.max_model_len, self.block_size)
        verify_len, verify_sizes = self._verify_graph_shape(sizes)
        inputs = DecodeInputs(sc.max_num_seqs, max_blocks, self.block_size, self.device, verify_len)
        variants: dict[int, list[tuple[int, int | None]]] = {}
        if self.ops.__name__ == "kernels":
            from kernels.paged_attention import paged_attention_num_splits

            longest = max_blocks * self.block_size
            short = min(_SHORT_CONTEXT, longest)
            heads = self.model.shard.num_local_heads  # what this rank's attention runs
            for b in sizes:
                s_short, s_long = (paged_attention_num_splits(b, b, heads, self.kv_heads, mc.head_dim,
                                                              ctx, self.device) for ctx in (short, longest))
                variants[b] = [(longest, s_long)] if s_short == s_long else [(short, s_short), (longest, s_long)]
        mixed_sizes = self._mixed_graph_sizes()
        mixed = None
        if mixed_sizes:
            mixed = (self._forward_rows_logits,
                     MixedInputs(sc.max_num_seqs, max_blocks, self.block_size, self.device, max(mixed_sizes)))
        return DecodeGraphs(self._forward_logits, self.kv_cache, inputs, sizes, variants, use_graphs=use_graphs,
                            other_threads_may_use_cuda=self.tp is not None, verify_sizes=verify_sizes,
                            mixed=mixed, mixed_sizes=mixed_sizes, decode_blas=self.runtime.decode_blas)

    def _mixed_graph_sizes(self) -> list[int]:
        """The token buckets of ``RuntimeConfig.mixed_graph_sizes`` that a step can fill (at
        most ``max_num_batched_tokens``); unset, ``DEFAULT_MIXED_GRAPHS`` where decode graphs
        are captured (those below a smaller budget, and the budget); none under tensor
        parallelism or LoRA."""
        sizes = self.runtime.mixed_graph_sizes
        budget = self.config.scheduler.max_num_batched_tokens
        if sizes is None:
            if not self.use_cuda_graphs or self.tp is not None or self.lora is not None:
                return []
            if budget >= DEFAULT_MIXED_GRAPHS[-1]:
                return list(DEFAULT_MIXED_GRAPHS)
            return [n for n in DEFAULT_MIXED_GRAPHS if n < budget] + [budget]
        if not sizes:
            return []
        if self.tp is not None or self.lora is not None:
            logger.warning("%s ignored: not with tensor parallelism or LoRA", MIXED_GRAPHS_ENV)
            return []
        return [n for n in sizes if n <= budget] or [budget]

    def _forward_rows_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                             meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, kv_cache, meta)[rows])

    def _verify_graph_shape(self, sizes: Sequence[int]) -> tuple[int, list[int]]:
        """Speculative decoding: the tokens of a verify row (k + 1) and the batch sizes that get
        verify graphs (up to _MAX_VERIFY_GRAPH_SIZE: past it a step is compute-bound and
        speculation stops paying); (1, []) without speculation or with tensor parallelism."""
        spec = self.config.speculative
        if spec is None or self.tp is not None:
            return 1, []
        return 1 + spec.num_speculative_tokens, [b for b in sizes if b <= _MAX_VERIFY_GRAPH_SIZE]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block on this rank (its share of the KV heads)."""
        mc = self.config.model
        return mc.kv_bytes_per_token(self.config.kv_dtype) * self.kv_heads // mc.num_kv_heads * self.block_size

    def _determine_num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        else:  # CUDA: total * utilization - (weights + activation peak of a full-budget step) - graphs
            peak = self._profile_peak_memory()
            graphs = self._graph_memory_estimate() if self.use_cuda_graphs else 0
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = int(total * cc.gpu_memory_utilization) - peak - graphs
            logger.info("memory profile: peak %.2f GiB (weights + activations), CUDA graphs %.2f GiB, "
                        "KV budget %.2f GiB", peak / 2**30, graphs / 2**30, budget / 2**30)
        num_blocks = budget // (self.block_bytes + self.extra_block_bytes)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget} bytes, one block needs "
                             f"{self.block_bytes}); raise --gpu-memory-utilization or --kv-cache-memory")
        return int(num_blocks)

    @torch.inference_mode()
    def _profile_peak_memory(self) -> int:
        mc, sc = self.config.model, self.config.scheduler
        n = min(sc.max_num_batched_tokens, sc.max_model_len)
        nb = -(-n // self.block_size)
        cache = torch.zeros(mc.num_layers, nb, 2, self.block_size, self.kv_heads, mc.head_dim,
                            dtype=self.kv_dtype, device=self.device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            block_tables=torch.arange(nb, dtype=torch.int32, device=self.device)[None],
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device))
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        hidden = self.model(ids, torch.arange(n, device=self.device), cache, meta)
        self.model.compute_logits(hidden[-min(n, sc.max_num_seqs):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - cache.numel() * cache.element_size()
        del cache, hidden
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def _graph_memory_estimate(self) -> int:
        """Bytes the decode graphs will hold: the activation peak of an eager
        pass (their private pool), the shared logits output, the persistent input
        buffers, and a margin. The pass is a decode step of ``max_num_seqs`` rows, or with
        mixed-step graphs (the pool is shared) their largest bucket's tokens if more, with
        the logits of ``max_num_seqs`` rows as those graphs compute them."""
        mc, sc = self.config.model, self.config.scheduler
        mixed = self._mixed_graph_sizes()
        m = sc.max_num_seqs
        activations = self._activation_peak(max(m, max(mixed)), m) if mixed else self._activation_peak(m, None)
        max_blocks = cdiv(sc.max_model_len, self.block_size)
        buffers = 2 * m * max_blocks * 4 + 3 * m * 8
        if mixed:  # MixedInputs: its tables; ids, positions, slots; query starts, lengths, rows
            buffers += m * max_blocks * 4 + 3 * max(mixed) * 8 + 3 * m * 8
        verify_len, verify_sizes = self._verify_graph_shape(capture_sizes(m))
        logits_rows = max(m, max(verify_sizes, default=0) * verify_len)
        return int(1.25 * activations) + logits_rows * mc.vocab_size * 4 + buffers + 64 * 2**20

    def _activation_peak(self, num_tokens: int, logits_rows: int | None) -> int:
        """Bytes an eager forward pass of ``num_tokens`` one-token sequences allocates at its
        peak, with the logits of every row (None) or of the first ``logits_rows``."""
        mc = self.config.model
        cache = torch.zeros(mc.num_layers, 1, 2, self.block_size, self.kv_heads, mc.head_dim,
                            dtype=self.kv_dtype, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(num_tokens, 1, dtype=torch.int32, device=self.device),
            query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(num_tokens, dtype=torch.int32, device=self.device))
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        rows = None if logits_rows is None else torch.arange(logits_rows, device=self.device)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        if rows is None:
            self._forward_logits(ids, ids, cache, meta)
        else:
            self._forward_rows_logits(ids, ids, cache, meta, rows)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del cache
        torch.cuda.empty_cache()
        return peak

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's flat inputs (``engine.step_inputs``) on the device."""
        a = step_arrays(out.scheduled, self.block_size)
        dev = self.device

        def to_dev(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            # Through pinned memory: from pageable memory the copy may wait for the stream, and
            # with steps overlapped the step before is still on it.
            return to_device(torch.from_numpy(x).to(dtype), dev)

        if self.lora is not None:
            self.lora.set_step([s.request.lora for s in out.scheduled], a.counts)
        meta = AttentionMetadata(slot_mapping=to_dev(a.slots, torch.long), block_tables=to_dev(a.tables, torch.int32),
                                 query_start_loc=to_dev(a.query_start_loc, torch.int32),
                                 seq_lens=to_dev(a.seq_lens, torch.int32))
        # The sampled positions as a device index: indexing the hidden states with a Python list
        # copies it to the device synchronously, making the host wait for the whole forward pass.
        rows = to_dev(np.asarray(a.sample_idx, dtype=np.int64), torch.long)
        return to_dev(a.ids, torch.long), to_dev(a.positions, torch.long), meta, rows

    # ---- tensor parallelism: rank 0 drives, the other ranks follow ------------
    def _broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        sample_idx: torch.Tensor) -> None:
        """Rank 0: the step's inputs to every other rank (a header, then one int64 payload)."""
        assert self.tp is not None
        b, w = meta.block_tables.shape
        header = torch.tensor([_STEP, input_ids.shape[0], b, w, sample_idx.shape[0]], dtype=torch.int64)
        self.tp.broadcast(to_device(header, self.device))
        parts = [input_ids, positions, meta.slot_mapping, meta.block_tables.flatten(), meta.query_start_loc,
                 meta.seq_lens, sample_idx]
        if self.lora is not None:  # each token's adapter slot (-1 throughout: none)
            batch = self.lora.batch
            parts.append(batch.token_slots[:input_ids.shape[0]] if batch.active
                         else torch.full_like(input_ids, -1))
        self.tp.broadcast(torch.cat([p.to(torch.int64) for p in parts]))

    def _share_graph_step(self, step: GraphStep) -> None:
        """Rank 0: which graph this step replays, then the inputs it uploaded (the other ranks
        place the block tables themselves). The header goes up from pinned memory: a pageable
        copy would wait for the step in flight."""
        assert self.tp is not None and self.graphs is not None
        size, splits, width = step.size, step.splits, step.width
        header = torch.tensor([_GRAPH, size, -1 if splits is None else splits, width, 0], dtype=torch.int64)
        self.tp.broadcast(to_device(header, self.device))
        self._broadcast_graph_inputs(size, width)

    def _share_lora_slot(self, slot: int, info: LoRAInfo) -> None:
        """Rank 0 filled ``slot`` with ``info``: every other rank does the same (before any step
        that reads it: broadcasts keep their order)."""
        data = json.dumps({"name": info.name, "path": info.path, "fingerprint": info.fingerprint}).encode()
        self.tp.broadcast(torch.tensor([_LORA_SLOT, slot, len(data), 0, 0], dtype=torch.int64, device=self.device))
        self.tp.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))

    def _receive_bytes(self, n: int) -> bytes:
        return bytes(self.tp.broadcast(torch.empty(n, dtype=torch.uint8, device=self.device)).cpu().tolist())

    def _replay_shared_graph_step(self, size: int, splits: int, width: int) -> None:
        """Ranks > 0: the inputs rank 0 shares into this rank's buffers, then the same graph."""
        assert self.graphs is not None
        self._broadcast_graph_inputs(size, width)  # (the adapter slots land in the buffer the graph reads)
        self.graphs.inputs.place_tables(size, width)
        self.graphs.replay(size, None if splits < 0 else splits)

    def _broadcast_graph_inputs(self, size: int, width: int) -> None:
        """Rank 0's uploaded decode-graph inputs into every rank's buffers (the same call on all)."""
        assert self.tp is not None and self.graphs is not None
        inputs = self.graphs.inputs
        self.tp.broadcast(inputs.i64)
        self.tp.broadcast(inputs.staged_i32(size, width))
        if self.lora is not None:  # the rows' adapter slots, which the graph reads
            self.tp.broadcast(self.lora.batch.token_slots[:size])

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Ranks > 0: run every step rank 0 broadcasts, until it says stop."""
        assert self.tp is not None and self.tp.rank > 0
        dev = self.device
        while True:
            header = self.tp.broadcast(torch.empty(5, dtype=torch.int64, device=dev))
            cmd, t, b, w, s = header.tolist()
            if cmd == _STOP:
                return
            if cmd == _GRAPH:
                self._replay_shared_graph_step(t, b, w)
                continue
            if cmd == _LORA_SLOT:  # rank 0 filled slot t: the same adapter into this rank's slot
                self.lora.follow_slot(t, self._receive_bytes(b))
                continue
            lora_t = t if self.lora is not None else 0
            payload = self.tp.broadcast(torch.empty(3 * t + b * w + 2 * b + 1 + s + lora_t, dtype=torch.int64,
                                                    device=dev))
            ids, pos, slots, tables, qsl, lens, idx, lora_slots = payload.split([t, t, t, b * w, b + 1, b, s, lora_t])
            meta = AttentionMetadata(slot_mapping=slots, block_tables=tables.view(b, w).to(torch.int32),
                                     query_start_loc=qsl.to(torch.int32), seq_lens=lens.to(torch.int32))
            if self.lora is not None:
                self.lora.batch.set_device(lora_slots.to(torch.int32))
            hidden = self.model(ids, pos, self.kv_cache, meta)
            if s:
                self.model.compute_logits(hidden[idx])  # takes part in the gather

    def bind_thread(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop; then, on every rank, drop the graphs and
        release the group (in that order: graphs hold work captured on the group's
        communicator, and a process whose communicator went first hung at exit)."""
        if self.tp is None:
            return
        if self.tp.rank == 0:
            try:
                self.tp.broadcast(torch.tensor([_STOP, 0, 0, 0, 0], dtype=torch.int64, device=self.device))
            except Exception as e:  # a rank already gone
                logger.info("tensor-parallel stop: %s", e)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the stop has left; no replay still runs
        self.graphs = None
        self.tp.close()

    def _count_forward(self) -> None:
        if self._forwards_before_fault is not None:
            if self._forwards_before_fault == 0:
                raise InjectedFault("forward pass failed on purpose (fault injection armed)")
            self._forwards_before_fault -= 1

    def step_runtime(self, overlap: bool = False) -> StepRuntime:
        """What the step planner reads of this runner: its graphs, and whether steps with prefill
        chunks overlap (``overlap``: whether the engine queues steps ahead at all)."""
        return StepRuntime(self.graph_menu, overlap, self.overlap_mixed)

    def _ahead_ids(self, out: SchedulerOutput, in_flight: LaunchedStep | None) -> torch.Tensor | None:
        """The inputs of the leading rows a step ahead (``Scheduler.schedule_ahead``): the ids
        ``in_flight`` sampled, still on the device; None when no row is ahead."""
        ahead = sum(1 for s in out.scheduled if s.lookahead)
        if not ahead:
            return None
        if (in_flight is None or len(in_flight.which) < ahead or any(s.lookahead for s in out.scheduled[ahead:])
                or any(a.request is not in_flight.out.scheduled[i].request
                       for a, i in zip(out.scheduled, in_flight.which[:ahead]))):
            raise ValueError("rows a step ahead must lead the batch, in the order of the step in flight")
        return in_flight.token_ids[:ahead]

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, plan: StepPlan, in_flight: LaunchedStep | None = None,
            before_sampling: Callable[[SchedulerOutput], None] | None = None,
            on_layer: Callable[[int], None] | None = None) -> LaunchedStep:
        """Carry out ``plan`` (``engine.planner.plan_step``'s) for step ``out``: the forward pass
        on its path, then its sampling, queued without waiting for the device (the sampled ids
        stay there for a step scheduled ahead; ``result()`` waits). ``in_flight``: the step whose
        sampled ids are the inputs of this one's leading rows (those scheduled ahead).
        ``before_sampling(out)`` runs on the host once the forward pass is queued, before the
        sampling that needs it (the constraints' bitmasks, computed while the device runs the
        forward). ``on_layer(i)``: called as each layer's work is queued (eager steps only).
        Rows with proposals are verified and read before this returns."""
        ahead_ids = self._ahead_ids(out, in_flight)
        self._count_forward()
        rows = out.scheduled
        which = [i for i, s in enumerate(rows) if s.samples]
        if plan.path is StepPath.DECODE_GRAPH:
            assert self.graphs is not None and plan.bucket is not None
            step = self.graphs.fill_decode(rows, plan.bucket, plan.splits, ahead_ids)
            if self.lora is not None:  # (before sharing the step: the other ranks follow its slot fills)
                self.lora.set_graph_step([s.request.lora for s in rows], step.size)
            if self.tp is not None:
                self._share_graph_step(step)
            logits = self.graphs.replay(step.size, step.splits)[:len(rows)]
        elif plan.path is StepPath.MIXED_GRAPH:
            assert self.graphs is not None and plan.bucket is not None
            self.graphs.fill_mixed(rows, plan.bucket, ahead_ids)
            logits = self.graphs.replay_mixed(plan.bucket)[:len(which)]
        elif plan.path is StepPath.VERIFY_GRAPH:
            assert self.graphs is not None and plan.bucket is not None
            step = self.graphs.fill_verify(rows, plan.bucket)
            if self.lora is not None:
                self.lora.set_graph_step([s.request.lora for s in rows], step.size, step.query_len)
            q = step.query_len
            logits = self.graphs.replay(step.size, None, q)
            logits = logits[[i * q + j for i in which for j in range(1 + len(rows[i].draft_token_ids))]]
        else:
            logits = self._forward_eager(out, ahead_ids, on_layer)
        if any(rows[i].draft_token_ids for i in which):
            if before_sampling is not None:
                before_sampling(out)
            return LaunchedStep(out, None, which, done=self._sample_with_proposals(out, which, logits))
        return self._queue_sampling(out, logits, which, before_sampling)

    def _queue_sampling(self, out: SchedulerOutput, logits: torch.Tensor | None, which: Sequence[int],
                        before_sampling: Callable[[SchedulerOutput], None] | None) -> LaunchedStep:
        """The sampling of rows ``which`` (their logits, in order) queued after a forward pass
        already queued; ``before_sampling`` first, where a row samples."""
        if not which:
            return LaunchedStep(out, None, which)
        if before_sampling is not None:
            before_sampling(out)
        return LaunchedStep(out, self.sampler.sample_async(logits, [_sampling_row(out.scheduled[i]) for i in which]),
                            which)

    def _forward_eager(self, out: SchedulerOutput, ahead_ids: torch.Tensor | None,
                       on_layer: Callable[[int], None] | None) -> torch.Tensor | None:
        """An eager forward pass of the step: the logits of its sampled positions, None when no
        row samples. ``ahead_ids``: the leading rows' inputs on the device (rows a step ahead
        are one token each, so token i is row i's)."""
        input_ids, positions, meta, sample_idx = self._prepare(out)
        if ahead_ids is not None:
            input_ids[:ahead_ids.shape[0]].copy_(ahead_ids)
        if self.tp is not None:
            self._broadcast_step(input_ids, positions, meta, sample_idx)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, on_layer)
        return self.model.compute_logits(hidden[sample_idx]) if any(s.samples for s in out.scheduled) else None

    def _sample_with_proposals(self, out: SchedulerOutput, which: list[int], logits: torch.Tensor
                               ) -> tuple[list, list | None]:
        """A step with speculating rows: the plain rows sampled as usual, each speculating
        row's positions verified (engine/sampler.py ``verify_async``); a speculating row's
        result is its accepted proposals and then the target's token, as a list."""
        plain, spec_rows, drafts, at, spans = [], [], [], 0, []
        for i in which:
            s = out.scheduled[i]
            n = 1 + len(s.draft_token_ids)
            if not s.draft_token_ids:
                plain.append((i, at))
            else:
                r, past = s.request, list(s.request.output_token_ids)
                for j in range(n):  # position j sees the proposals before it as output
                    spec_rows.append(SamplingRow(r.sampling_params, r.prompt_token_ids, past + s.draft_token_ids[:j],
                                                 r.eos_token_ids))
                drafts += s.draft_token_ids + [-1]
                spans.append((i, at, len(spec_rows) - n))
            at += n
        spec_idx = [at_ + j for i, at_, _ in spans for j in range(1 + len(out.scheduled[i].draft_token_ids))]
        verified = verify_async(logits[spec_idx], spec_rows, drafts)
        sampled: list = [None] * len(out.scheduled)
        logprobs: list | None = None
        if plain:
            res = self.sampler.sample(logits[[p for _, p in plain]], [_sampling_row(out.scheduled[i]) for i, _ in plain])
            for (i, _), tok in zip(plain, res.token_ids):
                sampled[i] = tok
            if any(lp is not None for lp in res.logprobs):
                logprobs = [None] * len(out.scheduled)
                for (i, _), lp in zip(plain, res.logprobs):
                    logprobs[i] = lp
        results = verified.result()
        for i, _, first in spans:
            d = len(out.scheduled[i].draft_token_ids)
            tokens = []
            for j in range(d + 1):
                ok, tok = results[first + j]
                if j < d and ok:
                    tokens.append(out.scheduled[i].draft_token_ids[j])
                    continue
                tokens.append(tok)
                break
            sampled[i] = tokens
        return sampled, logprobs
