"""The oracle of the FP8 W8A8 tests: transformers' own model with the checkpoint's
weights dequantized to float32 (tests/engine/quant_checkpoints.py writes that copy),
whose linear layers and experts see their inputs round-tripped through e4m3 per
token (per token and group of columns for block-scaled weights), as dynamic
activation quantization does. Written here from the scheme's definition,
independently of kernels/:

    s = max(amax |x| / 448, 1 / (448 * 512)) over a token's row (or a group of it)
    x -> e4m3(clamp(x / s, -448, 448)) * s

The LM head and the MoE routers keep their float inputs (they are not quantized).

Rounding to e4m3 makes the model chaotic at the scale of float rounding: an
activation within an ulp of a rounding boundary takes either code depending on the
order of a sum (pdserve's attention and transformers' add in different orders), and
one code step (1/8 to 1/16 relative) can flip a later token whose logits do not tie.
So a first difference from the oracle is allowed where the logits tie or where the
oracle itself, its activations perturbed at float-rounding size (1e-6 relative) before
they are rounded, picks the served token too (``assert_w8a8_match``): a quantizer
tie. A systematic error (a scale dropped, activations not rounded) changes tokens
where no such perturbation reaches."""
from __future__ import annotations

from pathlib import Path

import torch


def round_trip_tokens(x: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """x [..., K] as a dynamically quantized activation gives it back, in x's dtype."""
    shape = x.shape
    rows = x.float().reshape(-1, shape[-1])
    k = rows.shape[1]
    g = k if group_size is None else group_size
    pad = -k % g
    grouped = torch.nn.functional.pad(rows, (0, pad)).reshape(rows.shape[0], -1, g)
    s = (grouped.abs().amax(dim=2, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    q = (grouped / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s
    return q.reshape(rows.shape[0], -1)[:, :k].reshape(shape).to(x.dtype)


class _Rounding:
    """The activation rounding of one oracle model; ``noise``: (relative size, generator) to
    perturb inputs before they are rounded, or None."""

    def __init__(self, group_size: int | None) -> None:
        self.group_size, self.noise = group_size, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.noise is not None:
            eps, gen = self.noise
            x = x * (1 + eps * torch.randn(x.shape, generator=gen))
        return round_trip_tokens(x, self.group_size)


def hf_w8a8_model(dequant_dir: Path, group_size: int | None = None, keep: tuple[str, ...] = ()):
    """transformers' model at ``dequant_dir`` (float32, CPU) with W8A8's activation rounding
    on every decoder linear layer and expert, but those named ``keep`` (the last part of
    their names: left unquantized)."""
    from transformers import AutoModelForCausalLM

    # eager experts: the loop over hit experts calling F.linear, which the rounding wraps
    # (the default grouped_mm path would not call it)
    model = AutoModelForCausalLM.from_pretrained(str(dequant_dir), dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    rounding = model.w8a8_rounding = _Rounding(group_size)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and name.rsplit(".", 1)[-1] not in keep:
            module.register_forward_pre_hook(lambda mod, args: (rounding(args[0]), *args[1:]))
        elif type(module).__name__.endswith("Experts"):  # transformers 5's stacked experts call F.linear
            module.forward = _experts_forward(module.forward, rounding)
    return model


def _experts_forward(forward, rounding: _Rounding):
    def wrapped(*args, **kwargs):
        linear = torch.nn.functional.linear
        torch.nn.functional.linear = lambda x, w, b=None: linear(rounding(x), w, b)
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = linear
    return wrapped


def assert_w8a8_match(model, prompts: list[list[int]], expected: list[list[int]], got: list[list[int]], *,
                      eps: float = 1e-6, trials: int = 16) -> None:
    """Token for token, a first difference allowed only at a tie of the logits or of the
    quantizer (module docstring): the oracle ``model`` (hf_w8a8_model) run on the prompt and
    its tokens before the difference, with ``trials`` perturbations of ``eps``, must pick
    the served token at least once."""
    from tests.engine.families import assert_greedy_match

    rounding = model.w8a8_rounding
    for p, want, have in zip(prompts, expected, got):
        if want == have:
            continue
        i = next((j for j, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        assert i < min(len(want), len(have)), f"lengths differ: {len(want)} vs {len(have)}"
        ids = torch.tensor([p + want[:i]])
        picks = set()
        gen = torch.Generator().manual_seed(i)
        try:
            rounding.noise = (eps, gen)
            with torch.no_grad():
                for _ in range(trials):
                    picks.add(int(model(ids).logits[0, -1].argmax()))
        finally:
            rounding.noise = None
        if have[i] in picks:
            continue
        assert_greedy_match(model, [p], [want], [have])  # else only a tie of the logits explains it
