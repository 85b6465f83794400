"""FP8 (e4m3) W8A8: weights stored in e4m3 with float32 scales, activations
quantized per token at run time, products accumulated in float32 by the FP8
GEMM (``ops.fp8_gemm``: Triton or ``torch._scaled_mm`` on CUDA, its PyTorch
reference on CPU) or, for the experts of a mixture-of-experts block, by the
fused MoE kernel in FP8.

Checkpoint tensors, per linear layer (N = out_features, K = in_features):

    strategy  weight      scale                                          activations (dynamic)
    tensor    [N, K] e4m3 weight_scale: one float per tensor               per token
    channel   [N, K] e4m3 weight_scale [N, 1]                              per token
    block     [N, K] e4m3 weight_scale_inv (fp8) / weight_scale (compressed-tensors)
                          [cdiv(N, bn), cdiv(K, bk)], one per bn x bk tile  per token and group of bk

W = weight * scale (the tile's scale for block weights). ``--quantization fp8``
(online) draws or loads the 16-bit weight and quantizes it per output row at
load: s[n] = max(amax_k |W[n, k]| / 448, 1 / (448 * 512)), weight = e4m3(W / s);
online block weights (a block config with random weights) take one scale per
tile the same way.

After loading, every layer holds ``weight`` [N, K] e4m3 and ``weight_scale``:
[N] float32 (tensor scales expanded to their part's rows: the same values, so
per-tensor layers run the per-channel kernel) or [cdiv(N, bn), cdiv(K, bk)]
(block). A stacked layer (q|k|v, gate|up) takes each part's scales; with block
scales every part but the last must be a multiple of bn rows, so that row n's
tile is n // bn in the stacked weight too.

Experts (``Fp8MoEMethod``): ``experts.gate_up_proj`` [E, 2I, H] and
``experts.down_proj`` [E, H, I] in e4m3 with per-row scales [E, 2I] / [E, H]
(channel) or per-tile ones [E, 2I / bn, cdiv(H, bk)] / [E, cdiv(H, bn), cdiv(I, bk)]
(block: I a multiple of bn); the kernel quantizes each token's input per row (per
group of bk for block weights).
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from engine.layers.linear import LinearBase, LinearMethod, cdiv
from engine.layers.moe import FusedMoE, MoEMethod
from engine.quantization.config import Scheme
from kernels.fp8_reference import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 [N, K], scales [cdiv(N, bn), cdiv(K, bk)] float32): one scale per
    tile, max(amax / 448, FP8_MIN_SCALE), the division in float32 (load time only)."""
    n, k = w.shape
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    padded = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.view(nb, bn, kb, bk)
    scales = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=FP8_MIN_SCALE)  # [nb, kb]
    q = (tiles / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scales.contiguous()


def _replace(module: nn.Module, drop: list[str], buffers: dict[str, torch.Tensor]) -> None:
    """Swap the loaded checkpoint parameters for the kernel's tensors (buffers: no loader)."""
    for name in drop:
        if name in module._parameters:
            delattr(module, name)
    for name, t in buffers.items():
        module.register_buffer(name, t.contiguous())


def _check_scales(where: str, scales: torch.Tensor) -> None:
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
        raise ValueError(f"{where}: the checkpoint's FP8 weight scales must be positive and finite")


class Fp8LinearMethod(LinearMethod):
    """A linear layer with FP8 weights (module docstring). ``ops``: the kernel module
    (``kernels`` or ``kernels.reference``)."""

    def __init__(self, scheme: Scheme, *, online: bool, ops: ModuleType, prefix: str = "") -> None:
        self.strategy, self.block_size, self.scale_name = scheme.strategy, scheme.block_size, scheme.scale_name
        self.online, self.ops, self.prefix = online, ops, prefix

    @property
    def group_size(self) -> int | None:
        """Columns per activation scale: the block width, or None (per token)."""
        return None if self.block_size is None else self.block_size[1]

    def create_weights(self, layer: LinearBase) -> None:
        if self.online:  # the 16-bit weight, quantized in process_weights_after_loading
            super().create_weights(layer)
            return
        n, k = layer.out_size, layer.in_size
        layer.add_param("weight", torch.empty(n, k, dtype=FP8_DTYPE), out_dim=0, in_dim=1)
        if self.strategy == "tensor":
            layer.add_param(self.scale_name, torch.ones(()), per_part=True, keep_dtype=True)
        elif self.strategy == "channel":
            layer.add_param(self.scale_name, torch.ones(n, 1), out_dim=0, keep_dtype=True)
        else:
            bn, bk = self.block_size
            sizes = layer.output_sizes
            if any(size % bn for size in sizes[:-1]):
                raise ValueError(f"{self.prefix}: block-scaled fp8 needs every stacked part but the last to be a "
                                 f"multiple of {bn} rows, got {sizes}")
            layer.add_param(self.scale_name, torch.ones(cdiv(n, bn), cdiv(k, bk)), out_dim=0, in_dim=1,
                            out_div=bn, in_div=bk, keep_dtype=True)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.online:
            w = layer.weight.data
            if self.block_size is not None:
                q, s = quantize_blocks(w, *self.block_size)
            else:
                q, s = self.ops.fp8_quantize(w, None)  # per output row
            _replace(layer, ["weight"], {"weight": q, "weight_scale": s})
            return
        s = getattr(layer, self.scale_name).data.float()
        _check_scales(self.prefix, s)
        if self.strategy == "tensor":  # one per part -> one per row of that part
            s = torch.repeat_interleave(s.reshape(-1), torch.tensor(layer.output_sizes, device=s.device))
        elif self.strategy == "channel":
            s = s.reshape(-1)
        _replace(layer, ["weight", self.scale_name], {"weight": layer.weight.data, "weight_scale": s})

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x8, xs = self.ops.fp8_quantize(x.reshape(-1, shape[-1]), self.group_size)  # [T, K] e4m3, scales
        y = self.ops.fp8_gemm(x8, xs, layer.weight, layer.weight_scale, out_dtype=x.dtype,
                              block_size=self.block_size)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], y.shape[-1])


    def warm_up_key(self, layer: LinearBase) -> tuple:
        return ("fp8", tuple(layer.weight.shape), tuple(layer.weight_scale.shape), self.block_size)

    def warm_up(self, layer: LinearBase, max_tokens: int, dtype: torch.dtype) -> None:
        from kernels.fp8_gemm import warm_up

        warm_up(layer.weight, layer.weight_scale, max_tokens, dtype, block_size=self.block_size)


class Fp8MoEMethod(MoEMethod):
    """The experts of a FusedMoE layer in FP8 (module docstring): per-channel or block
    scales; per-tensor expert scales are not served."""

    def __init__(self, scheme: Scheme, *, online: bool, ops: ModuleType, prefix: str = "") -> None:
        if scheme.strategy == "tensor" and not online:
            raise ValueError(f"{prefix}: per-tensor fp8 expert weights are not supported (per-channel and block "
                             "scales are)")
        self.strategy, self.block_size, self.scale_name = scheme.strategy, scheme.block_size, scheme.scale_name
        self.online, self.ops, self.prefix = online, ops, prefix

    def create_weights(self, layer: FusedMoE) -> None:
        if self.online:
            super().create_weights(layer)
            return
        e, i, h = layer.num_local_experts, layer.part.size, layer.hidden_size
        layer.add_expert_param("gate_up_proj", torch.empty(e, 2 * i, h, dtype=FP8_DTYPE), "gate_up")
        layer.add_expert_param("down_proj", torch.empty(e, h, i, dtype=FP8_DTYPE), "down")
        up, down = f"gate_up_proj_{self.scale_name}", f"down_proj_{self.scale_name}"
        if self.block_size is None:
            layer.add_expert_param(up, torch.ones(e, 2 * i, 1), "gate_up", keep_dtype=True)
            layer.add_expert_param(down, torch.ones(e, h, 1), "down", split=False, keep_dtype=True)
            return
        bn, bk = self.block_size
        if i % bn:
            raise ValueError(f"{self.prefix}: block-scaled fp8 experts need this rank's intermediate size ({i}) "
                             f"to be a multiple of {bn} (gate and up rows are stacked)")
        layer.add_expert_param(up, torch.ones(e, 2 * (i // bn), cdiv(h, bk)), "gate_up", div=bn, keep_dtype=True)
        layer.add_expert_param(down, torch.ones(e, cdiv(h, bn), cdiv(i, bk)), "down", div=bk, keep_dtype=True)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        ex = layer.experts
        if self.online:
            q, s = [], []
            for w in (ex.gate_up_proj.data, ex.down_proj.data):  # [E, rows, cols]
                if self.block_size is not None:
                    pairs = [quantize_blocks(w[j], *self.block_size) for j in range(w.shape[0])]
                    q.append(torch.stack([p[0] for p in pairs]))
                    s.append(torch.stack([p[1] for p in pairs]))
                else:
                    wq, ws = self.ops.fp8_quantize(w.reshape(-1, w.shape[2]), None)  # per row
                    q.append(wq.view(w.shape))
                    s.append(ws.view(w.shape[:2]))
            _replace(ex, ["gate_up_proj", "down_proj"], {"gate_up_proj": q[0], "down_proj": q[1],
                                                           "w13_scale": s[0], "w2_scale": s[1]})
            return
        up, down = f"gate_up_proj_{self.scale_name}", f"down_proj_{self.scale_name}"
        s13, s2 = getattr(ex, up).data.float(), getattr(ex, down).data.float()
        for scales in (s13, s2):
            _check_scales(self.prefix, scales)
        if self.block_size is None:
            s13, s2 = s13.squeeze(2), s2.squeeze(2)
        _replace(ex, ["gate_up_proj", "down_proj", up, down],
                 {"gate_up_proj": ex.gate_up_proj.data, "down_proj": ex.down_proj.data, "w13_scale": s13,
                  "w2_scale": s2})

    def kernel_args(self, layer: FusedMoE) -> dict:
        return dict(w13_scale=layer.experts.w13_scale, w2_scale=layer.experts.w2_scale, block_size=self.block_size)
