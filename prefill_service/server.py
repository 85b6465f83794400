"""`pdserve prefill`: a prefill server (chunked prefill + KV send)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from engine.speculative import SpeculativeConfig
from kv_transfer import layerwise
from prefill_service.flags import add_kv_send_args
from prefill_service.servicer import PrefillServicer
from rpc.engine_server import add_server_args, configure_logging, serve_engine

DEFAULT_PORT = 50061


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    add_kv_send_args(parser)
    # Tests only (kv_transfer/layerwise.py TEST_PAUSE_AFTER_LAYER): hidden, and not passed on by `pdserve up`.
    parser.add_argument("--test-pause-kv-send", default=None, metavar="LAYER:SECONDS", help=argparse.SUPPRESS)


def _test_pause(value: str | None) -> tuple[int, float] | None:
    if value is None:
        return None
    layer, _, seconds = value.partition(":")
    return int(layer), float(seconds)


def main(args: argparse.Namespace) -> int:
    configure_logging("prefill")
    layerwise.TEST_PAUSE_AFTER_LAYER = _test_pause(getattr(args, "test_pause_kv_send", None))
    try:
        spec = SpeculativeConfig.parse(getattr(args, "speculative_config", None))
    except ValueError:  # reported by the engine's configuration
        spec = None
    if spec is not None and spec.method != "draft_model":
        # The prefill tier computes prompts and first tokens: nothing to propose. (With a draft
        # model it computes the draft's KV of each prompt too, sent beside the target's.)
        logging.getLogger(__name__).info("--speculative-config %s is for decode servers: this prefill server "
                                         "has nothing to do for it", spec.method)
        args.speculative_config = None
    return asyncio.run(serve_engine(args, "prefill", PrefillServicer(args.kv_send, args.kv_pairs_per_decode)))


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="pdserve prefill")
    add_cli_args(p)
    sys.exit(main(p.parse_args()))
