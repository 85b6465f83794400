"""The int4 weight-only GEMM (``kernels/int4_gemm.py``) on the GPU against its floor.

The floor is the bytes a call must move (the packed weight, scales and zeros
once, x read and y written) at the copy bandwidth measured in the same run, or
the bf16 matrix rate for large M, whichever is longer. Each case is checked
against ``kernels.reference.int4_gemm`` first. Times are medians of CUDA-graph
replays, each graph cycling through enough weight copies that L2 (60 MB) cannot
hold them (``bench.gemm_timing``). ``--sweep`` also times a grid of tile configs
per case and prints the best next to the default.

    python -m bench.int4_gemm [--sweep] [--group-size 128] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import itertools

from bench.gemm_timing import copy_bandwidth, cycle_copies, fastest, graph_us, parse_shapes, precompile, relative_error

SHAPES = [  # (K, N): Llama-3-8B's qkv, o, gate|up and down projections
    (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
]
TOKENS = (1, 4, 16, 32, 64, 128, 256, 1024, 4096)


def make_weight(k: int, n: int, group_size: int, dtype, device, gen, zeros: bool):
    import torch

    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=device, generator=gen)
    scales = (torch.rand(k // group_size, n, device=device, generator=gen) * 0.01 + 0.001).to(dtype)
    z = torch.randint(0, 16, (k // group_size, n), dtype=torch.uint8, device=device, generator=gen) if zeros else None
    return qweight, scales, z


def _compile_job(job: tuple) -> str | None:
    """Worker process: one (K, group size, dtype, zeros, M, config) run once on a 16-column weight
    (N's divisibility kept), which compiles it into Triton's cache."""
    import torch

    from kernels.int4_gemm import int4_gemm

    k, g, dtype, zeros, m, cfg = job
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        qw, s, z = make_weight(k, 16, g, getattr(torch, dtype), "cuda", gen, zeros)
        int4_gemm(torch.zeros(m, k, device="cuda", dtype=getattr(torch, dtype)), qw, s, z, g, config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: reported, then skipped
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def weight_bytes(qweight, scales, zeros) -> int:
    return qweight.numel() * 4 + scales.numel() * scales.element_size() + (zeros.numel() if zeros is not None else 0)


def main() -> None:
    import torch

    from kernels import int4_gemm, reference
    from kernels.int4_gemm import Int4Tiles, default_tiles

    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--zeros", action="store_true", help="asymmetric weights (zeros read)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--shapes", default="")
    p.add_argument("--gemv-max-rows", type=int, default=None,
                   help="the GEMV kernel up to this many rows by default (kernels.int4_gemm.GEMV_MAX_ROWS)")
    args = p.parse_args()
    if args.gemv_max_rows is not None:
        import importlib

        importlib.import_module("kernels.int4_gemm").GEMV_MAX_ROWS = args.gemv_max_rows  # the module, not the launcher
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth()
    peak = 790e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name(dev)}")
    shapes = parse_shapes(args.shapes, SHAPES)
    tokens = [int(t) for t in args.tokens.split(",")]
    g = args.group_size
    if args.sweep:
        jobs = [(k, g, args.dtype, args.zeros, m, c) for k in sorted({k for k, _ in shapes}) for m in tokens
                for c in candidates(m, g)]
        errors = precompile(_compile_job, jobs)
        print(f"sweep: compiled {len(jobs)} configs, {sum(e is not None for e in errors)} failed", flush=True)
    print(f"{'K':>6} {'N':>6} {'M':>5} | {'default us':>10} {'TB/s':>5} {'%floor':>6} | {'bf16 mm us':>10} | "
          f"{'best us':>8} best tiles")
    for (k, n), m in itertools.product(shapes, tokens):
        first = make_weight(k, n, g, dtype, dev, gen, args.zeros)
        wbytes = weight_bytes(*first)
        weights = [first] + [make_weight(k, n, g, dtype, dev, gen, args.zeros)
                             for _ in range(cycle_copies(wbytes) - 1)]
        x = torch.randn(m, k, device=dev, generator=gen).to(dtype)
        qw, s, z = first
        got = int4_gemm(x, qw, s, z, g)
        want = reference.int4_gemm(x, qw, s, z, g)
        err = relative_error(got, want)
        assert err < 1e-2, f"K={k} N={n} M={m}: relative error {err}"
        floor_s = max((wbytes + m * k * 2 + m * n * 2) / bw, 2 * m * n * k / peak)

        def timed(cfg):
            return graph_us(lambda i: int4_gemm(x, *weights[i], g, config=cfg), len(weights))

        us = timed(None)
        dense = [torch.randn(n, k, device=dev, generator=gen).to(dtype) for _ in range(cycle_copies(2 * n * k))]
        mm_us = graph_us(lambda i: torch.nn.functional.linear(x, dense[i]), len(dense))
        del dense
        best = (us, default_tiles(m, n, k, g, dtype, dev))
        if args.sweep:
            best = fastest(timed, candidates(m, g), best)
        del weights
        tbs = wbytes / (us * 1e-6) / 1e12
        print(f"{k:>6} {n:>6} {m:>5} | {us:>10.1f} {tbs:>5.2f} {100 * floor_s / (us * 1e-6):>5.0f}% | {mm_us:>10.1f} | "
              f"{best[0]:>8.1f} {best[1].as_dict() if isinstance(best[1], Int4Tiles) else best[1]}", flush=True)


def candidates(m: int, g: int) -> list[dict]:
    out = []
    if m <= 4:  # the GEMV kernel (its K tile is the group's: default_tiles'); the tensor-core tiles lost here
        rows = 1 << (m - 1).bit_length()
        for bn, split, warps, stages in itertools.product([32, 64, 128, 256], [1, 2, 4, 8, 16, 32], [1, 2, 4, 8],
                                                          [1, 2]):
            out.append({"block_m": rows, "block_n": bn, "block_k": min(128, g), "split_k": split, "group_m": 1,
                        "num_warps": warps, "num_stages": stages, "kernel": "gemv"})
        return out
    if m <= 16:
        grid = itertools.product([16], [32, 64, 128], [64, 128, 256], [1, 2, 4, 8, 16], [4], [3, 4])
    elif m <= 64:
        grid = itertools.product([m if m >= 16 else 16], [64, 128], [64, 128], [1, 2, 4], [4, 8], [3, 4])
    else:
        grid = itertools.product([64, 128], [64, 128, 256], [64, 128], [1], [4, 8], [3, 4])
    for bm, bn, bk, split, warps, stages in grid:
        if bk > g and g % 16 == 0:
            continue
        out.append({"block_m": bm, "block_n": bn, "block_k": bk, "split_k": split, "group_m": 8,
                    "num_warps": warps, "num_stages": stages})
    return out


if __name__ == "__main__":
    main()
