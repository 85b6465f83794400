"""`pdserve bench throughput`: offline throughput at fixed input and output lengths, the workload of
TensorRT-LLM's `trtllm-bench throughput` (and of vLLM's `bench throughput`): N requests of exactly
ISL random tokens submitted at once, each generating exactly OSL tokens (greedy, ignore_eos); total
output tokens/s is the figure.

``--trtllm-table`` runs the rows of TensorRT-LLM's published Llama-3.1-8B FP8 table (its
perf-overview: ISL/OSL and request counts, PyTorch backend, TP 1) on one engine, each against the
figure published for the GPU found (H200 or H100; no comparison elsewhere). ``--rows`` picks some
of them, ``--num-prompts-scale`` runs a fraction of each row's requests (said in the output: fewer
requests weigh the ramp-up and the tail more). The results file is rewritten after each row: a run
cut off (a time limit) keeps the rows it finished.

    pdserve bench throughput --model-shape llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 \\
        --max-num-seqs 512 --max-num-batched-tokens 8192 --trtllm-table --rows 1000/1000,2048/128
    pdserve bench throughput --model DIR --input-len 1000 --output-len 1000 --num-prompts 1000
"""
from __future__ import annotations

import argparse
import random

from bench.offline import describe_engine, load_pdserve, time_generate
from bench.results import result_path, write_result
from engine.config import EngineArgs

# TensorRT-LLM's Llama-3.1-8B FP8 rows (docs/source/developer-guide/perf-overview.md,
# trtllm-bench throughput, TP 1): (ISL, OSL, requests, output tok/s on an H200, on an H100)
TRTLLM_LLAMA31_8B_FP8 = [
    (128, 128, 30000, 28447, 27569),
    (128, 2048, 3000, 23295, 22004),
    (1000, 1000, 3000, 17591, 15270),
    (2048, 128, 3000, 3531, 3495),
    (2048, 2048, 1500, 12022, 9654),
    (5000, 500, 1500, 3852, 3371),
]


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=int, default=128, help="prompt tokens of every request (ISL)")
    g.add_argument("--output-len", type=int, default=128, help="tokens every request generates (OSL)")
    g.add_argument("--num-prompts", type=int, default=1000, help="requests, all submitted at once")
    g.add_argument("--trtllm-table", action="store_true",
                   help="run TensorRT-LLM's published Llama-3.1-8B FP8 rows (their ISL/OSL and request counts) "
                        "against its figure for this GPU")
    g.add_argument("--rows", default=None, metavar="ISL/OSL,...",
                   help="with --trtllm-table: only these rows, e.g. 1000/1000,2048/128")
    g.add_argument("--num-prompts-scale", type=float, default=1.0,
                   help="with --trtllm-table: run this fraction of each row's requests (at least 1)")
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--model-shape", default=None,
                   help="random weights at a named shape instead of --model (e.g. llama-3.1-8b)")
    g.add_argument("--output-json", default=None, help="default: bench/results/throughput-<time>.json")
    EngineArgs.add_cli_args(p)


def table_rows(rows: str | None, scale: float) -> list[dict]:
    """The table's rows (``rows`` "ISL/OSL,..." picks some), each with its requests scaled."""
    wanted = None if rows is None else {tuple(int(n) for n in r.split("/")) for r in rows.split(",")}
    known = {(i, o) for i, o, *_ in TRTLLM_LLAMA31_8B_FP8}
    if wanted is not None and not wanted <= known:
        raise ValueError(f"--rows: {sorted(wanted - known)} not in TensorRT-LLM's table "
                         f"({', '.join(f'{i}/{o}' for i, o in sorted(known))})")
    return [{"input_len": i, "output_len": o, "num_prompts": max(1, round(n * scale)), "trtllm_requests": n,
             "trtllm": {"H200": h200, "H100": h100}}
            for i, o, n, h200, h100 in TRTLLM_LLAMA31_8B_FP8 if wanted is None or (i, o) in wanted]


def gpu_name(device: str) -> str | None:
    """"H200" or "H100" where the engine's device is one (TensorRT-LLM publishes those), else None."""
    import torch

    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((g for g in ("H200", "H100") if g in name), None)


def main(args: argparse.Namespace) -> int:
    if args.model_shape:
        from bench.model_shapes import shape_dir

        args.model, args.load_format = str(shape_dir(args.model_shape)), "dummy"
    rows = (table_rows(args.rows, args.num_prompts_scale) if args.trtllm_table else
            [{"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts}])
    llm, load_s = load_pdserve(args)
    engine = describe_engine(llm)
    gpu = gpu_name(engine["device"])
    vocab = llm.engine.config.model.vocab_size
    rng = random.Random(args.workload_seed)
    lo = min(100, vocab // 2)  # past the special tokens at the start of the vocabulary
    print(f"pdserve: {engine['config']}")
    out = result_path("throughput", args.output_json)
    result = {"kind": "throughput", "gpu": gpu, "load_seconds": load_s, "engine": engine, "rows": [],
              "num_prompts_scale": args.num_prompts_scale if args.trtllm_table else None,
              "workload_seed": args.workload_seed}
    for row in rows:
        prompts = [[rng.randrange(lo, vocab) for _ in range(row["input_len"])] for _ in range(row["num_prompts"])]
        row.update(time_generate(llm, prompts, row["output_len"]))
        line = (f"ISL {row['input_len']:>5} OSL {row['output_len']:>5}  {row['num_prompts']:>6} requests  "
                f"{row['seconds']:8.2f} s  {row['output_tokens_per_s']:10.1f} output tok/s")
        published = row.get("trtllm", {}).get(gpu) if gpu else None
        if published:
            row["ratio_to_trtllm"] = row["output_tokens_per_s"] / published
            line += (f"  TensorRT-LLM {gpu}: {published} ({row['trtllm_requests']} requests)  "
                     f"{row['ratio_to_trtllm']:.2f}x")
        result["rows"].append(row)
        write_result(result, "throughput", out, quiet=True)  # each row kept before it is shown
        print(line, flush=True)
    if args.trtllm_table and gpu is None:
        print(f"(no TensorRT-LLM figure for {engine['device']}: it publishes H200 and H100 rows)")
    write_result(result, "throughput", out)
    return 0
