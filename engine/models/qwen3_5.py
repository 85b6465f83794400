"""Qwen3.5 (text): Qwen3-Next's hybrid decoder (engine/models/qwen3_next.py) with the
DeltaNet's input projections stored apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
``in_proj_a``; they load stacked into one ``in_proj``, or into ``in_proj_qkvz`` and
``in_proj_ba`` where the checkpoint quantizes b and a otherwise). The dense model has an MLP
on every layer; the MoE model (``Qwen3_5MoeForCausalLM``) experts and a sigmoid-gated
shared expert on every layer, top-k weights always renormalised.

Qwen3.5's multimodal RoPE (``mrope_section``, ``mrope_interleaved``) gives each section of
the rotary dims the position of one axis (text, height, width); text has one position on
every axis, so every section turns by it and the rotation is plain (partial) RoPE.

The published checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``,
``Qwen3_5MoeForConditionalGeneration``): served as their text model, see
``Qwen3_5ForConditionalGeneration`` below.
"""
from __future__ import annotations

from engine.models.base import CausalLM
from engine.models.qwen3_next import Qwen3NextForCausalLM


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    fused_qkvz = False
    always_renormalize = True
    stacked_params = CausalLM.stacked_params + (
        (".in_proj_qkv.", ".in_proj.", "qkv"), (".in_proj_z.", ".in_proj.", "z"),
        (".in_proj_b.", ".in_proj.", "b"), (".in_proj_a.", ".in_proj.", "a"),
    )

    def map_name(self, name: str) -> tuple[str, object] | None:
        mapped = super().map_name(name)
        if mapped is None or ".in_proj." not in mapped[0]:
            return mapped
        if mapped[0] in self.params_by_name():
            return mapped
        # this layer keeps b and a apart (engine/layers/gated_delta_net.py)
        apart = ".in_proj_ba." if mapped[1] in ("b", "a") else ".in_proj_qkvz."
        return mapped[0].replace(".in_proj.", apart), mapped[1]


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A multimodal Qwen3.5 or Qwen3.5-MoE checkpoint served as its text model (ModelConfig
    reads its ``text_config``): ``model.language_model.*`` is the text model's ``model.*``,
    ``lm_head.*`` and ``mtp.*`` are where the text model has them, and the vision tower
    (``model.visual.*``) is not read. Without media, transformers embeds an image or video
    placeholder in a prompt as any other token, at a plain text position: so does this."""

    _LANGUAGE_MODEL = "model.language_model."
    _VISION = "model.visual."

    def map_name(self, name: str) -> tuple[str, object] | None:
        if name.startswith(self._VISION):
            return None
        if name.startswith(self._LANGUAGE_MODEL):
            name = "model." + name[len(self._LANGUAGE_MODEL):]
        return super().map_name(name)
