"""`pdserve bench quant-quality`: how far FP8 moves a model from its 16-bit self.

A small model is sensitive to FP8: its greedy text changes after a few tokens even when
every kernel is exact (the tests prove exactness against the dequantized model, not
against 16 bits). This measures, against the unquantized run of the same model on the
same device, for FP8 KV (--kv-cache-dtype fp8), FP8 W8A8 (--quantization fp8) and both:

  * the mean KL divergence KL(p16 || pq) of the next-token distributions over every
    position of a text that ships with Python (CPython's LICENSE.txt, a few thousand
    tokens), fed teacher-forced in windows of ``--window`` tokens;
  * the mean length of the greedy continuations (``--new-tokens`` each) that agree with
    the 16-bit ones, from ``--prompts`` prompts cut from the same text.

    pdserve bench quant-quality                       # the default model, float32 on CPU
    pdserve bench quant-quality --device cuda --dtype bfloat16
"""
from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

from bench.results import write_result
from engine.config import EngineArgs

VARIANTS = {"fp8-kv": dict(kv_cache_dtype="fp8"), "w8a8": dict(quantization="fp8"),
            "w8a8+fp8-kv": dict(quantization="fp8", kv_cache_dtype="fp8")}


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=int, default=1024, help="tokens per teacher-forced window")
    p.add_argument("--max-text-tokens", type=int, default=4096)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)


def text_path() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def teacher_forced_logprobs(engine, ids: list[int]):
    """log_softmax of the logits at every position of ``ids`` (one sequence, prefilled in
    chunks of the engine's token budget into blocks 0.. of its cache, which must be idle)."""
    import torch

    from engine.layers.attention import AttentionMetadata

    runner, dev = engine.runner, engine.runner.device
    bs, budget = engine.config.cache.block_size, engine.config.scheduler.max_num_batched_tokens
    n = len(ids)
    if -(-n // bs) > runner.num_blocks:
        raise ValueError(f"a window of {n} tokens needs {-(-n // bs)} blocks; the cache has {runner.num_blocks}")
    table = torch.arange(-(-n // bs), dtype=torch.int32, device=dev)[None]
    out = []
    with torch.inference_mode():
        for start in range(0, n, budget):
            stop = min(n, start + budget)
            meta = AttentionMetadata(slot_mapping=torch.arange(start, stop, device=dev),
                                     block_tables=table,
                                     query_start_loc=torch.tensor([0, stop - start], dtype=torch.int32, device=dev),
                                     seq_lens=torch.tensor([stop], dtype=torch.int32, device=dev))
            x = torch.tensor(ids[start:stop], device=dev)
            hidden = runner.model(x, torch.arange(start, stop, device=dev), runner.kv_cache, meta)
            out.append(torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1))
    return torch.cat(out)


def main(args: argparse.Namespace) -> int:
    import torch

    from engine import LLM, SamplingParams

    text = text_path().read_text()
    base_args = EngineArgs.from_cli_args(args)
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")

    def build(**extra) -> LLM:
        kw = {k: v for k, v in vars(base_args).items() if k not in ("model", "extra")}
        kw.update(max_model_len=max(args.window, args.prompt_len + args.new_tokens) + 16, **extra)
        return LLM(base_args.model, **kw)

    from transformers import AutoTokenizer

    ref = build()
    ids = AutoTokenizer.from_pretrained(str(ref.engine.config.model.path))(text)["input_ids"][:args.max_text_tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    windows = [w for w in windows if len(w) > 1]
    step = max(1, (len(ids) - args.prompt_len) // args.prompts)
    prompts = [ids[i:i + args.prompt_len] for i in range(0, step * args.prompts, step)][:args.prompts]
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    ref_lp = [teacher_forced_logprobs(ref.engine, w) for w in windows]
    ref_greedy = [o.outputs[0].token_ids for o in ref.generate(prompts, sp)]
    config = ref.engine.config.describe()
    del ref
    result: dict = {"config": config, "text": str(text_path()), "text_tokens": sum(len(w) for w in windows),
                    "window": args.window, "prompts": len(prompts), "new_tokens": args.new_tokens, "variants": {}}
    print(f"{result['text_tokens']} tokens of {text_path().name}, {len(prompts)} prompts x {args.new_tokens} "
          f"greedy tokens; {config}", flush=True)
    for name in names:
        llm = build(**VARIANTS[name])
        kl_sum, count = 0.0, 0
        for w, lp in zip(windows, ref_lp):
            q = teacher_forced_logprobs(llm.engine, w)
            kl = (lp.exp() * (lp - q)).sum(-1)  # [positions]
            kl_sum, count = kl_sum + float(kl.sum()), count + kl.numel()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ref_greedy, got)]
        full = sum(a == args.new_tokens for a in agree)
        result["variants"][name] = {"mean_kl": kl_sum / count, "mean_agreeing_prefix": sum(agree) / len(agree),
                                    "agreeing_prefixes": agree, "prompts_fully_agreeing": full}
        print(f"{name:12s} mean KL {kl_sum / count:.5f} nats over {count} positions; greedy agrees for "
              f"{sum(agree) / len(agree):.1f} of {args.new_tokens} tokens on average ({full} of {len(prompts)} "
              f"prompts all the way): {agree}", flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    write_result(result, "quant-quality", args.output_json)
    return 0
