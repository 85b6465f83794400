"""Offline batch API, shaped like vLLM's:

    llm = LLM(model=None)  # the embedded default model
    outs = llm.generate(["What is the capital of France?"], SamplingParams(temperature=0))
    outs[0].outputs[0].text
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
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
        tracks: list[_Track] = []
        try:
            for (text, ids), sp, lr, done, rank in zip(encoded, params, loras, resumed, priorities):
                req = self.engine.add_request(str(next(self._ids)), ids, sp,
                                              lora_name=lr.lora_name if lr is not None else None,
                                              resume_output_token_ids=done, priority=rank)
                detok = IncrementalDetokenizer(self.tokenizer, ids, sp) if self.tokenizer else None
                tracks.append(_Track(req, text, detok))
            by_id = {t.request.request_id: t for t in tracks}
            bar = _progress(len(tracks)) if use_tqdm else None
            while self.engine.has_unfinished_requests():
                step = self.engine.step()
                if not step.did_work:  # everything waits (a constraint compiling)
                    self.engine.wait_for_background(_IDLE_WAIT_S)
                for req in step.updated:
                    t = by_id.pop(req.request_id, None)  # None: reported again after a stop string
                    if t is None:
                        continue
                    self._on_tokens(t)
                    if not req.is_finished:
                        by_id[req.request_id] = t
                    elif bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        finally:  # an exception (or Ctrl-C) must not leave requests holding blocks
            for t in tracks:
                if not t.request.is_finished:
                    self.engine.abort_request(t.request.request_id)
        return [t.output() for t in tracks]

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


@dataclass
class _Track:
    """One prompt of a generate() call: its request and detokenizer."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    num_seen: int = 0  # output tokens already fed to the detokenizer

    def output(self) -> RequestOutput:
        req, text = self.request, ""
        if self.detok is not None:
            if not self.detok.is_stopped:
                self.detok.finish()
            text = self.detok.output_text
        comp = CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason, req.stop_reason,
                                list(req.logprobs) if req.sampling_params.logprobs is not None else None)
        t = req.times
        metrics = {"arrival_time": t.arrival, "first_scheduled_time": t.first_scheduled,
                   "first_token_time": t.first_token, "finished_time": t.finished}
        # vLLM's shape: None for the first prompt token, then one entry per prompt token
        prompt_lps = None if req.prompt_logprobs is None else [None, *req.prompt_logprobs]
        return RequestOutput(req.request_id, self.prompt, list(req.sampling_prompt_token_ids), [comp], True,
                             req.num_cached_tokens, metrics, prompt_lps)


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
