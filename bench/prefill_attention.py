"""Prefill attention on one GPU: the paged kernel, the dense prefill path and SDPA.

    python -m bench.prefill_attention --out FILE.json [--quick] [--budget-s 200]

Cases (bf16, 32 query / 8 KV heads, D 128, KV blocks of 16 tokens in random
order, as ``pdserve bench kernels``): a 4k and a 16k causal prefill (no cached
prefix: the dense kernel's whole attention), and a 2k chunk over a 4k and a
16k cached prefix (the new path leaves these to the paged kernel; its dense
kernel is timed there too over the chunk's own keys alone, "self part", as a
measure of what a prefix pass plus a merge would have to beat).

Each case times, in one process:
  * ``paged``: ``kernels.paged_attention`` as before (K/V from the paged cache);
  * ``new path``: the same call given ``new_k`` / ``new_v`` (views of a fused
    [T, Hq + 2 Hkv, D] projection output, as the engine's layer has them);
  * ``dense ...``: ``kernels.prefill_attention.prefill_self_attention`` alone in
    tile / warp / stage / warp-specialisation / TMA variants;
  * ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on dense
    [1, H, T, D] tensors (``causal_lower_right``, GQA), as bench/kernels.py.

Every timed output is first compared with SDPA's (max abs error; over
``--tol`` it is reported wrong and not timed); a variant that fails to
compile or run is reported and skipped. A CUDA error that poisons the context
stops the run with what it has. Times from ``triton.testing.do_bench_cudagraph``
(CUDA-graph replay; the launcher's own check that keeps the dense path out of
graph captures is lifted for the run). The results go to ``--out`` after
every case, so an interrupted run leaves what it measured. Under ``--budget-s``
seconds (default 200) of wall time, variants not reached are listed as
skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

HQ, HKV, D, BS = 32, 8, 128, 16
# (cached tokens, new tokens)
CASES = [(0, 4096), (0, 16384), (4096, 2048), (16384, 2048)]
QUICK_CASES = [(0, 4096), (4096, 2048)]
TOL = 3e-2  # bf16 outputs of magnitude <~ 1: the paged kernel measured 1e-4..2e-3 against SDPA

# (label, PrefillConfig fields): the default first, warp specialisation last (the likeliest
# to fail to compile on Hopper under Triton 3.6).
VARIANTS = [
    ("128x128 w8 s2", dict(block_m=128, block_n=128, num_warps=8, num_stages=2)),
    ("128x128 w8 s3", dict(block_m=128, block_n=128, num_warps=8, num_stages=3)),
    ("128x64 w8 s2", dict(block_m=128, block_n=64, num_warps=8, num_stages=2)),
    ("128x64 w8 s3", dict(block_m=128, block_n=64, num_warps=8, num_stages=3)),
    ("128x64 w4 s3", dict(block_m=128, block_n=64, num_warps=4, num_stages=3)),
    ("128x128 w4 s2", dict(block_m=128, block_n=128, num_warps=4, num_stages=2)),
    ("64x64 w4 s3", dict(block_m=64, block_n=64, num_warps=4, num_stages=3)),
    ("64x128 w4 s2", dict(block_m=64, block_n=128, num_warps=4, num_stages=2)),
    ("128x128 w8 s2 ptr", dict(block_m=128, block_n=128, num_warps=8, num_stages=2, use_tma=False)),
    ("128x64 w8 s3 ptr", dict(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=False)),
    ("128x128 w8 s2 ws", dict(block_m=128, block_n=128, num_warps=8, num_stages=2, warp_specialize=True)),
    ("128x64 w8 s3 ws", dict(block_m=128, block_n=64, num_warps=8, num_stages=3, warp_specialize=True)),
    ("128x128 w4 s2 ws", dict(block_m=128, block_n=128, num_warps=4, num_stages=2, warp_specialize=True)),
]
# Over a prefix the dense kernel computes only the self part: a few variants suffice.
CHUNK_VARIANTS = ("128x128 w8 s2", "128x64 w8 s3", "128x128 w8 s2 ws")


class Poisoned(RuntimeError):
    """A CUDA error after which the context cannot be trusted."""


def _fatal(e: BaseException) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("illegal memory", "illegal instruction", "misaligned address",
                                   "unspecified launch failure", "device-side assert", "an illegal"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="JSON file (default bench/results/prefill_attention-<time>.json)")
    p.add_argument("--quick", action="store_true", help="two cases and three variants (a smoke run)")
    p.add_argument("--budget-s", type=float, default=200.0, help="wall seconds after which variants are skipped")
    p.add_argument("--tol", type=float, default=TOL, help="max abs error against SDPA for a result to count")
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph's rep (ms) for the main rows")
    args = p.parse_args(argv)

    import torch
    import triton
    import triton.testing
    from torch.nn.attention.bias import causal_lower_right

    import kernels
    pa = sys.modules["kernels.paged_attention"]  # (kernels.paged_attention is the function)
    from kernels import prefill_attention
    from kernels.prefill_attention import PrefillConfig

    started = time.perf_counter()
    out_path = Path(args.out or f"bench/results/prefill_attention-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        raise SystemExit("bench.prefill_attention needs a CUDA GPU")
    dev, dt = torch.device("cuda"), torch.bfloat16
    pa.DENSE_PREFILL_IN_GRAPHS = True  # time the new path under graph replay like the rest
    result: dict = {
        "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "triton": triton.__version__,
        "shape": {"num_q_heads": HQ, "num_kv_heads": HKV, "head_dim": D, "block_size": BS, "dtype": "bfloat16"},
        "default_config": prefill_attention.DEFAULT_CONFIG.as_dict(), "tol": args.tol, "cases": [],
        "errors": [],
    }

    def save() -> None:
        result["wall_s"] = time.perf_counter() - started
        out_path.write_text(json.dumps(result, indent=2, default=str))

    def over_budget() -> bool:
        return time.perf_counter() - started > args.budget_s

    def bench(fn, rep: int) -> float:  # milliseconds
        return triton.testing.do_bench_cudagraph(fn, rep=rep)

    variants = VARIANTS[:3] if args.quick else VARIANTS
    cases = QUICK_CASES if args.quick else CASES
    torch.manual_seed(0)
    poisoned = False
    rows_printed: list[str] = []

    def report(line: str) -> None:
        rows_printed.append(line)
        print(line, flush=True)

    for ctx, qn in cases:
        if poisoned:
            break
        n = ctx + qn
        nblk = n // BS
        name = f"{qn // 1024}k causal" if ctx == 0 else f"{qn // 1024}k chunk over {ctx // 1024}k prefix"
        case: dict = {"case": name, "cached": ctx, "new": qn, "rows": []}
        result["cases"].append(case)
        try:
            k = torch.randn(n, HKV, D, device=dev, dtype=dt)
            v = torch.randn(n, HKV, D, device=dev, dtype=dt)
            fused = torch.empty(qn, HQ + 2 * HKV, D, device=dev, dtype=dt)  # the projection's output
            fused[:, :HQ].normal_()
            fused[:, HQ:HQ + HKV], fused[:, HQ + HKV:] = k[ctx:], v[ctx:]
            q, new_k, new_v = fused[:, :HQ], fused[:, HQ:HQ + HKV], fused[:, HQ + HKV:]
            perm = torch.randperm(nblk, device=dev)
            kc = torch.empty(nblk, BS, HKV, D, device=dev, dtype=dt)
            vc = torch.empty(nblk, BS, HKV, D, device=dev, dtype=dt)
            kc[perm], vc[perm] = k.view(nblk, BS, HKV, D), v.view(nblk, BS, HKV, D)
            tables = perm.to(torch.int32)[None]
            qsl = torch.tensor([0, qn], device=dev, dtype=torch.int32)
            lens = torch.tensor([n], device=dev, dtype=torch.int32)
            scale = D ** -0.5
            qd, kd, vd = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            mask = causal_lower_right(qn, n)
            sdpa_fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qd, kd, vd, attn_mask=mask, enable_gqa=True)
            want = sdpa_fn()[0].transpose(0, 1).float()
            # the chunk's self part alone (its own keys, causal), for the dense kernel over a prefix
            want_self = None
            if ctx:
                want_self = torch.nn.functional.scaled_dot_product_attention(
                    qd, kd[:, :, ctx:], vd[:, :, ctx:], is_causal=True, enable_gqa=True)[0].transpose(0, 1).float()
            flops = 4 * qn * (ctx + qn / 2) * HQ * D
            self_flops = 4 * qn * (qn / 2) * HQ * D
        except Exception as e:  # noqa: BLE001
            case["error"] = f"setup failed: {e!r}"
            report(f"{name}: setup failed: {e!r}")
            poisoned = _fatal(e)
            save()
            continue

        sdpa_us = None
        self_sdpa_us = [None]  # SDPA over the chunk's own keys (rows "... (self part)")

        def timed(label: str, fn, ref, case_flops: float, rep: int, **extra) -> None:
            nonlocal poisoned, sdpa_us
            row: dict = {"name": label, **extra}
            case["rows"].append(row)
            try:
                got = fn()
                torch.cuda.synchronize()
                err = (got.float() - ref).abs().max().item() if ref is not None else 0.0
                row["max_abs_err_vs_sdpa"] = err
                if not err <= args.tol:  # NaN too
                    row["status"] = "wrong"
                    report(f"  {label:28s} WRONG: max |err| vs SDPA {err:.3g} > {args.tol}: not timed")
                    return
                ms = bench(fn, rep)
                row.update(status="ok", us=ms * 1e3, tflops=case_flops / (ms * 1e-3) / 1e12)
                if label == "sdpa":
                    sdpa_us = ms * 1e3
                if label == "sdpa (self part)":
                    self_sdpa_us[0] = ms * 1e3
                versus = self_sdpa_us[0] if "self part" in label else sdpa_us
                if versus is not None:
                    row["sdpa_over_this"] = versus / row["us"]
                ratio = f"  SDPA/this {row['sdpa_over_this']:.2f}x" if "sdpa_over_this" in row else ""
                report(f"  {label:28s} {ms * 1e3:9.1f} us  {row['tflops']:6.0f} TFLOP/s{ratio}  (max |err| {err:.2g})")
            except Exception as e:  # noqa: BLE001
                row.update(status="failed", error=f"{type(e).__name__}: {str(e)[:2000]}")
                result["errors"].append({"case": name, "row": label, "traceback": traceback.format_exc()[-4000:]})
                report(f"  {label:28s} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                if _fatal(e):
                    poisoned = True
            finally:
                save()

        report(f"{name} ({qn} new tokens, {ctx} cached):")
        timed("sdpa", lambda: sdpa_fn()[0].transpose(0, 1), want, flops, args.rep)
        if poisoned:
            break
        if ctx:  # what the dense rows of this case compute: the chunk over its own keys
            timed("sdpa (self part)", lambda: torch.nn.functional.scaled_dot_product_attention(
                qd, kd[:, :, ctx:], vd[:, :, ctx:], is_causal=True, enable_gqa=True)[0].transpose(0, 1),
                want_self, self_flops, args.rep)
        timed("paged", lambda: kernels.paged_attention(q, kc, vc, tables, qsl, lens, scale), want, flops, args.rep)
        timed("new path", lambda: kernels.paged_attention(q, kc, vc, tables, qsl, lens, scale,
                                                          new_k=new_k, new_v=new_v), want, flops, args.rep)
        for label, fields in variants:
            if poisoned:
                break
            if ctx and label not in CHUNK_VARIANTS:
                continue
            full_label = f"dense {label}" + (" (self part)" if ctx else "")
            if over_budget():
                case["rows"].append({"name": full_label, "status": "skipped (time budget)"})
                report(f"  {full_label:28s} skipped: past the {args.budget_s:.0f} s budget")
                continue
            cfg = PrefillConfig(**fields)
            fn = (lambda cfg=cfg: prefill_attention.prefill_self_attention(
                q, new_k, new_v, qsl, lens, scale, config=cfg, only_fresh=not ctx))
            timed(full_label, fn, want_self if ctx else want, self_flops if ctx else flops,
                  max(20, args.rep // 2), config=cfg.as_dict())
        del k, v, fused, kc, vc
        torch.cuda.empty_cache()

    # ---- summary table ---------------------------------------------------------------
    print("\nsummary (us; SDPA / ours > 1 means faster than SDPA):")
    print(f"{'case':28s} {'sdpa':>9s} {'paged':>9s} {'new path':>9s} {'best dense':>10s}  best variant")
    summary = []
    for case in result["cases"]:
        by = {r["name"]: r for r in case["rows"] if r.get("status") == "ok"}
        dense = [r for r in case["rows"] if r["name"].startswith("dense") and r.get("status") == "ok"]
        best = min(dense, key=lambda r: r["us"]) if dense else None

        def us(r):
            return f"{r['us']:9.1f}" if r else f"{'-':>9s}"
        print(f"{case['case']:28s} {us(by.get('sdpa'))} {us(by.get('paged'))} {us(by.get('new path'))} "
              f"{us(best):>10s}  {best['name'] if best else '-'}")
        summary.append({"case": case["case"], "sdpa_us": by.get("sdpa", {}).get("us"),
                        "paged_us": by.get("paged", {}).get("us"), "new_path_us": by.get("new path", {}).get("us"),
                        "best_dense": best and {"name": best["name"], "us": best["us"]}})
    result["summary"] = summary
    result["poisoned"] = poisoned
    save()
    print(f"wrote {out_path} ({time.perf_counter() - started:.0f} s)")
    return 1 if poisoned else 0


if __name__ == "__main__":
    sys.exit(main())
