"""The KV that lands on the decode side equals what the prefill side
computed: two real engines, a real gloo pair, the prefill tier's hold/release
and the decode tier's reserve/kv_arrived paths; then the decode engine
continues and matches a colocated engine token for token."""
from __future__ import annotations

import threading

import torch

from engine.config import EngineArgs
from engine.kv_transfer import KVLayout, KVReceiver, KVSender
from engine.llm_engine import LLMEngine
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

    # Prefill tier: finish after the first token, keep the blocks for the send.
    p = prefill.make_request("r", prompt, sp)
    p.max_tokens, p.hold_kv_on_finish = 1, True
    prefill.scheduler.add_request(p)
    _run(prefill)
    src = prefill.scheduler.kv.get_block_ids("r")
    assert p.is_finished and "r" in prefill.scheduler.held and len(src) == 10

    # Decode tier: reserve, then receive into the reserved blocks.
    filler = decode.make_request("filler", prompt[:8], sp)
    decode.scheduler.kv.allocate_slots(filler, 8)  # occupy blocks so src and dst ids differ
    d = decode.make_request("r", prompt, sp)
    dst = decode.scheduler.reserve(d)
    assert dst is not None and dst != src

    layout = KVLayout.of(prefill.runner.kv_cache, "tiny")
    receiver, port = KVReceiver.listen("127.0.0.1", layout, timeout=20)
    got = {}
    t = threading.Thread(target=lambda: got.update(r=receiver.recv(decode.runner.kv_cache, timeout=20)))
    t.start()
    sender = KVSender.connect("127.0.0.1", port, layout, timeout=20)
    sender.send("r", src, dst, prefill.runner.kv_cache, meta={"first_token": p.output_token_ids[0]})
    t.join(30)
    sender.close()
    receiver.close()
    prefill.abort_request("r")  # releases the held blocks
    assert prefill.scheduler.kv.pool.num_used_blocks == 0

    # Bit-exact: the decode cache now holds exactly what prefill computed,
    # and what the colocated engine computed for the same prompt.
    kv_p, kv_d = prefill.runner.kv_cache, decode.runner.kv_cache
    assert torch.equal(kv_d[:, dst], kv_p[:, src])
    n_full = len(prompt) // 4
    ref_blocks = [b.block_id for b in colocated.scheduler.kv.pool.blocks if b.block_hash is not None][:n_full]
    assert torch.equal(kv_d[:, dst[:n_full]], colocated.runner.kv_cache[:, ref_blocks])

    rid, _, stats, meta = got["r"]
    assert rid == "r" and stats.num_blocks == 10 and stats.num_bytes == kv_p[:, :10].numel() * 4
    decode.scheduler.kv_arrived("r", meta["first_token"])
    _run(decode)
    assert d.output_token_ids == ref.output_token_ids
    decode.scheduler.kv.forget(filler)
    assert decode.scheduler.kv.pool.num_used_blocks == 0
