"""`pdserve bench offline`: engine throughput on a synthetic workload, and
the same workload through transformers' generate() for the ratio.

Workload: ``--num-prompts`` random-token prompts of ``--min-prompt-len`` to
``--max-prompt-len`` tokens (seeded), each generating exactly
``--output-len`` tokens (ignore_eos, greedy). transformers runs them as one
left-padded batch, and a few prompts at batch 1 for its single-stream speed.
Results go to stdout and a JSON file.
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import time

from bench.results import write_result
from engine.config import EngineArgs


def add_cli_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=32)
    g.add_argument("--min-prompt-len", type=int, default=10)
    g.add_argument("--max-prompt-len", type=int, default=160)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--workload-seed", type=int, default=0)
    g.add_argument("--skip-transformers", action="store_true", help="only measure pdserve")
    g.add_argument("--hf-batch1-prompts", type=int, default=3,
                   help="prompts run through transformers one at a time (batch-1 speed)")
    g.add_argument("--output-json", default=None, help="default: bench/results/offline-<time>.json")
    g.add_argument("--model-shape", default=None,
                   help="random weights at a named shape instead of --model (e.g. llama-3.1-8b)")
    EngineArgs.add_cli_args(p)


def make_workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.workload_seed)
    lo = min(100, vocab // 2)  # skip the special tokens at the start of the vocabulary
    return [[rng.randrange(lo, vocab) for _ in range(rng.randint(args.min_prompt_len, args.max_prompt_len))]
            for _ in range(args.num_prompts)]


def load_pdserve(args: argparse.Namespace):
    """The offline engine the flags describe, and the seconds it took to load."""
    from engine import LLM

    eargs = EngineArgs.from_cli_args(args)
    kw = {k: v for k, v in vars(eargs).items() if k not in ("model", "extra")}
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    return llm, time.perf_counter() - t0


def time_generate(llm, prompts: list[list[int]], output_len: int) -> dict:
    """All of ``prompts`` submitted at once, each generating exactly ``output_len`` tokens
    (greedy, ignore_eos), after a two-token warm-up and with an empty prefix cache."""
    from engine import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    llm.engine.scheduler.kv.pool.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=True)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": dt, "requests_per_s": len(prompts) / dt, "output_tokens_per_s": n_out / dt,
            "total_tokens_per_s": (n_out + sum(map(len, prompts))) / dt, "output_tokens": n_out}


def describe_engine(llm) -> dict:
    cfg = llm.engine.config
    return {"kv_cache_blocks": llm.engine.num_blocks,
            "kv_cache_bytes": llm.engine.num_blocks * llm.engine.runner.block_bytes,
            "config": cfg.describe(), "model_dir": str(cfg.model.path),
            "dtype": cfg.model.dtype, "device": cfg.device}


def run_pdserve(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    llm, load_s = load_pdserve(args)
    return {**time_generate(llm, prompts, args.output_len), "load_seconds": load_s, **describe_engine(llm)}


def run_transformers(args: argparse.Namespace, model_dir: str, dtype: str, device: str,
                     prompts: list[list[int]]) -> dict:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    n = max(map(len, prompts))
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generation needs
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    with torch.inference_mode():
        hf.generate(ids[:1, -4:].to(device), max_new_tokens=2, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        out = hf.generate(ids.to(device), attention_mask=mask.to(device), **gen)
        batch_s = time.perf_counter() - t0
        n_out = (out.shape[1] - n) * len(prompts)
        b1_tokens, t0 = 0, time.perf_counter()
        for p in tqdm(prompts[:args.hf_batch1_prompts], desc="transformers batch 1", unit="req"):
            o = hf.generate(torch.tensor([p], device=device), **gen)
            b1_tokens += o.shape[1] - len(p)
        b1_s = time.perf_counter() - t0
    return {"padded_batch_seconds": batch_s, "padded_batch_output_tokens_per_s": n_out / batch_s,
            "padded_batch_requests_per_s": len(prompts) / batch_s,
            "batch1_output_tokens_per_s": b1_tokens / b1_s, "batch1_prompts": args.hf_batch1_prompts}


def main(args: argparse.Namespace) -> int:
    from engine.config import ModelConfig
    from engine.model_files import resolve_model_path

    if args.model_shape:
        from bench.model_shapes import shape_dir

        args.model, args.load_format, args.skip_transformers = str(shape_dir(args.model_shape)), "dummy", True

    vocab = ModelConfig.from_dir(resolve_model_path(args.model), dtype="float32", load_format="auto",
                                 served_model_name="x").vocab_size
    prompts = make_workload(args, vocab)
    result: dict = {"workload": {"num_prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                                 "prompt_len_range": [args.min_prompt_len, args.max_prompt_len],
                                 "output_len": args.output_len, "seed": args.workload_seed},
                    "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}}
    result["pdserve"] = ours = run_pdserve(args, prompts)
    result["pdserve"]["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"pdserve: {ours['seconds']:.2f} s, {ours['requests_per_s']:.2f} req/s, "
          f"{ours['output_tokens_per_s']:.1f} output tok/s ({ours['config']})")
    if not args.skip_transformers:
        result["transformers"] = hf = run_transformers(args, ours["model_dir"], ours["dtype"], ours["device"],
                                                       prompts)
        result["speedup_vs_padded_batch"] = hf["padded_batch_seconds"] / ours["seconds"]
        result["speedup_vs_batch1"] = ours["output_tokens_per_s"] / hf["batch1_output_tokens_per_s"]
        print(f"transformers generate(): padded batch {hf['padded_batch_seconds']:.2f} s "
              f"({hf['padded_batch_output_tokens_per_s']:.1f} tok/s); batch 1 "
              f"{hf['batch1_output_tokens_per_s']:.1f} tok/s")
        print(f"speedup: {result['speedup_vs_padded_batch']:.2f}x vs padded batch, "
              f"{result['speedup_vs_batch1']:.1f}x vs batch 1")
    write_result(result, "offline", args.output_json)
    return 0
