"""`pdserve prefill`: a prefill server (chunked prefill + KV send)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from prefill_service.layerwise import PAIRS_PER_DECODE
from prefill_service.servicer import KV_SEND_MODES, PrefillServicer
from rpc.engine_server import add_server_args, configure_logging, serve_engine

DEFAULT_PORT = 50061


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--kv-send", choices=KV_SEND_MODES, default="layerwise",
                        help="when a prompt's KV leaves for the decode server: layerwise (each layer as the "
                             "last prefill chunk computes it, overlapping the transfer with prefill) or "
                             "after-prefill (all layers once the first token is sampled)")
    parser.add_argument("--kv-pairs-per-decode", type=int, default=PAIRS_PER_DECODE,
                        help="layerwise: KV pairs to open to one decode server, so that this many requests "
                             "finishing in the same step overlap their sends (each pair between two GPUs is "
                             "an NCCL communicator with buffers of its own on both)")


def main(args: argparse.Namespace) -> int:
    configure_logging("prefill")
    if args.tensor_parallel_size > 1:
        print("pdserve prefill: --tensor-parallel-size > 1 is not supported on prefill servers yet (the KV "
              "transfer sends one rank's heads); use it on colocated servers (pdserve decode "
              "--prefill-mode local)", file=sys.stderr)
        return 2
    return asyncio.run(serve_engine(args, "prefill", PrefillServicer(args.kv_send, args.kv_pairs_per_decode)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdserve prefill")
    add_cli_args(p)
    sys.exit(main(p.parse_args()))
