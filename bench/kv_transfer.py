"""KV transfer bandwidth between two GPUs, against a raw NCCL send of the same size.

One prefill-side process (KVSender) and one decode-side process (KVReceiver), one GPU
each, move the KV of one request of the Llama-3.1-8B shape (32 layers, 8 KV heads,
head_dim 128, bf16, blocks of 16 tokens: 128 KiB a token) from blocks 0..n-1 into
destination blocks laid out three ways: one run (contiguous), runs of 8 blocks, and
single blocks (scattered). Each message plan is timed, and a raw NCCL send of the same
number of bytes between the same processes, from one contiguous buffer, in the same run.

One timed transfer: both processes meet (a 1-element NCCL message from decode to prefill),
then the decode side's clock runs until the data is in its cache (raw: until the receive
completed). The figure is the median over ``--iters``. After each case the decode side
poisons the destination blocks, receives once more and checks that every byte equals the
sender's.

    NCCL_NVLS_ENABLE=0 python -m bench.kv_transfer --tokens 1024,4096,16384 --devices cuda:0,cuda:1
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
LAYER_BLOCK_BYTES = 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 2  # K and V of one block in one layer, bf16
LAYOUTS = ("contiguous", "runs8", "scattered")
MAX_DIRECT_MESSAGES = 4096  # beyond this an in-place plan is host-bound for seconds: not timed


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", default="1024,4096,16384", help="prompt lengths (multiples of 16)")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--devices", default="cuda:0,cuda:1", help="prefill device, decode device")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plans", default="auto,direct,packed-1,packed-8,packed-32",
                   help="auto (the sender's own choice), direct (runs in place, one group), "
                        "direct-per-layer, packed-C (gathered, C layers a chunk)")
    p.add_argument("--output-json", default=None)


def _plans(names: list[str]) -> list[tuple[str, tuple[bool, int] | None]]:
    out: list[tuple[str, tuple[bool, int] | None]] = []
    for name in names:
        if name == "auto":
            out.append((name, None))
        elif name == "direct":
            out.append((name, (False, NUM_LAYERS)))
        elif name == "direct-per-layer":
            out.append((name, (False, 1)))
        elif name.startswith("packed-"):
            out.append((name, (True, int(name.split("-", 1)[1]))))
        else:
            raise ValueError(f"unknown plan {name!r}")
    return out


def _ids(tokens: int, layout: str) -> tuple[list[int], list[int]]:
    """Source blocks 0..n-1; destination blocks laid out by ``layout`` (never the same ids)."""
    n = tokens // BLOCK_SIZE
    if layout == "contiguous":
        return list(range(n)), list(range(8, 8 + n))
    if layout == "runs8":
        return list(range(n)), [16 * (i // 8) + i % 8 for i in range(n)]
    if layout == "scattered":
        return list(range(n)), [2 * i for i in range(n)]
    raise ValueError(f"unknown layout {layout!r}")


def _cases(cfg: dict[str, Any]) -> list[tuple[int, str, str, tuple[bool, int] | None]]:
    """The same list in both processes: (tokens, layout, plan name, plan), raw first per size."""
    from engine.kv_transfer import merge_runs

    cases: list[tuple[int, str, str, tuple[bool, int] | None]] = []
    for tokens in cfg["tokens"]:
        cases.append((tokens, "contiguous", "raw", None))
        for layout in cfg["layouts"]:
            src, dst = _ids(tokens, layout)
            runs = len(merge_runs(src, dst))
            for name, plan in cfg["plans"]:
                if plan is not None and not plan[0] and runs * NUM_LAYERS > MAX_DIRECT_MESSAGES:
                    continue
                cases.append((tokens, layout, name, plan))
    return cases


def _fill(cache: Any, salt: int) -> None:
    """Deterministic, varied values (the same on any device): no random state to share."""
    import torch

    for layer in range(cache.shape[0]):
        idx = torch.arange(cache[layer].numel(), device=cache.device, dtype=torch.int64) + salt + layer
        cache[layer].view(-1).copy_(((idx * 2654435761) % 1000003).to(torch.float32) / 1000003 - 0.5)


def _poll(works: list[Any]) -> None:
    for work in works:
        while not work.is_completed():
            pass
        work.wait()


def _raw_op(pg: Any, tensor: Any, send: bool) -> list[Any]:
    """One NCCL send or receive to the other rank, as one group (as the pair's own batches)."""
    pg._start_coalescing()
    (pg.send if send else pg.recv)([tensor], 1 - pg.rank(), 0)
    return [pg._end_coalescing()]


def _worker(role: str, conn: Any, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from engine.kv_transfer import KVLayout, KVReceiver, KVSender, WirePlan, merge_runs, plan_transfer

    device = torch.device(cfg["devices"][0 if role == "prefill" else 1])
    torch.cuda.set_device(device)
    prefill = role == "prefill"
    layout = KVLayout(model="llama-3.1-8b-shape", dtype="bfloat16", block_size=BLOCK_SIZE,
                      num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM)
    shape = (NUM_LAYERS, cfg["num_blocks"], 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cache = torch.empty(shape, dtype=torch.bfloat16, device=device)
    _fill(cache, salt=0 if prefill else 17)
    expected = None
    if not prefill:
        expected = torch.empty_like(cache)
        _fill(expected, salt=0)
    raw_buf = torch.empty(max(cfg["tokens"]) // BLOCK_SIZE * NUM_LAYERS * LAYER_BLOCK_BYTES // 2,
                          dtype=torch.bfloat16, device=device)
    _fill(raw_buf.view(1, -1), salt=5)
    timeout = timedelta(seconds=120)
    if prefill:
        kv_port, raw_port = cfg["ports"]
        raw_store = dist.TCPStore("127.0.0.1", raw_port, None, False, timeout)
        pair = KVSender.connect("127.0.0.1", kv_port, layout, device=device, timeout=120)
    else:
        pair, kv_port = KVReceiver.listen("127.0.0.1", layout, device=device, timeout=120)
        raw_store = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
        conn.send((kv_port, raw_store.port))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    raw = dist.ProcessGroupNCCL(dist.PrefixStore("raw", raw_store), 0 if prefill else 1, 2, opts)
    raw.eager_connect_single_device(device)
    if not prefill:
        pair.wait_connected()
    go = torch.zeros(1, device=device)

    def meet() -> None:  # decode tells prefill "go"; both leave at about the same time
        _poll(_raw_op(raw, go, send=not prefill))

    results = []
    for tokens, layout_name, name, plan in _cases(cfg):
        src, dst = _ids(tokens, layout_name)
        nbytes = len(src) * NUM_LAYERS * LAYER_BLOCK_BYTES
        times, side = [], []
        for it in range(cfg["warmup"] + cfg["iters"]):
            meet()
            t0 = time.perf_counter()
            if name == "raw":
                _poll(_raw_op(raw, raw_buf[:nbytes // 2], send=prefill))
            elif prefill:
                side.append(pair.send(f"{name}-{it}", src, dst, cache, plan=WirePlan(*plan) if plan else None).seconds)
            else:
                side.append(pair.recv(cache, timeout=120).stats.seconds)
            if it >= cfg["warmup"]:
                times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {"tokens": tokens, "layout": layout_name, "plan": name, "bytes": nbytes,
                               "runs": len(merge_runs(src, dst))}
        if name != "raw":  # one more transfer into poisoned blocks: every byte must arrive
            if not prefill:
                cache[:, dst] = 7.0
            meet()
            if prefill:
                pair.send(f"{name}-check", src, dst, cache, plan=WirePlan(*plan) if plan else None)
                used = WirePlan(*plan) if plan else plan_transfer(merge_runs(src, dst), NUM_LAYERS,
                                                                  LAYER_BLOCK_BYTES, "nccl", True)
                row["wire_plan"] = f"{'packed' if used.pack else 'in place'}, {used.chunk_layers} layer(s) a chunk"
            else:
                pair.recv(cache, timeout=120)
                assert expected is not None
                row["exact"] = bool(torch.equal(cache[:, dst], expected[:, src]))
        row["median_s" if not prefill else "sender_median_s"] = statistics.median(times)
        if side:
            row["side_median_s"] = statistics.median(side[cfg["warmup"]:])
        results.append(row)
    conn.send(results)
    conn.recv()  # both sides are done: close
    pair.close()
    raw.abort()


def main(args: argparse.Namespace) -> int:
    import os

    from bench.results import write_result

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
    tokens = [int(t) for t in args.tokens.split(",")]
    if any(t % BLOCK_SIZE for t in tokens):
        raise ValueError(f"--tokens must be multiples of {BLOCK_SIZE}")
    devices = args.devices.split(",")
    if len(devices) != 2:
        raise ValueError("--devices takes two devices: prefill's, decode's")
    cfg = {"tokens": tokens, "layouts": args.layouts.split(","), "plans": _plans(args.plans.split(",")),
           "devices": devices, "iters": args.iters, "warmup": args.warmup,
           "num_blocks": 2 * max(tokens) // BLOCK_SIZE + 16}
    ctx = mp.get_context("spawn")
    dconn, dchild = ctx.Pipe()
    pconn, pchild = ctx.Pipe()
    decode = ctx.Process(target=_worker, args=("decode", dchild, cfg), daemon=True)
    decode.start()
    cfg = dict(cfg, ports=dconn.recv())
    prefill = ctx.Process(target=_worker, args=("prefill", pchild, cfg), daemon=True)
    prefill.start()
    rows, sender_rows = dconn.recv(), pconn.recv()
    dconn.send("done")
    pconn.send("done")
    decode.join(60)
    prefill.join(60)
    raw = {r["tokens"]: r["median_s"] for r in rows if r["plan"] == "raw"}
    for row, srow in zip(rows, sender_rows):
        row.update({k: v for k, v in srow.items() if k in ("wire_plan", "sender_median_s")})
        if "side_median_s" in srow:
            row["sender_side_median_s"] = srow["side_median_s"]
        row["gb_per_s"] = row["bytes"] / row["median_s"] / 1e9
        row["of_raw"] = raw[row["tokens"]] / row["median_s"]
    print(f"\n{'tokens':>6} {'MiB':>6} {'layout':>10} {'runs':>5} {'plan':>16} {'wire plan':>28} "
          f"{'ms':>7} {'GB/s':>6} {'of raw':>7} exact")
    for r in rows:
        print(f"{r['tokens']:>6} {r['bytes'] / 2**20:>6.0f} {r['layout']:>10} {r['runs']:>5} {r['plan']:>16} "
              f"{r.get('wire_plan', ''):>28} {r['median_s'] * 1e3:>7.3f} {r['gb_per_s']:>6.1f} "
              f"{r['of_raw'] * 100:>6.1f}% {r.get('exact', '')}")
    write_result({"devices": devices, "iters": args.iters, "rows": rows}, "kv-transfer", args.output_json)
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
