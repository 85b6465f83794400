"""Which method each layer of a model gets, from a resolved ``QuantizationConfig``.

Layers name themselves by their checkpoint names (``model.layers.3.self_attn``
with the parts ``q_proj``, ``k_proj``, ``v_proj``; a checkpoint that stores them
fused names ``qkv_proj``), so the checkpoint's own rules apply unchanged:

    compressed-tensors   ``ignore``: exact names or "re:" patterns; a config group's
                         ``targets``: "Linear" (every linear layer), names or "re:" patterns
    awq, gptq, fp8       ``modules_to_not_convert`` / ``ignored_layers``: a layer whose
                         name contains one of them (as whole dotted components: "gate"
                         is a router, not gate_proj) is left in the model dtype
    mxfp4                only the experts of MoE blocks are quantized; experts named by a
                         ``modules_to_not_convert`` pattern (transformers' rule:
                         config.hf_module_matches) stay in the model dtype; a linear layer
                         the patterns do not name is refused (MXFP4 linear layers are not served)
    gguf                 ``tensor_types``: the layers it names (every part of a stacked layer,
                         with one type) are GGUF blocks; the rest are float

A stacked layer's parts must agree: all quantized with one scheme, or none.
"""
from __future__ import annotations

import re
from types import ModuleType
from typing import Sequence

from engine.layers.linear import LinearMethod
from engine.layers.moe import MoEMethod
from engine.quantization.config import QuantizationConfig, Scheme, config_schemes, hf_module_matches, ignored_names


class QuantMethods:
    """The methods of one model: ``linear(...)`` for a linear layer, ``moe(...)`` for a
    mixture-of-experts block (None: the plain method)."""

    def __init__(self, qc: QuantizationConfig, ops: ModuleType) -> None:
        self.config, self.ops = qc, ops
        self.schemes = config_schemes(qc)
        self.ignore = ignored_names(qc)
        self.regex_rules = qc.method == "compressed-tensors"

    # ---- matching -----------------------------------------------------------------------------------
    def _matches(self, rule: str, name: str) -> bool:
        if self.regex_rules:
            return re.match(rule[3:], name) is not None if rule.startswith("re:") else rule == name
        # whole dotted components: "mlp.gate" names a router, not "mlp.gate_proj"
        return re.search(rf"(^|\.){re.escape(rule)}($|\.)", name) is not None

    def _scheme_of(self, name: str) -> Scheme | None:
        if any(self._matches(rule, name) for rule in self.ignore):
            return None
        if not self.regex_rules:
            return self.schemes["default"]
        for group, scheme in self.schemes.items():
            targets = self.config.checkpoint["config_groups"][group]["targets"]
            if any(t == "Linear" or self._matches(t, name) for t in targets):
                return scheme
        return None

    def scheme(self, prefix: str, module: str, parts: Sequence[str] = ()) -> Scheme | None:
        """The scheme of layer ``prefix.module`` stacked from ``prefix.<part>`` checkpoint
        tensors: the fused name's when a rule names it, else the parts' (which must agree)."""
        fused = f"{prefix}.{module}"
        names = [f"{prefix}.{p}" for p in parts] or [fused]
        if any(self._matches(rule, fused) for rule in self.ignore):
            return None
        found = {n: self._scheme_of(n) for n in names}
        if len(set(found.values())) > 1:
            listed = ", ".join(f"{n}: {s.summary() if s else 'not quantized'}" for n, s in found.items())
            raise ValueError(f"{fused} is stacked from parts the checkpoint quantizes differently ({listed}); "
                             "its parts need one scheme")
        return found[names[0]]

    # ---- methods ------------------------------------------------------------------------------------
    def linear(self, prefix: str, module: str, parts: Sequence[str] = ()) -> LinearMethod | None:
        if self.config.method == "mxfp4":  # MXFP4 checkpoints quantize only the experts
            names = [f"{prefix}.{module}"] + [f"{prefix}.{p}" for p in parts]
            if not any(hf_module_matches(rule, n) for rule in self.ignore for n in names):
                raise ValueError(f"{names[0]}: the mxfp4 checkpoint's quantization_config.modules_to_not_convert "
                                 "does not leave this linear layer 16-bit, and MXFP4 linear layers are not supported "
                                 "(only the experts of mixture-of-experts blocks; gpt-oss lists "
                                 "model.layers.*.self_attn, model.layers.*.mlp.router, model.embed_tokens, lm_head)")
            return None
        if self.config.method == "gguf":
            return self._gguf_linear(prefix, module, parts)
        scheme = self.scheme(prefix, module, parts)
        if scheme is None:
            return None
        where = f"{prefix}.{module}"
        if scheme.kind == "fp8":
            from engine.quantization.fp8 import Fp8LinearMethod

            return Fp8LinearMethod(scheme, online=self.config.online, ops=self.ops, prefix=where)
        from engine.quantization.int4 import Int4LinearMethod

        return Int4LinearMethod(**scheme.int4, online=self.config.online, prefix=where, ops=self.ops)

    def _gguf_linear(self, prefix: str, module: str, parts: Sequence[str]) -> LinearMethod | None:
        types = self.config.checkpoint.get("tensor_types", {})
        names = [f"{prefix}.{p}" for p in parts] or [f"{prefix}.{module}"]
        found = {n: types.get(n) for n in names}
        if len(set(found.values())) > 1:
            listed = ", ".join(f"{n}: {t or 'float'}" for n, t in found.items())
            raise ValueError(f"{prefix}.{module} is stacked from parts of different GGUF types ({listed}); its "
                             "parts need one type")
        qtype = found[names[0]]
        if qtype is None:
            return None
        from engine.quantization.gguf import GgufLinearMethod

        return GgufLinearMethod(qtype, prefix=f"{prefix}.{module}", ops=self.ops,
                                activations=self.config.gguf_activations)

    def vocab_type(self, name: str) -> str | None:
        """The GGUF type a vocabulary table (``model.embed_tokens``, ``lm_head``) is kept packed
        in (None: float; every other method leaves these tables 16-bit)."""
        if self.config.method != "gguf":
            return None
        return self.config.checkpoint.get("tensor_types", {}).get(name)

    def moe(self, prefix: str, num_experts: int, projections: Sequence[str]) -> MoEMethod | None:
        """The experts' method: every expert's projections (``prefix.experts.<e>.<proj>``)
        must share one scheme. MXFP4: ``prefix.experts`` unless modules_to_not_convert names it."""
        if self.config.method == "gguf":
            raise ValueError(f"{prefix}.experts: GGUF mixture-of-experts layers are not supported")
        if self.config.method == "mxfp4":
            if any(hf_module_matches(rule, f"{prefix}.experts") for rule in self.ignore):
                return None
            from engine.quantization.mxfp4 import Mxfp4MoEMethod

            return Mxfp4MoEMethod(online=self.config.online, ops=self.ops, prefix=f"{prefix}.experts")
        names = [f"experts.{e}.{p}" for e in range(num_experts) for p in projections]
        scheme = self.scheme(prefix, "experts", names)
        if scheme is None:
            return None
        if scheme.kind != "fp8":
            raise ValueError(f"{prefix}.experts: {scheme.summary()} experts are not supported (mixture-of-experts "
                             "layers serve fp8, mxfp4 or 16-bit weights)")
        from engine.quantization.fp8 import Fp8MoEMethod

        return Fp8MoEMethod(scheme, online=self.config.online, ops=self.ops, prefix=f"{prefix}.experts")
