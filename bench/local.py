"""`pdserve bench local`: one user on a CPU, pdserve's offline engine against llama.cpp on the same
GGUF file, in the same run.

Workload: the chat prompt ``--prompt`` under the model's chat template (39 tokens with the
default), greedy, ``--output-len`` tokens generated past any end of turn (ignore_eos). Each
measurement is a fresh process (its peak RSS is its own) that loads the model, runs one short
warm-up request, then the measured request, streamed: time to the first token, then generation
tok/s over the tokens after it. ``--batch N`` then runs N sequences of the prompt for their total
tok/s: pdserve batches them, llama.cpp's one context runs them in turn. The engines alternate,
``--repeats`` processes each, and the medians are reported. Both get the same prompt token ids and
``--threads`` threads.

llama.cpp runs through llama-cpp-python when it is installed (``pip install ".[llama-cpp]"``
builds it from source, a few minutes; on a CPU with AMX whose llama.cpp build crashes in its AMX
path, build without it: ``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install --no-binary llama-cpp-python
llama-cpp-python``). ``--llama-cpp-python PATH`` takes an interpreter of another environment that has
it; without either, pdserve alone is measured.

    pdserve bench local                        # the default model's GGUF, packed, 2 threads
    pdserve bench local --model DIR --gguf-file FILE.gguf --threads 4
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.results import write_result

DEFAULT_PROMPT = "Write a short story about a lighthouse keeper."
_WARM_UP_TOKENS = 4


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="what pdserve serves (default: the embedded model's GGUF, its blocks kept packed)")
    p.add_argument("--gguf-file", default=None,
                   help="the GGUF file llama.cpp loads (default: the embedded model's own file)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (under the chat template)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per engine, alternating")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=0, metavar="N",
                   help="also N sequences of the same prompt at once: pdserve batches them, llama.cpp (one "
                        "context) runs them one after another; total generated tok/s (default 0: not measured)")
    p.add_argument("--llama-cpp-python", default=None, metavar="PYTHON",
                   help="an interpreter with llama-cpp-python (default: this one, where it is installed)")
    p.add_argument("--skip-llama-cpp", action="store_true", help="measure pdserve alone")
    p.add_argument("--gguf-activations", default="float32", metavar="LIST",
                   help="pdserve's --gguf-activations, comma-separated to measure several side by side "
                        "(float32,q8_0)")
    p.add_argument("--output-json", default=None, help="default: bench/results/local-<time>.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: "pdserve" | "llama.cpp"
    p.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)  # a child's prompt, JSON


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(tokens) -> dict:
    """Time a stream of generated tokens: to the first, then the rest."""
    start = time.perf_counter()
    first = end = None
    ids = []
    for token in tokens:
        now = time.perf_counter()
        first = now if first is None else first
        end = now
        ids.append(int(token))
    n = len(ids)
    return {"ttft_s": first - start, "gen_tok_s": (n - 1) / (end - first) if n > 1 else 0.0,
            "num_tokens": n, "token_ids": ids}


def measure_pdserve(model: str, prompt_ids: list[int], output_len: int, batch: int = 0,
                    gguf_activations: str = "float32") -> dict:
    from engine import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, device="cpu", dtype="float32", gguf_activations=gguf_activations)
    load_s = time.perf_counter() - t0
    engine = llm.engine

    def stream(ids: list[int], n: int):
        req = engine.add_request("local-" + str(time.monotonic_ns()), ids,
                                 SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        seen = 0
        while not req.is_finished:
            engine.step()
            out = req.output_token_ids
            while seen < len(out):
                yield out[seen]
                seen += 1

    list(stream(prompt_ids[:8], _WARM_UP_TOKENS))
    result = {"load_s": load_s, **_timed(stream(prompt_ids, output_len))}
    if batch > 0:
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        # The same prompt: its prefix is cached after the first, as the llama.cpp context's is.
        t = time.perf_counter()
        outs = llm.generate([list(prompt_ids)] * batch, params)
        result["batch_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    return result


def measure_llama_cpp(gguf_file: str, prompt_ids: list[int], output_len: int, threads: int, batch: int = 0) -> dict:
    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf_file, n_ctx=max(512, len(prompt_ids) + output_len + 16),
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - t0

    def stream(ids: list[int], n: int):
        llm.reset()
        for i, token in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
            yield token
            if i + 1 >= n:
                return

    list(stream(prompt_ids[:8], _WARM_UP_TOKENS))
    result = {"load_s": load_s, "version": llama_cpp.__version__, **_timed(stream(prompt_ids, output_len))}
    if batch > 0:  # one context: one sequence after another
        t = time.perf_counter()
        n = sum(len(list(stream(prompt_ids, output_len))) for _ in range(batch))
        result["batch_tok_s"] = n / (time.perf_counter() - t)
    return result


def _child(args: argparse.Namespace) -> int:
    prompt_ids = json.loads(args.prompt_ids)
    if args.one == "pdserve":
        import torch

        torch.set_num_threads(args.threads)
        result = measure_pdserve(args.model, prompt_ids, args.output_len, args.batch, args.gguf_activations)
    else:
        result = measure_llama_cpp(args.gguf_file, prompt_ids, args.output_len, args.threads, args.batch)
    result["peak_rss_mib"] = _peak_rss_mib()
    print(json.dumps(result))
    return 0


def _llama_cpp_python(args: argparse.Namespace) -> str | None:
    """The interpreter that runs llama.cpp, or None (not installed)."""
    python = args.llama_cpp_python or sys.executable
    probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True)
    return python if probe.returncode == 0 else None


def _run_child(python: str, engine: str, args: argparse.Namespace, prompt_ids: list[int],
               activations: str = "float32") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else repo
    out = subprocess.run([python, "-m", "bench.local", "--one", engine, "--model", args.model, "--gguf-file",
                          args.gguf_file, "--output-len", str(args.output_len), "--threads", str(args.threads),
                          "--batch", str(args.batch), "--gguf-activations", activations,
                          "--prompt-ids", json.dumps(prompt_ids)],
                         capture_output=True, text=True, env=env, cwd=repo)
    if out.returncode != 0:
        raise RuntimeError(f"the {engine} measurement failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(args: argparse.Namespace) -> int:
    if args.one:
        return _child(args)
    from engine.model_files import GGUF_MODEL, ensure_default_model, find_default_gguf
    from engine.tokenizer import apply_chat_template, load_tokenizer

    if args.model is None:
        args.model = str(ensure_default_model(packed=True))  # its conversion is not measured
    args.gguf_file = args.gguf_file or str(find_default_gguf())
    tokenizer = load_tokenizer(Path(args.model))
    prompt_ids = apply_chat_template(tokenizer, [{"role": "user", "content": args.prompt}])
    # name -> (interpreter, the child's engine, its --gguf-activations)
    engines = {"pdserve" if act == "float32" else f"pdserve {act}": (sys.executable, "pdserve", act)
               for act in args.gguf_activations.split(",")}
    if not args.skip_llama_cpp:
        python = _llama_cpp_python(args)
        if python is None:
            print("llama-cpp-python is not installed here (see `pdserve bench local --help`); measuring pdserve "
                  "alone", file=sys.stderr)
        else:
            engines["llama.cpp"] = (python, "llama.cpp", "float32")
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for i in range(args.repeats):
        for name, (python, engine, act) in engines.items():
            r = _run_child(python, engine, args, prompt_ids, act)
            runs[name].append(r)
            print(f"run {i + 1}/{args.repeats} {name:<13}  TTFT {r['ttft_s'] * 1e3:6.1f} ms  "
                  f"generation {r['gen_tok_s']:6.1f} tok/s  peak RSS {r['peak_rss_mib']:5.0f} MiB", flush=True)
    summary = {name: {"ttft_ms": 1e3 * _median(rs, "ttft_s"), "gen_tok_s": _median(rs, "gen_tok_s"),
                      "peak_rss_mib": _median(rs, "peak_rss_mib"), "load_s": _median(rs, "load_s"),
                      **({"batch_tok_s": _median(rs, "batch_tok_s")} if args.batch else {})}
               for name, rs in runs.items()}
    print(f"\nmedians of {args.repeats}, {len(prompt_ids)} prompt tokens, {args.output_len} generated, "
          f"{args.threads} threads ({Path(args.model).name} / {Path(args.gguf_file).name})")
    for name, s in summary.items():
        batch = f"  {args.batch} sequences {s['batch_tok_s']:6.1f} tok/s" if args.batch else ""
        print(f"  {name:<13}  TTFT {s['ttft_ms']:6.1f} ms  generation {s['gen_tok_s']:6.1f} tok/s  "
              f"peak RSS {s['peak_rss_mib']:5.0f} MiB  load {s['load_s']:.2f} s{batch}")
    b = summary.get("llama.cpp")
    for name in (n for n in summary if b is not None and n != "llama.cpp"):
        a = summary[name]
        same = runs[name][0]["token_ids"] == runs["llama.cpp"][0]["token_ids"]
        print(f"  {name} / llama.cpp: generation {a['gen_tok_s'] / b['gen_tok_s']:.2f}x, "
              f"TTFT {a['ttft_ms'] / b['ttft_ms']:.2f}x, peak RSS {a['peak_rss_mib'] / b['peak_rss_mib']:.2f}x; "
              f"greedy tokens {'identical' if same else 'differ'}")
    write_result({"kind": "local", "model": args.model, "gguf_file": args.gguf_file, "threads": args.threads,
                  "prompt_tokens": len(prompt_ids), "output_len": args.output_len, "summary": summary,
                  "runs": runs, "default_model": args.model.endswith(GGUF_MODEL)}, "local", args.output_json)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
