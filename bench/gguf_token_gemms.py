"""A decode token's worth of the default model's packed GEMMs (120 Q4_1 layers at SmolLM2-135M's
shapes and the Q8_0 LM head: 96 MB of random blocks, called in a step's order), for builds of
``kernels/cpu/gguf_gemm.cpp`` side by side: each SOURCE[:FLAGS] is built as its own extension (FLAGS
are extra compiler flags, e.g. ``-DGGUF_PREFETCH_GROUPS=0``), checked against the reference, then
all are timed alternately, best of ``--rounds``. ``--activations float32,q8_0`` times each build's
float32-activation GEMM (``gguf_linear``) and its int8-activation one (``gguf_linear_q8``) side by side.

    python -m bench.gguf_token_gemms kernels/cpu/gguf_gemm.cpp \\
        "kernels/cpu/gguf_gemm.cpp:-DGGUF_PREFETCH_GROUPS=0" --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="+", metavar="SOURCE[:FLAGS]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1, help="rows of x (1: a decode step of one sequence)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--activations", default="float32", help="comma-separated: float32 (gguf_linear), q8_0 "
                   "(gguf_linear_q8: int8 activations)")
    args = p.parse_args()
    from bench.kernel_builds import load_builds
    from kernels import gguf_reference as ref
    from kernels.cpu_gemm import GGUF_CFLAGS

    mods = load_builds(args.builds, "gguf_token_gemms", GGUF_CFLAGS)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    def packed(qtype: str, n: int, k: int) -> torch.Tensor:
        return ref.quantize(torch.randn(n, k, generator=g) * 0.05, qtype)

    layers = [[packed("Q4_1", n, k) for n, k in SHAPES] for _ in range(LAYERS)]
    head = packed("Q8_0", VOCAB, HIDDEN)
    x576, x1536 = torch.randn(args.tokens, 576, generator=g), torch.randn(args.tokens, 1536, generator=g)
    runs = {}  # label -> (the GEMM, its reference)
    for build, m in mods.items():
        for act in args.activations.split(","):
            gemm, reference = (m.gguf_linear, ref.linear) if act == "float32" else (m.gguf_linear_q8, ref.linear_q8)
            for w, x, q, code in ((layers[0][2], x576, "Q4_1", 1), (layers[0][3], x1536, "Q4_1", 1),
                                  (head, x576, "Q8_0", 2)):
                want = reference(x, w, q)
                err = float((gemm(x, w, code, None) - want).abs().max() / want.abs().max())
                assert err < 1e-5, f"{build} ({act}): {q} differs from the reference by {err:.2e}"
            runs[f"{build} [{act}]" if act != "float32" else build] = gemm

    def token(gemm) -> None:
        for qkv, o, gate_up, down in layers:
            for w, x in ((qkv, x576), (o, x576), (gate_up, x576), (down, x1536)):
                gemm(x, w, 1, None)
        gemm(x576, head, 2, None)

    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.rounds):
        for build, gemm in runs.items():
            t = time.perf_counter()
            token(gemm)
            best[build] = min(best[build], time.perf_counter() - t)
    total = sum(w.numel() for ws in layers for w in ws) + head.numel()
    for build, s in best.items():
        print(f"{s * 1e3:6.2f} ms a token ({total / s / 1e9:4.1f} GB/s)  {build}  [{args.threads} threads, "
              f"{args.tokens} row(s)]")


if __name__ == "__main__":
    main()
