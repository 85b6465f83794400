"""Decode steps of one model shape served several ways, in one process (one engine at a
time, its memory released before the next), so that the 16-bit run and the quantized
ones meet the same GPU, the same compiled kernels and the same context:

    python -m bench.quant_steps --model-shape llama-3.1-8b bf16:1,32,256 fp8:1,32 kv8:256 int4:1

Each argument is VARIANT:BATCH_SIZES; variants (engine flags on top of the shape's):

    bf16     the model dtype's weights and KV cache
    fp8      --quantization fp8 (W8A8: per-channel weight scales, dynamic per-token activations)
    kv8      --kv-cache-dtype fp8 (16-bit weights)
    fp8+kv8  both
    int4     --quantization gptq (int4 W4A16, symmetric groups of 128, from the random weights)
    int4a    --quantization awq (int4 W4A16 with zero points)

Each variant's figures are written as soon as it ends (``--output-json``: one file, the
variants so far), with ``bench/decode_step.py``'s measurement.
"""
from __future__ import annotations

import argparse
import gc
import json

from bench.decode_step import measure

VARIANTS = {"bf16": {}, "fp8": dict(quantization="fp8"), "kv8": dict(kv_cache_dtype="fp8"),
            "fp8+kv8": dict(quantization="fp8", kv_cache_dtype="fp8"), "int4": dict(quantization="gptq"),
            "int4a": dict(quantization="awq")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="VARIANT:BATCH_SIZES, e.g. fp8:1,32")
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N steps per batch size (bench/decode_step.py's --profile)")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    import torch

    from bench.model_shapes import shape_dir
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine

    runs = []
    for run in args.runs:
        name, _, sizes = run.partition(":")
        if name not in VARIANTS or not sizes:
            p.error(f"{run!r}: want VARIANT:BATCH_SIZES with VARIANT one of {', '.join(VARIANTS)}")
        runs.append((name, [int(x) for x in sizes.split(",")]))
    results: dict = {"model_shape": args.model_shape, "context_len": args.context_len, "variants": {}}
    for name, sizes in runs:
        print(f"== {name}: batch sizes {sizes}", flush=True)
        engine = LLMEngine.from_engine_args(EngineArgs(
            model=str(shape_dir(args.model_shape)), load_format="dummy", max_model_len=args.context_len + 1024,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max(sizes), **VARIANTS[name]))
        try:
            results["variants"][f"{name}:{','.join(map(str, sizes))}"] = measure(
                engine, sizes, args.context_len, args.steps, args.profile)
            results["variants"][f"{name}:{','.join(map(str, sizes))}"]["kv_cache_blocks"] = engine.runner.num_blocks
        finally:
            engine.close()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)
    base = {b: s for key, r in results["variants"].items() if key.startswith("bf16:") for b, s in r["steps"].items()}
    for name, r in results["variants"].items():
        row = [f"batch {b}: {s['median_ms']:.2f} ms" + (f" ({s['median_ms'] / base[b]['median_ms']:.2f}x bf16)"
                                                         if b in base and not name.startswith("bf16:") else "")
               for b, s in r["steps"].items()]
        print(f"{name:8s} " + "; ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
