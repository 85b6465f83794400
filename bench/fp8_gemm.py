"""The FP8 W8A8 GEMM (``kernels/fp8_gemm.py``) on the GPU against its floor and its peers.

Modes, at Llama-3.1-8B's projection shapes and batch sizes from decode to prefill:

    triton            per-channel scales, the Triton kernel (default tiles)
    scaled_mm         per-channel scales, torch._scaled_mm (rowwise scales, cuBLASLt / CUTLASS)
    block             128x128 block scales (Qwen3-FP8 / DeepSeek checkpoints), the Triton kernel
    block_scaled_mm   128x128 block scales, torch._scaled_mm (cuBLASLt's 1x128 x 128x128 recipe, sm_90)

next to bf16 ``F.linear`` on the same shape. The floor is the bytes a call must
move (the fp8 weight and its scales once, x8 and its scales read, y written) at
the bandwidth measured in the same run (the better of a device-to-device copy and
a read-only sum: a GEMV only reads), or the FLOPs at the fp8 matrix rate measured
in the same run (``torch._scaled_mm`` at 8192^3), whichever is longer.
Each case is checked against ``kernels.reference.fp8_gemm`` first. Times are
medians of CUDA-graph replays, each graph cycling through enough weight copies
that L2 (60 MB) cannot hold them (``bench.gemm_timing``).

``--sweep`` also times a grid of tile configs per case and prints the best next
to the default (every candidate is compiled first, in parallel worker
processes); the closing summary adds the times up per M over the shapes, which
is what ``default_tiles`` and ``SCALED_MM_MIN_ROWS`` are set from.

    python -m bench.fp8_gemm [--sweep] [--tokens 1,16,8192] [--shapes 4096x6144] [--modes triton,block]
                             [--json results.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

from bench.gemm_timing import (
    copy_bandwidth,
    cycle_copies,
    fastest,
    graph_us,
    parse_shapes,
    precompile,
    read_bandwidth,
    relative_error,
)

SHAPES = [  # (K, N): Llama-3.1-8B's qkv, o, gate|up and down projections
    (4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
]
TOKENS = (1, 4, 16, 32, 64, 128, 256, 1024, 8192)
MODES = ("triton", "scaled_mm", "block", "block_scaled_mm")
BLOCK = (128, 128)


def block_size(mode: str) -> tuple[int, int] | None:
    return BLOCK if mode.startswith("block") else None


def backend_of(mode: str) -> str:
    return "scaled_mm" if mode.endswith("scaled_mm") else "triton"


def make_weight(n: int, k: int, mode: str, gen):
    """Random finite e4m3 codes (no NaN) and scales of the mode's format."""
    import torch

    codes = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, device="cuda", generator=gen)  # 0x7f is NaN
    codes |= torch.randint(0, 2, (n, k), dtype=torch.uint8, device="cuda", generator=gen) << 7
    if block_size(mode) is not None:
        shape = (math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]))
    else:
        shape = (n,)
    scales = torch.rand(shape, device="cuda", generator=gen) * 1e-3 + 1e-4
    return codes.view(torch.float8_e4m3fn), scales


def matrix_rates() -> tuple[float, float]:
    """(fp8 rowwise torch._scaled_mm, bf16 F.linear) FLOP/s at 8192^3 on random data."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device="cuda"), torch.ones(1, n, device="cuda")
    fp8 = graph_us(lambda i: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), 1)
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    bf16 = graph_us(lambda i: torch.nn.functional.linear(a16, b16), 1)
    return 2 * n**3 / (fp8 * 1e-6), 2 * n**3 / (bf16 * 1e-6)


def candidates(m: int, mode: str) -> list[dict]:
    """The sweep's tile grid for an M-row case (block mode: K tiles that divide 128)."""
    out = []
    if m <= 4:
        rows = 1 << (m - 1).bit_length()
        for bn, bk, split, warps in itertools.product([16, 32, 64, 128], [128, 256, 512], [2, 4, 8, 16, 32],
                                                      [1, 2, 4, 8]):
            out.append({"block_m": rows, "block_n": bn, "block_k": bk, "split_k": split, "group_m": 1,
                        "num_warps": warps, "num_stages": 2, "kernel": "gemv"})
    if m <= 16:
        grid = itertools.product([16], [64, 128], [128, 256], [2, 4, 8], [4], [4])
    elif m <= 64:
        grid = itertools.product([m], [64, 128], [128], [1, 2, 4], [4], [3, 4])
    elif m <= 256:
        grid = itertools.product([64, 128], [128, 256], [128], [1], [4, 8], [3, 4])
    else:
        grid = [(bm, bn, bk, 1, 8, st) for (bm, bn), bk, st in
                itertools.product([(128, 128), (128, 256), (256, 128)], [64, 128], [3, 4])]
    for bm, bn, bk, split, warps, stages in grid:
        out.append({"block_m": bm, "block_n": bn, "block_k": bk, "split_k": split, "group_m": 8,
                    "num_warps": warps, "num_stages": stages, "kernel": "dot"})
    if block_size(mode) is not None:
        out = [c for c in out if c["block_k"] <= BLOCK[1]]
    return out


def _compile_job(job: tuple) -> str | None:
    """Worker process: run one (K, mode, config) once on tiny operands of the same specialization
    (M is not specialized; N = 16 keeps N's divisibility), which compiles it into Triton's cache."""
    import torch

    from kernels.fp8_gemm import fp8_gemm

    k, mode, cfg = job
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        w8, ws = make_weight(16, k, mode, gen)
        x8 = w8[:1].clone()
        xs = torch.ones((1, ws.shape[1]) if block_size(mode) else (1,), device="cuda")
        fp8_gemm(x8, xs, w8, ws, out_dtype=torch.bfloat16, block_size=block_size(mode), backend="triton", config=cfg)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: reported, then skipped
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def main() -> None:
    import torch
    import torch.nn.functional as F

    from kernels import reference
    from kernels.fp8_gemm import default_tiles, fp8_gemm, fp8_quantize

    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--shapes", default="", help="KxN,KxN (default: Llama-3.1-8B's)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", default="", help="write every row here")
    args = p.parse_args()
    dev = torch.device("cuda")
    shapes = parse_shapes(args.shapes, SHAPES)
    tokens = [int(t) for t in args.tokens.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    gen = torch.Generator(device=dev).manual_seed(0)

    fp8_rate, bf16_rate = matrix_rates()
    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()  # after the matrix rates: the clocks are up
    bw = max(copy_bw, read_bw)  # the floor's bandwidth
    print(f"{torch.cuda.get_device_name(dev)}: copy {copy_bw / 1e12:.2f} TB/s, read {read_bw / 1e12:.2f} TB/s, "
          f"fp8 scaled_mm {fp8_rate / 1e12:.0f} TFLOP/s, bf16 {bf16_rate / 1e12:.0f} TFLOP/s (8192^3)", flush=True)
    failed: dict[tuple, str] = {}
    if args.sweep:
        jobs = sorted({(k, mode, _key(c)) for (k, _), m, mode in itertools.product(shapes, tokens, modes)
                       if backend_of(mode) == "triton" for c in candidates(m, mode)})
        errors = precompile(_compile_job, [(k, mode, dict(c)) for k, mode, c in jobs])
        failed = {job: err for job, err in zip(jobs, errors) if err is not None}
        print(f"sweep: compiled {len(jobs)} configs, {len(failed)} failed", flush=True)
        for job, err in sorted(failed.items())[:10]:
            print(f"    {job[0]} {job[1]} {dict(job[2])}: {err}")
    rows = []
    print(f"{'K':>6} {'N':>6} {'M':>5} | {'mode':<9} | {'us':>8} {'TB/s':>5} {'%floor':>6} | {'bf16 us':>8} "
          f"{'x bf16':>6} | {'best us':>8} best tiles")
    for (k, n), m in itertools.product(shapes, tokens):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        dense = [torch.randn(n, k, device=dev, generator=gen).to(torch.bfloat16)
                 for _ in range(cycle_copies(2 * n * k))]
        bf16_us = graph_us(lambda i: F.linear(x, dense[i]), len(dense))
        del dense
        for mode in modes:
            bs = block_size(mode)
            backend = backend_of(mode)
            weights = [make_weight(n, k, mode, gen) for _ in range(cycle_copies(n * k))]
            x8, xs = fp8_quantize(x, bs[1] if bs else None)
            w8, ws = weights[0]
            got = fp8_gemm(x8, xs, w8, ws, out_dtype=torch.bfloat16, block_size=bs, backend=backend)
            want = reference.fp8_gemm(x8, xs, w8, ws, out_dtype=torch.bfloat16, block_size=bs)
            err = relative_error(got, want)
            assert err < 1e-2, f"K={k} N={n} M={m} {mode}: relative error {err}"
            wbytes = n * k + ws.numel() * 4
            floor_us = max((wbytes + m * k + xs.numel() * 4 + 2 * m * n) / bw, 2 * m * n * k / fp8_rate) * 1e6

            def timed(cfg, backend=backend, bs=bs, x8=x8, xs=xs, weights=weights):
                return graph_us(lambda i: fp8_gemm(x8, xs, *weights[i], out_dtype=torch.bfloat16, block_size=bs,
                                                   backend=backend, config=cfg), len(weights))

            us = timed(None)
            default = default_tiles(m, n, k, bs, dev).as_dict() if backend == "triton" else None
            best = (us, default)
            if args.sweep and backend == "triton":
                compiled = [cfg for cfg in candidates(m, mode) if (k, mode, _key(cfg)) not in failed]
                best = fastest(timed, compiled, best)
            del weights
            rows.append(dict(k=k, n=n, m=m, mode=mode, us=us, floor_us=floor_us, bf16_us=bf16_us, best_us=best[0],
                             best=best[1], default=default, err=err))
            best_text = "" if backend != "triton" else (
                "(default)" if best[1] == default else ", ".join(f"{a}={b}" for a, b in best[1].items()))
            print(f"{k:>6} {n:>6} {m:>5} | {mode:<9} | {us:>8.1f} {wbytes / (us * 1e-6) / 1e12:>5.2f} "
                  f"{100 * floor_us / us:>5.0f}% | {bf16_us:>8.1f} {bf16_us / us:>6.2f} | {best[0]:>8.1f} {best_text}",
                  flush=True)
    summary(rows, modes, tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def summary(rows: list[dict], modes: list[str], tokens: list[int]) -> None:
    """Per M, times added up over the shapes: default and best tiles per mode, bf16, the floor."""
    print("\nsum over shapes, us  (triton/block: default -> best tiles; floor of the per-channel format)")
    print(f"{'M':>5} | " + " | ".join(f"{mode:>17}" for mode in modes) + f" | {'bf16':>8} | {'floor':>8}")
    for m in tokens:
        at = [r for r in rows if r["m"] == m]
        cells = []
        for mode in modes:
            mine = [r for r in at if r["mode"] == mode]
            us, best = sum(r["us"] for r in mine), sum(r["best_us"] for r in mine)
            cells.append(f"{us:>8.1f} -> {best:>5.0f}" if backend_of(mode) == "triton" else f"{us:>17.1f}")
        bf16 = sum(r["bf16_us"] for r in at if r["mode"] == modes[0])
        floor = sum(r["floor_us"] for r in at if r["mode"] == modes[0])
        print(f"{m:>5} | " + " | ".join(cells) + f" | {bf16:>8.1f} | {floor:>8.1f}")


if __name__ == "__main__":
    main()
