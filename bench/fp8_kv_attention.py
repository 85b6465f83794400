"""Paged attention over an FP8 (e4m3) KV cache against a bf16 cache, on the GPU.

Decode shapes of the Llama-3.1-8B attention (32 query / 8 KV heads, head dim 128,
16-token pages in random order), bf16 queries. Each FP8 variant is checked against
``kernels.reference.paged_attention`` first, then timed with CUDA-graph replays;
the floor is the cache bytes read (K and V, one byte a value in FP8) at the
bandwidth measured in the same run (the better of a device-to-device copy and a
read-only sum, as ``bench.fp8_gemm``'s floor: attention only reads the cache). Variants of the FP8 kernel
(``kernels/paged_attention.py``'s module settings):

    krows   decode tiles load K key by key, widen, then transpose (else [dims, keys])
    fp16    the dots run in float16 (Q clamped to float16's range; e4m3 widens to it in
            one instruction), else in bfloat16
    bn      decode key tiles of 64 or 128 keys (0: the default tiles)

Each variant is one ``--variant krows,fp16,bn`` (e.g. 1,1,0; several allowed); run each
in its own process where one could fault (a fault ends the process's CUDA context).

    python -m bench.fp8_kv_attention [--variant 1,1,0 ...] [--cases 256x1024,64x4096] [--output-json F]
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools

from bench.results import write_result

HQ, HKV, D, BS = 32, 8, 128, 16
DECODE_CASES = [(256, 1024), (64, 4096), (8, 32768)]  # (batch, context)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=None, metavar="KROWS,FP16,BN")
    p.add_argument("--cases", default=",".join(f"{b}x{c}" for b, c in DECODE_CASES), metavar="BxCTX,...")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    variants = [tuple(int(v) for v in spec.split(",")) for spec in
                (args.variant or [",".join(map(str, v)) for v in itertools.product((1, 0), (1, 0), (0, 64, 128))])]
    cases = [tuple(int(v) for v in case.split("x")) for case in args.cases.split(",")]
    import torch
    import triton.testing

    from bench.gemm_timing import copy_bandwidth, read_bandwidth
    from kernels import reference

    pa = importlib.import_module("kernels.paged_attention")  # the module (kernels exports its launcher)

    dev = torch.device("cuda")
    torch.manual_seed(0)

    def bench(fn) -> float:  # microseconds
        return triton.testing.do_bench_cudagraph(fn, rep=100) * 1e3

    copy_bw, read_bw = copy_bandwidth(), read_bandwidth()
    bw = max(copy_bw, read_bw)  # the floor's bandwidth
    print(f"copy {copy_bw / 1e12:.2f} TB/s (read + write), read {read_bw / 1e12:.2f} TB/s", flush=True)
    result: dict = {"copy_bytes_per_s": copy_bw, "read_bytes_per_s": read_bw, "cases": []}
    tile_config = pa._tile_config
    settings = pa.FP8_DECODE_K_ROWS, pa.FP8_FP16_DOTS  # put back after each variant

    def decode_tiles(block_n: int):
        def config(num_tokens, num_seqs, group, head_dim, itemsize=2, kv_itemsize=None):
            cfg = tile_config(num_tokens, num_seqs, group, head_dim, itemsize, kv_itemsize)
            return dataclasses.replace(cfg, block_n=block_n) if block_n and cfg.block_q == 1 else cfg
        return config

    k_scale, v_scale = 0.02, 0.015
    for b, ctx in cases:
        nblk = b * (ctx // BS)
        kc = torch.randn(nblk, BS, HKV, D, device=dev, dtype=torch.bfloat16)
        vc = torch.randn(nblk, BS, HKV, D, device=dev, dtype=torch.bfloat16)
        k8 = (kc.float() * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
        v8 = (vc.float() * 8).clamp(-448, 448).to(torch.float8_e4m3fn)
        tables = torch.randperm(nblk, device=dev, dtype=torch.int32).view(b, ctx // BS)
        q = torch.randn(b, HQ, D, device=dev, dtype=torch.bfloat16)
        qsl = torch.arange(b + 1, device=dev, dtype=torch.int32)
        lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
        scale = D ** -0.5
        shape = f"{b:4d} x {ctx:6d}"
        us = bench(lambda: pa.paged_attention(q, kc, vc, tables, qsl, lens, scale))
        bf16_bytes = b * ctx * HKV * D * 2 * 2
        row = {"batch": b, "context": ctx, "cache": "bf16", "us": us, "of_bandwidth": bf16_bytes / (us * 1e-6) / bw}
        result["cases"].append(row)
        print(f"{shape} bf16 cache                 {us:8.1f} us  {100 * row['of_bandwidth']:5.1f}% of bandwidth",
              flush=True)
        ref = reference.paged_attention(q, k8, v8, tables, qsl, lens, scale, k_scale=k_scale, v_scale=v_scale)
        fp8_bytes = bf16_bytes // 2
        for krows, fp16, block_n in variants:
            pa.FP8_DECODE_K_ROWS, pa.FP8_FP16_DOTS = bool(krows), bool(fp16)
            pa._tile_config = decode_tiles(block_n)
            try:
                call = lambda: pa.paged_attention(q, k8, v8, tables, qsl, lens, scale,  # noqa: E731
                                                  k_scale=k_scale, v_scale=v_scale)
                err = (call().float() - ref.float()).abs().max().item()
                us = bench(call)
            finally:
                pa._tile_config = tile_config
                pa.FP8_DECODE_K_ROWS, pa.FP8_FP16_DOTS = settings
            torch.cuda.synchronize()
            name = f"krows={krows} fp16={fp16} bn={block_n or 'default'}"
            row = {"batch": b, "context": ctx, "cache": "fp8", "krows": krows, "fp16_dots": fp16, "block_n": block_n,
                   "us": us, "of_bandwidth": fp8_bytes / (us * 1e-6) / bw, "floor_us": fp8_bytes / bw * 1e6,
                   "max_abs_err": err}
            result["cases"].append(row)
            print(f"{shape} fp8 {name:24s} {us:8.1f} us  {100 * row['of_bandwidth']:5.1f}% of bandwidth  "
                  f"(floor {row['floor_us']:.1f} us; max |err| {err:.2g})", flush=True)
        del kc, vc, k8, v8
    write_result(result, "fp8_kv_attention", args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
