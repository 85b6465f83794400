"""GGUF block-quantized linear layers (Q4_0, Q4_1, Q8_0), weight-only, kept as the file ships them.

A checkpoint with ``quantization_config: {"quant_method": "gguf", "tensor_types": {layer: type}}``
(written by engine/model_files.py's packed conversion of the embedded GGUF) stores each named
layer's weight as ``<layer>.weight`` uint8 [out, in / 32 * block bytes]: the GGUF tensor's rows
unchanged (q and k rows in Hugging Face's order, i.e. llama.cpp's rotary permutation undone row
by row). The layout and the dequantization are ``kernels/gguf_reference.py``'s.

``apply`` runs ``kernels.cpu_gemm.gguf_linear`` (on CPU the compiled kernel of
``kernels/cpu/gguf_gemm.cpp``: blocks dequantized in registers; the reference where it cannot
be built or on other devices). With float32 activations (the default) the result equals
dequantize-then-matmul up to float32 summation order; with ``--gguf-activations q8_0`` the
activations are quantized to int8 blocks first, as llama.cpp does
(``kernels.gguf_reference.linear_q8`` is that reference). Stacked layers (q|k|v,
gate|up) need one type for all their parts; splitting a layer's input across tensor-parallel
ranks is not supported (its output rows split as usual).
"""
from __future__ import annotations

from types import ModuleType

import torch

from engine.layers.linear import LinearBase, LinearMethod
from kernels import cpu_gemm, gguf_reference


class GgufLinearMethod(LinearMethod):
    def __init__(self, qtype: str, *, prefix: str = "", ops: ModuleType | None = None,
                 activations: str = "float32") -> None:
        gguf_reference.check_type(qtype)
        self.qtype, self.prefix, self.ops, self.activations = qtype, prefix, ops, activations

    def create_weights(self, layer: LinearBase) -> None:
        if layer.in_size != layer.full_in_size:
            raise ValueError(f"{self.prefix}: a GGUF layer's input cannot be split across tensor-parallel ranks")
        try:
            nbytes = gguf_reference.row_bytes(self.qtype, layer.in_size)
        except ValueError as e:
            raise ValueError(f"{self.prefix}: {e}") from None
        layer.add_param("weight", torch.empty(layer.out_size, nbytes, dtype=torch.uint8), out_dim=0,
                        keep_dtype=True)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if layer.weight.device.type == "cpu":
            cpu_gemm.gguf_extension()  # build or load it at start-up, not inside the first step

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = cpu_gemm.gguf_linear(x, layer.weight, self.qtype, bias, self.activations)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def direct(self, layer: LinearBase):
        """The compiled GEMM's call on this layer's blocks, where it runs."""
        return cpu_gemm.gguf_linear_call(layer.weight, self.qtype, self.activations)

    def dequantized_weight(self, layer: LinearBase) -> torch.Tensor:
        """The float32 weight [out, in] the layer computes with."""
        return gguf_reference.dequantize(layer.weight.data, self.qtype, layer.in_size)
