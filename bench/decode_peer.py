"""The peer of `pdserve bench decode-step`: transformers' own fast decode path
on the same shape, batch sizes and context, timed the same way.

transformers' recommended fast path is a ``StaticCache`` with the model's
forward under ``torch.compile(mode="reduce-overhead", fullgraph=True)``
(CUDA graphs of the whole step). A step is one token for every row: the
forward pass at the next cache position, greedy argmax, the ids to the
host, with a device sync before and after, as for pdserve. The prompt is
prefilled once per batch size (eager, last position's logits only); the
compile (one per batch size) happens in the warm-up steps and is reported.
On CPU the forward runs eagerly (reduce-overhead needs CUDA); that is
for checking the code path, not for figures. ``eager=True`` (``--peer-eager``)
times the eager forward on CUDA too: the peer for mixture-of-experts shapes,
whose expert dispatch depends on the routing and is not captured whole.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path


def run(model_dir: str | Path, sizes: list[int], context_len: int, steps: int, device: str,
        dtype: str = "bfloat16", warmup: int = 3, eager: bool = False) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    torch_dtype = getattr(torch, dtype)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype).eval()
    compiled = device.startswith("cuda") and not eager
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    gen = torch.Generator(device="cpu").manual_seed(0)
    result: dict = {"peer": "transformers", "compiled": compiled, "dtype": dtype, "steps": {}}

    def sync() -> None:
        if compiled:
            torch.cuda.synchronize()

    for b in sizes:
        cache = StaticCache(config=config, max_cache_len=context_len + warmup + steps + 1)
        ids = torch.randint(100, config.vocab_size, (b, context_len), generator=gen).to(device)
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                        cache_position=torch.arange(context_len, device=device))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        del out, ids
        pos = context_len

        def step() -> None:
            nonlocal token, pos
            with torch.inference_mode():
                logits = forward(input_ids=token, past_key_values=cache, use_cache=True,
                                 cache_position=torch.tensor([pos], device=device)).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            token.tolist()  # the ids reach the host, as a server's would
            pos += 1

        t0 = time.perf_counter()
        for _ in range(warmup):
            step()
        sync()
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            sync()
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        result["steps"][b] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                              "context": [context_len + warmup, context_len + warmup + steps],
                              "warmup_s": compile_s}
        print(f"batch {b:4d}: transformers{' compiled' if compiled else ''} decode step median "
              f"{result['steps'][b]['median_ms']:.2f} ms (min {result['steps'][b]['min_ms']:.2f}; "
              f"warm-up incl. compile {compile_s:.1f} s)", flush=True)
        del cache
        if compiled:
            torch.cuda.empty_cache()
    return result
