"""`pdserve bench serve` against a real gateway (fake engine servers speak the
real protos): every dataset's prompts have the shapes asked for, goodput
targets parse as vLLM's do and decide which requests count."""
from __future__ import annotations

import argparse
import asyncio
import random

import pytest

from bench import serve
from tests.gateway.conftest import API_KEY


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
