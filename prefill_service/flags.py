"""The prefill server's own flags, shared with `pdserve up`, which passes them on
(imports nothing heavy: `pdserve up` reads them before any server starts)."""
from __future__ import annotations

import argparse

KV_SEND_MODES = ("layerwise", "after-prefill")
PAIRS_PER_DECODE = 4  # default: requests to one decode server that finish in one step and overlap at once


def add_kv_send_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--kv-send", choices=KV_SEND_MODES, default="layerwise",
                        help="when a prompt's KV leaves for the decode server: layerwise (each layer as the "
                             "last prefill chunk computes it, overlapping the transfer with prefill) or "
                             "after-prefill (all layers once the first token is sampled)")
    parser.add_argument("--kv-pairs-per-decode", type=int, default=PAIRS_PER_DECODE,
                        help="layerwise: KV pairs to open to one decode server, so that this many requests "
                             "finishing in the same step overlap their sends (each pair between two GPUs is "
                             "an NCCL communicator with buffers of its own on both)")
