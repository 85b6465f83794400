"""`pdserve bench kernels`: each Triton kernel on the GPU against its floor.

The floor is the bytes a kernel must move at the copy bandwidth measured in
the same run (a device-to-device copy, bytes read plus written). Every case
is first checked against its PyTorch reference (``kernels.reference``) on
fresh random inputs. Times come from ``triton.testing.do_bench_cudagraph``
(the kernel replayed in a CUDA graph: no launch overhead, as in a decode
step). The 8B shape: 32 query / 8 KV heads of 128, hidden 4096, MLP 14336,
bf16, KV blocks of 16 tokens scattered over the cache. Cases with a sliding
window (a 4k window over 32k contexts, a 2k chunk over a 16k prefix) sit next
to the same shape without one: their floor counts the keys inside the window.

    pdserve bench kernels [--splits 16,32,64] [--output-json F]
"""
from __future__ import annotations

import argparse

from bench.results import write_result

HQ, HKV, D, HIDDEN, INTER, BS = 32, 8, 128, 4096, 14336, 16
MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K = 128, 2048, 768, 8  # Qwen3-30B-A3B
MOE_DECODE_TOKENS, MOE_PREFILL_TOKENS = (1, 8, 32, 64), 8192
MOE_PEAK_BF16_FLOPS = 790e12  # one H200, dense bf16, as measured before (docs: environment)
MOE_ROUTINGS = 8  # decode cases cycle through this many routings so L2 (50 MB) cannot hold the weights
# (batch, context, sliding window or None)
DECODE_CASES = [(1, 32768, None), (1, 32768, 4096), (1, 1024, None), (4, 8192, None), (8, 32768, None),
                (8, 32768, 4096), (32, 1024, None), (32, 4096, None), (32, 8192, None), (64, 4096, None),
                (128, 1024, None), (256, 1024, None)]
# (cached tokens, new tokens, sliding window or None)
PREFILL_CASES = [(0, 4096, None), (4096, 2048, None), (16384, 2048, None), (16384, 2048, 4096)]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--splits", default="",
                   help="split counts to time for every decode case besides the default choice, e.g. 1,2,4,8,16,32,64")
    p.add_argument("--moe-only", action="store_true", help="only the fused MoE cases (and the copy bandwidth)")
    p.add_argument("--output-json", default=None)


def decode_attention_inputs(batch: int, ctx: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                            block_size: int, device, dtype) -> tuple:
    """A decode step's attention inputs: (q [B, Hq, D], k_cache, v_cache, block_tables in a
    random page order, query_start_loc, seq_lens), every sequence ``ctx`` keys long."""
    import torch

    nblk = batch * (ctx // block_size)
    kc = torch.randn(nblk, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.randn(nblk, block_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    tables = torch.randperm(nblk, device=device, dtype=torch.int32).view(batch, ctx // block_size)
    q = torch.randn(batch, num_q_heads, head_dim, device=device, dtype=dtype)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    return q, kc, vc, tables, qsl, lens


def moe_weight_bytes(topk_ids, num_experts: int, hidden: int, inter: int, itemsize: int) -> int:
    """Bytes of expert weights a call must read: w13 and w2 of each distinct expert hit, once."""
    ids = topk_ids[(topk_ids >= 0) & (topk_ids < num_experts)]
    return int(ids.unique().numel()) * 3 * hidden * inter * itemsize


def moe_flops(num_tokens: int, top_k: int, hidden: int, inter: int) -> float:
    """Multiply-adds x 2 of the gate, up and down projections of every (token, slot)."""
    return 2.0 * num_tokens * top_k * 3 * hidden * inter


def bench_fused_moe(bench, copy_bw: float, *, device: str = "cuda", dtype=None,
                    shape: tuple[int, int, int, int] = (MOE_EXPERTS, MOE_HIDDEN, MOE_INTER, MOE_TOP_K),
                    decode_tokens: tuple[int, ...] = MOE_DECODE_TOKENS, prefill_tokens: int = MOE_PREFILL_TOKENS,
                    matmul_size: int = 8192, eager_bench=None) -> dict:
    """The fused MoE cases (see the module docstring). ``bench(fn)`` times in ms
    under a CUDA graph, ``eager_bench(fn)`` (default ``triton.testing.do_bench``)
    without one, for the reference (it syncs). The keywords shrink the run for a
    smoke test; ``dtype`` defaults to bfloat16, ``shape`` is (E, H, I, K)."""
    import time

    import torch
    import triton.testing

    import kernels
    from engine.moe_configs import moe_kernel_config
    from kernels import reference
    from kernels.fused_moe import pick_tiles

    dev, dt = torch.device(device), dtype or torch.bfloat16
    eager_bench = eager_bench or (lambda fn: triton.testing.do_bench(fn, rep=100))
    e, h, i, k = shape
    started = time.perf_counter()
    config = moe_kernel_config(e, h, i, k, dt, dev)
    tune_s = time.perf_counter() - started
    print(f"fused MoE tiles ready in {tune_s:.1f} s (tuned now, or read from the cache)", flush=True)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=dt) * h ** -0.5
    w2 = torch.randn(e, h, i, device=dev, dtype=dt) * i ** -0.5
    a = torch.randn(matmul_size, matmul_size, device=dev, dtype=dt)
    peak = 2 * matmul_size ** 3 / (bench(lambda: a @ a) * 1e-3)
    del a
    print(f"dense {dt} matmul {matmul_size}^3: {peak / 1e12:.0f} TFLOP/s", flush=True)
    result: dict = {"config_seconds": tune_s, "matmul_flops_per_s": peak, "cases": []}

    for t in (*decode_tokens, prefill_tokens):
        calls = MOE_ROUTINGS if t in decode_tokens else 1
        xs = [torch.randn(t, h, device=dev, dtype=dt) for _ in range(calls)]
        ids = [torch.rand(t, e, device=dev).topk(k, dim=-1).indices.to(torch.int32) for _ in range(calls)]
        ws = [torch.rand(t, k, device=dev).softmax(-1) for _ in range(calls)]
        err = max((kernels.fused_moe(x, w13, w2, w, d, config=config).float()
                   - reference.fused_moe(x, w13, w2, w, d).float()).abs().max().item()
                  for x, w, d in zip(xs, ws, ids))
        row = {"tokens": t, "max_abs_err": err, "tiles": pick_tiles(config, t, e, k, dt).as_dict()}
        for name, cfg in (("tuned", config), ("default", None)):
            ms = bench(lambda: [kernels.fused_moe(x, w13, w2, w, d, config=cfg) for x, w, d in zip(xs, ws, ids)])
            row[f"{name}_us"] = ms * 1e3 / calls
        ref_ms = eager_bench(lambda: reference.fused_moe(xs[0], w13, w2, ws[0], ids[0]))
        row["reference_us"] = ref_ms * 1e3
        us = row["tuned_us"]
        if t in decode_tokens:
            nbytes = sum(moe_weight_bytes(d, e, h, i, w13.element_size()) for d in ids) / calls
            row.update(weight_bytes=nbytes, bytes_per_s=nbytes / (us * 1e-6), of_copy=nbytes / (us * 1e-6) / copy_bw)
            what = (f"{nbytes / 1e6:6.1f} MB of experts  {row['bytes_per_s'] / 1e12:5.2f} TB/s = "
                    f"{100 * row['of_copy']:5.1f}% of copy")
        else:
            flops = moe_flops(t, k, h, i)
            row.update(flops=flops, flops_per_s=flops / (us * 1e-6), of_matmul=flops / (us * 1e-6) / peak)
            what = (f"{row['flops_per_s'] / 1e12:5.0f} TFLOP/s = {100 * row['of_matmul']:5.1f}% of the matmul, "
                    f"{100 * row['flops_per_s'] / MOE_PEAK_BF16_FLOPS:5.1f}% of {MOE_PEAK_BF16_FLOPS / 1e12:.0f}")
        result["cases"].append(row)
        print(f"fused_moe {t:5d} tokens: {us:8.1f} us (default tiles {row['default_us']:8.1f} us, reference "
              f"{row['reference_us']:9.1f} us)  {what}  (max |err| {err:.3g})", flush=True)
    return result


def main(args: argparse.Namespace) -> int:
    import torch
    import triton.testing

    import kernels
    from kernels import reference
    from kernels.paged_attention import paged_attention_num_splits

    if not torch.cuda.is_available():
        raise SystemExit("pdserve bench kernels needs a CUDA GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)

    def bench(fn) -> float:  # milliseconds
        return triton.testing.do_bench_cudagraph(fn, rep=100)

    src = torch.empty(1 << 28, dtype=torch.float32, device=dev)  # 1 GiB (a byte-wise copy runs slower)
    dst = torch.empty_like(src)
    copy_bw = 2 * src.numel() * 4 / (bench(lambda: dst.copy_(src)) * 1e-3)
    del src, dst
    result: dict = {"copy_bytes_per_s": copy_bw, "attention_decode": [], "prefill": {}, "elementwise": {}}
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read + write)", flush=True)
    if args.moe_only:
        result["fused_moe"] = bench_fused_moe(bench, copy_bw)
        write_result(result, "kernels", args.output_json)
        return 0

    # ---- paged attention, decode ------------------------------------------------------
    for b, ctx, window in DECODE_CASES:
        q, kc, vc, tables, qsl, lens = decode_attention_inputs(b, ctx, HQ, HKV, D, BS, dev, dt)
        scale = D ** -0.5
        default = paged_attention_num_splits(b, b, HQ, HKV, D, ctx, dev, sliding_window=window)
        ref = reference.paged_attention(q, kc, vc, tables, qsl, lens, scale, sliding_window=window)
        visible = min(ctx, window or ctx)  # keys each query reads
        kv_bytes = b * visible * HKV * D * 2 * 2
        extra = {int(s) for s in args.splits.split(",") if s and int(s) <= max(1, visible // 128)}
        shape = f"{b:4d} x {ctx:6d}" + (f" w{window}" if window else "")
        for splits in sorted({default, *extra}):
            got = kernels.paged_attention(q, kc, vc, tables, qsl, lens, scale, num_splits=splits,
                                          sliding_window=window)
            err = (got.float() - ref.float()).abs().max().item()
            ms = bench(lambda: kernels.paged_attention(q, kc, vc, tables, qsl, lens, scale, num_splits=splits,
                                                       sliding_window=window))
            row = {"batch": b, "context": ctx, "window": window, "splits": splits, "default": splits == default,
                   "us": ms * 1e3, "bytes_per_s": kv_bytes / (ms * 1e-3), "of_copy": kv_bytes / (ms * 1e-3) / copy_bw,
                   "max_abs_err": err}
            result["attention_decode"].append(row)
            print(f"decode {shape:19s}: splits {splits:3d}{' (default)' if splits == default else '':10s} "
                  f"{ms * 1e3:8.1f} us  {row['bytes_per_s'] / 1e12:5.2f} TB/s = {100 * row['of_copy']:5.1f}% "
                  f"of copy  (max |err| {err:.3g})", flush=True)
        del kc, vc

    # ---- prefill attention against SDPA on dense tensors -------------------------------
    # one 4k causal prefill, and a 2k chunk over a 4k and a 16k prefix (SDPA with a
    # lower-right causal mask), the last also with a 4k window (SDPA on the keys of the
    # chunk's windows with a band mask); the pages in random order
    from torch.nn.attention.bias import causal_lower_right

    for ctx, qn, window in PREFILL_CASES:
        n = ctx + qn
        nblk = n // BS
        k = torch.randn(n, HKV, D, device=dev, dtype=dt)
        v = torch.randn(n, HKV, D, device=dev, dtype=dt)
        q = torch.randn(qn, HQ, D, device=dev, dtype=dt)
        perm = torch.randperm(nblk, device=dev)
        kc, vc = torch.empty(nblk, BS, HKV, D, device=dev, dtype=dt), torch.empty(nblk, BS, HKV, D, device=dev, dtype=dt)
        kc[perm], vc[perm] = k.view(nblk, BS, HKV, D), v.view(nblk, BS, HKV, D)
        tables = perm.to(torch.int32)[None]
        qsl = torch.tensor([0, qn], device=dev, dtype=torch.int32)
        lens = torch.tensor([n], device=dev, dtype=torch.int32)
        ours = bench(lambda: kernels.paged_attention(q, kc, vc, tables, qsl, lens, D ** -0.5,
                                                     sliding_window=window))
        k_lo = 0 if window is None else max(0, ctx - window + 1)  # keys before every window: not given to SDPA
        qd, kd, vd = q.transpose(0, 1)[None], k[k_lo:].transpose(0, 1)[None], v[k_lo:].transpose(0, 1)[None]
        if window is None:
            mask = causal_lower_right(qn, n)
        else:
            q_pos = torch.arange(ctx, n, device=dev)[:, None]
            k_pos = torch.arange(k_lo, n, device=dev)[None, :]
            mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [qn, n - k_lo]
        sdpa_fn = lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask,  # noqa: E731
                                                                            enable_gqa=True)
        sdpa = bench(sdpa_fn)
        got = kernels.paged_attention(q, kc, vc, tables, qsl, lens, D ** -0.5, sliding_window=window)
        err = (got.float() - sdpa_fn()[0].transpose(0, 1).float()).abs().max().item()
        seen = qn * (ctx + qn / 2) if window is None else sum(min(p + 1, window) for p in range(ctx, n))
        flops = 4 * seen * HQ * D
        key = f"{ctx}+{qn}" + (f" w{window}" if window else "")
        result["prefill"][key] = {"us": ours * 1e3, "sdpa_us": sdpa * 1e3, "tflops": flops / ours / 1e9,
                                  "max_abs_err_vs_sdpa": err}
        print(f"prefill {qn} tokens over {ctx} cached{f', window {window}' if window else ''}: "
              f"{ours * 1e3:.0f} us ({flops / ours / 1e9:.0f} TFLOP/s), "
              f"SDPA {sdpa * 1e3:.0f} us = {sdpa / ours:.2f}x ours (max |err| vs SDPA {err:.3g})", flush=True)

    # ---- norms, RoPE, activation ------------------------------------------------------
    t = 4096
    x = torch.randn(t, HIDDEN, device=dev, dtype=dt)
    res = torch.randn(t, HIDDEN, device=dev, dtype=dt)
    w = torch.randn(HIDDEN, device=dev, dtype=dt)
    pos = torch.randint(0, 8192, (t,), device=dev)
    cos_sin = torch.randn(8192, D, device=dev, dtype=torch.float32)
    qr = torch.randn(t, HQ, D, device=dev, dtype=dt)
    kr = torch.randn(t, HKV, D, device=dev, dtype=dt)
    gu = torch.randn(t, 2 * INTER, device=dev, dtype=dt)
    cases = {
        "rms_norm": (lambda: kernels.rms_norm(x, w, 1e-5), lambda: reference.rms_norm(x, w, 1e-5), 2 * x.numel() * 2),
        "fused_add_rms_norm": (lambda: kernels.fused_add_rms_norm(x, res, w, 1e-5),
                               lambda: reference.fused_add_rms_norm(x, res, w, 1e-5), 4 * x.numel() * 2),
        "rotary_embedding": (lambda: kernels.rotary_embedding(pos, qr, kr, cos_sin),
                             lambda: reference.rotary_embedding(pos, qr, kr, cos_sin),
                             2 * (qr.numel() + kr.numel()) * 2 + t * D * 4),
        "silu_and_mul": (lambda: kernels.silu_and_mul(gu), lambda: reference.silu_and_mul(gu),
                         gu.numel() * 2 + gu.numel() // 2 * 2),
    }
    for name, (fn, ref_fn, nbytes) in cases.items():
        got, want = fn(), ref_fn()
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
        ms = bench(fn)
        bw = nbytes / (ms * 1e-3)
        result["elementwise"][name] = {"us": ms * 1e3, "bytes_per_s": bw, "of_copy": bw / copy_bw,
                                       "max_abs_err": err}
        print(f"{name:20s} [{t} tokens]: {ms * 1e3:7.1f} us  {bw / 1e12:5.2f} TB/s = {100 * bw / copy_bw:5.1f}% "
              f"of copy  (max |err| {err:.3g})", flush=True)
    result["fused_moe"] = bench_fused_moe(bench, copy_bw)
    write_result(result, "kernels", args.output_json)
    return 0
