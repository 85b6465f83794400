"""The model runner owns the device: the model's weights, the KV cache
tensor and the per-step input tensors. It turns a ``SchedulerOutput`` into
one forward pass and samples the rows that reached the end of their tokens.

KV cache layout: ``[num_slots, num_blocks, 2, block_size, num_kv_heads,
head_dim]`` — a block is a page in every slot, and slot s of a block taken by
KV cache group g holds the KV of g's s-th layer (engine/kv_cache_groups.py; one
group: slot = layer). For each slot a run of consecutive blocks is one contiguous
chunk holding both K and V (what the KV transfer sends). Linear-attention layers
keep a state slot per sequence instead (``linear_states``, engine/cache_spec.py). Its dtype is the
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

import logging
import os
from types import ModuleType
from typing import Callable, Sequence

import torch

from engine import graph_setup, memory_profile, model_setup
from engine.cache_spec import CacheSpec
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache_dtype import KVScales
from engine.kv_cache_groups import model_layout
from engine.kv_offload import HostKVTier
from engine.launched_step import LaunchedStep
from engine.layers.attention import AttentionMetadata
from engine.lora.config import LoRAConfig
from engine.lora.manager import LoRAManager
from engine.model_loader import load_model
from engine.models.llama_cpu import fuse_layers
from engine.parallel import TPGroup
from engine.prompt_logprobs import PendingPromptLogprobs, prompt_logprobs_async
from engine.runtime_config import KERNEL_CHOICES, KERNELS_ENV
from engine.sampler import Sampler, SamplingRow, verify_async
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_inputs import device_inputs, step_arrays
from engine.step_plan import GraphMenu, StepPath, StepPlan, StepRuntime
from engine.tp_wire import TPWire
from engine.warm_up import warm_up_kernels

logger = logging.getLogger(__name__)


_armed_forward_fault: int | None = None  # arm_forward_fault(); None = off


def state_snapshots(config: EngineConfig, tp: TPGroup | None) -> int:
    """Prefix-cache snapshots of linear-attention state (engine/linear_state_cache.py) this
    runner keeps: none without prefix caching or under tensor parallelism (the copies are rank
    0's alone), else --linear-state-snapshots (default: one per --max-num-seqs)."""
    cc = config.cache
    if not cc.enable_prefix_caching or tp is not None:
        return 0
    return config.scheduler.max_num_seqs if cc.linear_state_snapshots is None else cc.linear_state_snapshots


def select_ops(device: torch.device, choice: str = "auto") -> ModuleType:
    """The kernel module for ``device``, by ``choice`` (``RuntimeConfig.kernels``): ``kernels``
    (Triton; "auto" on CUDA), ``kernels.cpu_ops`` ("auto" on CPU: the references with the compiled
    CPU glue and attention) or ``kernels.reference`` ("reference")."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice == "auto" and device.type == "cpu":
        from kernels import cpu_ops

        return cpu_ops
    use_triton = device.type == "cuda" if choice == "auto" else choice == "triton"
    if not use_triton:
        from kernels import reference

        return reference
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{KERNELS_ENV}=triton on {device} needs Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before the process imports kernels/ (slow; meant for tests)")
    import kernels

    return kernels


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


def _sampling_row(s: ScheduledRequest) -> SamplingRow:
    r = s.request
    return SamplingRow(r.sampling_params, r.sampling_prompt_token_ids, r.generated_token_ids, r.eos_token_ids, s.lookahead,
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
                memory_profile.check_free_memory(free, total, cc.gpu_memory_utilization, str(self.device))
        self.runtime = config.runtime
        self.ops = select_ops(self.device, self.runtime.kernels)
        logger.info("kernels: %s", self.ops.describe_kernels(self.device, config.model.torch_dtype,
                                                             self.runtime.cpu_attention_build_timeout))
        mc, cc = config.model, config.cache
        self.block_size = cc.block_size
        self.tp = tp
        self.wire = TPWire(self) if tp is not None else None  # rank 0 -> the other ranks (engine/tp_wire.py)
        self.model = load_model(mc, self.device, self.ops, tp, expert_parallel=config.enable_expert_parallel)
        self.kv_dtype: torch.dtype = getattr(torch, config.kv_dtype)
        # The cache groups (engine/kv_cache_groups.py): each layer's group and slot, the pages.
        self.layout = model_layout(mc, cc.block_size, hybrid=cc.hybrid_kv_cache)
        self.model.set_cache_layout(self.layout)
        self.cache_spec = CacheSpec.of(self.model, self.layout, cc.block_size, self.kv_dtype,
                                       config.scheduler.max_num_seqs, state_snapshots(config, tp))
        self.kv_heads = self.cache_spec.kv_heads  # this rank's share of every block
        # The linear-attention state slots (bound to their layers before any forward pass).
        self.linear_states = self.cache_spec.new_linear_states(self.device)
        self.model.bind_linear_states(self.linear_states)
        log = tp is None or tp.rank == 0
        self.kv_scales: KVScales | None = model_setup.set_kv_scales(self.model, config, log)  # None unless FP8
        model_setup.set_dense_prefill(self.model, self.runtime.dense_prefill)
        model_setup.configure_moe(self.model, self.device, self.ops)
        self.lora: LoRAManager | None = None  # --enable-lora: the adapters' slots beside every linear layer
        if config.lora is not None:
            self.lora = self._make_lora(config.lora)
        # CPU: decoder layers as direct kernel calls where llama_cpu.py covers them (no LoRA, one rank)
        fused = fuse_layers(self.model, self.ops, self.kv_dtype)
        if fused and log:
            logger.info("%d of %d decoder layers run as direct kernel calls (CPU)", fused,
                        len(self.model.model.layers))
        graphs_eager = self.runtime.graphs_without_capture
        if graphs_eager:
            logger.warning("graphs_without_capture: CUDA graphs are off; steps run the graph path eagerly "
                           "(a test setting)")
        self.use_cuda_graphs = not graphs_eager and graph_setup.graphs_wanted(self)
        self.num_blocks = memory_profile.determine_num_blocks(self, with_graphs=self.use_cuda_graphs)
        if tp is not None:  # every rank holds the same blocks: the smallest cache decides
            self.num_blocks = tp.all_min(self.num_blocks)
        self.kv_cache = self.cache_spec.new_kv_cache(self.num_blocks, self.device)
        self.sampler = Sampler()
        warm_up_kernels(self)
        self.graphs: DecodeGraphs | None = None
        if self.use_cuda_graphs or graphs_eager:
            self.graphs = graph_setup.build_decode_graphs(self, use_graphs=self.use_cuda_graphs)
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
            lora.on_slot_filled = self.wire.share_lora_slot
        if self.tp is None or self.tp.rank == 0:  # the other ranks follow rank 0's slots
            for name, path in lc.modules:
                lora.register(name, path)
        return lora

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        if self.lora is None:
            return self.model.compute_logits(self.model(input_ids, positions, kv_cache, meta))
        self.lora.batch.begin(input_ids.shape[0])  # a decode graph: its rows' slots are in the buffer
        try:
            return self.model.compute_logits(self.model(input_ids, positions, kv_cache, meta))
        finally:
            self.lora.batch.active = False  # eager steps set their own

    def forward_rows_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                             meta: AttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions, kv_cache, meta)[rows])

    @property
    def block_bytes(self) -> int:
        """Bytes of one block on this rank (its share of the KV heads), every slot's page."""
        return self.cache_spec.block_bytes

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's flat inputs (``engine.step_inputs``) on the device; the adapters' rows."""
        a = step_arrays(out.scheduled, self.cache_spec.block_sizes, linear_state=bool(self.linear_states))
        if self.lora is not None:
            self.lora.set_step([s.request.lora for s in out.scheduled], a.counts)
        return device_inputs(a, self.device)

    def serve_steps(self) -> None:
        """Ranks > 0: run every step rank 0 broadcasts, until it says stop (engine/tp_wire.py)."""
        assert self.wire is not None
        self.wire.serve_steps()

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
            self.wire.stop()
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
        self._copy_states(out.state_restores)  # prefix hits: a snapshot into the request's slot
        rows = out.scheduled
        which = [i for i, s in enumerate(rows) if s.samples]
        prompt: PendingPromptLogprobs | None = None  # rows computing prompt logprobs: eager steps only
        if plan.path is StepPath.DECODE_GRAPH:
            assert self.graphs is not None and plan.bucket is not None
            step = self.graphs.fill_decode(rows, plan.bucket, plan.splits, ahead_ids)
            if self.lora is not None:  # (before sharing the step: the other ranks follow its slot fills)
                self.lora.set_graph_step([s.request.lora for s in rows], step.size)
            if self.tp is not None:
                self.wire.share_graph_step(step)
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
            logits, prompt = self._forward_eager(out, ahead_ids, on_layer, samples=bool(which))
        self._copy_states(out.state_snapshots)  # chunks that ended on a boundary: their slot kept
        if any(rows[i].draft_token_ids for i in which):
            if before_sampling is not None:
                before_sampling(out)
            return LaunchedStep(out, None, which, done=self._sample_with_proposals(out, which, logits), prompt=prompt)
        return self._queue_sampling(out, logits, which, before_sampling, prompt)

    @torch.inference_mode()
    def copy_kv_tiers(self, tier: HostKVTier, wait: bool = False) -> None:
        """The host tier's queued block copies (engine/kv_offload.py) on this cache, ordered before
        the next step's forward pass (on CUDA a side stream the compute stream waits for; loading
        layer by layer, overlapped with the forward, is not done yet). ``wait``: the host waits too."""
        tier.flush(self.kv_cache, wait=wait)

    def _copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy linear-attention state slots (src, dst) in every linear layer, queued in order."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for st in self.linear_states:
            st.conv.index_copy_(0, dst, st.conv.index_select(0, src))
            st.ssm.index_copy_(0, dst, st.ssm.index_select(0, src))

    def _queue_sampling(self, out: SchedulerOutput, logits: torch.Tensor | None, which: Sequence[int],
                        before_sampling: Callable[[SchedulerOutput], None] | None,
                        prompt: PendingPromptLogprobs | None = None) -> LaunchedStep:
        """The sampling of rows ``which`` (their logits, in order) queued after a forward pass
        already queued; ``before_sampling`` first, where a row samples."""
        if not which:
            return LaunchedStep(out, None, which, prompt=prompt)
        if before_sampling is not None:
            before_sampling(out)
        return LaunchedStep(out, self.sampler.sample_async(logits, [_sampling_row(out.scheduled[i]) for i in which]),
                            which, prompt=prompt)

    def _forward_eager(self, out: SchedulerOutput, ahead_ids: torch.Tensor | None,
                       on_layer: Callable[[int], None] | None, samples: bool
                       ) -> tuple[torch.Tensor | None, PendingPromptLogprobs | None]:
        """An eager forward pass of the step: the logits of its sampled positions, None when no
        row samples (``samples``: whether any does), and the prompt logprobs of rows that want
        them (engine/prompt_logprobs.py; None: no row does). ``ahead_ids``: the leading rows'
        inputs on the device (rows a step ahead are one token each, so token i is row i's)."""
        input_ids, positions, meta, sample_idx = self._prepare(out)
        if ahead_ids is not None:
            input_ids[:ahead_ids.shape[0]].copy_(ahead_ids)
        if self.tp is not None:
            self.wire.broadcast_step(input_ids, positions, meta, sample_idx)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, on_layer)
        prompt = None
        if any(s.prompt_logprob_positions for s in out.scheduled):
            if self.tp is not None:  # (refused at admission: the head's other shards are the workers')
                raise ValueError("prompt logprobs are not computed under tensor parallelism")
            prompt = prompt_logprobs_async(hidden, out.scheduled, self.model.compute_logits,
                                           self.config.model.vocab_size)
        return (self.model.compute_logits(hidden[sample_idx]) if samples else None), prompt

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
                r, past = s.request, list(s.request.generated_token_ids)
                for j in range(n):  # position j sees the proposals before it as output
                    spec_rows.append(SamplingRow(r.sampling_params, r.sampling_prompt_token_ids,
                                                 past + s.draft_token_ids[:j],
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
