"""The engine: a scheduler and a model runner, driven one step at a time.

    expired = scheduler.expire(now)          # every non-final state has a deadline
    out = scheduler.schedule()               # reservations, then which tokens of which requests
    plan = plan_step(out.scheduled, ...)     # eager or which graph, overlapped or not (engine/planner.py)
    launched = runner.run(out, plan)         # one forward pass + sampling, queued
    scheduler.update_from_output(out, *launched.result())   # advance token counts, finish

Overlapped steps (``--async-scheduling``, on by default, with decode graphs):
a step whose plan says overlapped (a decode step; one mixed with prefill
chunks where the runner overlaps them) is queued on the device without
waiting for it. The next call schedules the step after it
a step ahead (``scheduler.schedule_ahead``: inputs are the ids the step in
flight samples, still on the device; chunks go on past the positions in
flight), queues it, and only then reads the tokens of the step in flight and
updates the requests, so that host work hides behind the GPU's. A call thus
reports the tokens of the step queued by the call before; tokens computed for
a request that finished meanwhile are discarded. Where the next schedule
depends on those tokens (preemption, penalties, proposals) the call reads
them first, one step at a time.

Servers never touch the scheduler or the cache: they call the engine's
named operations (``add_request``, ``add_prefill_request``, ``reserve``,
``prefill_started``, ``begin_kv_receive``, ``kv_received``, ``kv_failed``,
``begin_send``, ``release_after_send``, ``abort_request``) and read what
happened from each ``StepOutput``. A request that an operation finishes or
advances outside a step is reported in the next step's output, so every
outcome reaches the caller through one path.

Not thread-safe: one thread owns an engine (the servers run it in a
dedicated loop thread and talk to it through queues).
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from engine.config import EngineArgs, EngineConfig
from engine.grammar import GrammarManager
from engine.kv_disk_tier import DiskKVTier, DiskTierStats
from engine.kv_offload import HostKVTier
from engine.launched_step import LaunchedStep
from engine.model_runner import ModelRunner
from engine.planner import plan_step
from engine.request import Request, RequestError, RequestStatus
from engine.sampling_params import SamplingParams, check_priority
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative import Speculator
from engine.step_plan import StepPlan, StepRuntime
from engine.structured_outputs import GrammarState

if TYPE_CHECKING:
    from engine.draft_model import DraftProposer
    from engine.lora.config import LoRAInfo
    from engine.lora.manager import LoRAManager

logger = logging.getLogger(__name__)
_EXPIRY_CHECK_S = 0.02  # deadlines are noticed at most this late (plus the step in progress)


@dataclass
class StepOutput:
    """What one step changed, for the server that drives the engine."""

    updated: list[Request] = field(default_factory=list)  # got tokens, became held, or finished
    reserved: list[Request] = field(default_factory=list)  # decode tier: blocks reserved (block ids ready)
    started: list[Request] = field(default_factory=list)  # scheduled for the first time
    num_batched_tokens: int = 0  # tokens the model ran on (0: no forward pass)

    @property
    def is_empty(self) -> bool:
        """Nothing to report (the model may still have run a prefill chunk)."""
        return not (self.updated or self.reserved or self.started)

    @property
    def did_work(self) -> bool:
        return self.num_batched_tokens > 0 or not self.is_empty


class LayerSignal(Protocol):
    """One step's per-layer progress, for the requests a ``LayerwiseSink`` took."""

    request_ids: list[str]  # the requests whose send starts now (they must end with release_after_send)

    def layer_done(self, layer: int) -> None:
        """Layer ``layer``'s KV writes are queued on the current stream."""

    def step_ended(self) -> None:
        """The forward pass is over (every layer done), or it failed part-way."""


class LayerwiseSink(Protocol):
    """Told, as a step begins, which held-for-send requests finish their prompt in it
    (request id, the block ids its send reads: ``LLMEngine.begin_send``'s), so their KV can
    leave layer by layer while the rest of the forward pass runs. Returns None to take none of
    them."""

    def step_begins(self, finishing: list[tuple[str, list[int]]]) -> LayerSignal | None: ...


@dataclass(frozen=True)
class EngineStats:
    """Counters a server reports (load, metrics); a consistent snapshot."""

    num_running: int
    num_waiting: int  # waiting to run, for blocks, or for KV
    kv_blocks_used: int  # held by live requests (idle prefix-cache blocks are free)
    kv_blocks_total: int
    prefix_queries_total: int
    prefix_hits_total: int  # every tier's (the requests' num_cached_tokens)
    num_preemptions_total: int
    num_steps_total: int = 0  # forward passes run or queued
    num_steps_ahead_total: int = 0  # of those, scheduled a step ahead (overlapped with the one before)
    # The host tier (--kv-offloading-size; all 0 when off): its blocks, those in use, blocks copied
    # to it (evicted from the device cache) and back (prefix hits there), and those it dropped (LRU).
    host_kv_blocks_total: int = 0
    host_kv_blocks_used: int = 0
    host_kv_stored_total: int = 0
    host_kv_loaded_total: int = 0
    host_kv_dropped_total: int = 0
    host_kv_hit_tokens_total: int = 0  # prompt tokens of prefix hits in the host tier (loaded blocks)
    disk_kv: DiskTierStats | None = None  # the disk tier's counters (--kv-offloading-path; None when off)
    # prefix_hits_total by where the blocks were: "device" | "host" | "disk" (Scheduler.prefix_hits_by_source)
    prefix_hits_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


def _close_tensor_parallel(runner: ModelRunner, workers: list) -> None:
    if workers:
        from engine.tp_worker import stop_workers

        runner.close()
        stop_workers(workers)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        logger.info("engine config: %s", config.describe())
        self.config = config
        self.tp, self._workers = self._start_tensor_parallel(config)
        spec = config.speculative
        draft = None
        if spec is not None and spec.method == "draft_model":
            from engine.draft_model import draft_block_bytes, draft_model_config

            draft = draft_model_config(config)
        # A draft model's cache has a block for each of the target's: sized together.
        self.runner = ModelRunner(config, self.tp,
                                  extra_block_bytes=draft_block_bytes(config, draft) if draft is not None else 0)
        # Closed by close(), or when the engine is dropped or the process ends.
        self._close_tp = weakref.finalize(self, _close_tensor_parallel, self.runner, self._workers)
        mc, sc = config.model, config.scheduler
        self.eos_token_ids = mc.eos_token_ids
        self.drafter: DraftProposer | None = None
        speculator = None
        if draft is not None:  # a draft model's proposals, a step's rows at once (engine/draft_model.py)
            from engine.draft_model import DraftProposer

            self.drafter = DraftProposer(config, draft, self.runner.num_blocks)
            speculator = Speculator.from_config(spec, propose_batch=self.drafter.propose)
        elif spec is not None:  # n-gram proposals, from the request's own tokens (engine/speculative.py)
            speculator = Speculator.from_config(spec)
        # Structured outputs: cheap to make, the tokenizer and xgrammar load at the first compile.
        self.grammars = GrammarManager(config.tokenizer or mc.path, mc.vocab_size, self.eos_token_ids,
                                       config.max_grammar_compile_seconds,
                                       on_compiled=lambda: self.on_background_done and self.on_background_done())
        self.scheduler = Scheduler(sc, config.cache, self.runner.num_blocks, speculator=speculator,
                                   grammars=self.grammars,
                                   max_loras=self.runner.lora.max_loras if self.runner.lora is not None else None,
                                   layout=self.runner.layout, num_state_slots=self.runner.cache_spec.num_state_slots,
                                   num_state_snapshots=self.runner.cache_spec.num_snapshots)
        # The host tier (--kv-offloading-size): blocks the device cache evicts, loaded back on a hit.
        self.host_kv: HostKVTier | None = None
        if config.cache.kv_offloading_size > 0:
            self.host_kv = HostKVTier.of_size(config.cache.kv_offloading_size, self.runner.kv_cache)
            self.scheduler.kv.attach_host_tier(self.host_kv)
            logger.info("host KV tier: %d blocks (%.1f MiB%s)", self.host_kv.num_blocks,
                        self.host_kv.num_blocks * self.host_kv.block_bytes / 2**20,
                        ", pinned" if self.host_kv.buffer.is_pinned() else "")
            if config.cache.kv_offloading_path is not None:  # and the disk tier behind it
                self.host_kv.attach_disk(DiskKVTier.for_engine(config, self.runner.kv_cache, self.kv_scales))
                # a prefix's blocks read from disk (off the step) wake whoever waits between steps
                self.host_kv.on_read_done = lambda: self.on_background_done and self.on_background_done()
        layout = self.runner.layout
        # tokens of context the cache holds were every group to keep every block
        capacity = self.runner.num_blocks // layout.num_groups * config.cache.block_size
        logger.info("KV cache blocks: %d (%d tokens, %.1f MiB of %s); groups: %s", self.runner.num_blocks, capacity,
                    self.runner.num_blocks * self.runner.block_bytes / 2**20, config.kv_dtype, layout.describe())
        if capacity < sc.max_model_len:
            logger.warning("the KV cache holds %d tokens, less than --max-model-len %d", capacity,
                           sc.max_model_len)
        self._outside_step: list[Request] = []  # advanced or finished by an operation; reported next step
        self._next_expiry_check = 0.0
        self.layerwise_sink: LayerwiseSink | None = None  # prefill tier: KV sent as layers finish
        self._in_flight: LaunchedStep | None = None  # a decode step queued, its tokens not read yet
        self.num_steps_total = 0
        self.num_steps_ahead_total = 0
        # Called from another thread when background work (a grammar compile) ends: set by
        # whoever waits for work between steps (the engine loop), to wake up.
        self.on_background_done: Callable[[], None] | None = None

    @staticmethod
    def _start_tensor_parallel(config: EngineConfig):
        """Rank 0's group and the worker processes of ranks 1..N-1 (none at size 1); the
        workers die with this process, and ``close`` (or this engine's collection) stops them."""
        size = config.tensor_parallel_size
        if size == 1:
            return None, []
        import torch

        from engine.parallel import TPGroup, serve_store
        from engine.tp_worker import release, start_workers

        store = serve_store("127.0.0.1", size)
        workers = start_workers(config, size, "127.0.0.1", store.port)
        try:
            tp = TPGroup(0, size, "127.0.0.1", store.port, torch.device(config.device), store=store)
        except BaseException:
            for w in workers:
                w.kill()
            raise
        weakref.finalize(tp, release, tp.group, workers)  # dropped without close(), or at exit
        logger.info("tensor parallel: %d ranks (%s), workers %s", size, tp.backend, [w.pid for w in workers])
        return tp, workers

    def bind_thread(self) -> None:
        """Make the calling thread's current CUDA device the engine's. Call it first in any
        thread that steps the engine other than the one that built it: a thread starts on
        cuda:0, and Triton launches on the current device's stream, whatever device the
        tensors are on (out of order with the engine's own stream, on another GPU)."""
        self.runner.bind_thread()

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at size 1) and the grammar
        compiler's threads. Idempotent."""
        self._close_tp()
        self._workers = []
        self.grammars.close()
        if self.drafter is not None:
            self.drafter.close()
        if self.host_kv is not None:  # (the disk tier's queued writes)
            self.host_kv.close()

    def expert_load(self):  # -> torch.Tensor
        """[MoE layers, experts] int64 on the host: tokens routed to each expert since the
        engine started (empty for a dense model). Routing is replicated on every rank, so
        rank 0's counters are the whole model's. Read while steps run: a snapshot."""
        return self.runner.model.expert_load.cpu()

    @property
    def moe_layer_indices(self) -> list[int]:
        """The decoder layer of each row of ``expert_load()``."""
        return self.runner.model.moe_layer_indices

    @property
    def workers_alive(self) -> bool:
        return all(w.is_alive() for w in self._workers)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def kv_cache(self):  # -> torch.Tensor [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
        """The paged KV cache, for the KV transfer plumbing (which reads and
        writes only blocks the engine has handed out for that)."""
        return self.runner.kv_cache

    @property
    def cache_layout(self):  # -> engine.kv_cache_groups.KVCacheLayout
        """The KV cache groups: which layers share a table, and the cache's slots."""
        return self.runner.layout

    @property
    def draft_kv_cache(self):  # -> torch.Tensor | None
        """A draft model's KV cache (``--speculative-config`` method draft_model), whose blocks
        travel with the target's; None without one."""
        return self.drafter.kv_cache if self.drafter is not None else None

    @property
    def linear_states(self):  # -> list[engine.layers.linear_state.LinearState]
        """A hybrid model's linear-attention state slots, one ``LinearState`` per linear layer
        (``conv`` [slots, conv_dim, K-1], ``ssm`` [slots, H_v, D_k, D_v]; empty without such
        layers), for the KV transfer plumbing, which reads and writes only the slot the engine
        handed out for that (``state_slot``)."""
        return self.runner.linear_states

    def state_slot(self, request_id: str) -> int:
        """The request's linear-attention state slot (-1: none, or a model without linear
        layers): a decode-tier reservation's from its reservation on, where its state is to
        land; a prefill-tier request's while it runs or is held for a send."""
        return self.scheduler.kv.state_slot(request_id)

    @property
    def kv_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """An FP8 cache's per-layer (k_scale, v_scale); ((), ()) for a cache in the model's
        dtype. Part of what a KV pair's two sides must agree on."""
        s = self.runner.kv_scales
        return ((), ()) if s is None else (s.k, s.v)

    # ---- admission -------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                     arrival_time: float | None = None, deadline: float | None = None,
                     lora_name: str | None = None, resume_output_token_ids: Sequence[int] = (),
                     priority: int = 0) -> Request:
        """Validate and build a request (not yet queued). ``deadline`` is a
        time.monotonic() instant after which the request is aborted; ``lora_name``: the
        adapter it runs under (LoRAError when it is not loaded here);
        ``resume_output_token_ids``: the tokens it already generated elsewhere (a migrated
        request: they are computed with the prompt and count as its output, see
        engine/request.py); ``priority``: its place under ``--scheduling-policy priority``
        (lower first; anything but 0 is refused under fcfs, as vLLM does)."""
        lora = self.lora_info(lora_name) if lora_name else None
        max_len = self.config.scheduler.max_model_len
        tokens = [*prompt_token_ids, *resume_output_token_ids]  # what is computed here: checked as one
        n = len(tokens)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n >= max_len:
            raise ValueError(f"This model's maximum context length is {max_len} tokens. However, the "
                             f"prompt has {n} tokens; at least one token must remain for generation.")
        vocab = self.config.model.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for vocabulary size {vocab}")
        params.validate(vocab_size=vocab)
        if params.num_sequences != 1:
            raise ValueError(f"n={params.n}, best_of={params.best_of}: an engine server runs one sequence per request; "
                             "the gateway and the offline LLM run a request's choices as requests of their own "
                             "(SamplingParams.choice)")
        check_priority(priority, self.config.scheduler.scheduling_policy)
        if params.prompt_logprobs is not None and self.tp is not None:
            raise ValueError("prompt_logprobs is not supported with --tensor-parallel-size > 1: the LM head is "
                             "split over the ranks, and the prompt positions' logits would need every rank")
        if params.structured_outputs is not None:
            self.grammars.check_tokenizer()
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, max_len, arrival_time,
                      resume_output_token_ids, priority)
        req.deadline = deadline
        req.lora = lora
        self.scheduler.check_fits(req)
        return req

    # ---- LoRA adapters ---------------------------------------------------------
    @property
    def lora(self) -> LoRAManager | None:
        """The adapters (None without --enable-lora). ``register``/``unregister`` may run on
        any thread: they read and check files, and never touch the device."""
        return self.runner.lora

    def lora_info(self, name: str) -> LoRAInfo:
        from engine.lora.adapter import LoRANotLoaded

        if self.runner.lora is None:
            raise LoRANotLoaded(f"LoRA adapter {name!r} requested, but this server was not started with "
                                "--enable-lora")
        info = self.runner.lora.get(name)
        if info is None:
            raise LoRANotLoaded(f"LoRA adapter {name!r} is not loaded here (loaded: "
                            f"{', '.join(i.name for i in self.runner.lora.list()) or 'none'})")
        return info

    def lora_requests(self) -> tuple[list[str], list[str]]:
        """The adapters of running requests and of waiting ones (sorted names; racy reads)."""
        sched = self.scheduler
        running = {r.lora.name for r in list(sched.running) if r.lora is not None}
        waiting = {r.lora.name for q in (list(sched.waiting), list(sched.block_waiting), list(sched.reserved.values()))
                   for r in q if r.lora is not None}
        return sorted(running), sorted(waiting - running)

    def _constrain(self, req: Request) -> Request:
        """A queued request with a constraint starts compiling it now (off the engine loop; the
        decode tier's while the prefill tier computes the prompt)."""
        if req.sampling_params.structured_outputs is not None:
            self.grammars.register(req)
        return req

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None, deadline: float | None = None,
                    lora_name: str | None = None, resume_output_token_ids: Sequence[int] = (),
                    priority: int = 0) -> Request:
        """Compute the request here, prompt and output (offline, colocated)."""
        req = self.make_request(request_id, prompt_token_ids, params, arrival_time, deadline, lora_name,
                                resume_output_token_ids, priority)
        self.scheduler.add_request(req)
        return self._constrain(req)

    def add_prefill_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                            deadline: float | None = None, lora_name: str | None = None,
                            resume_output_token_ids: Sequence[int] = (), priority: int = 0,
                            kv_skip_tokens: int = 0) -> Request:
        """Prefill tier: compute the prompt and sample the first token, then
        hold the blocks (HELD_FOR_SEND) until ``begin_send`` ...
        ``release_after_send``. ``kv_skip_tokens``: the prompt's first tokens whose KV the
        decode server holds already (its prefix-cache hit; a whole number of every cache
        group's blocks): the send leaves out each group's blocks of them."""
        req = self.make_request(request_id, prompt_token_ids, params, deadline=deadline, lora_name=lora_name,
                                resume_output_token_ids=resume_output_token_ids, priority=priority)
        req.max_tokens = 1
        req.hold_kv_on_finish = True
        kv = self.scheduler.kv
        kv.layout.check_prefix(kv_skip_tokens, req.num_prompt_tokens)  # (ValueError before it is queued)
        self.scheduler.add_request(req)
        kv.skip_on_send(req, kv_skip_tokens)
        return self._constrain(req)

    def reserve(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                deadline: float | None = None, lora_name: str | None = None,
                resume_output_token_ids: Sequence[int] = (), priority: int = 0) -> Request:
        """Decode tier: queue a request whose prompt KV will arrive by
        transfer. Its blocks are reserved first come first served; the step
        that does it lists the request in ``StepOutput.reserved``. Raises
        ValueError (invalid) or OverflowError (the queue is full)."""
        req = self.make_request(request_id, prompt_token_ids, params, deadline=deadline, lora_name=lora_name,
                                resume_output_token_ids=resume_output_token_ids, priority=priority)
        req.prompt_logprobs = None  # the prefill tier computes the prompt, and its logprobs
        self.scheduler.add_reservation(req)
        if req.lora is not None:  # its adapter into a free slot while the prompt is prefilled elsewhere
            self.runner.lora.prefetch(req.lora)
        return self._constrain(req)

    # ---- KV hand-off -----------------------------------------------------
    def prefill_started(self, request_id: str) -> bool:
        """Decode tier: the prefill server began on the request."""
        return self.scheduler.prefill_started(request_id)

    def begin_kv_receive(self, request_id: str, dst_block_ids: list[int], state_slot: int = -1) -> None:
        """Decode tier: a transfer into ``dst_block_ids`` (and, for a hybrid model, its
        linear-attention state into ``state_slot``) begins; ValueError unless they are the
        request's reserved blocks and slot."""
        mine = self.scheduler.kv.state_slot(request_id)
        if state_slot != mine and request_id in self.scheduler.reserved:
            raise ValueError(f"request {request_id}: linear-attention state sent to slot {state_slot}, "
                             f"reserved slot {mine}")
        self.scheduler.begin_kv_receive(request_id, dst_block_ids)

    def kv_received(self, request_id: str, first_token: int, logprob=None,
                    transfer: dict | None = None) -> Request | None:
        """Decode tier: the transfer ended well; the request joins the batch.
        ``transfer``: its figures (bytes, blocks, seconds, backend), kept for the trace."""
        req = self.scheduler.kv_received(request_id, first_token, logprob, transfer)
        self._report(req)
        return req

    def kv_failed(self, request_id: str, message: str) -> Request | None:
        """Decode tier: the transfer failed; the request ends with that error."""
        req = self.scheduler.kv_failed(request_id, message)
        self._report(req)
        return req

    def begin_send(self, request_id: str) -> list[int]:
        """Prefill tier: a send of the held blocks starts; returns the ids it reads (each
        group's table less its blocks of ``kv_skip_tokens``). (A request a ``layerwise_sink``
        took is sending already: no call.)"""
        return self.scheduler.begin_send(request_id)

    def release_after_send(self, request_id: str) -> Request | None:
        """Prefill tier: the send ended (or never began): free the blocks.
        Also ends a layer-wise send of a request finished (aborted) meanwhile."""
        req = self.scheduler.release_held(request_id)
        self._report(req)
        return req

    def abort_request(self, request_id: str, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        """End the request in whatever state it is; None if unknown or done."""
        req = self.scheduler.finish_request(request_id, status)
        self._report(req)
        return req

    def limit_waiting(self, max_waiting: int | None) -> None:
        """Bound the waiting queue (servers: ``--max-queued-requests``; past
        it ``add_request`` raises OverflowError). The offline API leaves it
        unbounded."""
        self.scheduler.limit_waiting(max_waiting)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.scheduler.kv.get_block_ids(request_id)

    # ---- prefix-cache feed (for a cluster-wide prefix index) ------------
    @property
    def cache_namespace(self) -> str:
        """What a block hash of this engine is only meaningful within: the
        model, the block size and the KV dtype (the cache's: float8_e4m3fn with
        --kv-cache-dtype fp8, else the model's; the hash itself has no salt)."""
        c = self.config
        return f"{c.model.served_model_name}:{c.cache.block_size}:{c.kv_dtype}"

    def cache_snapshot(self) -> list[int]:
        """Start recording prefix-cache events (if not yet) and return every
        full-block hash cached now; ``take_cache_events`` continues from here."""
        return self.scheduler.kv.cache_snapshot()

    def take_cache_events(self) -> tuple[list[tuple[bool, int]], bool]:
        """(events in order: (stored?, hash), lost) since the last call; lost
        means the buffer overflowed and only a new snapshot is exact."""
        return self.scheduler.kv.take_cache_events()

    def _report(self, req: Request | None) -> None:
        if req is not None:
            self._outside_step.append(req)

    # ---- the step --------------------------------------------------------
    def step(self) -> StepOutput:
        """One engine step: schedule -> plan -> run -> update. With a step in flight
        (overlapped steps: see the module's docstring) it queues the next one a step ahead
        where it can, then reports the tokens of the one in flight; otherwise it schedules one
        step and runs it, or queues it when its plan says overlapped."""
        result = StepOutput(updated=self._outside_step + self._expire())
        self._outside_step = []
        if self._in_flight is not None and self._step_ahead(result):
            return self._once_each(result)
        out = self.scheduler.schedule()
        self._copy_kv_tiers(bool(out.reserved))
        result.reserved += out.reserved
        result.started = out.started
        result.updated += out.finished + self._drop_unusable_adapters(out)
        if not out.is_empty:
            result.num_batched_tokens = out.num_batched_tokens
            self.num_steps_total += 1
            if self.drafter is not None:  # the prefill tier: the draft's KV of the prompts it sends
                self.drafter.prefill([s for s in out.scheduled if s.request.hold_kv_on_finish])
            signal = self._layerwise_signal(out)
            plan = plan_step(out.scheduled, self._step_runtime(), layerwise=signal is not None)
            launched = self._run(out, plan, signal)
            if plan.overlapped:
                self._in_flight = launched
            else:
                result.updated += self.scheduler.update_from_output(out, *launched.result(),
                                                                    prompt_logprobs=launched.prompt_logprobs())
        return self._once_each(result)

    def _drop_unusable_adapters(self, out: SchedulerOutput) -> list[Request]:
        """Requests of the step whose adapter cannot be placed in a slot (its files changed
        since it was loaded) end with that error and leave the step; the rest run. (The rows
        of a step ahead that lead it ran in the step in flight: their adapters hold slots.)"""
        lora = self.runner.lora
        if lora is None:  # (every step: nothing to look at without adapters)
            return []
        infos = [s.request.lora for s in out.scheduled if s.request.lora is not None]
        bad = lora.unusable(infos) if infos else {}
        if not bad:
            return []
        failed = []
        for s in out.scheduled:
            if s.request.lora is not None and s.request.lora.name in bad:
                error = RequestError("lora", f"request {s.request.request_id}: {bad[s.request.lora.name]}")
                req = self.scheduler.finish_request(s.request.request_id, RequestStatus.FINISHED_ABORTED, error)
                if req is not None:
                    failed.append(req)
        out.scheduled = [s for s in out.scheduled if not s.request.is_finished]
        return failed

    def _step_runtime(self) -> StepRuntime:
        # Steps are queued ahead only without layer-wise sends (they read each step's outcome).
        return self.runner.step_runtime(overlap=self.config.runtime.async_scheduling and self.layerwise_sink is None)

    def _expire(self) -> list[Request]:
        now = time.monotonic()
        if now < self._next_expiry_check:  # a walk over every request: not on every decode step
            return []
        self._next_expiry_check = now + _EXPIRY_CHECK_S
        return self.scheduler.expire(now)

    def _step_ahead(self, result: StepOutput) -> bool:
        """Queue the step after the one in flight if it can be scheduled ahead and its plan is
        overlapped, then read the one in flight into ``result``. True when a step is in flight
        again."""
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        ahead = self.scheduler.schedule_ahead(in_flight.out)
        self._copy_kv_tiers(ahead is not None and bool(ahead.reserved))
        taken: list[Request] | None = None  # the in-flight step's outcome, if taken inside the run
        if ahead is not None:
            result.reserved += ahead.reserved
            result.started += ahead.started
            result.updated += ahead.finished + self._drop_unusable_adapters(ahead)
            plan = plan_step(ahead.scheduled, self._step_runtime())
            before_sampling = None
            if self._bitmasks_of(ahead) is not None:
                # Constrained rows: once the step ahead's forward is queued, read the tokens in
                # flight (their sampling is queued before it), take them, and fill the masks
                # the step ahead samples with; the device runs the forward meanwhile.
                def before_sampling(step: SchedulerOutput) -> None:
                    nonlocal taken
                    taken = self.scheduler.update_from_output(in_flight.out, *in_flight.result(),
                                                              prompt_logprobs=in_flight.prompt_logprobs())
                    for s in step.scheduled:  # those tokens are known now: none is pending for the sampler
                        s.landed()
                    self._fill_ready_masks(step)
            if plan.overlapped:  # (otherwise it is scheduled again once the tokens are read)
                self._in_flight = self.runner.run(ahead, plan, in_flight, before_sampling=before_sampling)
        result.updated += taken if taken is not None else \
            self.scheduler.update_from_output(in_flight.out, *in_flight.result(),
                                              prompt_logprobs=in_flight.prompt_logprobs())
        if self._in_flight is None:
            return False
        assert ahead is not None
        for s in ahead.scheduled:  # the requests' counts include the step taken now
            s.landed()
        result.num_batched_tokens = ahead.num_batched_tokens
        self.num_steps_total += 1
        self.num_steps_ahead_total += 1
        return True

    def _copy_kv_tiers(self, reserved: bool) -> None:
        """The host tier's copies the scheduling just queued (evicted blocks out, hits in), before
        anything writes the blocks: the step's forward pass, or (``reserved``) a KV receive into
        blocks just reserved, which the host waits for."""
        if self.host_kv is not None and self.host_kv.num_pending_copies:
            self.runner.copy_kv_tiers(self.host_kv, wait=reserved)

    @staticmethod
    def _once_each(result: StepOutput) -> StepOutput:
        result.updated = list(dict.fromkeys(result.updated))  # once each, first report first
        return result

    def _layerwise_signal(self, out: SchedulerOutput) -> LayerSignal | None:
        """The prefill tier: the sink's signal for the held rows that finish their prompt in this
        step (their KV leaves layer by layer as the forward pass goes), or None."""
        if self.layerwise_sink is None:
            return None
        kv = self.scheduler.kv  # (its tables are the rows' as allocated for this step)
        finishing = [(s.request.request_id, kv.send_block_ids(s.request.request_id)) for s in out.scheduled
                     if s.samples and s.request.hold_kv_on_finish]
        return self.layerwise_sink.step_begins(finishing) if finishing else None

    def _run(self, out: SchedulerOutput, plan: StepPlan, signal: LayerSignal | None) -> LaunchedStep:
        before_sampling = self._bitmasks_of(out)
        if signal is None:
            return self.runner.run(out, plan, before_sampling=before_sampling)
        for request_id in signal.request_ids:  # their blocks are read from now on: never freed under it
            self.scheduler.begin_streamed_send(request_id)
        try:
            launched = self.runner.run(out, plan, on_layer=signal.layer_done, before_sampling=before_sampling)
            launched.result()  # (the step is over before the signal says so)
            return launched
        finally:
            signal.step_ended()

    def _bitmasks_of(self, out: SchedulerOutput) -> Callable[[SchedulerOutput], None] | None:
        """What the runner calls before sampling a step with constrained rows that sample:
        each gets its next-token bitmask (computed on the host while the device runs the
        forward pass). None when the step has none."""
        if not self.grammars.num_requests or not any(
                s.samples and s.request.sampling_params.structured_outputs is not None for s in out.scheduled):
            return None
        grammars = self.grammars

        def fill(step: SchedulerOutput) -> None:
            rows = [s for s in step.scheduled if s.samples and s.request.sampling_params.structured_outputs]
            for s, mask in zip(rows, grammars.fill([s.request for s in rows])):
                s.bitmask = mask
        return fill

    def _fill_ready_masks(self, step: SchedulerOutput) -> None:
        """The masks of a step scheduled ahead, after the tokens before it were taken: for its
        constrained rows still running with a mask ready (a row the tokens finished samples
        unmasked, and its token is thrown away)."""
        rows = [s for s in step.scheduled if s.samples and s.request.sampling_params.structured_outputs is not None
                and s.request.status == RequestStatus.RUNNING
                and self.grammars.poll(s.request)[0] is GrammarState.READY]
        for s, mask in zip(rows, self.grammars.fill([s.request for s in rows]) if rows else []):
            s.bitmask = mask

    def wait_for_background(self, timeout: float) -> None:
        """After a step that did no work: wait (at most ``timeout`` s) for background work that
        may let one run (a grammar compiling, a prefix's blocks read from the disk tier), rather
        than step again at once."""
        host = self.host_kv
        if host is not None and host.num_reads_in_flight:
            # (both kinds at once: a short wait for reads, then the step looks at the grammars again)
            host.wait_reads(min(timeout, 0.01) if self.grammars.num_requests else timeout)
            return
        self.grammars.wait(timeout)

    def has_unfinished_requests(self) -> bool:
        """Requests to step, outcomes to report, or a step in flight to read."""
        return (self.scheduler.has_unfinished_requests() or bool(self._outside_step)
                or self._in_flight is not None)

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(num_running=s.num_running, num_waiting=s.num_waiting,
                           kv_blocks_used=s.kv.num_used_blocks, kv_blocks_total=s.kv.num_blocks,
                           prefix_queries_total=s.prefix_queries_total, prefix_hits_total=s.prefix_hits_total,
                           num_preemptions_total=s.num_preemptions_total, num_steps_total=self.num_steps_total,
                           num_steps_ahead_total=self.num_steps_ahead_total, **self._host_kv_stats(),
                           prefix_hits_by_source=dict(s.prefix_hits_by_source),
                           disk_kv=self.host_kv.disk.stats() if self.host_kv and self.host_kv.disk else None)

    def _host_kv_stats(self) -> dict[str, int]:
        h = self.host_kv
        if h is None:
            return {}
        return dict(host_kv_blocks_total=h.num_blocks, host_kv_blocks_used=h.num_used_blocks,
                    host_kv_stored_total=h.stored_blocks_total, host_kv_loaded_total=h.loaded_blocks_total,
                    host_kv_dropped_total=h.dropped_blocks_total,
                    host_kv_hit_tokens_total=h.loaded_blocks_total * self.config.cache.block_size)
