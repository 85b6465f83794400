"""Decode attention on the CPU at the default model's shape (9 query heads, 3 kv heads, head dim 64,
float32 cache in blocks of 16), for builds of ``kernels/cpu/paged_attention.cpp`` side by side: each
SOURCE[:FLAGS] is built as its own extension (FLAGS are extra compiler flags), checked against the
reference, then all are timed alternately at each context length, best of ``--rounds``.

    python -m bench.cpu_attention_builds BEFORE.cpp kernels/cpu/paged_attention.cpp --threads 2
"""
from __future__ import annotations

import argparse
import time

import torch

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("builds", nargs="+", metavar="SOURCE[:FLAGS]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences, one query row each")
    p.add_argument("--contexts", default="64,256,1024,4096")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    from bench.kernel_builds import load_builds
    from kernels import reference
    from kernels.cpu_extension import DEFAULT_CFLAGS

    mods = load_builds(args.builds, "cpu_attention_builds", DEFAULT_CFLAGS)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    b = args.batch
    print(f"batch {b}, {args.threads} threads; microseconds a call, best of {args.rounds}")
    print("context | " + " | ".join(mods))
    for ctx in (int(c) for c in args.contexts.split(",")):
        per_seq = -(-ctx // BLOCK)
        kv = torch.randn(b * per_seq + 1, 2, BLOCK, HKV, D, generator=g)
        kc, vc = kv[:, 0], kv[:, 1]
        perm = torch.randperm(b * per_seq, generator=g).to(torch.int32)
        tables = perm.reshape(b, per_seq).contiguous()
        q = torch.randn(b, HQ, D, generator=g)
        qsl = torch.arange(b + 1, dtype=torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32)
        want = reference.paged_attention(q, kc, vc, tables, qsl, lens, D ** -0.5)
        for build, m in mods.items():
            got = m.paged_attention(q, kc, vc, tables, qsl, lens, D ** -0.5, 0, 1.0, 1.0, None)
            err = float((got - want).abs().max())
            assert err < 1e-4, f"{build}: differs from the reference by {err:.2e} at context {ctx}"
        best = dict.fromkeys(mods, float("inf"))
        reps = max(2, 20000 // ctx)
        for _ in range(args.rounds):
            for build, m in mods.items():
                t = time.perf_counter()
                for _ in range(reps):
                    m.paged_attention(q, kc, vc, tables, qsl, lens, D ** -0.5, 0, 1.0, 1.0, None)
                best[build] = min(best[build], (time.perf_counter() - t) / reps)
        print(f"{ctx} | " + " | ".join(f"{v * 1e6:.1f}" for v in best.values()))


if __name__ == "__main__":
    main()
