"""Multi-LoRA against the plain model, in one engine and one call: random adapters of
rank R on every linear layer of a model shape (written as PEFT directories, read the
way served adapters are), then

    decode   the decode step at each batch size with no adapter rows, and with every row
             under one of the adapters in turn (bench/decode_step.py's measurement)
    prefill  one prompt of --prefill-len tokens, plain and under one adapter (median of
             --prefill-runs fresh prompts each: no prefix-cache hits)
    load     reading and checking one adapter (LoRAManager.register) and copying it into
             a device slot

    python -m bench.lora_steps --model-shape llama-3.1-8b --adapters 8 --rank 16 \\
        --batch-sizes 32,256 --prefill-len 8192
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_step import _sync, measure
from bench.results import write_result
from engine.config import EngineArgs


def write_random_adapter(path: Path, modules: dict, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory of random A and B (N(0, 0.02)) for every module in ``modules``
    (name -> ModuleShape), bf16 tensors."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in modules.items():
        if name.endswith(("qkv_proj", "gate_up_proj")) and name.replace("qkv_proj", "q_proj") in modules:
            continue  # a stacked layer's own name: its parts are adapted instead
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, shape.in_features, generator=gen) * 0.02).bfloat16()
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(shape.out_features, rank, generator=gen) * 0.02).bfloat16()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})}))
    return path


def _prefill_ms(engine, length: int, lora: str | None, runs: int, seed: int) -> float:
    from engine.sampling_params import SamplingParams

    rng, vocab, times = random.Random(seed), engine.config.model.vocab_size, []
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(runs + 1):  # the first is a warm-up
        req = engine.add_request(f"prefill-{lora}-{seed}-{i}", [rng.randrange(100, vocab) for _ in range(length)],
                                 sp, lora_name=lora)
        _sync(engine.config.device)
        t0 = time.perf_counter()
        while not req.is_finished:
            engine.step()
        _sync(engine.config.device)
        if i:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch-sizes", default="32,256")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prefill-len", type=int, default=8192)
    p.add_argument("--prefill-runs", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    from bench.model_shapes import shape_dir
    from engine.llm_engine import LLMEngine

    sizes = [int(x) for x in args.batch_sizes.split(",")]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=str(shape_dir(args.model_shape)), load_format="dummy", enable_lora=True, max_loras=args.adapters,
        max_lora_rank=args.rank, max_cpu_loras=args.adapters, max_num_seqs=max(sizes),
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.prefill_len),
        max_model_len=max(args.prefill_len, args.context_len) + 64))
    lora = engine.lora
    result: dict = {"config": engine.config.describe(), "adapters": args.adapters, "rank": args.rank}
    names = [f"bench{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            path = write_random_adapter(Path(tmp) / name, lora.modules, args.rank, seed=i)
            t0 = time.perf_counter()
            info = lora.register(name, str(path))
            if i == 0:
                read_s = time.perf_counter() - t0
                _sync(engine.config.device)
                t0 = time.perf_counter()
                lora.activate([info])
                _sync(engine.config.device)
                result["load"] = {"register_ms": 1e3 * read_s, "slot_copy_ms": 1e3 * (time.perf_counter() - t0),
                                  "bytes": (path / "adapter_model.safetensors").stat().st_size}
                print(f"adapter load: read and checked in {1e3 * read_s:.0f} ms, copied to a slot in "
                      f"{result['load']['slot_copy_ms']:.1f} ms ({result['load']['bytes'] / 2**20:.0f} MiB)",
                      flush=True)
        decode = measure(engine, [b for b in sizes for _ in (0, 1)], args.context_len, args.steps,
                         lora_rows=[n for b in sizes for n in (0, b)], lora_names=names)
        result["decode"] = decode["steps"]
        for b in sizes:
            plain, adapted = decode["steps"][b]["median_ms"], decode["steps"][f"{b}+{b}lora"]["median_ms"]
            print(f"batch {b}: {adapted / plain:.3f}x the plain step ({adapted:.2f} vs {plain:.2f} ms)", flush=True)
        if args.prefill_len:
            plain = _prefill_ms(engine, args.prefill_len, None, args.prefill_runs, 1)
            adapted = _prefill_ms(engine, args.prefill_len, names[0], args.prefill_runs, 2)
            result["prefill"] = {"tokens": args.prefill_len, "plain_ms": plain, "lora_ms": adapted}
            print(f"prefill of {args.prefill_len} tokens: {adapted:.1f} ms under an adapter, {plain:.1f} ms plain "
                  f"({adapted / plain:.3f}x)", flush=True)
    write_result(result, "lora-steps", args.output_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
