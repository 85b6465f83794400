"""What the command line says to a vLLM user: an unknown flag is refused with the
nearest known one (every command: up, gateway, prefill, decode, bench, trace),
vLLM's ``--port`` is the HTTP port of ``pdserve up`` and ``pdserve gateway``
(the engine servers keep theirs as the gRPC port), and output piped into a
reader that stops early (``pdserve trace ID | head -1``) ends quietly."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pdserve.cli import build_parser, main
from tests.processes import REPO
from tests.tracing.trace_samples import write_sample_file


@pytest.mark.parametrize("argv, error", [
    (["up", "--prefil-port", "9000"],
     "pdserve up: error: unrecognized arguments: --prefil-port 9000; did you mean --prefill-port?"),
    (["gateway", "--max-model-length", "512"],
     "pdserve gateway: error: unrecognized arguments: --max-model-length 512; did you mean --max-model-len?"),
    (["prefill", "--tensor_parallel_size", "2"],  # vLLM's Python names
     "pdserve prefill: error: unrecognized arguments: --tensor_parallel_size 2; did you mean "
     "--tensor-parallel-size?"),
    (["decode", "--prot=50071"],
     "pdserve decode: error: unrecognized arguments: --prot=50071; did you mean --port?"),
    (["bench", "serve", "--request_rate", "4"],
     "pdserve bench serve: error: unrecognized arguments: --request_rate 4; did you mean --request-rate?"),
    (["trace", "cmpl-1", "--slowst", "3"],
     "pdserve trace: error: unrecognized arguments: --slowst 3; did you mean --slowest?"),
    (["up", "--prefil-port", "9000", "--decod-port", "9010"],
     "pdserve up: error: unrecognized arguments: --prefil-port 9000 --decod-port 9010; did you mean "
     "--prefill-port (for --prefil-port), --decode-port (for --decod-port)?"),
    (["up", "--xyzzy"],
     "pdserve up: error: unrecognized arguments: --xyzzy (the flags: pdserve up --help)"),
])
def test_an_unknown_flag_is_refused_with_the_nearest_known_one(capsys, argv, error):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: pdserve ") and err[-1] == error, err


def test_vllm_port_is_the_http_port_of_up_and_the_gateway():
    from pdserve.cli.up import Cluster

    up = build_parser("up").parse_args(["up", "--port", "8080"])
    assert up.http_port == 8080
    gateway_argv = Cluster(up).gateway_argv()
    assert gateway_argv[gateway_argv.index("--http-port") + 1] == "8080"
    assert build_parser("gateway").parse_args(["gateway", "--port", "8081"]).http_port == 8081
    for role in ("prefill", "decode"):  # an engine server's --port is its gRPC port, as before
        args = build_parser(role).parse_args([role, "--port", "50099"])
        assert args.port == 50099 and not hasattr(args, "http_port")


def test_trace_piped_into_head_ends_quietly(tmp_path):
    """Enough output (very wide lines) that the reader is gone while pdserve still writes."""
    traces = write_sample_file(tmp_path / "traces.jsonl")
    command = (f"set -o pipefail; {sys.executable} -m pdserve.cli trace cmpl-a --traces-file {traces} "
               "--width 20000 | head -1")
    done = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout == f"trace {'a' * 32}  request cmpl-a\n"


@pytest.mark.parametrize("cores, prefill, decode, threads", [
    (2, 1, 1, (1, 2)), (2, 0, 1, (2, 2)), (1, 1, 1, (1, 1)), (8, 1, 1, (4, 8)), (8, 2, 2, (2, 4)), (16, 0, 1, (16, 16))])
def test_decode_servers_on_cpu_split_every_core_and_prefill_servers_a_share(cores, prefill, decode, threads):
    from pdserve.cli.up import cpu_threads

    args = build_parser("up").parse_args(["up", "--device", "cpu"])
    assert cpu_threads(args, prefill, decode, cpu_count=cores) == threads


SPIN_OF = """
import os
from pdserve.cli import main
try:
    main([{role!r}, "--help"])
except SystemExit:
    pass
print("spin", os.environ.get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize("role, user, spin", [("decode", None, "3000"), ("prefill", None, "3000"),
                                              ("gateway", None, None), ("decode", "50", "50")])
def test_engine_servers_bound_their_openmp_spin_unless_the_user_set_it(role, user, spin):
    """Set before torch loads libgomp (tests/engine/test_cpu_threads.py shows its effect)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if user is not None:
        env["GOMP_SPINCOUNT"] = user
    done = subprocess.run([sys.executable, "-c", SPIN_OF.format(role=role)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == f"spin {spin}"


def test_up_gives_its_cpu_servers_libgomp_s_spin_and_leaves_the_user_s(monkeypatch):
    from pdserve.cli.up import child_env

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert child_env(2)["GOMP_SPINCOUNT"] == "300000"
    assert "GOMP_SPINCOUNT" not in child_env(None)  # on GPUs: each server decides
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "GOMP_SPINCOUNT" not in child_env(2)


@pytest.mark.parametrize("flags, prefill, decode, shares", [
    (["--device", "cuda"], 1, 1, [0.45, 0.45]),  # one GPU for both: at 0.9 each the second failed to allocate
    (["--device", "cuda", "--gpu-memory-utilization", "0.8"], 1, 2, [0.2667, 0.2667, 0.2667]),
    (["--device", "cuda", "--kv-cache-memory", "1GiB"], 1, 1, [None, None]),
    (["--devices", "cuda:0,cuda:1"], 1, 1, [None, None]),
    (["--devices", "cuda:0,cuda:1"], 1, 2, [0.45, None, 0.45]),  # round robin: decode-1 back on cuda:0
    (["--devices", "cuda:0,cuda:1", "--prefill-tensor-parallel-size", "2"], 1, 1, [0.45, 0.45]),
    (["--devices", "cuda:0,cuda:2", "--tensor-parallel-size", "2"], 1, 1, [None, None]),
    (["--device", "cpu"], 1, 1, [None, None])])
def test_up_splits_a_shared_gpu_between_its_servers(flags, prefill, decode, shares):
    from pdserve.cli.up import gpu_memory_shares

    args = build_parser("up").parse_args(["up", *flags])
    assert gpu_memory_shares(args, prefill, decode) == shares
