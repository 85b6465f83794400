"""`pdserve bench disagg`: disaggregated (1 prefill + 1 decode) vs colocated
(`--prefill-mode local`) on the same workload, each on a fresh `pdserve up`
cluster, plus two probes:

- KV transfer share of time to first token: prompts of ``--probe-len``
  tokens driven through the tiers directly (reserve on decode, prefill with
  KV send), TTFT vs the transfer's own seconds and bytes/s;
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
    p.add_argument("--probe-len", type=int, default=512, help="prompt tokens for the KV share probe")
    p.add_argument("--probe-requests", type=int, default=8)
    p.add_argument("--overhead-requests", type=int, default=30)
    p.add_argument("--port-base", type=int, default=58000)
    p.add_argument("--engine-args", default="--kv-cache-memory 512MiB --max-model-len 2048",
                   help="extra flags for the engine servers")
    p.add_argument("--output-json", default=None)


class Up(UpCluster):
    """A `pdserve up` cluster in ``mode`` for the duration of a with-block."""

    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        b = args.port_base
        self.http, self.grpc, self.prefill, self.decode = b, b + 1, b + 2, b + 4
        super().__init__(["--prefill-mode", mode, "--http-port", str(b), "--grpc-port", str(b + 1),
                          "--prefill-port", str(b + 2), "--decode-port", str(b + 4), "--disable-log-requests",
                          *args.engine_args.split()])


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def probe_kv_share(up: Up, args: argparse.Namespace) -> dict:
    rng = random.Random(1)
    d_addr, p_addr = f"127.0.0.1:{up.decode}", f"127.0.0.1:{up.prefill}"
    sp = common_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    rows = []
    with grpc.insecure_channel(d_addr) as dch, grpc.insecure_channel(p_addr) as pch:
        d, p = engine_pb2_grpc.DecodeStub(dch), engine_pb2_grpc.PrefillStub(pch)
        for i in range(args.probe_requests + 1):  # the first opens the KV pair: not counted
            ids = _prompt(rng, args.probe_len)
            t0 = time.perf_counter()
            stream = d.Generate(engine_pb2.DecodeRequest(request_id=f"probe-{i}", prompt_token_ids=ids, sampling=sp,
                                                         remote_prefill=True), timeout=120)
            reserved = next(stream).reserved
            r = p.Prefill(engine_pb2.PrefillRequest(request_id=f"probe-{i}", prompt_token_ids=ids, sampling=sp,
                                                    decode_address=d_addr, dst_block_ids=reserved.block_ids),
                          timeout=120)
            ttft = time.perf_counter() - t0
            for _ in stream:
                pass
            if i:
                rows.append((ttft, r.transfer.seconds, r.transfer.num_bytes))
    ttft = statistics.median(r[0] for r in rows)
    xfer = statistics.median(r[1] for r in rows)
    nbytes = rows[0][2]
    return {"prompt_tokens": args.probe_len, "ttft_s": ttft, "transfer_s": xfer, "transfer_bytes": nbytes,
            "transfer_share_of_ttft": xfer / ttft, "transfer_bytes_per_s": nbytes / xfer,
            "backend": "gloo"}


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


def main(args: argparse.Namespace) -> int:
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "func"}}
    with Up(args, "disaggregated") as up:
        result["disaggregated"] = serve_run(up, args)
        result["kv_probe"] = probe_kv_share(up, args)
    with Up(args, "local") as up:
        result["local"] = serve_run(up, args)
        result["gateway_overhead"] = probe_gateway_overhead(up, args)
    for mode in ("disaggregated", "local"):
        r = result[mode]
        print(f"{mode:>14}: {r['completed']} ok, {r['failed']} failed, {r['output_tokens_per_s']:.1f} output tok/s, "
              f"TTFT p50 {r['ttft']['p50']:.3f}s, TPOT p50 {r['tpot']['p50'] * 1e3:.1f} ms")
    k, g = result["kv_probe"], result["gateway_overhead"]
    print(f"KV transfer, {k['prompt_tokens']}-token prompt: {k['transfer_s'] * 1e3:.2f} ms of TTFT "
          f"{k['ttft_s'] * 1e3:.1f} ms ({100 * k['transfer_share_of_ttft']:.1f}%), "
          f"{k['transfer_bytes'] / 2**20:.1f} MiB at {k['transfer_bytes_per_s'] / 1e9:.2f} GB/s")
    print(f"gateway overhead: median {g['overhead_median_s'] * 1e3:.2f} ms per request "
          f"(via gateway {g['via_gateway_median_s'] * 1e3:.1f} ms, direct {g['direct_decode_median_s'] * 1e3:.1f} ms)")
    write_result(result, "disagg", args.output_json)
    return 0
