"""How many requests of a context length a GPU's KV cache holds, with the cache groups and
without (``--disable-hybrid-kv-cache-manager``): the engine sizes its cache as it serves (random
weights of a named shape), then each group's blocks per request are counted (a windowed group
holds its window and the block in progress; a full group the whole context).

    python -m bench.cache_capacity --model-shape gemma-3-12b --context-len 32768 [--disable-hybrid-kv-cache-manager]
"""
from __future__ import annotations

import argparse
import json
import sys

from engine.config import EngineArgs


def main() -> int:
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    p.add_argument("--model-shape", required=True)
    p.add_argument("--context-len", type=int, default=32768)
    args = p.parse_args()
    from bench.model_shapes import shape_dir
    from engine.llm_engine import LLMEngine

    args.model, args.load_format = str(shape_dir(args.model_shape)), "dummy"
    args.max_model_len = args.max_model_len or args.context_len
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    runner, ctx = engine.runner, args.context_len
    per_request = 0
    for g in runner.layout.groups:
        blocks = g.blocks_needed(ctx)
        if g.kind == "sliding":
            blocks = min(blocks, -(-(g.sliding_window - 1) // g.block_size) + 1)
        per_request += blocks
    mc = engine.config.model
    elem = runner.kv_dtype.itemsize
    # what the request's layers must keep: every full layer the context, every windowed one its window
    floor = sum(2 * h * d * elem * (ctx if w is None else min(ctx, w))
                for (h, d), w in zip(mc.layer_kv_shapes, mc.layer_windows))
    held = per_request * runner.block_bytes
    out = {"shape": args.model_shape, "context_len": ctx, "groups": runner.layout.describe(),
           "num_blocks": runner.num_blocks, "block_bytes": runner.block_bytes, "blocks_per_request": per_request,
           "kv_bytes_per_request": held, "floor_bytes_per_request": floor, "ratio_to_floor": held / floor,
           "requests_that_fit": runner.num_blocks // per_request}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
