"""`pdserve bench multi-turn`'s bookkeeping: the chats' histories, the per-turn and overall
figures, and the engine servers' cached tokens by source read from their /metrics."""
from __future__ import annotations

from bench.multi_turn import Conversation, Turn, cached_by_source, difference, report, summarize
from pdserve.cli import BENCH


def test_each_turn_sends_the_whole_history():
    a, b = Conversation.start(0, seed=1, system_words=5), Conversation.start(0, seed=1, system_words=5)
    first = a.next_user(3)
    assert [m["role"] for m in first] == ["system", "user"] and len(first[1]["content"].split()) == 3
    a.add_reply("an answer")
    second = a.next_user(3)
    assert second[:2] == first and second[2] == {"role": "assistant", "content": "an answer"}
    assert [m["role"] for m in second] == ["system", "user", "assistant", "user"]
    assert b.next_user(3) == first  # seeded: the same chat again
    other = Conversation.start(1, seed=1, system_words=5).next_user(3)
    assert other[0] != first[0] and other[0]["content"].startswith("Chat 1. ")


def test_summary_per_turn_and_overall():
    turns = [Turn(0, 1, ok=True, ttft=1.0, prompt_tokens=100, cached_tokens=0),
             Turn(1, 1, ok=True, ttft=3.0, prompt_tokens=100, cached_tokens=0),
             Turn(0, 2, ok=True, ttft=0.5, prompt_tokens=200, cached_tokens=96),
             Turn(1, 2, ok=True, ttft=0.25, prompt_tokens=200, cached_tokens=192),
             Turn(0, 3, error="HTTP 503: b'busy'")]  # failed: counted, not in the figures
    s = summarize(turns)
    assert (s["completed"], s["failed"], s["prompt_tokens"], s["cached_tokens"]) == (4, 1, 600, 288)
    assert s["hit_rate"] == 288 / 600 and s["hit_rate_after_first_turn"] == 288 / 400
    assert s["ttft_after_first_turn_mean"] == 0.375
    one, two, three = s["per_turn"]
    assert (one["turn"], one["completed"], one["ttft_mean"], one["hit_rate"]) == (1, 2, 2.0, 0.0)
    assert (two["cached_tokens_mean"], two["prompt_tokens_mean"], two["hit_rate"]) == (144, 200, 0.72)
    assert (three["completed"], three["failed"], three["hit_rate"]) == (0, 1, 0.0)
    assert s["errors"] == ["HTTP 503: b'busy'"]
    text = report({**s, "wall_seconds": 2.0})
    assert "hit rate 48.0% overall (288 of 600 prompt tokens cached), 72.0% over turns 2.." in text


def test_cached_tokens_by_source_from_an_engine_servers_metrics():
    text = """# HELP pdserve:prompt_tokens_cached_by_source_total Prompt tokens found cached, by the tier
# TYPE pdserve:prompt_tokens_cached_by_source_total counter
pdserve:prompt_tokens_cached_by_source_total{model_name="m",role="prefill",source="device"} 32.0
pdserve:prompt_tokens_cached_by_source_total{model_name="m",role="prefill",source="host"} 480.0
pdserve:prompt_tokens_cached_by_source_total{model_name="m",role="prefill",source="disk"} 0.0
pdserve:prompt_tokens_cached_total{model_name="m",role="prefill"} 512.0
pdserve:prefix_cache_hits_total{model_name="m",role="prefill"} 32.0
"""
    assert cached_by_source(text) == {"device": 32.0, "host": 480.0, "disk": 0.0}
    before = {"routed_cached_tokens": {"device": 16, "host": 0}, "engine_cached_by_source": {"prefill": {"host": 80.0}}}
    after = {"routed_cached_tokens": {"device": 48, "host": 64},
             "engine_cached_by_source": {"prefill": cached_by_source(text)}}
    assert difference(after, before) == {"routed_cached_tokens": {"device": 32, "host": 64},
                                         "engine_cached_by_source": {"prefill": {"device": 32.0, "host": 400.0,
                                                                                 "disk": 0.0}}}


def test_registered_as_a_bench_subcommand():
    assert BENCH["multi-turn"][0] == "bench.multi_turn"
