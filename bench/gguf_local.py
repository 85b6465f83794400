"""Single-stream decode speed and peak memory of the offline engine on the embedded model, its
GGUF weights served packed (``SmolLM2-135M-Instruct-GGUF``) against the float32 conversion
(``SmolLM2-135M-Instruct``). Each model runs in a process of its own (peak RSS is per process).

    .venv/bin/python -m bench.gguf_local [--output-len 128] [--repeats 3]
    .venv/bin/python -m bench.gguf_local --lm-head     # the LM head alone: float32 against packed Q8_0

Decode tok/s: one greedy request of a short prompt generating ``--output-len`` tokens
(ignore_eos), minus the same request generating 1 token (prefill and start), over the
``--output-len - 1`` decode steps; the best of ``--repeats``.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(model: str, output_len: int, repeats: int) -> dict:
    from engine import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_memory="64MiB")
    load_s = time.perf_counter() - t0
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    prompt = "Write a short story about a lighthouse keeper."

    def run(n: int) -> float:
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    run(8)  # warm-up
    best = min(run(output_len) - run(1) for _ in range(repeats))
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    return {"model": model, "decode_tok_s": (output_len - 1) / best, "step_ms": 1000 * best / (output_len - 1),
            "load_s": load_s, "weights_MiB": weights / 2**20, "peak_rss_after_load_MiB": rss_loaded,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def lm_head(rounds: int = 30) -> None:
    """The default model's LM head, [T, 576] x [49152, 576]: the float32 table (oneDNN) against
    the same table packed in Q8_0 (kernels/cpu/gguf_gemm.cpp), interleaved, best of ``rounds``."""
    import torch

    from kernels import cpu_gemm, gguf_reference

    vocab, hidden = 49152, 576
    packed = gguf_reference.quantize(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0)) * 0.05,
                                     "Q8_0")
    table = gguf_reference.dequantize(packed, "Q8_0", hidden)
    cpu_gemm.gguf_extension()
    for rows in (1, 4):
        x = torch.randn(rows, hidden)
        runs = {"float32": lambda: cpu_gemm.linear(x, table), "Q8_0": lambda: cpu_gemm.gguf_linear(x, packed, "Q8_0")}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(rounds):
            for name, run in runs.items():
                t = time.perf_counter()
                for _ in range(5):
                    run()
                best[name] = min(best[name], (time.perf_counter() - t) / 5)
        print(f"LM head, {rows} row(s): " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items())
              + f" (tables {table.numel() * 4 / 2**20:.0f} and {packed.numel() / 2**20:.0f} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lm-head", action="store_true", help="time the LM head alone (float32 against packed Q8_0)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child process's model
    args = p.parse_args()
    if args.lm_head:
        lm_head()
        return
    if args.one:
        print(json.dumps(measure(args.one, args.output_len, args.repeats)))
        return
    from engine.model_files import DEFAULT_MODEL, GGUF_MODEL, ensure_default_model

    ensure_default_model(), ensure_default_model(packed=True)  # conversions are not measured
    for model in (GGUF_MODEL, DEFAULT_MODEL):
        out = subprocess.run([sys.executable, "-m", "bench.gguf_local", "--one", model, "--output-len",
                              str(args.output_len), "--repeats", str(args.repeats)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{r['model']:<28} decode {r['decode_tok_s']:6.1f} tok/s ({r['step_ms']:.1f} ms/step)  "
              f"weights {r['weights_MiB']:.0f} MiB  peak RSS {r['peak_rss_MiB']:.0f} MiB "
              f"(after load {r['peak_rss_after_load_MiB']:.0f})  load {r['load_s']:.1f} s")


if __name__ == "__main__":
    main()
