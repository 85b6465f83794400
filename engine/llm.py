"""Offline batch API, shaped like vLLM's:

    llm = LLM(model=None)  # the embedded default model
    outs = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0))
    outs[0].outputs[0].text
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from engine.config import EngineArgs
from engine.detokenizer import IncrementalDetokenizer
from engine.llm_engine import LLMEngine
from engine.lora.config import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

Prompt = Union[str, Sequence[int]]
_IDLE_WAIT_S = 0.05


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))
        mc = self.engine.config.model
        self.tokenizer = None
        if (mc.path / "tokenizer_config.json").exists() or (mc.path / "tokenizer.json").exists():
            self.tokenizer = load_tokenizer(mc.path)
        self._ids = itertools.count()

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass token ids")
            return prompt, encode_prompt(self.tokenizer, prompt)
        return None, [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 resume_output_token_ids: Sequence[Sequence[int]] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """``lora_request``: the adapter of every prompt, or one (or None) per prompt; an
        adapter not loaded yet is loaded from its ``lora_path`` (needs ``enable_lora=True``).
        ``resume_output_token_ids``: per prompt, tokens it already generated (a resumed
        request continues after them, as the uninterrupted one would; its outputs are the
        new tokens only). ``priority``: one per prompt, under ``scheduling_policy="priority"``
        (vLLM's argument: lower is served first)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(prompts))
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one object or one per prompt")
        for lr in {lr for lr in loras if lr is not None}:
            self._ensure_lora(lr)
        encoded = [self._encode(p) for p in prompts]
        resumed = list(resume_output_token_ids) if resume_output_token_ids is not None else [()] * len(prompts)
        if len(resumed) != len(prompts):
            raise ValueError("resume_output_token_ids must be one list per prompt")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError("priority must be one value per prompt")
        prompts_out: list[_Prompt] = []
        tracks: list[_Track] = []  # every choice's
        by_id: dict[str, tuple[_Prompt, _Track]] = {}

        def add(p: _Prompt, index: int) -> None:
            sp = p.params.choice(index)
            req = self.engine.add_request(str(next(self._ids)), p.ids, sp, lora_name=p.lora,
                                          resume_output_token_ids=p.resumed, priority=p.priority)
            detok = IncrementalDetokenizer(self.tokenizer, p.ids, sp) if self.tokenizer else None
            t = _Track(req, p.text, detok, index)
            p.choices.append(t)
            tracks.append(t)
            by_id[req.request_id] = (p, t)

        try:
            for (text, ids), sp, lr, done, rank in zip(encoded, params, loras, resumed, priorities):
                p = _Prompt(text, ids, sp, lr.lora_name if lr is not None else None, done, rank)
                prompts_out.append(p)
                add(p, 0)  # the other choices once its prompt is computed: they share its blocks
            bar = _progress(len(prompts_out)) if use_tqdm else None
            while self.engine.has_unfinished_requests():
                step = self.engine.step()
                if not step.did_work:  # everything waits (a constraint compiling)
                    self.engine.wait_for_background(_IDLE_WAIT_S)
                for req in step.updated:
                    entry = by_id.pop(req.request_id, None)  # None: reported again after a stop string
                    if entry is None:
                        continue
                    p, t = entry
                    self._on_tokens(t)
                    if t.index == 0 and len(p.choices) == 1:
                        for index in range(1, p.params.num_sequences):
                            add(p, index)
                    if not req.is_finished:
                        by_id[req.request_id] = entry
                    elif bar is not None and all(c.request.is_finished for c in p.choices) \
                            and len(p.choices) == p.params.num_sequences:
                        bar.update(1)
            if bar is not None:
                bar.close()
        finally:  # an exception (or Ctrl-C) must not leave requests holding blocks
            for t in tracks:
                if not t.request.is_finished:
                    self.engine.abort_request(t.request.request_id)
        return [p.output() for p in prompts_out]

    def _ensure_lora(self, lr: LoRARequest) -> None:
        lora = self.engine.lora
        if lora is None:
            raise ValueError("lora_request needs an LLM made with enable_lora=True")
        info = lora.get(lr.lora_name)
        if info is None or (lr.lora_path and info.path != lr.lora_path):
            if not lr.lora_path:
                raise ValueError(f"LoRA adapter {lr.lora_name!r} is not loaded and the request has no lora_path")
            lora.register(lr.lora_name, lr.lora_path)

    def _on_tokens(self, t: "_Track") -> None:
        if t.detok is None:
            return
        req = t.request
        t.detok.add_tokens(req.output_token_ids[t.num_seen:])
        t.num_seen = req.num_output_tokens
        if t.detok.is_stopped and not req.is_finished:
            req.stop_reason = t.detok.stop_reason
            self.engine.abort_request(req.request_id, RequestStatus.FINISHED_STOPPED)

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer")
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [apply_chat_template(self.tokenizer, c) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params, use_tqdm=use_tqdm)


@dataclass(eq=False)
class _Track:
    """One choice of a prompt of a generate() call: its request and detokenizer."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    index: int = 0  # the choice's
    num_seen: int = 0  # output tokens already fed to the detokenizer

    def completion(self, index: int, logprobs: bool) -> CompletionOutput:
        req, text = self.request, ""
        if self.detok is not None:
            if not self.detok.is_stopped:
                self.detok.finish()
            text = self.detok.output_text
        return CompletionOutput(index, text, list(req.output_token_ids), req.finish_reason, req.stop_reason,
                                list(req.logprobs) if logprobs else None)


@dataclass(eq=False)
class _Prompt:
    """One prompt of a generate() call and its choices (``params.num_sequences`` of them:
    choice 0 first, the others added once its prompt is computed, sharing its KV blocks
    through the prefix cache)."""

    text: str | None
    ids: list[int]
    params: SamplingParams
    lora: str | None
    resumed: Sequence[int]
    priority: int
    choices: list[_Track] = field(default_factory=list)

    def output(self) -> RequestOutput:
        """vLLM's shape: ``n`` completions by index; of ``best_of`` sequences, the ``n`` with the
        highest cumulative logprob (ties: the lower index), re-indexed in that order."""
        choices = sorted(self.choices, key=lambda t: t.index)
        if self.params.num_sequences > self.params.n:
            choices = [choices[i] for i in self.params.best([cumulative_logprob(t.request.logprobs) for t in choices])]
        outputs = [t.completion(i, self.params.logprobs is not None) for i, t in enumerate(choices)]
        req = self.choices[0].request
        t = req.times
        metrics = {"arrival_time": t.arrival, "first_scheduled_time": t.first_scheduled,
                   "first_token_time": t.first_token, "finished_time": t.finished}
        # vLLM's shape: None for the first prompt token, then one entry per prompt token
        prompt_lps = None if req.prompt_logprobs is None else [None, *req.prompt_logprobs]
        return RequestOutput(req.request_id, self.text, list(req.sampling_prompt_token_ids), outputs, True,
                             req.num_cached_tokens, metrics, prompt_lps)


def cumulative_logprob(logprobs: Sequence[Any]) -> float:
    """A sequence's ``best_of`` score: the sum of its sampled tokens' logprobs."""
    return sum(lp.logprob for lp in logprobs if lp is not None)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
