"""Tensor parallelism on CPU (gloo): real worker processes, sharded weights
read shard by shard from safetensors, the same tokens as one rank and as
transformers, and a worker's death taking the engine down without orphans."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.model_loader import iter_safetensors
from engine.parallel import Shard, check_tp_size
from tests.conftest import make_tiny_model
from tests.processes import pid_alive as _alive

pytestmark = pytest.mark.slow
KW = dict(dtype="float32", device="cpu", kv_cache_memory="4MiB")
PROMPTS = [[5, 9, 31, 7], list(range(40, 57)), [200], list(range(3, 40))]


def _tokens(llm: LLM, prompts, sp) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]


def _hf_greedy(model_dir, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and, per step, the gap between its top two logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids, gaps = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(ids).logits[0, -1]
            top = logits.topk(2).values
            gaps.append((top[0] - top[1]).item())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), gaps


def _assert_matches(got: list[int], want: list[int], gaps: list[float], tol: float = 1e-4) -> None:
    """Equal, or equal up to a first difference where the reference's top two logits tie
    (all-reduce sums in another order)."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            assert gaps[i] < tol, (i, got, want, gaps[i])
            return
    assert len(got) == len(want)


def test_tp2_gives_transformers_greedy_tokens(tiny_llama_dir):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **KW)
    try:
        assert llm.engine.kv_cache.shape[4] == 1  # 2 KV heads over 2 ranks
        got = _tokens(llm, PROMPTS, sp)
        for prompt, tokens in zip(PROMPTS, got):
            _assert_matches(tokens, *_hf_greedy(tiny_llama_dir, prompt, 12))
        # chunked prefill and preemption-free continuous batching work the same across ranks
        assert got == _tokens(LLM(str(tiny_llama_dir), **KW), PROMPTS, sp)
        # The prefix cache is rank 0's bookkeeping over blocks every rank holds: a repeat hits it.
        hits = llm.engine.stats().prefix_hits_total
        assert _tokens(llm, [PROMPTS[3]], sp) == [got[3]]
        assert llm.engine.stats().prefix_hits_total > hits
    finally:
        llm.engine.close()


def test_tp4_replicates_kv_heads_and_pads_the_vocabulary(tmp_path):
    # 8 query heads, 2 KV heads (each on 2 ranks), a vocabulary of 386 (not a multiple of 4)
    d = make_tiny_model(tmp_path / "m", num_attention_heads=8, num_key_value_heads=2, vocab_size=386,
                        tie_word_embeddings=True)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(d), tensor_parallel_size=4, max_num_batched_tokens=16, **KW)
    try:
        got = _tokens(llm, PROMPTS, sp)
        for prompt, tokens in zip(PROMPTS, got):
            _assert_matches(tokens, *_hf_greedy(d, prompt, 8))
    finally:
        llm.engine.close()
    assert not llm.engine.workers_alive or not llm.engine._workers


def test_tp2_decode_graph_steps_share_rank0s_inputs(tiny_llama_dir, monkeypatch):
    """The graph path under TP (run eagerly on CPU: what every rank's graph replays): rank 0
    sends which graph and its input buffers, every rank places the block tables and runs it;
    the tokens are one rank's. Sampled rows of different lengths exercise padding and the
    block tables' width."""
    sp = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=3, max_tokens=9, ignore_eos=True)] * 2
    kw = dict(KW, block_size=4, max_num_seqs=6)
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, graphs_without_capture=True, **kw)  # every rank's
    try:
        runner = llm.engine.runner
        assert runner.graphs is not None and not runner.graphs.use_graphs
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]
        assert runner.graphs.num_replays > 0
    finally:
        llm.engine.close()
    one = LLM(str(tiny_llama_dir), **kw)
    assert one.engine.runner.graphs is None
    assert got == [o.outputs[0].token_ids for o in one.generate(PROMPTS, sp)]


def test_shards_and_shard_by_shard_reads(tiny_llama_dir):
    s = Shard(rank=1, size=2, num_heads=6, num_kv_heads=2, vocab_size=384)
    assert (s.q_heads, s.kv_heads, s.vocab) == ((3, 6), (1, 2), (192, 384))
    r = Shard(rank=3, size=4, num_heads=8, num_kv_heads=2, vocab_size=386)
    assert r.kv_heads == (1, 2) and r.vocab == (291, 388)  # replicated head; rows past 386 are padding
    # The loader reads only a rank's part of each tensor from the file.
    parts = {"model.layers.0.self_attn.q_proj.weight": (0, 48, 96), "model.embed_tokens.weight": (0, 192, 384),
             "model.layers.0.mlp.down_proj.weight": (1, 96, 192)}
    seen = {n: t.shape for n, t in iter_safetensors(tiny_llama_dir, parts.get) if n in parts}
    assert seen == {"model.layers.0.self_attn.q_proj.weight": (48, 96), "model.embed_tokens.weight": (192, 96),
                    "model.layers.0.mlp.down_proj.weight": (96, 96)}
    for bad in (4, 5):
        with pytest.raises(ValueError):
            check_tp_size(bad, 6, 2)
    with pytest.raises(ValueError, match="attention heads"):
        EngineArgs(model=str(tiny_llama_dir), device="cpu", tensor_parallel_size=4).create_engine_config()


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("llama", {"tie_word_embeddings": True}),
                                             ("qwen2", {})])
def test_full_shapes_are_what_the_checkpoint_stacks(tmp_path, arch, overrides):
    """Dummy weights draw each parameter at its full (unsharded) shape: the checkpoint
    tensors that load into it, stacked along its split dimension."""
    from safetensors import safe_open

    from engine.model_runner import select_ops
    from engine.models.llama import LlamaForCausalLM

    d = make_tiny_model(tmp_path / arch, arch=arch, **overrides)
    model = LlamaForCausalLM(EngineArgs(model=str(d), device="cpu").create_engine_config().model,
                             select_ops(torch.device("cpu")))
    stacked: dict[str, list[tuple[int, ...]]] = {}
    for f in d.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            for n in sorted(fh.keys()):
                mapped = model.map_name(n)
                if mapped is not None:
                    stacked.setdefault(mapped[0], []).append(tuple(fh.get_slice(n).get_shape()))
    params = dict(model.named_parameters())
    assert set(stacked) == set(params)
    for name, shapes in stacked.items():
        rows = sum(s[0] for s in shapes)
        assert params[name].full_shape == (rows, *shapes[0][1:]), name


def test_dummy_weights_are_the_same_model_at_every_tp_size(tiny_llama_dir):
    """Each rank keeps its part of one seeded draw, so TP 2 serves TP 1's random model
    (and tiers of different TP sizes agree on it)."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(KW, load_format="dummy")
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kw)
    try:
        got = _tokens(llm, PROMPTS, sp)
    finally:
        llm.engine.close()
    assert got == _tokens(LLM(str(tiny_llama_dir), **kw), PROMPTS, sp)


def test_a_dead_worker_fails_the_next_step_and_leaves_no_process(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **KW)
    engine = llm.engine
    worker = engine._workers[0]
    assert engine.workers_alive
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    assert not engine.workers_alive
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3))
    t0 = time.monotonic()
    with pytest.raises(Exception):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 30
    engine.close()
    assert not any(w.is_alive() for w in [worker])


def test_workers_die_with_a_killed_engine_process(tiny_llama_dir):
    import subprocess
    import sys

    code = ("import sys, time\nfrom engine import LLM\n"
            "if __name__ == '__main__':\n"
            f"    llm = LLM({str(tiny_llama_dir)!r}, dtype='float32', device='cpu', kv_cache_memory='4MiB', "
            "tensor_parallel_size=2)\n"
            "    print(*[w.pid for w in llm.engine._workers], flush=True)\n"
            "    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert pids and all(_alive(p) for p in pids)
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
