"""The fused MoE kernel at a few tokens: the pair GEMV against the grouped GEMMs, on the GPU.

At 1, 2, 4 and 8 tokens a decode step's MoE layer reads each hit expert's weights once and
multiplies them by one or two rows: the grouped GEMMs pad each expert's rows to a 16-row dot
tile, the pair GEMV (``kernels.fused_moe._pair_gemv_kernel``) reduces along K in registers.
For gpt-oss-20b and -120b (MXFP4 experts, bf16 activations) and Qwen3-30B-A3B (bf16 experts),
this times the grouped GEMMs with tiles tuned for exactly these counts, and the pair GEMV with
each candidate tile, as CUDA-graph replays cycling through ``MOE_ROUTINGS`` routings (so L2
cannot hold the experts); each row reports the expert bytes read (codes and scales of each
distinct expert hit) against the copy bandwidth measured in the same run, and the largest
difference between the two paths' outputs.

    python -m bench.moe_small_batch [--tokens 1,2,4,8] [--shapes gpt-oss-20b,...] [--candidates N]
        [--tune-candidates N] [--output-json F]
"""
from __future__ import annotations

import argparse
import importlib
import math

from bench.kernels import MOE_ROUTINGS

# name: (experts, hidden, intermediate, top_k, MXFP4)
SHAPES = {
    "gpt-oss-20b": (32, 2880, 2880, 4, True),
    "gpt-oss-120b": (128, 2880, 2880, 4, True),
    "qwen3-30b-a3b": (128, 2048, 768, 8, False),
}
# (block_n, block_k, num_warps)
GEMV_CANDIDATES = [(16, 256, 4), (32, 128, 4), (8, 512, 4), (16, 512, 8), (32, 256, 8), (64, 128, 4), (16, 128, 4)]


def expert_bytes(hidden: int, inter: int, mxfp4: bool) -> float:
    """Bytes of one expert's w13 and w2: bf16, or MXFP4 codes (half a byte) and a scale byte per 32."""
    n = 3 * hidden * inter
    return n / 2 + n / 32 if mxfp4 else 2 * n


def make_experts(e: int, h: int, i: int, mxfp4: bool, gen, device):
    """(w13, w2, keywords): random bf16 experts, or random MXFP4 codes with scales that give the
    16-bit path's magnitudes (as ``kernels.fused_moe.tune`` makes them)."""
    import torch

    if not mxfp4:
        return (torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=gen) * h ** -0.5,
                torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=gen) * i ** -0.5, {})

    def packed(rows: int, cols: int):
        codes = torch.randint(0, 256, (e, rows, cols // 2), device=device, dtype=torch.uint8, generator=gen)
        exp = 127 + round(math.log2(cols ** -0.5 / 2.9))
        return codes, torch.full((e, rows, cols // 32), exp, device=device, dtype=torch.uint8)

    (w13, s13), (w2, s2) = packed(2 * i, h), packed(h, i)
    return w13, w2, dict(w13_scale=s13, w2_scale=s2, activation="swigluoai",
                         w13_bias=torch.randn(e, 2 * i, device=device, dtype=torch.bfloat16, generator=gen) * 0.1,
                         w2_bias=torch.randn(e, h, device=device, dtype=torch.bfloat16, generator=gen) * 0.1)


def main() -> int:
    import torch
    import triton.testing

    import kernels
    from bench.results import write_result

    fm = importlib.import_module("kernels.fused_moe")  # the module: ``kernels.fused_moe`` is its launcher

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--candidates", type=int, default=len(GEMV_CANDIDATES), help="time the first N GEMV tiles")
    p.add_argument("--tune-candidates", type=int, default=None, help="the grouped GEMMs' first N tiles per BLOCK_M")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.moe_small_batch needs a CUDA GPU")
    dev = torch.device("cuda")
    counts = tuple(int(t) for t in args.tokens.split(","))
    gen = torch.Generator(device=dev).manual_seed(0)

    def bench(fn) -> float:  # milliseconds
        return triton.testing.do_bench_cudagraph(fn, rep=50)

    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / (bench(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    result: dict = {"device": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_bw, "cases": []}
    real_gemv_tiles = fm.gemv_tiles
    for name in args.shapes.split(","):
        e, h, i, k, mxfp4 = SHAPES[name]
        w13, w2, kw = make_experts(e, h, i, mxfp4, gen, dev)
        weight_dtype = torch.uint8 if mxfp4 else torch.bfloat16
        fm.PAIR_GEMV_MAX_TOKENS = 0
        config = fm.tune(e, h, i, k, weight_dtype, dev, counts, rep_ms=20, max_candidates=args.tune_candidates)  # the grouped GEMMs' best tiles
        per_expert = expert_bytes(h, i, mxfp4)
        for t in counts:
            xs = [torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(MOE_ROUTINGS)]
            ids = [torch.rand(t, e, device=dev, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
                   for _ in range(MOE_ROUTINGS)]
            ws = [torch.rand(t, k, device=dev, generator=gen).softmax(-1) for _ in range(MOE_ROUTINGS)]
            nbytes = sum(int(d.unique().numel()) for d in ids) * per_expert / MOE_ROUTINGS

            def run(cfg=None):
                return [kernels.fused_moe(x, w13, w2, w, d, config=cfg, **kw) for x, w, d in zip(xs, ws, ids)]

            fm.PAIR_GEMV_MAX_TOKENS = 0
            want = run(config)
            grouped_us = bench(lambda: run(config)) * 1e3 / MOE_ROUTINGS
            row = {"shape": name, "tokens": t, "weight_bytes": nbytes, "grouped_us": grouped_us, "gemv": []}
            line = (f"{name:14s} {t:2d} tokens {nbytes / 1e6:6.1f} MB: grouped {grouped_us:7.1f} us "
                    f"({nbytes / grouped_us / 1e6 / copy_bw:5.1%} of copy)")
            for bn, bk, warps in GEMV_CANDIDATES[:args.candidates]:
                tiles = fm.GemvTiles(bn, bk, warps)
                fm.gemv_tiles = lambda *_a, _t=tiles: _t
                try:
                    got = run()
                    err = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, want))
                    us = bench(run) * 1e3 / MOE_ROUTINGS
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit
                    print(f"  gemv {tiles}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                finally:
                    fm.gemv_tiles = real_gemv_tiles
                row["gemv"].append({"tiles": [bn, bk, warps], "us": us, "max_abs_diff": err,
                                    "of_copy": nbytes / (us * 1e-6) / copy_bw})
            best = min(row["gemv"], key=lambda g: g["us"], default=None)
            if best is not None:
                line += (f"; gemv best {best['us']:7.1f} us ({best['of_copy']:5.1%}) with {best['tiles']}, "
                         f"x{grouped_us / best['us']:.2f}, max |diff| {best['max_abs_diff']:.3g}")
            print(line, flush=True)
            print("    " + "  ".join(f"{g['tiles']}: {g['us']:.1f}" for g in row["gemv"]), flush=True)
            result["cases"].append(row)
        del w13, w2, kw
        torch.cuda.empty_cache()
    fm.PAIR_GEMV_MAX_TOKENS = 0
    write_result(result, "moe_small_batch", args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
