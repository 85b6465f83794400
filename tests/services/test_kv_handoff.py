"""The KV that lands on the decode side equals what the prefill side
computed: two real engines, a real gloo pair, driven through the engines'
named hand-off operations (prefill: add_prefill_request, begin_send,
release_after_send; decode: reserve, begin_kv_receive, kv_received); then the decode engine
continues and matches a colocated engine token for token."""
from __future__ import annotations

import threading

import torch

from engine.config import EngineArgs
from kv_transfer import KVLayout, KVReceiver, KVSender
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams


def _engine(model_dir) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), block_size=4, kv_cache_memory="4MiB",
                                                 max_num_batched_tokens=16))


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_prefill_to_decode_handoff(tiny_llama_dir):
    prefill, decode, colocated = _engine(tiny_llama_dir), _engine(tiny_llama_dir), _engine(tiny_llama_dir)
    prompt = torch.randint(3, 384, (37,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    ref = colocated.add_request("r", prompt, sp)
    _run(colocated)

    # Prefill tier: the first token, then the blocks are held for the send.
    p = prefill.add_prefill_request("r", prompt, sp)
    while not p.status == RequestStatus.HELD_FOR_SEND:
        prefill.step()
    src = prefill.begin_send("r")
    assert len(src) == 10 and not p.is_finished

    # Decode tier: a request holding blocks (so src and dst ids differ), then the reservation.
    decode.add_request("filler", [t + 1 for t in prompt[:8]], sp)  # no prefix shared
    decode.step()
    d = decode.reserve("r", prompt, sp)
    out = decode.step()
    assert out.reserved == [d]
    dst = decode.get_block_ids("r")
    assert dst != src and len(dst) == 10
    decode.abort_request("filler")

    layout = KVLayout.of(prefill.kv_cache, "tiny")
    receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
    got = {}
    t = threading.Thread(target=lambda: got.update(r=receiver.recv(
        decode.kv_cache, validate=decode.begin_kv_receive, timeout=20)))
    t.start()
    sender = KVSender.connect("127.0.0.1", port, layout, timeout=20)
    sender.send("r", src, dst, prefill.kv_cache, meta={"first_token": p.output_token_ids[0]})
    t.join(30)
    sender.close()
    receiver.close()
    assert prefill.release_after_send("r") is p and p.is_finished
    assert prefill.stats().kv_blocks_used == 0

    # Bit-exact: the decode cache now holds exactly what prefill computed,
    # and what the colocated engine computed for the same prompt.
    kv_p, kv_d = prefill.kv_cache, decode.kv_cache
    assert torch.equal(kv_d[:, dst], kv_p[:, src])
    n_full = len(prompt) // 4
    ref_blocks = [b.block_id for b in colocated.scheduler.kv.pool.blocks if b.block_hash is not None][:n_full]
    assert torch.equal(kv_d[:, dst[:n_full]], colocated.kv_cache[:, ref_blocks])

    rid, _, stats, meta = got["r"]
    assert rid == "r" and stats.num_blocks == 10 and stats.num_bytes == kv_p[:, :10].numel() * 4
    assert d.status == RequestStatus.RECEIVING_KV
    decode.kv_received("r", meta["first_token"])
    _run(decode)
    assert d.output_token_ids == ref.output_token_ids
    assert decode.stats().kv_blocks_used == 0


def test_transferred_request_preempted_on_decode_recomputes_the_same_tokens(tiny_llama_dir):
    """A request whose prompt KV came by transfer is preempted on a full decode
    cache and recomputed there from its tokens: the output is unchanged."""
    def engine(**kw) -> LLMEngine:
        return LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), block_size=4,
                                                     max_num_batched_tokens=64, **kw))

    prefill, colocated = engine(kv_cache_memory="4MiB"), engine(kv_cache_memory="4MiB")
    decode = engine(num_gpu_blocks_override=26)  # 104 slots: two requests growing to 37+30 do not fit
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 384, (37,), generator=gen).tolist() for _ in range(2)]
    refs = [colocated.add_request(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    _run(colocated)

    reqs = []
    for i, prompt in enumerate(prompts):
        p = prefill.add_prefill_request(f"r{i}", prompt, sp)
        while p.status != RequestStatus.HELD_FOR_SEND:
            prefill.step()
        src = prefill.begin_send(f"r{i}")
        reqs.append(decode.reserve(f"r{i}", prompt, sp))
        decode.step()
        dst = decode.get_block_ids(f"r{i}")
        decode.begin_kv_receive(f"r{i}", dst)
        decode.kv_cache[:, dst] = prefill.kv_cache[:, src]  # the transfer itself is tested above
        decode.kv_received(f"r{i}", p.output_token_ids[0])
        prefill.release_after_send(f"r{i}")
    _run(decode)
    assert decode.scheduler.num_preemptions_total > 0 and any(r.num_preemptions for r in reqs)
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in refs]
    assert decode.stats().kv_blocks_used == 0 and prefill.stats().kv_blocks_used == 0
