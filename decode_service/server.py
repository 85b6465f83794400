"""`pdserve decode`: a decode server (continuous batching + token streams)."""
from __future__ import annotations

import argparse
import asyncio
import sys

from decode_service.servicer import DecodeServicer
from rpc.engine_server import add_server_args, advertise_host, configure_logging, serve_engine

DEFAULT_PORT = 50071


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--prefill-mode", choices=("disaggregated", "local"), default="disaggregated",
                        help="local: prefill every request here, even when the gateway offers a prefill "
                             "server (the colocated baseline)")


def main(args: argparse.Namespace) -> int:
    configure_logging("decode")
    servicer = DecodeServicer(advertise_host(args), local_prefill=args.prefill_mode == "local")
    return asyncio.run(serve_engine(args, "decode", servicer))


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdserve decode")
    add_cli_args(p)
    sys.exit(main(p.parse_args()))
