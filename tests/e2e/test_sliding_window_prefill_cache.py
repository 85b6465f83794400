"""A sliding-window model on the prefill tier with a KV cache small enough that blocks are
reused while other requests still wait for their KV to leave.

With every layer windowed (Mistral style), a request's blocks that fall behind the window
are no longer read by its own queries, and the engine gives them back as the prefill goes.
A request whose KV is still to be sent must keep them all: the send reads every block of
the prompt, and the decode server keeps what came as prefix-cache blocks. Given back early
on a cache this small, they are handed to the concurrent requests' chunks before the send
reads them, and the decode server receives (and caches, under the first request's hashes)
another request's KV for the prompt's early positions.

What reads those positions on the decode server is a later prompt that shares the prefix:
the decode server takes the prefix from its cache (the prefill server sends only the rest)
and its first queries' windows reach back into the prefix's last blocks. So: twelve prompts
of 76 tokens (over nine windows of 8), six at a time through the gateway, on a prefill
server whose cache holds two of them; then twelve prompts that share their first 48 tokens
and add 2. Every greedy token of both rounds must be the offline engine's, and the second
round's prefixes must have come out of the decode server's cache (else nothing here reads
the early blocks).

Black box (served tokens only), so that it holds however the KV cache manager tracks the
blocks. The cache is sized in bytes: 40 blocks of 4 tokens of this model, two of the
prompts. One prompt running while another waits for its send then always fits; a smaller
cache trips the scheduler's "alone and still too big" exit first, which ends a running
prompt "length" (the client sees the prefill aborted) when the blocks it lacks are held by
requests waiting for their sends."""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.engine.families import WINDOW, make_family_model, random_prompts
from tests.processes import EngineServer, GatewayProcess, running_cluster

pytestmark = pytest.mark.slow

BLOCK_SIZE = 4
PREFIX, REST, SHORT_REST = 6 * WINDOW, 28, 2  # tokens: shared prefix, first round's rest, second round's
NUM_PROMPTS, CONCURRENCY = 12, 6
BUDGET = 64  # tokens a prefill step computes: a 76-token prompt takes two steps, next to others' chunks
MAX_TOKENS = 8
# KV bytes per block of the test model: 3 layers x K and V x 4 tokens x 2 KV heads x 16 dims x 4 bytes
BLOCK_BYTES = 3 * 2 * BLOCK_SIZE * 2 * 16 * 4
PREFILL_BLOCKS = 40  # two 19-block prompts (and no more): blocks given back early are reused at once
COMMON = ["--block-size", str(BLOCK_SIZE), "--max-model-len", "128"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir: Path) -> Path:
    d = make_family_model(tmp_path_factory.mktemp("mistral-window") / "model", "mistral-window", seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the gateway's tokenizer (ids stay below 384)
        shutil.copy(default_model_dir / name, d / name)
    return d


@pytest.fixture(scope="module")
def prompts() -> tuple[list[list[int]], list[list[int]]]:
    """(first round, second round): each second-round prompt is a first-round prompt's
    first PREFIX tokens and SHORT_REST others."""
    heads = random_prompts([PREFIX] * NUM_PROMPTS, seed=7)
    first = [h + t for h, t in zip(heads, random_prompts([REST] * NUM_PROMPTS, seed=8))]
    second = [h + t for h, t in zip(heads, random_prompts([SHORT_REST] * NUM_PROMPTS, seed=9))]
    assert (PREFIX + REST) // BLOCK_SIZE * 2 <= PREFILL_BLOCKS  # the sizing the docstring states
    return first, second


@pytest.fixture(scope="module")
def offline(model_dir, prompts) -> tuple[list[list[int]], list[list[int]]]:
    """The offline engine's greedy tokens for both rounds, in the same order (a cache that
    holds everything)."""
    from engine import LLM, SamplingParams

    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, kv_cache_memory="16MiB", max_model_len=128,
              max_num_batched_tokens=BUDGET)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return tuple([o.outputs[0].token_ids for o in llm.generate(round_, sp)] for round_ in prompts)


def _generate(address: str, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens over the gateway's gRPC API, and the prompt tokens that came from a cache."""
    with grpc.insecure_channel(address) as ch:
        sp = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens, cached = [], 0
        for d in gateway_pb2_grpc.GatewayStub(ch).Generate(
                gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sp), timeout=120):
            tokens += d.token_ids
            cached = max(cached, d.usage.cached_tokens)
        return tokens, cached


@pytest.mark.parametrize("kv_send", ["layerwise", "after-prefill"])
def test_blocks_behind_the_window_stay_until_sent(model_dir, prompts, offline, kv_send):
    m = ["--model", str(model_dir), *COMMON]
    prefill = EngineServer("prefill", [*m, "--kv-cache-memory", str(PREFILL_BLOCKS * BLOCK_BYTES),
                                       "--max-num-batched-tokens", str(BUDGET), "--kv-send", kv_send],
                           name="prefill")
    decode = EngineServer("decode", [*m, "--kv-cache-memory", "16MiB"], name="decode")
    gw = GatewayProcess("gw", ["--model", str(model_dir), "--prefill", prefill.address, "--decode", decode.address])
    with running_cluster([prefill, decode], gw):
        got = []
        for round_ in prompts:  # the second round once the first is over: its prefix is in the decode cache
            with ThreadPoolExecutor(CONCURRENCY) as pool:
                got.append(list(pool.map(lambda p: _generate(gw.grpc_address, p), round_)))
        # every request was prefilled on the prefill server, its KV sent
        assert prefill.load().num_requests_finished == 2 * NUM_PROMPTS
    first, second = ([tokens for tokens, _ in r] for r in got)
    assert first == offline[0], _differ(first, offline[0])
    # the prefix's blocks came from the decode server's cache, as the first round sent them
    assert all(cached >= PREFIX for _, cached in got[1]), [cached for _, cached in got[1]]
    assert second == offline[1], _differ(second, offline[1])


def _differ(got: list[list[int]], want: list[list[int]]) -> str:
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return f"{len(bad)} of {len(want)} prompts differ from the offline engine's tokens: " + "; ".join(
        f"#{i} {got[i]} != {want[i]}" for i in bad)
