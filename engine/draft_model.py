"""Speculative decoding with a draft model (``{"method": "draft_model", "model": DIR}``):
a smaller model of the same vocabulary proposes each decoding row's next k tokens,
greedily, and the target verifies them as it does n-gram proposals.

The draft runs in its own ``ModelRunner`` (its weights, its KV cache, its decode
graphs) over the target's block ids: its cache has as many blocks as the target's,
so a request's block table addresses both. Per request the draft keeps its own count
of positions whose draft KV is valid (``Request.num_draft_computed``). A proposal
round for a batch of rows:

    catch-up   each row computes its positions [draft computed, T) (T tokens known; on
               a decode server the whole prompt the first time: the draft's prefill) and
               samples proposal 1 at T - 1
    k - 1      single-token steps (the draft's decode graphs): proposal j is the input of
               step j, written at position T + j - 1, sampling proposal j + 1

after which the draft KV is valid up to T + k - 1 if every proposal is accepted;
the next round starts from min(that, the target's computed tokens), which is where
the accepted proposals end. The scheduler takes blocks for all k positions first.

Across the tiers the draft's prefill is the prefill server's: there the draft runs
every prompt chunk the target runs (``prefill``, before the target's forward pass, so
the draft's KV is written when the target's last layer is), into the same block ids,
and each KV transfer moves the same blocks of both caches (kv_transfer's ``KVLayout.draft``). A
decode server whose prompt KV came whole from such a transfer starts its first
proposal round with the draft's KV of the prompt in place; one that had a cached
prefix of the prompt (not sent) computes the draft's KV of the whole prompt itself,
since a cached block's draft KV may trail its target KV by the positions a finished
request's last round never drafted.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from engine.config import EngineConfig, ModelConfig
from engine.planner import plan_step
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0)


class _DraftRow:
    """What the draft's runner reads of a request: its tokens (growing by the proposals)
    and how many of them have draft KV."""

    def __init__(self, req: Request, num_computed_tokens: int | None = None) -> None:
        self.request_id = req.request_id
        self.all_token_ids = list(req.all_token_ids)
        self.num_computed_tokens = (min(req.num_draft_computed, req.num_computed_tokens)
                                    if num_computed_tokens is None else num_computed_tokens)
        self.prompt_token_ids: list[int] = []
        self.output_token_ids: list[int] = []
        self.sampling_prompt_token_ids = self.prompt_token_ids  # what the sampler reads (engine/request.py)
        self.generated_token_ids = self.output_token_ids
        self.eos_token_ids: frozenset[int] = frozenset()
        self.sampling_params = _GREEDY
        self.lora = None
        self.hold_kv_on_finish = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        return range(0)  # the target's logits give prompt logprobs; the draft's never do


def draft_model_config(config: EngineConfig) -> ModelConfig:
    """The draft's model, in the target's dtype; ValueError where it cannot draft for it."""
    spec, target = config.speculative, config.model
    assert spec is not None and spec.model is not None
    draft = ModelConfig.from_dir(spec.model, dtype=target.dtype, load_format=target.load_format,
                                 served_model_name=f"{target.served_model_name}-draft", seed=target.seed + 1)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-config: the draft model's vocabulary ({draft.vocab_size} tokens, "
                         f"{spec.model}) is not the target's ({target.vocab_size}): they must share the tokenizer")
    if config.tensor_parallel_size > 1:
        raise ValueError("--speculative-config: draft_model with --tensor-parallel-size > 1 is not supported yet")
    return draft


def draft_block_bytes(config: EngineConfig, draft: ModelConfig) -> int:
    """Bytes a KV block of the draft takes (its cache has one block per target block)."""
    return draft.kv_bytes_per_token(config.kv_dtype) * config.cache.block_size


class DraftProposer:
    def __init__(self, config: EngineConfig, draft: ModelConfig, num_blocks: int) -> None:
        from engine.model_runner import ModelRunner

        cache = dataclasses.replace(config.cache, num_gpu_blocks_override=num_blocks, kv_cache_memory=None)
        self.config = dataclasses.replace(config, model=draft, cache=cache, speculative=None, lora=None)
        self.runner = ModelRunner(self.config)
        logger.info("speculative decoding: draft model %s (%d layers) beside the target, %d KV blocks",
                    draft.path, draft.num_layers, num_blocks)
        self.num_rounds = 0
        self.num_prompt_tokens_computed = 0  # prompt positions the draft computed here (its prefill)

    @property
    def kv_cache(self):  # -> torch.Tensor, the target's layout with the draft's layers and heads
        return self.runner.kv_cache

    @property
    def model_name(self) -> str:
        """The draft model's name as KV pairs compare it (its directory's name)."""
        return self.config.model.path.name

    @property
    def kv_scales(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """An FP8 draft cache's per-layer (k_scale, v_scale); ((), ()) in the model's dtype."""
        s = self.runner.kv_scales
        return ((), ()) if s is None else (s.k, s.v)

    def _run(self, step: SchedulerOutput) -> tuple[list, list | None]:
        """One step of the draft, read at once (on its decode graphs where they hold it)."""
        return self.runner.run(step, plan_step(step.scheduled, self.runner.step_runtime())).result()

    def prefill(self, rows: Sequence[ScheduledRequest]) -> None:
        """Compute the draft's KV of the prompt chunks the target computes this step (the
        prefill tier: rows whose KV is sent), into the same blocks. The prefill tier's cached
        blocks all came through here, so a row's draft KV is valid wherever its target's is."""
        step = SchedulerOutput(scheduled=[ScheduledRequest(_DraftRow(s.request, s.request.num_computed_tokens),  # type: ignore[arg-type]
                                                           s.num_new_tokens, s.block_ids[:1]) for s in rows])
        if not step.scheduled:
            return
        self._run(step)
        for s in rows:
            s.request.num_draft_computed = s.request.num_computed_tokens + s.num_new_tokens
        self.num_prompt_tokens_computed += step.num_batched_tokens

    def propose(self, batch: Sequence[tuple[Request, int, list[int]]]) -> dict[str, list[int]]:
        """Up to k greedy proposals for each (request, k, its block table), by request id."""
        rows = [(_DraftRow(req), k, blocks, req) for req, k, blocks in batch if k > 0]
        out: dict[str, list[int]] = {row.request_id: [] for row, *_ in rows}
        self.num_prompt_tokens_computed += sum(max(0, req.num_prompt_tokens - row.num_computed_tokens)
                                               for row, _, _, req in rows)
        active = rows
        while active:
            step = SchedulerOutput(scheduled=[ScheduledRequest(row, row.num_tokens - row.num_computed_tokens,  # type: ignore[arg-type]
                                                               (blocks,)) for row, _, blocks, _ in active])
            sampled, _ = self._run(step)
            still = []
            for (row, k, blocks, req), token in zip(active, sampled):
                row.num_computed_tokens = row.num_tokens
                if token is None or token < 0:  # no proposal from this row (the sampler's guard)
                    continue
                out[row.request_id].append(int(token))
                row.all_token_ids.append(int(token))
                if len(out[row.request_id]) < k:
                    still.append((row, k, blocks, req))
            active = still
        for row, _, _, req in rows:  # the last proposal has no draft KV yet
            req.num_draft_computed = row.num_computed_tokens
        self.num_rounds += 1
        return out

    def close(self) -> None:
        self.runner.close()
