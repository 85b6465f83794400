"""`pdserve bench serve` against a real gateway (fake engine servers speak the
real protos): every dataset's prompts have the shapes asked for, goodput
targets parse as vLLM's do and decide which requests count, one rate writes
the JSON it always wrote. A rate sweep (``--request-rate 2,4``) against a
real prefill + decode cluster on the default model: one JSON with each
rate's figures, and its plot."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys

import pytest

from bench import serve
from pdserve import cli
from tests.gateway.conftest import API_KEY
from tests.processes import EngineServer, GatewayProcess, running_cluster


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_cli_args(p)
    return p.parse_args(list(argv))


def test_datasets_have_the_asked_shapes():
    rng = random.Random(0)
    fixed = serve.make_prompts(_args("--num-prompts", "5", "--input-len", "7", "--output-len", "3"), rng)
    assert [(len(p), n) for p, n in fixed] == [(7, 3)] * 5
    chat = serve.make_prompts(_args("--dataset", "sharegpt", "--num-prompts", "400", "--input-len", "200",
                                    "--output-len", "100", "--max-input-len", "1000", "--max-output-len", "300"), rng)
    ins, outs = sorted(len(p) for p, _ in chat), sorted(n for _, n in chat)
    assert 120 < ins[200] < 330 and 60 < outs[200] < 160  # medians near the asked ones
    assert max(ins) <= 1000 and max(outs) <= 300 and min(ins) >= 1 and len(set(ins)) > 50
    shared = serve.make_prompts(_args("--dataset", "shared-prefix", "--num-prompts", "6", "--prefix-len", "10",
                                      "--prefix-groups", "2", "--input-len", "4"), rng)
    assert all(len(p) == 14 for p, _ in shared)
    assert shared[0][0][:10] == shared[2][0][:10] != shared[1][0][:10]
    assert shared[0][0][10:] != shared[2][0][10:]


def test_goodput_targets():
    assert serve.parse_goodput(_args()) == {"ttft": 2.0, "tpot": 0.2}
    assert serve.parse_goodput(_args("--goodput", "ttft:500", "e2e:3000")) == {"ttft": 0.5, "e2e": 3.0}
    assert serve.parse_goodput(_args("--ttft-slo", "1.5")) == {"ttft": 1.5}
    for bad in ("ttft", "itl:5", "tpot:fast"):
        with pytest.raises(ValueError):
            serve.parse_goodput(_args("--goodput", bad))
    samples = [serve.Sample(ok=True, ttft=0.4, e2e=1.0, output_tokens=11), serve.Sample(ok=True, ttft=0.6, e2e=1.0,
                                                                                       output_tokens=11),
               serve.Sample(ok=False)]
    result = serve.summarize(samples, 2.0, _args("--goodput", "ttft:500", "tpot:100"))
    assert result["completed"] == 2 and result["failed"] == 1 and result["goodput_requests_per_s"] == 0.5


def test_against_a_real_gateway(cluster):
    args = _args("--base-url", cluster.main.http_url, "--api-key", API_KEY, "--num-prompts", "6", "--dataset", "shared-prefix", "--prefix-len", "8",
                 "--input-len", "4", "--output-len", "3", "--max-concurrency", "3", "--goodput", "ttft:60000")
    result = asyncio.run(serve.run(args))
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["goodput_requests_per_s"] == result["request_throughput"] > 0
    assert all(s["output_tokens"] == 3 and s["input_tokens"] == 12 for s in result["samples"])
    assert result["ttft"]["p50"] <= result["e2e"]["p50"]


def test_request_rates_parse():
    assert _args().request_rate == [math.inf]
    assert _args("--request-rate", "4").request_rate == [4.0]
    assert _args("--request-rate", "4, 8,12.5,inf").request_rate == [4.0, 8.0, 12.5, math.inf]
    assert serve.request_rates(argparse.Namespace(request_rate=3)) == [3.0]  # a Namespace built by hand
    for bad in ("0", "-1", "4,,8", "fast", "nan"):
        with pytest.raises(SystemExit):
            _args("--request-rate", bad)
    with pytest.raises(ValueError, match="sweep"):
        asyncio.run(serve.run(_args("--request-rate", "1,2")))
    args = _args("--request-rate", "2,4,inf", "--duration", "3", "--num-prompts", "5")
    assert [serve.num_prompts(args, r) for r in args.request_rate] == [6, 12, 5]


def test_busy_instances():
    idle = {"role": "decode", "address": "a", "healthy": True, "num_running": 0, "num_waiting": 0,
            "num_in_flight": 0, "kv_blocks_used": 0}
    assert serve._busy([idle, {**idle, "healthy": False, "num_running": 3}]) == []  # a dead one's load is stale
    for key in ("num_running", "num_waiting", "num_in_flight", "kv_blocks_used"):
        assert len(serve._busy([idle, {**idle, key: 1}])) == 1


def test_settle_waits_for_an_idle_cluster():
    import httpx

    def client(answers: list) -> httpx.AsyncClient:
        def handler(request: httpx.Request) -> httpx.Response:
            status, instances = answers.pop(0) if len(answers) > 1 else answers[0]
            return httpx.Response(status, json={"instances": instances})
        return httpx.AsyncClient(base_url="http://test", transport=httpx.MockTransport(handler))

    busy = {"healthy": True, "num_running": 1}
    idle = {"healthy": True, "num_running": 0, "kv_blocks_used": 0}

    async def settle(answers: list, quiet: float = 0.3, timeout: float = 5.0) -> dict:
        async with client(answers) as c:
            return await serve.settle(c, {}, quiet, timeout)

    done = asyncio.run(settle([(200, [busy])] * 3 + [(200, [idle])] * 2 + [(200, [busy])] + [(200, [idle])]))
    assert done["idle"] is True and done["seconds"] >= 0.3 + 0.5  # the busy polls, then 0.3 s idle in a row
    stuck = asyncio.run(settle([(200, [busy])], timeout=0.4))
    assert stuck["idle"] is False and "1 running" in stuck["busy"][0] and stuck["seconds"] >= 0.4
    other = asyncio.run(settle([(404, [])]))  # not pdserve: a plain pause
    assert other["idle"] is None and other["seconds"] >= 0.3


ONE_RATE_KEYS = {"completed", "failed", "wall_seconds", "request_throughput", "output_tokens_per_s",
                 "total_tokens_per_s", "goodput_targets_s", "goodput_requests_per_s", "ttft", "tpot", "itl", "e2e",
                 "errors", "samples", "args"}


def test_one_rate_writes_the_json_it_always_wrote(cluster, tmp_path):
    out = tmp_path / "one.json"
    assert cli.main(["bench", "serve", "--base-url", cluster.main.http_url, "--api-key", API_KEY, "--num-prompts",
                     "3", "--input-len", "4", "--output-len", "2", "--request-rate", "50",
                     "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result) == ONE_RATE_KEYS
    assert result["args"]["request_rate"] == 50.0 and result["completed"] == 3


def test_multi_turn_mode_runs_the_chats(cluster, tmp_path):
    """`bench serve --multi-turn` is `bench multi-turn` under serve's flags: each chat's turns
    in order, each prompt the history so far (so it grows), the per-turn table in the JSON."""
    out = tmp_path / "mt.json"
    assert cli.main(["bench", "serve", "--multi-turn", "--base-url", cluster.main.http_url, "--api-key", API_KEY,
                     "--conversations", "2", "--turns", "3", "--think-time", "0", "--stagger", "0",
                     "--system-words", "20", "--user-words", "5", "--output-len", "2",
                     "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (6, 0)
    assert [t["turn"] for t in result["per_turn"]] == [1, 2, 3]
    for c in (0, 1):
        prompts = [t["prompt_tokens"] for t in result["turns"] if t["conversation"] == c]
        assert len(prompts) == 3 and prompts == sorted(prompts) and prompts[0] < prompts[2], prompts


def test_plot_without_matplotlib_fails_before_any_request(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    code = cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--request-rate", "1,2",
                     "--plot", str(tmp_path / "p.png"), "--output-json", str(tmp_path / "r.json")])
    assert code == 2 and "pip install" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_a_failed_request_makes_the_exit_status_one(tmp_path):
    """Requests that fail (nothing listens at the address) are counted and make ``bench
    serve`` exit 1, at one rate and in a sweep."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    common = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "2",
              "--input-len", "4", "--output-len", "2"]
    one, swept = tmp_path / "one.json", tmp_path / "sweep.json"
    assert cli.main(common + ["--request-rate", "inf", "--output-json", str(one)]) == 1
    result = json.loads(one.read_text())
    assert result["completed"] == 0 and result["failed"] == 2 and result["errors"]
    assert cli.main(common + ["--request-rate", "50,inf", "--settle-seconds", "0", "--output-json", str(swept)]) == 1
    runs = json.loads(swept.read_text())["sweep"]
    assert [(r["completed"], r["failed"]) for r in runs] == [(0, 2), (0, 2)]


@pytest.fixture(scope="module")
def real_cluster(default_model_dir):
    """One prefill and one decode server on the default model (CPU) behind a gateway."""
    flags = ["--kv-cache-memory", "64MiB", "--max-model-len", "256"]
    prefill, decode = EngineServer("prefill", flags), EngineServer("decode", flags)
    gw = GatewayProcess("bench-sweep", ["--prefill", prefill.address, "--decode", decode.address,
                                        "--max-model-len", "256"])
    with running_cluster([prefill, decode], gw):
        yield gw


@pytest.mark.slow
def test_rate_sweep_against_a_real_cluster(real_cluster, tmp_path):
    out = tmp_path / "sweep.json"
    code = cli.main(["bench", "serve", "--base-url", real_cluster.http_url, "--request-rate", "2,4",
                     "--duration", "1.5", "--input-len", "16", "--output-len", "4", "--settle-seconds", "0.6",
                     "--seed", "7", "--output-json", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result) == {"model", "request_rates", "goodput_targets_s", "sweep", "args"}
    assert result["request_rates"] == [2.0, 4.0] and result["model"] == "SmolLM2-135M-Instruct"
    assert result["goodput_targets_s"] == {"ttft": 2.0, "tpot": 0.2}
    runs = result["sweep"]
    assert [r["request_rate"] for r in runs] == [2.0, 4.0]
    assert [r["num_prompts"] for r in runs] == [3, 6]  # 1.5 s of arrivals at each rate
    assert [r["seed"] for r in runs] == [7, 8]  # new prompts at each rate, not the cached ones again
    assert runs[0]["settle"] is None and runs[1]["settle"]["idle"] is True
    assert runs[1]["settle"]["seconds"] >= 0.6
    for r in runs:
        assert set(r) == ONE_RATE_KEYS - {"args"} | {"request_rate", "num_prompts", "seed", "arrival_rate_per_s",
                                                    "goodput_fraction", "settle"}
        n, samples = r["num_prompts"], r["samples"]
        assert r["completed"] == n == len(samples) and r["failed"] == 0 and r["errors"] == []
        assert all(s["ok"] and s["input_tokens"] == 16 and s["output_tokens"] == 4 for s in samples)
        # The sent rate: the seeded Poisson gaps (drawn after the prompts, from the same
        # generator) replayed here; sending can only lag them (with 2 and 5 gaps, Poisson
        # noise alone puts the rate far from the offered one, so the seeded gaps are the yardstick).
        rng = random.Random(r["seed"])
        serve._bodies(_args("--input-len", "16", "--output-len", "4"), result["model"], rng, n)
        gaps = [rng.expovariate(r["request_rate"]) for _ in range(n - 1)]
        assert 0.7 * (n - 1) / sum(gaps) <= r["arrival_rate_per_s"] <= 1.02 * (n - 1) / sum(gaps), \
            (r["arrival_rate_per_s"], (n - 1) / sum(gaps))
        assert 0 < r["request_throughput"] == pytest.approx(n / r["wall_seconds"])
        assert r["wall_seconds"] >= max(s["start"] for s in samples)
        for metric in ("ttft", "tpot", "e2e"):
            assert 0 < r[metric]["p50"] <= r[metric]["p90"] <= r[metric]["p99"], (metric, r[metric])
        assert r["ttft"]["p99"] <= r["e2e"]["p99"]
        # goodput: the requests within the default targets, counted again from the samples
        good = [s for s in samples if s["ttft"] <= 2.0 and s["tpot"] <= 0.2]
        assert r["goodput_requests_per_s"] == pytest.approx(len(good) / r["wall_seconds"])
        assert r["goodput_fraction"] == pytest.approx(len(good) / n)


def _sweep_result() -> dict:
    def stats(p50: float) -> dict:
        return {"mean": p50, "p50": p50, "p90": 1.5 * p50, "p99": 2 * p50}

    runs = [{"request_rate": rate, "request_throughput": done, "goodput_requests_per_s": good,
             "goodput_fraction": good / done, "failed": failed, "ttft": stats(ttft), "tpot": stats(tpot)}
            for rate, done, good, failed, ttft, tpot in [(1, 1.0, 1.0, 0, 0.1, 0.01), (2, 1.8, 1.2, 0, 0.4, 0.02),
                                                       (4, 2.1, 0.3, 2, 3.0, 0.05), (math.inf, 2.2, 0.0, 0, 9.0, 0.06)]]
    return {"model": "m", "request_rates": [r["request_rate"] for r in runs], "sweep": runs,
            "goodput_targets_s": {"ttft": 0.5, "tpot": 0.025}, "args": {"dataset": "random", "input_len": 16,
                                                                      "output_len": 4, "num_prompts": 8,
                                                                      "max_concurrency": 16}}


def test_sweep_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from bench import serve_plot

    path = tmp_path / "sweep.png"
    serve_plot.plot_sweep(_sweep_result(), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(str(path)).shape
    assert width > 2 * height > 800  # three panels side by side
    one = tmp_path / "one.png"  # one rate: the plot it always drew
    serve_plot.plot_run({"completed": 2, "output_tokens_per_s": 9.0, "samples": [
        {"ok": True, "start": 0.0, "ttft": 0.1, "e2e": 0.5}, {"ok": False, "start": 0.2, "ttft": 0.0, "e2e": 0.0}],
        **{m: {"p50": 0.1, "p90": 0.2, "p99": 0.3} for m in ("ttft", "tpot", "e2e")}}, str(one))
    assert one.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
