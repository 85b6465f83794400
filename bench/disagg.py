"""`pdserve bench disagg`: disaggregated (1 prefill + 1 decode) vs colocated
(`--prefill-mode local`) on the same workload, each on a fresh `pdserve up`
cluster, plus two probes:

- KV transfer share of time to first token: prompts of ``--probe-len``
  tokens driven through the tiers directly (reserve on decode, prefill with
  KV send), TTFT vs the transfer's own seconds and bytes/s, and what is left
  of the transfer after the first token was sampled ("exposed"), once per
  prefill ``--kv-send`` mode (layer-wise overlap or after prefill);
- gateway overhead: the same short request through the gateway and straight
  to the decode server (local prefill), median latency difference.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

import grpc

from bench import serve
from bench.cluster import UpCluster
from bench.results import write_result
from pdserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--probe-len", default="512", help="prompt tokens for the KV share probe (comma list)")
    p.add_argument("--kv-send", default="layerwise",
                   help="prefill --kv-send modes to probe, each on a cluster of its own (comma list)")
    p.add_argument("--probe-only", action="store_true",
                   help="only the KV share probe (no serving runs, no colocated cluster)")
    p.add_argument("--up-args", default="", help="extra flags for pdserve up, e.g. '--devices cuda:0,cuda:1'")
    p.add_argument("--probe-requests", type=int, default=8)
    p.add_argument("--overhead-requests", type=int, default=30)
    p.add_argument("--port-base", type=int, default=58000)
    p.add_argument("--engine-args", default="--kv-cache-memory 512MiB --max-model-len 2048",
                   help="extra flags for the engine servers")
    p.add_argument("--output-json", default=None)


class Up(UpCluster):
    """A `pdserve up` cluster in ``mode`` for the duration of a with-block."""

    def __init__(self, args: argparse.Namespace, mode: str, kv_send: str = "layerwise") -> None:
        b = args.port_base
        self.http, self.grpc, self.prefill, self.decode = b, b + 1, b + 2, b + 4
        super().__init__(["--prefill-mode", mode, "--http-port", str(b), "--grpc-port", str(b + 1),
                          "--prefill-port", str(b + 2), "--decode-port", str(b + 4), "--disable-log-requests",
                          "--kv-send", kv_send, *args.up_args.split(), *args.engine_args.split()])


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def probe_kv_share(up: Up, args: argparse.Namespace, prompt_len: int, seed: int = 0) -> dict:
    """Medians over ``--probe-requests`` prompts of ``prompt_len`` tokens, one at a time.
    ``exposed_s``: the Prefill call's time after its first token was sampled (its own
    ``prefill_seconds``), i.e. what the KV send adds to TTFT, RPC return included."""
    rng = random.Random(f"{prompt_len}-{seed}")  # a length probed twice gets new prompts
    d_addr, p_addr = f"127.0.0.1:{up.decode}", f"127.0.0.1:{up.prefill}"
    sp = common_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    rows = []
    with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
        d, p = engine_pb2_grpc.DecodeStub(dch), engine_pb2_grpc.PrefillStub(pch)
        for i in range(args.probe_requests + 1):  # the first opens the KV pair: not counted
            ids = _prompt(rng, prompt_len)
            rid = f"probe-{prompt_len}-{seed}-{i}"
            t0 = time.perf_counter()
            stream = d.Generate(engine_pb2.DecodeRequest(request_id=rid, prompt_token_ids=ids,
                                                         sampling=sp, remote_prefill=True), timeout=120)
            reserved = next(stream).reserved
            t1 = time.perf_counter()
            r = p.Prefill(engine_pb2.PrefillRequest(request_id=rid, prompt_token_ids=ids,
                                                    sampling=sp, decode_address=d_addr,
                                                    dst_block_ids=reserved.block_ids), timeout=120)
            t2 = time.perf_counter()
            for _ in stream:
                pass
            if i:
                rows.append({"ttft_s": t2 - t0, "prefill_s": r.prefill_seconds,
                             "exposed_s": t2 - t1 - r.prefill_seconds, "transfer_s": r.transfer.seconds,
                             "after_token_s": r.transfer.seconds_after_first_token,
                             "bytes": r.transfer.num_bytes, "backend": r.transfer.backend})
    med = {k: statistics.median(row[k] for row in rows)
           for k in ("ttft_s", "prefill_s", "exposed_s", "transfer_s", "after_token_s")}
    return {"prompt_tokens": prompt_len, **med, "transfer_bytes": rows[0]["bytes"], "backend": rows[0]["backend"],
            "prefill_s_all": [row["prefill_s"] for row in rows], "exposed_s_all": [row["exposed_s"] for row in rows],
            "exposed_share_of_ttft": med["exposed_s"] / med["ttft_s"],
            "after_token_share_of_ttft": med["after_token_s"] / med["ttft_s"],
            "transfer_share_of_ttft": med["transfer_s"] / med["ttft_s"]}


def probe_all(args: argparse.Namespace) -> dict:
    out = {}
    for mode in args.kv_send.split(","):
        with Up(args, "disaggregated", mode) as up:
            out[mode] = [probe_kv_share(up, args, int(n), i) for i, n in enumerate(args.probe_len.split(","))]
    return out


def probe_gateway_overhead(up: Up, args: argparse.Namespace) -> dict:
    rng = random.Random(2)
    sp = common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    via, direct = [], []
    with grpc.insecure_channel(f"127.0.0.1:{up.grpc}") as gch, grpc.insecure_channel(f"127.0.0.1:{up.decode}") as dch:
        gw, d = gateway_pb2_grpc.GatewayStub(gch), engine_pb2_grpc.DecodeStub(dch)
        for i in range(args.overhead_requests + 2):  # two warm-ups each
            ids = _prompt(rng, 16)
            t0 = time.perf_counter()
            for _ in gw.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), sampling=sp),
                                 timeout=60):
                pass
            t1 = time.perf_counter()
            for _ in d.Generate(engine_pb2.DecodeRequest(request_id=f"direct-{i}", prompt_token_ids=ids,
                                                         sampling=sp), timeout=60):
                pass
            t2 = time.perf_counter()
            if i >= 2:
                via.append(t1 - t0)
                direct.append(t2 - t1)
    return {"requests": len(via), "via_gateway_median_s": statistics.median(via),
            "direct_decode_median_s": statistics.median(direct),
            "overhead_median_s": statistics.median(a - b for a, b in zip(via, direct))}


def serve_run(up: Up, args: argparse.Namespace) -> dict:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    ns = parser.parse_args(["--base-url", f"http://127.0.0.1:{up.http}", "--num-prompts", str(args.num_prompts),
                            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--max-concurrency", str(args.max_concurrency), "--seed", "0"])
    return asyncio.run(serve.run(ns))


def _print_probes(probes: dict) -> None:
    for mode, rows in probes.items():
        for k in rows:
            print(f"KV transfer ({mode}, {k['backend']}), {k['prompt_tokens']}-token prompt: TTFT "
                  f"{k['ttft_s'] * 1e3:.1f} ms, prefill {k['prefill_s'] * 1e3:.1f} ms, after the first token "
                  f"{k['exposed_s'] * 1e3:.2f} ms ({100 * k['exposed_share_of_ttft']:.1f}% of TTFT, of which the "
                  f"prefill server waited {k['after_token_s'] * 1e3:.2f} ms = "
                  f"{100 * k['after_token_share_of_ttft']:.1f}% for the transfer); the transfer "
                  f"was open {k['transfer_s'] * 1e3:.2f} ms for {k['transfer_bytes'] / 2**20:.1f} MiB")


def main(args: argparse.Namespace) -> int:
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.probe_only:
        result["kv_probe"] = probe_all(args)
        _print_probes(result["kv_probe"])
        write_result(result, "disagg", args.output_json)
        return 0
    with Up(args, "disaggregated") as up:
        result["disaggregated"] = serve_run(up, args)
    result["kv_probe"] = probe_all(args)
    with Up(args, "local") as up:
        result["local"] = serve_run(up, args)
        result["gateway_overhead"] = probe_gateway_overhead(up, args)
    for mode in ("disaggregated", "local"):
        r = result[mode]
        print(f"{mode:>14}: {r['completed']} ok, {r['failed']} failed, {r['output_tokens_per_s']:.1f} output tok/s, "
              f"TTFT p50 {r['ttft']['p50']:.3f}s, TPOT p50 {r['tpot']['p50'] * 1e3:.1f} ms")
    _print_probes(result["kv_probe"])
    g = result["gateway_overhead"]
    print(f"gateway overhead: median {g['overhead_median_s'] * 1e3:.2f} ms per request "
          f"(via gateway {g['via_gateway_median_s'] * 1e3:.1f} ms, direct {g['direct_decode_median_s'] * 1e3:.1f} ms)")
    write_result(result, "disagg", args.output_json)
    return 0
