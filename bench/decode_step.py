"""`pdserve bench decode-step`: time one engine decode step at several batch
sizes (all sequences at the same context length), the number to hold
against the roofline (weights + KV bytes per step / memory bandwidth).

    pdserve bench decode-step --model-shape llama-3.1-8b --batch-sizes 1,32,128 --context-len 1024

On CUDA, decode steps replay CUDA graphs; ``--enforce-eager`` times the
same steps launched eagerly (run the command once with it to compare), and
``--no-async-scheduling`` one step at a time (each waits for the one before).
``--peer transformers`` times transformers' compiled static-cache decode
instead, on the same shape, batch sizes and context (``bench/decode_peer.py``;
run it in its own process, after or before pdserve's, for a same-machine pair).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence

from bench.results import write_result
from engine.config import EngineArgs


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32,128")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model-shape", default=None, help="random weights at a named shape (e.g. llama-3.1-8b)")
    p.add_argument("--peer", choices=("transformers",), default=None,
                   help="time this peer instead of pdserve: transformers with a StaticCache and "
                        "torch.compile(mode='reduce-overhead')")
    p.add_argument("--peer-eager", action="store_true",
                   help="with --peer transformers: its eager forward (no torch.compile), e.g. for MoE shapes")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile N more steps per batch size (CUDA): the GPU's busy time "
                        "per step against the step's wall time, and the kernels that take it")
    p.add_argument("--structured-rows", default="0", metavar="N[,N...]",
                   help="how many rows of each batch size (one figure per batch size, or one for all) "
                        "decode under a structured-output constraint that never completes (an EBNF grammar "
                        "of lowercase words): the cost of their masks; the model needs a tokenizer "
                        "(--tokenizer DIR for --model-shape)")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main(args: argparse.Namespace) -> int:
    from engine.llm_engine import LLMEngine

    if args.model_shape:
        from bench.model_shapes import shape_dir

        args.model, args.load_format = str(shape_dir(args.model_shape)), "dummy"
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    if args.peer:
        from bench import decode_peer
        from engine.model_files import resolve_model_path

        device = EngineArgs.from_cli_args(args).resolve_device()
        peer = decode_peer.run(resolve_model_path(args.model), sizes, args.context_len, args.steps, device,
                               "bfloat16" if device.startswith("cuda") else "float32", eager=args.peer_eager)
        write_result(peer, "decode-step-peer", args.output_json)
        return 0
    args.max_num_seqs = max(max(sizes), args.max_num_seqs)
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    constrained = [int(x) for x in args.structured_rows.split(",")]
    if len(constrained) == 1:
        constrained *= len(sizes)
    if len(constrained) != len(sizes) or any(not 0 <= c <= b for c, b in zip(constrained, sizes)):
        raise SystemExit(f"--structured-rows {args.structured_rows}: one count (at most the batch) per batch size")
    result = measure(engine, sizes, args.context_len, args.steps, args.profile, constrained)
    write_result(result, "decode-step", args.output_json)
    return 0


# Never complete, so a constrained row decodes for as long as the unconstrained ones.
_ENDLESS = "root ::= [a-z]+ (\" \" [a-z]+)*"


def measure(engine, sizes: list[int], context_len: int, steps: int, profile: int = 0,
            constrained: list[int] | None = None, lora_rows: list[int] | None = None,
            lora_names: Sequence[str] = ()) -> dict:
    """Median decode-step times of ``engine`` at each batch size (sequences of ``context_len``
    random tokens, prefilled first, then ``steps`` timed steps), as ``main`` reports them;
    ``constrained[i]`` rows of batch ``sizes[i]`` decode under a grammar, ``lora_rows[i]``
    under the LoRA adapters ``lora_names`` in turn."""
    from engine.sampling_params import SamplingParams
    from engine.structured_outputs import StructuredOutputsParams

    device, vocab = engine.config.device, engine.config.model.vocab_size
    rng = random.Random(0)
    graphs = engine.runner.graphs
    result: dict = {"config": engine.config.describe(), "context_len": context_len,
                    "cuda_graphs": graphs is not None, "steps": {}}
    print(f"decode steps: {'CUDA graphs, batch sizes ' + ','.join(map(str, graphs.sizes)) if graphs else 'eager'}",
          flush=True)
    budget = engine.config.scheduler.max_num_batched_tokens
    for b, num_constrained, num_lora in zip(sizes, constrained or [0] * len(sizes), lora_rows or [0] * len(sizes)):
        # Requests prefilled first decode while the rest prefill (decode first): give them enough
        # tokens that none finishes before the timed steps, then abort them all.
        prefill_steps = -(-b * context_len // budget) + b
        sp = SamplingParams(temperature=0, max_tokens=prefill_steps + steps + 2 * profile + 2,
                            ignore_eos=True)
        grammar = SamplingParams(temperature=0, max_tokens=sp.max_tokens, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(grammar=_ENDLESS))
        for i in range(b):
            engine.add_request(f"b{b}-{i}", [rng.randrange(100, vocab) for _ in range(context_len)],
                               grammar if i < num_constrained else sp,
                               lora_name=lora_names[i % len(lora_names)] if i < num_lora else None)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
            if not engine.step().did_work:  # prefill (constraints compile first)
                engine.wait_for_background(0.05)
        engine.step()  # warm-up decode
        contexts = [r.num_tokens for r in engine.scheduler.requests.values()]
        times, rows = [], []
        replays = graphs.num_replays if graphs else 0
        # Steps back to back, the device synchronised only around the run: with overlapped
        # steps (--async-scheduling) a call queues the next step and reads the one before, so
        # a step's time is what one call takes in a steady stream of them.
        _sync(device)
        t0 = run_start = time.perf_counter()
        for _ in range(steps):
            rows.append(engine.step().num_batched_tokens)
            t = time.perf_counter()
            times.append(t - t0)
            t0 = t
        _sync(device)
        mean = (time.perf_counter() - run_start) / steps  # the last step's device tail included
        replayed = (graphs.num_replays - replays) if graphs else 0
        profiled = _profile(engine, profile, device) if profile else None
        for rid in list(engine.scheduler.requests):
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        if set(rows) != {b}:
            print(f"warning: batch {b}: the timed steps ran {sorted(set(rows))} rows", flush=True)
        key = b if not num_constrained else f"{b}+{num_constrained}c"  # one batch size with and without
        if num_lora:
            key = f"{key}+{num_lora}lora"
        result["steps"][key] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                              "mean_ms": 1e3 * mean, "constrained_rows": num_constrained,
                              "rows": sorted(set(rows)), "context": [min(contexts), max(contexts)],
                              "graph_replays": replayed, "lora_rows": num_lora}
        if profiled:
            result["steps"][key]["profile"] = profiled
        print(f"batch {b:4d}{f' ({num_constrained} constrained)' if num_constrained else ''}"
              f"{f' ({num_lora} under {min(num_lora, len(lora_names))} adapters)' if num_lora else ''}: decode step median "
              f"{result['steps'][key]['median_ms']:.2f} ms "
              f"(min {result['steps'][key]['min_ms']:.2f}, mean {1e3 * mean:.2f}; "
              f"context {min(contexts)}-{max(contexts)} tokens; "
              f"{replayed} of {steps} steps replayed a graph)", flush=True)
    return result


def _profile(engine, steps: int, device: str) -> dict:
    """Run ``steps`` engine steps under torch.profiler: per step, the wall time, the GPU's
    summed kernel time, and the kernels that take most of it (graph replays included);
    then the host's torch ops and Python functions. (On CPU: no GPU figures.)"""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in kernels) / steps / 1e3
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    launches = sum(e.count for e in kernels) / steps
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0),
                  key=lambda e: -e.self_cpu_time_total)[:10]
    out = {"wall_ms": wall * 1e3, "gpu_busy_ms": busy, "kernels_per_step": launches,
           "top_kernels_ms": {e.key[:90]: e.self_device_time_total / steps / 1e3 for e in top},
           "top_kernels_per_step": {e.key[:90]: e.count / steps for e in top},
           "top_host_ops_ms": {e.key[:90]: e.self_cpu_time_total / steps / 1e3 for e in host}}
    print(f"  profiled {steps} steps: {wall * 1e3:.2f} ms a step under the profiler, GPU busy {busy:.2f} ms "
          f"in {launches:.0f} kernels; top kernels (ms a step, launches a step):", flush=True)
    for name, ms in out["top_kernels_ms"].items():
        print(f"    {ms:7.3f} {out['top_kernels_per_step'][name]:6.0f}  {name}", flush=True)
    print("  top host ops (self CPU ms a step):", flush=True)
    for name, ms in out["top_host_ops_ms"].items():
        print(f"    {ms:7.3f}  {name}", flush=True)
    # The Python side of the same steps (cProfile, a separate pass: its overhead inflates
    # every figure, the ranking is what it is for).
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    _sync(device)
    pr.disable()
    stats = pstats.Stats(pr).stats  # {(file, line, fn): (cc, nc, tottime, cumtime, callers)}
    py = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    out["top_python_ms"] = {f"{k[2]} ({k[0].rsplit('/', 1)[-1]}:{k[1]})": v[2] / steps * 1e3 for k, v in py}
    print("  top Python functions (self ms a step, under cProfile):", flush=True)
    for name, ms in out["top_python_ms"].items():
        print(f"    {ms:7.3f}  {name}", flush=True)
    return out
