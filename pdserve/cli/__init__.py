"""The `pdserve` command: one subcommand per process kind.

    pdserve up                 the whole topology on this machine
    pdserve gateway|prefill|decode
    pdserve bench offline|throughput|serve
    pdserve trace REQUEST_ID | --slowest N   where a request's time went

Every command takes ``--config FILE`` (YAML keyed by long flag names; the
command line wins): see config_file.py. A flag no command knows is refused
with the nearest known ones (``did you mean --prefill-port?``). Output piped
into a reader that stops early (``pdserve trace ID | head``) ends the command
quietly, without a traceback.

The package sits above every other layer (it imports the services, the engine
and bench; nothing but bench and the tests imports it):

    __init__.py       the parser and ``main`` (the ``pdserve`` console script)
    __main__.py       ``python -m pdserve.cli``
    config_file.py    ``--config FILE``
    openmp_spin.py    how long an engine server's idle OpenMP workers spin
    up.py             ``pdserve up``: the local cluster
    trace.py          ``pdserve trace``: the text waterfall and breakdown, the command
    trace_html.py     ``pdserve trace --html``: the self-contained page
    trace_model.py    spans, traces and the breakdown both renderers read
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import Callable

from pdserve.cli.config_file import add_config_flag, command_parser, with_config_files
from pdserve.cli.openmp_spin import bound_openmp_spin


def _service(module: str) -> tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]:
    import importlib

    mod = importlib.import_module(module)
    return mod.add_cli_args, mod.main


SUBCOMMANDS = {
    "up": ("pdserve.cli.up", "start gateway, prefill and decode servers as local processes"),
    "gateway": ("gateway.server", "run the gateway (OpenAI HTTP + gRPC)"),
    "prefill": ("prefill_service.server", "run a prefill server"),
    "decode": ("decode_service.server", "run a decode server"),
    "trace": ("pdserve.cli.trace", "show a request's spans: waterfall and time-to-first-token breakdown"),
}
BENCH = {
    "offline": ("bench.offline", "offline throughput vs transformers generate()"),
    "throughput": ("bench.throughput", "offline throughput at fixed ISL/OSL, trtllm-bench's workload; "
                   "TensorRT-LLM's published Llama-3.1-8B rows with --trtllm-table"),
    "serve": ("bench.serve", "serving benchmark against a running gateway"),
    "disagg": ("bench.disagg", "disaggregated vs colocated on fresh local clusters, KV share, gateway overhead"),
    "decode-step": ("bench.decode_step", "time one decode step at several batch sizes"),
    "kernels": ("bench.kernels", "each Triton kernel on the GPU against the copy bandwidth (needs CUDA)"),
    "prefix": ("bench.prefix", "KV-aware vs load-only routing on shared-prefix multi-turn chats"),
    "multi-turn": ("bench.multi_turn", "multi-turn chats against a running gateway: TTFT and cached tokens per turn"),
    "quant-quality": ("bench.quant_quality", "KL divergence and greedy agreement of FP8 KV / W8A8 against 16 bits"),
    "spec-decode": ("bench.spec_decode", "speculative decoding against plain decoding: tokens/s, acceptance"),
    "soak": ("bench.soak", "bounded soak: many requests, some cancelled, a decode server killed; no leaks"),
    "local": ("bench.local", "one user on a CPU: TTFT, generation tok/s and peak RSS against llama.cpp on the same GGUF"),
}


def build_parser(only: str | None = None, only_bench: str | None = None) -> argparse.ArgumentParser:
    """The full parser (``only``/``only_bench`` import just one subcommand's flags)."""
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_, add_help=False)
            continue
        p = sub.add_parser(name, help=help_)
        add_args, main = _service(module)
        add_args(p)
        add_config_flag(p)
        p.set_defaults(func=main)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_) in BENCH.items():
        p = bsub.add_parser(name, help=help_)
        if only is None or (only == "bench" and only_bench in (None, name)):
            add_args, main = _service(module)
            add_args(p)
            add_config_flag(p)
            p.set_defaults(func=main)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    first = next((a for a in argv if not a.startswith("-")), None)
    only = first if first in SUBCOMMANDS or first == "bench" else None
    if only in ("prefill", "decode"):
        bound_openmp_spin()  # before torch loads libgomp
    rest = [a for a in argv if not a.startswith("-")]
    only_bench = rest[1] if only == "bench" and len(rest) > 1 and rest[1] in BENCH else None
    parser = build_parser(only, only_bench)
    try:
        argv = with_config_files(parser, argv)
    except ValueError as exc:  # exits 2 with the usage line, as a bad flag does
        parser.error(str(exc))
    args, extras = parser.parse_known_args(argv)
    if extras:  # exits 2 with the command's usage line
        command, _ = command_parser(parser, argv)
        command.error(unrecognized_message(command, extras))
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a reader that has gone shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # configuration errors: one clear line, no traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """argparse's "unrecognized arguments" with, for each unknown flag, the
    nearest flag ``parser`` knows (a typo, or vLLM's underscores)."""
    known = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    hints = []
    for token in extras:
        if not token.startswith("--") or token == "--":
            continue
        name = token.split("=", 1)[0]
        near = difflib.get_close_matches(name.replace("_", "-"), known, n=1, cutoff=0.6)
        if near:
            hints.append((name, near[0]))
    message = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{message}; did you mean {hints[0][1]}?"
    if hints:
        return f"{message}; did you mean {', '.join(f'{near} (for {name})' for name, near in hints)}?"
    return f"{message} (the flags: {parser.prog} --help)"


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``pdserve trace ID | head -1``): stop quietly, as
    a command that SIGPIPE ends does, with no traceback. What is still buffered would fail
    again in Python's flush at exit ("Exception ignored ..."): stdout becomes /dev/null."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0
