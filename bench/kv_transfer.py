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
import cProfile
import io
import multiprocessing as mp
import pstats
import statistics
import sys
import threading
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
    p.add_argument("--modes", default="cold,ahead",
                   help="cold: the header leaves when the timed transfer starts; ahead: before it, as the "
                        "layer-wise send does (it sends the header when prefill begins)")
    p.add_argument("--cprofile", action="store_true",
                   help="print each side's top functions (cProfile, by own time) for the auto plan's rows")
    p.add_argument("--phases", action="store_true",
                   help="also print when each step of a transfer happened on each side (medians)")
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


def _cases(cfg: dict[str, Any]) -> list[tuple[int, str, str, tuple[bool, int] | None, str]]:
    """The same list in both processes: (tokens, layout, plan name, plan, mode), raw first per size."""
    from kv_transfer import merge_runs

    cases: list[tuple[int, str, str, tuple[bool, int] | None, str]] = []
    for tokens in cfg["tokens"]:
        cases.append((tokens, "contiguous", "raw", None, ""))
        for layout in cfg["layouts"]:
            src, dst = _ids(tokens, layout)
            runs = len(merge_runs(src, dst))
            for name, plan in cfg["plans"]:
                if plan is not None and not plan[0] and runs * NUM_LAYERS > MAX_DIRECT_MESSAGES:
                    continue
                cases += [(tokens, layout, name, plan, mode) for mode in cfg["modes"]]
    return cases


def _fill(cache: Any, salt: int) -> None:
    """Deterministic, varied values (the same on any device): no random state to share."""
    import torch

    for layer in range(cache.shape[0]):
        idx = torch.arange(cache[layer].numel(), device=cache.device, dtype=torch.int64) + salt + layer
        cache[layer].view(-1).copy_(((idx * 2654435761) % 1000003).to(torch.float32) / 1000003 - 0.5)


def _phases(decode: list[tuple[float, list[tuple[str, float]]]],
            prefill: list[tuple[float, list[tuple[str, float]]]]) -> list[tuple[str, float]]:
    """[(side + mark, median ms after the decode side's start)] over the timed iterations: both
    sides stamp time.perf_counter (CLOCK_MONOTONIC: one clock for the processes of a host)."""
    if not decode or not decode[0][1]:
        return []
    rel: dict[str, list[float]] = {}
    for (t0, dmarks), (p0, pmarks) in zip(decode, prefill):
        rel.setdefault("prefill start", []).append((p0 - t0) * 1e3)
        for side, marks in (("prefill", pmarks), ("decode", dmarks)):
            for name, t in marks:
                rel.setdefault(f"{side} {name}", []).append((t - t0) * 1e3)
    return sorted(((n, statistics.median(v)) for n, v in rel.items()), key=lambda x: x[1])


def _poll(works: list[Any], yield_gil: bool = False) -> None:
    """Until done, spinning (the raw send's clock); ``yield_gil``: let this process's other
    threads run meanwhile (a receive posted from a thread while this one waits)."""
    for work in works:
        while not work.is_completed():
            if yield_gil:
                time.sleep(0)
        work.wait()


def _raw_op(pg: Any, tensor: Any, send: bool) -> list[Any]:
    """One NCCL send or receive to the other rank, as one group (as the pair's own batches)."""
    pg._start_coalescing()
    (pg.send if send else pg.recv)([tensor], 1 - pg.rank(), 0)
    return [pg._end_coalescing()]


def _worker(role: str, conn: Any, cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from kv_transfer import KVLayout, KVReceiver, KVSender, WirePlan, merge_runs, plan_transfer

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
        _poll(_raw_op(raw, go, send=not prefill), yield_gil=True)

    def one(it: int, src: list[int], dst: list[int], name: str, plan: Any, mode: str) -> tuple[float, Any]:
        """One timed transfer: (the time from the meeting, this side's TransferStats or None).
        "cold": the header leaves after the meeting; "ahead": before it, as a layer-wise send
        sends it when prefill begins, so the receiver may have posted before the data is ready."""
        wire = WirePlan(*plan) if plan else None
        if name == "raw":
            meet()
            t0 = time.perf_counter()
            _poll(_raw_op(raw, raw_buf[:len(src) * NUM_LAYERS * LAYER_BLOCK_BYTES // 2], send=prefill))
            return t0, None
        if prefill:
            transfer = pair.begin(f"{name}-{it}", src, dst, cache, plan=wire) if mode == "ahead" else None
            meet()
            t0 = time.perf_counter()
            if transfer is None:
                return t0, pair.send(f"{name}-{it}", src, dst, cache, plan=wire)
            for layer in range(NUM_LAYERS):
                transfer.send_layer(layer)
            return t0, transfer.finish()
        got: list[Any] = []
        receive = threading.Thread(target=lambda: got.append(pair.recv(cache, timeout=120)))
        if mode == "ahead":
            receive.start()
        meet()
        t0 = time.perf_counter()
        if mode == "ahead":
            receive.join()
        else:
            receive.run()
        return t0, got[0].stats

    results = []
    for tokens, layout_name, name, plan, mode in _cases(cfg):
        src, dst = _ids(tokens, layout_name)
        nbytes = len(src) * NUM_LAYERS * LAYER_BLOCK_BYTES
        times, side, marks = [], [], []
        profile = cProfile.Profile() if cfg["cprofile"] and name == "auto" and mode == "cold" else None
        for it in range(cfg["warmup"] + cfg["iters"]):
            timed = it >= cfg["warmup"]
            if profile is not None and timed:
                profile.enable()
            t0, stats = one(it, src, dst, name, plan, mode)
            end = time.perf_counter()
            if profile is not None and timed:
                profile.disable()
            if stats is not None:
                side.append(stats.seconds)
            if timed:
                times.append(end - t0)
                marks.append((t0, list(stats.marks) if stats else []))
        row: dict[str, Any] = {"tokens": tokens, "layout": layout_name, "plan": name, "mode": mode,
                               "bytes": nbytes, "runs": len(merge_runs(src, dst))}
        if profile is not None:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
            row["profile" if not prefill else "sender_profile"] = text.getvalue()
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
        row["marks" if not prefill else "sender_marks"] = marks
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
    modes = args.modes.split(",")
    if not modes or set(modes) - {"cold", "ahead"}:
        raise ValueError(f"--modes takes cold and/or ahead, got {args.modes!r}")
    cfg = {"tokens": tokens, "layouts": args.layouts.split(","), "plans": _plans(args.plans.split(",")),
           "modes": modes, "cprofile": args.cprofile,
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
        row.update({k: v for k, v in srow.items() if k in ("wire_plan", "sender_median_s", "sender_profile")})
        row["phases_ms"] = _phases(row.pop("marks"), srow["sender_marks"])
        if "side_median_s" in srow:
            row["sender_side_median_s"] = srow["side_median_s"]
        row["gb_per_s"] = row["bytes"] / row["median_s"] / 1e9
        row["of_raw"] = raw[row["tokens"]] / row["median_s"]
    print(f"\n{'tokens':>6} {'MiB':>6} {'layout':>10} {'runs':>5} {'plan':>10} {'mode':>5} {'wire plan':>28} "
          f"{'ms':>7} {'GB/s':>6} {'of raw':>7} exact")
    for r in rows:
        print(f"{r['tokens']:>6} {r['bytes'] / 2**20:>6.0f} {r['layout']:>10} {r['runs']:>5} {r['plan']:>10} {r['mode']:>5} "
              f"{r.get('wire_plan', ''):>28} {r['median_s'] * 1e3:>7.3f} {r['gb_per_s']:>6.1f} "
              f"{r['of_raw'] * 100:>6.1f}% {r.get('exact', '')}")
    if args.phases:
        print("\nwhere the time goes: medians of each side's marks, ms after the decode side left the meeting")
        for r in rows:
            if r["phases_ms"]:
                text = "  ".join(f"{n} {t:.3f}" for n, t in r["phases_ms"])
                print(f"{r['tokens']:>6} {r['layout']:>10} {r['plan']:>10} {r['mode']:>5}: {text}")
    for r in rows:
        for key in ("profile", "sender_profile"):
            if r.get(key):
                side = "prefill" if key == "sender_profile" else "decode"
                print(f"\n--- {side} side, {r['tokens']} {r['layout']} "
                      f"{r['plan']} {r['mode']}")
                print("\n".join(line for line in r[key].splitlines() if line.strip())[:3000])
    write_result({"devices": devices, "iters": args.iters, "rows": rows}, "kv-transfer", args.output_json)
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    sys.exit(main(parser.parse_args()))
