"""bf16 F.linear under each BLAS library at decode batch sizes: which one a decode graph
of M rows should be captured under (``engine/gemm_backend.py``, ``PDSERVE_DECODE_BLAS``).

For M in 1..256 and Llama-3.1-8B's layer GEMMs (qkv 4096->6144, o 4096->4096, gate_up
4096->28672, down 14336->4096) and its LM head (4096->128256), times F.linear under
every library PyTorch can prefer (cublas, cublaslt, and "default" where the build has
it; one that fails is reported and skipped) inside CUDA graphs that cycle through enough
weight copies that L2 (60 MB) cannot hold them (``bench.gemm_timing``: >= 240 MB a
cycle). Each time is held against its floor: the bytes a call moves (weight, x, y) at
the copy bandwidth of the environment notes (4.30 TB/s; the in-run copy probe read low
in ``bench kernels``), or its FLOPs at the measured bf16 peak (~790 TFLOP/s), whichever
is longer. Per M: the winner per shape, the layer's sum per library, a step's GEMMs
(32 layers + the LM head) per library and the library that wins it (the process's
default unless another is ``gemm_backend.AUTO_MARGIN`` faster, as ``auto`` decides); outputs of the
libraries are compared on copy 0 (max |diff| against the first library's). Ends with the
``PDSERVE_DECODE_BLAS`` table the step winners give.

    python -m bench.gemm_choice --out gemm_choice.json [--tokens 1,32,256] [--libraries cublas,cublaslt]
"""
from __future__ import annotations

import argparse
import json
import time

from bench.gemm_timing import cycle_copies, graph_us

SHAPES = {  # name: (K, N), Llama-3.1-8B
    "qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
LAYER = ("qkv", "o", "gate_up", "down")
NUM_LAYERS = 32
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
COPY_BW = 4.30e12  # bytes/s, read + written (environment notes)
BF16_PEAK = 790e12  # FLOP/s, measured dense bf16 (environment notes)


def floor_us(m: int, k: int, n: int) -> float:
    """The longer of the bytes floor (bf16 weight, x and y once) and the FLOP floor."""
    moved = 2 * (n * k + m * k + m * n)
    return max(moved / COPY_BW, 2 * m * n * k / BF16_PEAK) * 1e6


def _winner(us: dict[str, float], base: str) -> str:
    """As ``PDSERVE_DECODE_BLAS=auto`` decides: the process's library unless another is
    ``AUTO_MARGIN`` faster (smaller differences are noise, or the same kernel)."""
    from engine.gemm_backend import AUTO_MARGIN

    fastest = min(us, key=us.__getitem__)
    return base if base in us and us[fastest] >= us[base] * (1 - AUTO_MARGIN) else fastest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file (default bench/results/gemm-choice-<time>.json)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--libraries", default="", help="default: every one this build can prefer")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from engine import gemm_backend

    t_start = time.perf_counter()
    tokens = [int(t) for t in args.tokens.split(",")]
    names = [x for x in ("default", "cublas", "cublaslt") if x in torch.backends.cuda._BlasBackends]
    wanted = args.libraries.split(",") if args.libraries else names
    libs = [lib for lib in wanted if gemm_backend.available(lib)]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; process default: "
          f"{gemm_backend.current()}; libraries: {', '.join(libs)}"
          f"{' (cannot prefer ' + ', '.join(set(wanted) - set(libs)) + ')' if len(libs) < len(wanted) else ''}",
          flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    result: dict = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
                    "process_default": gemm_backend.current(), "libraries": libs, "copy_bw": COPY_BW,
                    "bf16_peak": BF16_PEAK, "cases": [], "per_m": {}}
    times: dict[tuple[int, str, str], float] = {}
    for shape, (k, n) in SHAPES.items():
        copies = cycle_copies(2 * n * k)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
              for _ in range(copies)]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            case = {"shape": shape, "m": m, "k": k, "n": n, "copies": copies, "floor_us": floor_us(m, k, n),
                    "us": {}, "max_abs_diff": {}, "errors": {}}
            ref = None
            for lib in libs:
                try:
                    with gemm_backend.prefer(lib):
                        us = graph_us(lambda i: F.linear(x, ws[i]), copies)
                        y = F.linear(x, ws[0]).float()
                except Exception as e:  # noqa: BLE001 - one failing variant must not end the run
                    case["errors"][lib] = f"{type(e).__name__}: {e}"[:300]
                    print(f"  {shape} M={m} {lib}: {case['errors'][lib]}", flush=True)
                    continue
                case["us"][lib] = times[(m, shape, lib)] = us
                ref = y if ref is None else ref
                case["max_abs_diff"][lib] = (y - ref).abs().max().item()
            if case["us"]:
                best = min(case["us"], key=case["us"].__getitem__)
                case["fastest"] = best
                case["best_of_floor"] = case["us"][best] / case["floor_us"]
            result["cases"].append(case)
            print(f"{shape:8s} M={m:4d}  floor {case['floor_us']:8.1f} us  "
                  + "  ".join(f"{lib} {us:8.1f} ({us / case['floor_us']:.2f}x, diff {case['max_abs_diff'][lib]:.2g})"
                              for lib, us in case["us"].items()), flush=True)
        del ws
        torch.cuda.empty_cache()

    print(f"\nper M (us; a step's GEMMs = {NUM_LAYERS} layers + lm_head):", flush=True)
    print(f"{'M':>4s}  " + "  ".join(f"{lib + ' layer':>16s}" for lib in libs) + "  "
          + "  ".join(f"{lib + ' step':>15s}" for lib in libs) + f"  {'step floor':>10s}  winner", flush=True)
    winners: dict[int, str] = {}
    for m in tokens:
        full = [lib for lib in libs if all((m, s, lib) in times for s in SHAPES)]
        layer = {lib: sum(times[(m, s, lib)] for s in LAYER) for lib in full}
        step = {lib: NUM_LAYERS * layer[lib] + times[(m, "lm_head", lib)] for lib in full}
        step_floor = NUM_LAYERS * sum(floor_us(m, *SHAPES[s]) for s in LAYER) + floor_us(m, *SHAPES["lm_head"])
        row = {"layer_us": layer, "step_us": step, "step_floor_us": step_floor,
               "winner_by_shape": {s: _winner({lib: times[(m, s, lib)] for lib in full}, result["process_default"])
                                   for s in SHAPES} if full else {}}
        if step:
            row["winner"] = winners[m] = _winner(step, result["process_default"])
            fastest = min(step, key=step.__getitem__)
            row["best_step_of_floor"] = step[fastest] / step_floor
            if result["process_default"] in step:
                row["gain_over_default"] = 1 - step[fastest] / step[result["process_default"]]
        result["per_m"][m] = row
        print(f"{m:4d}  " + "  ".join(f"{layer.get(lib, float('nan')):16.1f}" for lib in libs) + "  "
              + "  ".join(f"{step.get(lib, float('nan')):15.1f}" for lib in libs)
              + f"  {step_floor:10.1f}  {row.get('winner', '-')}"
              + (f" ({row['best_step_of_floor']:.2f}x floor, {100 * row.get('gain_over_default', 0):+.1f}%)"
                 if step else "")
              + f"  (by shape: {', '.join(f'{s} {w}' for s, w in row['winner_by_shape'].items())})", flush=True)
    if winners:
        result["suggested_env"] = f"{gemm_backend.BLAS_ENV}={gemm_backend.table_text(winners)}"
        print(f"\nstep winners as a table: {result['suggested_env']}", flush=True)
    result["seconds"] = time.perf_counter() - t_start
    from bench.results import write_result

    write_result(result, "gemm-choice", args.out)
    print(f"{result['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
