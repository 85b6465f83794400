"""`pdserve prefill`: a prefill server (chunked prefill + KV send)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from prefill_service.flags import add_kv_send_args
from prefill_service.servicer import PrefillServicer
from rpc.engine_server import add_server_args, configure_logging, serve_engine

DEFAULT_PORT = 50061


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    add_kv_send_args(parser)


def main(args: argparse.Namespace) -> int:
    configure_logging("prefill")
    if getattr(args, "speculative_config", None):
        # The prefill tier computes prompts and first tokens: nothing to propose (a draft
        # model's own prompt KV is computed on the decode server).
        logging.getLogger(__name__).info("--speculative-config is for decode servers: this prefill server "
                                         "does not speculate (and loads no draft model)")
        args.speculative_config = None
    return asyncio.run(serve_engine(args, "prefill", PrefillServicer(args.kv_send, args.kv_pairs_per_decode)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdserve prefill")
    add_cli_args(p)
    sys.exit(main(p.parse_args()))
