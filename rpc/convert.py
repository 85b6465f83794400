"""Conversions between protobuf messages and engine value objects (no torch:
the gateway imports this)."""
from __future__ import annotations

from typing import Sequence

from engine.outputs import Logprobs
from engine.sampling_params import SamplingParams
from engine.structured_outputs import StructuredOutputsParams
from pdserve.v1 import common_pb2

_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "max_tokens", "min_tokens", "logprobs",
                    "skip_special_tokens", "prompt_logprobs", "n", "best_of")


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Raises ValueError on invalid values (the caller maps it to
    INVALID_ARGUMENT / HTTP 400)."""
    kw = {f: getattr(msg, f) for f in _OPTIONAL_FIELDS if msg.HasField(f)}
    if msg.HasField("structured_outputs"):
        kw["structured_outputs"] = structured_from_proto(msg.structured_outputs)
    if msg.logit_bias:
        kw["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        kw["allowed_token_ids"] = list(msg.allowed_token_ids)
    return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos, include_stop_str_in_output=msg.include_stop_str_in_output,
                          **kw)


def structured_from_proto(msg: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = msg.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs needs one of json, json_object, regex, choice, grammar, structural_tag")
    value = getattr(msg, kind)
    if kind == "choice":
        value = tuple(value.choices)
    return StructuredOutputsParams(**{kind: value}, any_whitespace=msg.any_whitespace,
                                   reasoning_end_token_ids=tuple(msg.reasoning_end_token_ids))


def structured_to_proto(p: StructuredOutputsParams) -> common_pb2.StructuredOutputs:
    msg = common_pb2.StructuredOutputs(any_whitespace=p.any_whitespace,
                                       reasoning_end_token_ids=p.reasoning_end_token_ids)
    if p.kind == "choice":
        msg.choice.choices.extend(p.choice)
    else:
        setattr(msg, p.kind, p.spec)
    return msg


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
        stop_token_ids=p.stop_token_ids, ignore_eos=p.ignore_eos, stop=p.stop,
        include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens)
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    if p.n != 1:
        msg.n = p.n
    if p.best_of is not None:
        msg.best_of = p.best_of
    if p.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_to_proto(p.structured_outputs))
    if p.logit_bias:
        msg.logit_bias.update(p.logit_bias)
    if p.allowed_token_ids:
        msg.allowed_token_ids.extend(p.allowed_token_ids)
    return msg


def logprob_to_proto(lp: Logprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def logprob_from_proto(msg: common_pb2.TokenLogprob) -> Logprobs:
    return Logprobs(token_id=msg.token_id, logprob=msg.logprob, rank=msg.rank,
                    top=[(t.token_id, t.logprob) for t in msg.top])


def logprobs_to_proto(lps: Sequence[Logprobs | None]) -> list[common_pb2.TokenLogprob]:
    return [logprob_to_proto(lp) for lp in lps if lp is not None]


def lora_to_proto(info, in_slot: bool = False) -> common_pb2.LoRAAdapter:
    """An engine.lora.config.LoRAInfo as the API reports it."""
    return common_pb2.LoRAAdapter(name=info.name, path=info.path, rank=info.rank, fingerprint=info.fingerprint,
                                  base_model=info.base_model or "", root_hash=info.root_hash, in_slot=in_slot)
