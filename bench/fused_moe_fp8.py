"""The fused MoE kernel with FP8 (e4m3, W8A8) experts against the bf16 kernel on the GPU.

At the Qwen3-30B-A3B shape (E=128, top-8, H=2048, I=768) and 1, 8, 32, 64
and 8192 tokens, three variants of ``kernels.fused_moe`` with bf16 activations:
bf16 weights, e4m3 weights with per-channel scales, and e4m3 weights with
128x128 block scales (Qwen3-30B-A3B-FP8's format). Each is tuned for exactly
these token counts first (``kernels.fused_moe.tune``, not cached) unless
``--no-tune``, and checked against ``kernels.reference.fused_moe``. Times are
medians of CUDA-graph replays (``triton.testing.do_bench_cudagraph``) of the
whole launcher (the two activation quantizations included); decode cases cycle
through ``MOE_ROUTINGS`` routings so that L2 cannot hold the experts. Decode
rows report the expert bytes read (codes and scales of each distinct expert
hit) against the copy bandwidth measured in the same run, the prefill row
TFLOP/s; every row the speed-up over bf16.

    python -m bench.fused_moe_fp8 [--no-tune] [--tokens 1,8,32,64,8192] [--output-json F]
"""
from __future__ import annotations

import argparse
import time

from bench.kernels import MOE_DECODE_TOKENS, MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_PREFILL_TOKENS, MOE_ROUTINGS, \
    MOE_TOP_K, moe_flops, moe_weight_bytes

VARIANTS = ("bf16", "fp8-channel", "fp8-block128")


def make_experts(variant: str, shape: tuple[int, int, int, int], device, gen) -> tuple:
    """(w13, w2, fused_moe keywords) of one variant: bf16 weights, or their e4m3 codes with
    scales amax / 448 per row or per 128x128 block (the last blocks may be short)."""
    import torch
    import torch.nn.functional as F

    from kernels.fused_moe import FP8_DTYPE

    e, h, i, _ = shape
    w13 = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=gen) * i ** -0.5
    if variant == "bf16":
        return w13, w2, {}
    block = (128, 128) if variant == "fp8-block128" else None
    out = []
    for w in (w13, w2):
        _, r, c = w.shape
        if block is None:
            scale = (w.float().abs().amax(dim=2) / 448).clamp(min=1e-12)  # [E, r]
            full = scale[:, :, None]
        else:
            nr, nc = -(-r // 128), -(-c // 128)
            padded = F.pad(w.float(), (0, nc * 128 - c, 0, nr * 128 - r))
            scale = (padded.view(e, nr, 128, nc, 128).abs().amax(dim=(2, 4)) / 448).clamp(min=1e-12)
            del padded
            full = scale.repeat_interleave(128, dim=1)[:, :r].repeat_interleave(128, dim=2)[:, :, :c]
        out += [(w.float() / full).to(FP8_DTYPE), scale]
        del full
    return out[0], out[2], dict(w13_scale=out[1], w2_scale=out[3], block_size=block)


def bench_fp8_moe(bench, copy_bw: float, *, device: str = "cuda",
                  shape: tuple[int, int, int, int] = (MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K),
                  tokens: tuple[int, ...] = (*MOE_DECODE_TOKENS, MOE_PREFILL_TOKENS), decode_max: int = 64,
                  tune: bool = True, variants: tuple[str, ...] = VARIANTS) -> dict:
    """Every variant at every token count; ``bench(fn)`` times fn in ms. Counts up to
    ``decode_max`` are decode rows (bytes), larger ones prefill rows (FLOP/s)."""
    import torch

    import kernels
    from kernels import reference
    from kernels.fused_moe import pick_tiles
    from kernels.fused_moe import tune as tune_tiles

    dev = torch.device(device)
    e, h, i, k = shape
    gen = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"shape": {"E": e, "H": h, "I": i, "K": k}, "copy_bytes_per_s": copy_bw, "variants": {}}
    bf16_us: dict[int, float] = {}
    for variant in variants:
        w13, w2, quant = make_experts(variant, shape, dev, gen)
        config = None
        if tune:
            started = time.perf_counter()
            config = tune_tiles(e, h, i, k, w13.dtype, dev, token_counts=tokens, block_size=quant.get("block_size"))
            print(f"{variant}: tuned {len(tokens)} token counts in {time.perf_counter() - started:.1f} s", flush=True)
        scale_bytes = sum(quant[n].numel() * 4 for n in ("w13_scale", "w2_scale") if n in quant) / e  # per expert
        rows = []
        for t in tokens:
            calls = MOE_ROUTINGS if t <= decode_max else 1
            xs = [torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(calls)]
            ids = [torch.rand(t, e, device=dev, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
                   for _ in range(calls)]
            ws = [torch.rand(t, k, device=dev, generator=gen).softmax(-1) for _ in range(calls)]
            err = (kernels.fused_moe(xs[0], w13, w2, ws[0], ids[0], config=config, **quant).float()
                   - reference.fused_moe(xs[0], w13, w2, ws[0], ids[0], **quant).float()).abs().max().item()
            ms = bench(lambda: [kernels.fused_moe(x, w13, w2, w, d, config=config, **quant)
                                for x, w, d in zip(xs, ws, ids)])
            us = ms * 1e3 / calls
            row = {"tokens": t, "us": us, "max_abs_err": err, "tiles": pick_tiles(config, t, e, k, w13.dtype).as_dict()}
            if variant == "bf16":
                bf16_us[t] = us
            if t in bf16_us:
                row["speedup_vs_bf16"] = bf16_us[t] / us
            if t <= decode_max:
                hit = sum(int(d[(d >= 0) & (d < e)].unique().numel()) for d in ids) / calls
                nbytes = sum(moe_weight_bytes(d, e, h, i, w13.element_size()) for d in ids) / calls + hit * scale_bytes
                row.update(weight_bytes=nbytes, bytes_per_s=nbytes / (us * 1e-6), of_copy=nbytes / (us * 1e-6) / copy_bw)
                what = (f"{nbytes / 1e6:6.1f} MB of experts {row['bytes_per_s'] / 1e12:5.2f} TB/s = "
                        f"{100 * row['of_copy']:5.1f}% of copy")
            else:
                flops = moe_flops(t, k, h, i)
                row.update(flops=flops, flops_per_s=flops / (us * 1e-6))
                what = f"{row['flops_per_s'] / 1e12:6.0f} TFLOP/s"
            speed = f"  x{row['speedup_vs_bf16']:.2f} vs bf16" if "speedup_vs_bf16" in row else ""
            print(f"fused_moe {variant:12s} {t:5d} tokens: {us:8.1f} us  {what}{speed}  (max |err| {err:.3g})",
                  flush=True)
            rows.append(row)
        result["variants"][variant] = {"config": config, "cases": rows}
        del w13, w2, quant
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return result


def main() -> None:
    import torch
    import triton.testing

    from bench.results import write_result

    p = argparse.ArgumentParser()
    p.add_argument("--no-tune", action="store_true", help="default tiles only (no tuning first)")
    p.add_argument("--tokens", default=",".join(map(str, (*MOE_DECODE_TOKENS, MOE_PREFILL_TOKENS))))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.fused_moe_fp8 needs a CUDA GPU")
    def bench(fn) -> float:  # milliseconds
        return triton.testing.do_bench_cudagraph(fn, rep=100)

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / (bench(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    result = bench_fp8_moe(bench, copy_bw,
                           tokens=tuple(int(t) for t in args.tokens.split(",")), tune=not args.no_tune,
                           variants=tuple(args.variants.split(",")))
    write_result(result, "fused_moe_fp8", args.output_json)


if __name__ == "__main__":
    main()
