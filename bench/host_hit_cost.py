"""What a prefix hit in the host KV tier costs against one on the device and against none:
the measurement behind the router's ``HOST_HIT_CREDIT`` (gateway/router.py).

One engine (the default model unless ``--model``), a small device cache and a host tier.
Per trial, a fresh ``--prompt-len``-token prompt is prefilled (one token generated) three
times: uncached (none), at once again (its full blocks on the device), and after a filler
prompt pushed its blocks out of the device cache into the host tier (host). Per block of the
prompt's cached part::

    recompute = (t_none - t_device) / blocks
    load      = the host tier's own copy path (``load`` + ``flush``) per block, timed alone
                (also shown: (t_host - t_device) / blocks, end to end, with its noise)
    credit    = 1 - load / recompute             (what a host hit saves, as a share of a device hit's)

Run: ``python -m bench.host_hit_cost [--model DIR [--load-format dummy]] [--trials 5]``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model directory (default: the embedded default model)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--load-format", default="auto", help="dummy: random weights at the model's shape "
                   "(the timings do not depend on the values)")
    args = p.parse_args(argv)

    from engine import LLM, SamplingParams
    from engine.model_files import ensure_default_model

    model = args.model or str(ensure_default_model())
    bs, n = args.block_size, args.prompt_len
    device_blocks = n // bs + 8  # one prompt and a little: the filler evicts it
    llm = LLM(model, block_size=bs, num_gpu_blocks_override=device_blocks, max_num_batched_tokens=4096,
              max_model_len=4 * n, kv_offloading_size=0.25, enforce_eager=True, load_format=args.load_format)
    engine = llm.engine
    host = engine.host_kv
    assert host is not None
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(10, 30000) for _ in range(length)]

    def timed(tokens: list[int]) -> tuple[float, int]:
        t0 = time.perf_counter()
        out = llm.generate([tokens], one)[0]
        return time.perf_counter() - t0, out.num_cached_tokens

    timed(prompt(n))  # warm-up
    rows = []
    for _ in range(args.trials):
        a = prompt(n)
        t_none, c0 = timed(a)
        t_dev, c1 = timed(a)
        loaded = host.loaded_blocks_total
        timed(prompt(device_blocks * bs - 1))  # takes every device block: a's go to the host tier
        t_host, c2 = timed(a)
        blocks = c1 // bs
        assert c0 == 0 and c1 == c2 == blocks * bs and host.loaded_blocks_total - loaded == blocks, \
            (c0, c1, c2, host.loaded_blocks_total - loaded)
        rows.append(((t_none - t_dev) / blocks, (t_host - t_dev) / blocks))
    recompute = statistics.median(r for r, _ in rows)
    e2e_load = statistics.median(h for _, h in rows)
    copy = _copy_time(host, engine.kv_cache, k=n // bs)
    load = copy  # (the end-to-end difference is within the noise of a prefill on a CPU)
    print(f"model {model}, block {bs} tokens, {host.block_bytes / 2**10:.0f} KiB a block, "
          f"{args.trials} trials of {n}-token prompts")
    print(f"recompute a block: {recompute * 1e3:.3f} ms")
    print(f"load a block from the host tier: {copy * 1e3:.3f} ms copying it (host tier's load + flush), "
          f"{e2e_load * 1e3:.3f} ms more than a device hit end to end (noise: +-{_spread(rows) * 1e3:.3f} ms)")
    print(f"load / recompute = {load / recompute:.4f}   credit of a host hit = {1 - load / recompute:.4f}")


def _spread(rows: list[tuple[float, float]]) -> float:
    return statistics.pstdev(h for _, h in rows) if len(rows) > 1 else 0.0


def _copy_time(host, kv_cache, k: int, reps: int = 20) -> float:
    """Seconds per block of the host tier's own copy path (``load`` then ``flush``) for ``k``
    blocks the tier holds, into the first ``k`` device blocks (the engine is done with them)."""
    slots = host.acquire(host.snapshot()[:k])
    try:
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for block, slot in enumerate(slots):
                host.load(slot, block)
            host.flush(kv_cache, wait=True)
            best = min(best, time.perf_counter() - t0)
    finally:
        host.release(slots)
    return best / len(slots)


if __name__ == "__main__":
    main()
