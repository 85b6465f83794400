"""Host time against device time of an eager mixed step (decode rows and a prefill chunk), on a
named shape with random weights: what bounds a colocated server's steps when a prefill budget is
small. Each step is queued by ``ModelRunner.launch`` (the overlapped path) after the device is
idle: "host" is the time until launch returns (Python, input preparation, kernel launches), "GPU"
the device time between events around the queued work, an upper bound of its busy time (it counts
the gaps while the host launches). For a dense shape each step's FLOPs (the projections and MLP of
every token, causal attention, the LM head of the sampled rows) give its rate against
``--peak-tflops`` (790: the H200's measured bf16 peak): with no decode rows, the prefill tier's
compute share of TTFT against its floor. Then one step under cProfile, its top functions by own
time.

    python -m bench.mixed_step --model-shape llama-3.1-8b --decode-rows 32 --chunks 480,992,1984
    python -m bench.mixed_step --model-shape llama-3.1-8b --decode-rows 0 --chunks 4096   # a 4k prefill
    PDSERVE_MIXED_GRAPHS=512,1024,2048 python -m bench.mixed_step --chunks 480,992,1984 \
        --max-num-batched-tokens 2048                                  # the same steps on their graphs
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time


def step_flops(config: dict, chunk: int, decode_rows: int, context: int) -> float | None:
    """FLOPs of one step of a dense decoder: ``chunk`` prompt tokens with no cached prefix and
    ``decode_rows`` rows each attending to ``context`` cached keys and itself, sampling one token
    a row (None for MoE)."""
    if any(k in config for k in ("num_experts", "num_local_experts")):
        return None
    h, n_layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    per_token = 2 * n_layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)
    keys = chunk * (chunk + 1) / 2 + decode_rows * (context + 1)  # (query, key) pairs, causal
    attention = 4 * n_layers * q * keys
    lm_head = 2 * h * config["vocab_size"] * (decode_rows + (1 if chunk else 0))
    return per_token * (chunk + decode_rows) + attention + lm_head


def main() -> int:
    import torch

    from bench.model_shapes import shape_dir
    from engine import LLM, SamplingParams
    from engine.planner import plan_step

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-shape", default="llama-3.1-8b")
    p.add_argument("--decode-rows", type=int, default=32)
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--chunks", default="480,992,1984")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the budget (default: the largest chunk and the decode rows); mixed-step graphs "
                        "(PDSERVE_MIXED_GRAPHS) are captured for buckets up to it")
    p.add_argument("--peak-tflops", type=float, default=790.0, help="the bf16 peak to compare with")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    cuda = torch.cuda.is_available()  # (on CPU: float32, host time only; a check of the script)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llm = LLM(str(shape_dir(args.model_shape)), load_format="dummy", dtype="bfloat16" if cuda else "float32",
              kv_cache_memory="24GiB" if cuda else "256MiB",
              max_model_len=8192, max_num_batched_tokens=args.max_num_batched_tokens or max(chunks) + args.decode_rows,
              max_num_seqs=args.decode_rows + 8)
    e = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.decode_rows):
        e.add_request(f"d{i}", torch.randint(100, 30000, (args.context_len,), generator=g).tolist(), sp)
    while any(r.num_output_tokens == 0 for r in e.scheduler.running) or e.scheduler.waiting:
        e.step()
    e.wait_for_background(0)
    if e._in_flight is not None:  # a decode step queued: take it
        e.scheduler.update_from_output(e._in_flight.out, *e._in_flight.result())
        e._in_flight = None
    runner, sched = e.runner, e.scheduler
    result: dict = {"shape": args.model_shape, "decode_rows": args.decode_rows, "cases": []}
    for n, chunk in enumerate(chunks):
        host, gpu = [], []
        for s in range(args.steps + 2):
            req = e.add_request(f"p{n}-{s}", torch.randint(100, 30000, (chunk,), generator=g).tolist(),
                                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            out = sched.schedule()
            assert sum(x.num_new_tokens for x in out.scheduled) == chunk + args.decode_rows, \
                [x.num_new_tokens for x in out.scheduled]
            sync()
            start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda \
                else (None, None)
            t0 = time.perf_counter()
            if cuda:
                start.record()
            # queued on its mixed-step graph where one holds it, else eagerly (CPU: no graphs)
            launched = runner.run(out, plan_step(out.scheduled, runner.step_runtime()))
            if cuda:
                end.record()
            t1 = time.perf_counter()
            sampled = launched.result()
            sync()
            sched.update_from_output(out, *sampled)
            if s >= 2:  # the first two: warm-up
                host.append((t1 - t0) * 1e3)
                gpu.append(start.elapsed_time(end) if cuda else 0.0)
            assert req.is_finished
        case = {"chunk": chunk, "host_ms": statistics.median(host), "gpu_ms": statistics.median(gpu),
                "host_all": host, "gpu_all": gpu}
        flops = step_flops(json.loads((shape_dir(args.model_shape) / "config.json").read_text()), chunk,
                           args.decode_rows, args.context_len)
        rate = ""
        if flops is not None and case["gpu_ms"] > 0:
            case["tflop"] = flops / 1e12
            case["tflops_per_s"] = flops / case["gpu_ms"] / 1e9
            case["of_peak"] = case["tflops_per_s"] / args.peak_tflops
            rate = (f", {case['tflop']:.1f} TFLOP: {case['tflops_per_s']:.0f} TFLOP/s, "
                    f"{100 * case['of_peak']:.0f}% of {args.peak_tflops:.0f}")
        result["cases"].append(case)
        print(f"{args.decode_rows} decode rows + {chunk}-token chunk: host {case['host_ms']:.2f} ms "
              f"(to queue it), GPU {case['gpu_ms']:.2f} ms{rate}")
    # one step of the smallest chunk under cProfile
    e.add_request("prof", torch.randint(100, 30000, (chunks[0],), generator=g).tolist(),
                  SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    out = sched.schedule()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    launched = runner.run(out, plan_step(out.scheduled, runner.step_runtime()))
    prof.disable()
    sched.update_from_output(out, *launched.result())
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print(buf.getvalue())
    result["profile_top"] = buf.getvalue()
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
