"""Speculative decoding through the whole topology: `pdserve up --speculative-config`
(n-gram proposals) on a tiny checkpoint, greedy prompts over gRPC, the prompt's KV from
the prefill server, the decode server verifying proposals: the streamed tokens are the
offline engine's without speculation, and the decode server counts the proposals in
vLLM's spec_decode metrics and records the acceptance on the request's decode span."""
from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_model
from tests.e2e.test_model_families_cluster import MAX_TOKENS, _generate, start_cluster

pytestmark = pytest.mark.slow
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir: Path):
    d = make_tiny_model(tmp_path_factory.mktemp("spec") / "model", seed=4)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / f, d / f)
    traces = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    up, ports = start_cluster(d, "--speculative-config", SPEC, "--traces-file", str(traces))
    yield d, ports, traces
    up.stop()


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 384, (5,), generator=g).tolist()
    return [phrase * 4 + torch.randint(3, 384, (n,), generator=g).tolist() for n in (1, 3, 7)]


def _served_as_plain(d: Path, ports: dict[str, int], prompts: list[list[int]]) -> Callable[[str], float]:
    """Assert the cluster streams the offline engine's plain greedy tokens for ``prompts``
    (concurrently); then the decode server's metric values by name."""
    want = [o.outputs[0].token_ids for o in LLM(str(d), kv_cache_memory="16MiB", block_size=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: _generate(f"127.0.0.1:{ports['grpc']}", p), prompts))
    assert got == want
    return _metrics(ports["decode"] + 1000)


def _metrics(port: int) -> Callable[[str], float]:
    """A server's metric values by name (summed over labels), as its /metrics says now."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text

    def value(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    return value


def test_speculating_decode_server_streams_plain_decodings_tokens(cluster):
    d, ports, traces = cluster
    prompts = _prompts()
    value = _served_as_plain(d, ports, prompts)
    assert value("pdserve:spec_decode_num_drafts_total") > 0
    proposed, accepted = value("pdserve:spec_decode_num_draft_tokens_total"), \
        value("pdserve:spec_decode_num_accepted_tokens_total")
    assert 0 < proposed and 0 <= accepted <= proposed
    assert value("pdserve:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    # Each request's decode span carries its own acceptance (a request that found nothing to
    # propose has none); they add up to the counters once every decode span is written.
    deadline = time.monotonic() + 20
    while True:
        spans = [json.loads(line) for line in traces.read_text().splitlines()]
        decode = [s["attributes"] for s in spans if s["name"] == "decode" and s["service"] == "pdserve-decode"]
        per_request = [a for a in decode if "pdserve.spec.draft_tokens" in a]
        if len(decode) >= len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert len(decode) == len(prompts) and per_request
    assert sum(a["pdserve.spec.draft_tokens"] for a in per_request) == proposed
    assert sum(a["pdserve.spec.accepted_tokens"] for a in per_request) == accepted
    assert all(a["pdserve.spec.acceptance_rate"] == round(a["pdserve.spec.accepted_tokens"]
                                                          / a["pdserve.spec.draft_tokens"], 4) for a in per_request)


def test_draft_model_through_the_cluster(tmp_path, default_model_dir: Path):
    """`pdserve up` with a draft model (the target as its own draft): the prefill server
    computes the draft's KV of each prompt beside the target's and one transfer moves both
    (twice the target's bytes, the draft being the target); the decode server computes no
    prompt token of the draft, then drafts every step; the tokens are plain decoding's,
    nearly every proposal is accepted, and each request's acceptance is in the gateway's
    request log line."""
    d = make_tiny_model(tmp_path / "model", seed=4)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / f, d / f)
    spec = json.dumps({"method": "draft_model", "model": str(d), "num_speculative_tokens": 3})
    up, ports = start_cluster(d, "--speculative-config", spec)
    try:
        g = torch.Generator().manual_seed(6)  # no two prompts share a block: none is cached on the decode server
        prompts = [torch.randint(3, 384, (5,), generator=g).tolist() * 4 + [n] for n in (3, 4, 5)]
        value = _served_as_plain(d, ports, prompts)
        proposed = value("pdserve:spec_decode_num_draft_tokens_total")
        assert proposed > 0 and value("pdserve:spec_decode_num_accepted_tokens_total") >= 0.9 * proposed
        assert value("pdserve:spec_decode_draft_prompt_tokens_total") == 0
        prefill = _metrics(ports["prefill"] + 1000)
        assert prefill("pdserve:spec_decode_draft_prompt_tokens_total") == sum(map(len, prompts))
        blocks = sum(-(-len(p) // 4) for p in prompts)  # block size 4
        target_bytes = blocks * 3 * 2 * 4 * 2 * 16 * 4  # 3 layers x (K, V) x 4 tokens x 2 KV heads x 16, float32
        assert value("pdserve:kv_transfer_bytes_total") == 2 * target_bytes == prefill("pdserve:kv_transfer_bytes_total")
        # each request's acceptance in the gateway's request log line, which the gateway writes
        # once the stream has ended: the client may have its last token a moment before
        deadline = time.monotonic() + 20
        while True:
            logged = [line for line in up.log_text().splitlines() if " spec_accepted=" in line]
            if len(logged) >= len(prompts) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(logged) == len(prompts), up.logs()[-3000:]
    finally:
        up.stop()
