"""The paged attention's decode tiles swept for one model's head shapes (CUDA).

    python -m bench.attention_tiles [--model-shape gemma-4-e2b] [--batch-sizes 1,32,128] [--context-len 1024]
                                    [--quick] [--output-json F]

For each layer shape of the model (query heads, KV heads, head size, window) and batch size:
the decode step's attention (one query a sequence, random pages) timed under a CUDA graph
(``triton.testing.do_bench_cudagraph``) with the launcher's own tile choice, then with each
(keys a tile, warps, pipeline stages) and split count of a small grid, each checked against
``kernels.reference.paged_attention``. Reports microseconds and the KV bytes read per second,
best first, so a shape's tile rule in ``kernels/paged_attention.py`` can be set from it.
"""
from __future__ import annotations

import argparse
import itertools
import json

BLOCK_SIZE = 16
TILES = list(itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3)))  # (block_n, num_warps, num_stages)
QUICK_TILES = list(itertools.product((16, 32), (4, 8), (1, 2)))


def layer_shapes(shape: dict) -> list[tuple[int, int, int, int | None]]:
    """(query heads, KV heads, head size, window) of each distinct attention layer."""
    hq, hkv, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape.get("head_dim")
    out = set()
    for kind in shape.get("layer_types") or ["full_attention"]:
        if kind == "sliding_attention":
            out.add((hq, hkv, d, shape["sliding_window"]))
        else:
            out.add((hq, shape.get("num_global_key_value_heads") or hkv, shape.get("global_head_dim") or d, None))
    return sorted(out, key=lambda s: (s[2], s[3] or 0))


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton.testing

    import kernels
    from bench.kernels import decode_attention_inputs
    from bench.model_shapes import SHAPES
    from kernels import paged_attention as pa
    from kernels import reference

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="gemma-4-e2b", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK_TILES)} tiles instead of {len(TILES)}")
    p.add_argument("--output-json")
    args = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    default_config = pa._tile_config
    results = []
    for (hq, hkv, d, window), b in itertools.product(layer_shapes(SHAPES[args.model_shape]),
                                                     [int(x) for x in args.batch_sizes.split(",")]):
        torch.manual_seed(0)
        ctx = args.context_len
        q, kc, vc, tables, qsl, lens = decode_attention_inputs(b, ctx, hq, hkv, d, BLOCK_SIZE, dev, dt)
        win = {} if window is None else {"sliding_window": window}
        ref = reference.paged_attention(q, kc, vc, tables, qsl, lens, 1.0, **win).float()
        kv_bytes = b * min(ctx, window or ctx) * hkv * d * 2 * 2
        default_splits = pa.paged_attention_num_splits(b, b, hq, hkv, d, ctx, dev, sliding_window=window)
        rows = []

        def timed(label, splits, config=None):
            pa._tile_config = default_config if config is None else (lambda *a, **k: config)
            try:
                def fn():
                    return kernels.paged_attention(q, kc, vc, tables, qsl, lens, 1.0, num_splits=splits, **win)
                err = (fn().float() - ref).abs().max().item()
                us = triton.testing.do_bench_cudagraph(fn, rep=30) * 1e3
            except Exception as e:  # a tile that does not fit (shared memory): skipped
                print(f"  {label}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                return
            finally:
                pa._tile_config = default_config
            rows.append({"tile": label, "splits": splits, "us": us, "tb_per_s": kv_bytes / us / 1e6,
                         "max_abs_err": err})

        for splits in sorted({default_splits, 1, 2, 4, 8}):
            timed("default", splits)
        for (bn, warps, stages) in QUICK_TILES if args.quick else TILES:
            cfg = pa._TileConfig(1, max(16, pa.next_pow2(hq // hkv)), bn, num_warps=warps, num_stages=stages)
            for splits in sorted({default_splits, max(1, default_splits // 2), 2 * default_splits}):
                timed(f"n{bn} w{warps} s{stages}", splits, cfg)
        rows.sort(key=lambda r: r["us"])
        base = min((r for r in rows if r["tile"] == "default" and r["splits"] == default_splits),
                   key=lambda r: r["us"], default=None)
        name = f"Hq {hq} Hkv {hkv} D {d}{f' window {window}' if window else ''} batch {b} ctx {ctx}"
        print(f"{name}: default {base['us']:.1f} us ({base['tb_per_s']:.2f} TB/s, splits {default_splits}); best:",
              flush=True)
        for r in rows[:6]:
            print(f"    {r['us']:8.1f} us  {r['tb_per_s']:5.2f} TB/s  {r['tile']:14s} splits {r['splits']:3d} "
                  f"err {r['max_abs_err']:.2g}", flush=True)
        results.append({"case": name, "default": base, "best": rows[:6]})
        del kc, vc
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cases": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
