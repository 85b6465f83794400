"""Tiny random checkpoints of every supported family, written by transformers itself
(``AutoConfig.for_model`` + ``save_pretrained``, float32), and transformers' greedy
tokens for them: the oracle the family tests compare against."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from engine.layers.attention import AttentionMetadata

WINDOW = 8  # sliding window of the windowed test models: far shorter than the prompts
BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            initializer_range=0.1, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (model_type, config overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", {}),
    "qwen3-moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)),
    "qwen3-moe-sparse-step": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=3, moe_intermediate_size=24,
                                                norm_topk_prob=False, decoder_sparse_step=2)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "gemma3": ("gemma3_text", dict(sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 100000.0},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}})),
    "phi3": ("phi3", dict(sliding_window=None)),
    "phi3-window": ("phi3", dict(sliding_window=WINDOW)),
    "mistral-window": ("mistral", dict(sliding_window=WINDOW)),
    "llama-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 128})),
    "qwen3-dynamic": ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                     "rope_theta": 10000.0})),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=512, original_max_position_embeddings=64,
                                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                    "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
    "phi3-partial-rotary": ("phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.5})),
}


def make_family_model(path: Path, name: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, family = FAMILIES[name]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **family, **overrides})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return path


def hf_model(path: Path, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, not stopped at end-of-sequence
    (as pdserve's ``ignore_eos``)."""
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        o = model.generate(torch.tensor([p], device=model.device), max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long, device=model.device))
        outs.append(o[0, len(p):].tolist())
    return outs


def assert_greedy_match(model, prompts, expected, got, tie: float = 1e-5, relative: float = 0.0) -> None:
    """Token for token; a first difference is allowed only where transformers' top two
    logits at that step tie: within ``tie`` + ``relative`` x |top logit| (bf16 rounding
    grows with the logits' size)."""
    for p, want, have in zip(prompts, expected, got):
        if want == have:
            continue
        i = next((j for j, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        assert i < min(len(want), len(have)), f"lengths differ: {len(want)} vs {len(have)}"
        with torch.no_grad():
            logits = model(torch.tensor([p + want[:i]], device=model.device)).logits[0, -1]
        top2 = torch.topk(logits.float(), 2).values
        gap, bound = float(top2[0] - top2[1]), tie + relative * abs(float(top2[0]))
        assert gap <= bound, (
            f"prompt of {len(p)} tokens: first difference at step {i} ({want[i]} vs {have[i]}) where the "
            f"reference's top two logits ({float(top2[0]):.4g}, {float(top2[1]):.4g}) differ by {gap:.3g} "
            f"> {bound:.3g}\nwant {want}\nhave {have}")


def random_prompts(lengths: list[int], vocab: int = 384, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy_references(models: dict[str, Path], lengths: list[int], seed: int, max_new_tokens: int) -> dict:
    """name -> (transformers model, random prompts of ``lengths``, its greedy tokens), the
    prompts of the i-th model drawn with seed ``seed + i``."""
    out = {}
    for i, (name, d) in enumerate(models.items()):
        m = hf_model(d)
        prompts = random_prompts(lengths, seed=seed + i)
        out[name] = (m, prompts, hf_greedy(m, prompts, max_new_tokens))
    return out


def group_metadata(layout, positions: torch.Tensor, total: int, longest: int) -> AttentionMetadata:
    """One sequence of ``total`` tokens so far, this step's at ``positions``: every group's
    blocks in order, numbered apart (a block of the shared pages is one group's), each group
    given room for ``longest`` tokens."""
    groups = layout.groups
    first = [sum(math.ceil(longest / h.block_size) for h in groups[:g]) for g in range(len(groups))]
    width = max(math.ceil(total / g.block_size) for g in groups)
    tables = torch.zeros(len(groups), 1, width, dtype=torch.int32)
    slots = torch.empty(len(groups), len(positions), dtype=torch.long)
    for i, g in enumerate(groups):
        n = math.ceil(total / g.block_size)
        tables[i, 0, :n] = torch.arange(first[i], first[i] + n)
        slots[i] = (first[i] + positions // g.block_size) * g.block_size + positions % g.block_size
    return AttentionMetadata(slot_mapping=slots, block_tables=tables,
                             query_start_loc=torch.tensor([0, len(positions)], dtype=torch.int32),
                             seq_lens=torch.tensor([total], dtype=torch.int32))


def assert_grouped_logits_match(model_dir: Path, ids: torch.Tensor, ends: tuple[int, ...], block_size: int = 4) -> None:
    """The model itself (float32, the PyTorch references) over a paged cache laid out in cache
    groups: ``ids`` in one call, then in chunks ending at ``ends``; every position's logits are
    transformers' float32 ones."""
    from engine.config import ModelConfig
    from engine.kv_cache_groups import model_layout
    from engine.model_loader import load_model
    from kernels import reference

    cfg = ModelConfig.from_dir(model_dir, dtype="float32", load_format="auto", served_model_name="m")
    model = load_model(cfg, torch.device("cpu"), reference)
    layout = model_layout(cfg, block_size)
    model.set_cache_layout(layout)
    widest = max(layout.groups, key=lambda g: g.num_kv_heads * g.head_dim)
    blocks = sum(math.ceil(len(ids) / g.block_size) for g in layout.groups)
    kv = torch.zeros(layout.num_slots, blocks, 2, block_size, widest.num_kv_heads, widest.head_dim)
    with torch.no_grad():
        want = hf_model(model_dir)(ids[None]).logits[0]
        pos = torch.arange(len(ids))
        whole = model.compute_logits(model(ids, pos, kv, group_metadata(layout, pos, len(ids), len(ids))))
        torch.testing.assert_close(whole, want, atol=1e-4, rtol=1e-4)
        kv.zero_()
        chunks, lo = [], 0
        for hi in ends:
            pos = torch.arange(lo, hi)
            chunks.append(model.compute_logits(model(ids[lo:hi], pos, kv, group_metadata(layout, pos, hi, len(ids)))))
            lo = hi
        torch.testing.assert_close(torch.cat(chunks), want, atol=1e-4, rtol=1e-4)


def assert_prefix_hits_and_preemption(model_dir: Path, blocks: int, caching: bool, preempts: bool,
                                      max_tokens: int) -> None:
    """Four prompts sharing a 30-token prefix (longer than the test models' windows) through the
    offline API with ``blocks`` KV blocks of 4 tokens: transformers' greedy tokens, a preemption
    exactly when ``preempts``, the prefix from the cache when ``caching``, every block back at the end."""
    from engine import LLM, SamplingParams

    base = random_prompts([30], seed=7)[0]
    prompts = [base + t for t in random_prompts([3, 9, 1, 14], seed=8)]
    m = hf_model(model_dir)
    want = hf_greedy(m, prompts, max_tokens)
    llm = LLM(str(model_dir), max_num_batched_tokens=32, num_gpu_blocks_override=blocks, block_size=4,
              enable_prefix_caching=caching)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert_greedy_match(m, prompts, want, [o.outputs[0].token_ids for o in outs])
    assert (llm.engine.scheduler.num_preemptions_total > 0) == preempts
    assert max(o.num_cached_tokens for o in outs) >= (24 if caching else 0)
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks


def _small_engine(model_dir: Path, dtype: str, device: str):
    """pdserve with a small cache and chunks of 64 tokens."""
    from engine import LLM

    return LLM(str(model_dir), dtype=dtype, device=device, block_size=16, kv_cache_memory="64MiB",
               max_num_batched_tokens=64, max_num_seqs=8)


def _teacher_forced_logprobs(model_dir: Path, dtype: torch.dtype, device: str,
                             sequences: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """transformers' logprob of each generated token given its prefix, over (prompt, generated)
    pairs, concatenated."""
    m = hf_model(model_dir, dtype, device)
    out = []
    with torch.no_grad():
        for prompt, generated in sequences:
            ids = torch.tensor([prompt + generated], device=device)
            lp = torch.log_softmax(m(ids).logits[0, len(prompt) - 1:-1].float(), -1)
            out.append(lp.gather(1, ids[0, len(prompt):, None])[:, 0].cpu())
    return torch.cat(out)


def assert_bf16_within_transformers_rounding(model_dir: Path, prompts: list[list[int]], device: str,
                                             max_tokens: int = 16, factor: float = 2.0) -> None:
    """pdserve in bf16 (greedy, each sampled token's logprob) against transformers on the same
    device, teacher-forced on pdserve's own tokens: at every generated position, how far
    pdserve's logprob of its token is from transformers' float32 one, against how far
    transformers' own bf16 is. The median and the 90th percentile of pdserve's errors must be
    within ``factor`` of transformers' bf16 errors (plus 1e-3).

    For models where bf16 rounding alone changes greedy tokens (a small random MoE, whose router
    flips an expert on a near-tie in either implementation), comparing free-running tokens asks
    which of two roundings chaos favours; each position here is conditioned on the same prefix,
    so one flip costs one position, not the rest of the sequence. The decode steps are pdserve's
    (CUDA graphs on the GPU)."""
    from engine import SamplingParams

    llm = _small_engine(model_dir, "bfloat16", device)
    outs = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                       ignore_eos=True, logprobs=0))]
    if device == "cuda":
        assert llm.engine.runner.graphs is not None  # decode steps replayed CUDA graphs
    sequences = [(p, list(out.token_ids)) for p, out in zip(prompts, outs)]
    want = _teacher_forced_logprobs(model_dir, torch.float32, device, sequences)
    theirs = _teacher_forced_logprobs(model_dir, torch.bfloat16, device, sequences)
    got = torch.tensor([lp.logprob for out in outs for lp in out.logprobs])
    err, ref = (got - want).abs(), (theirs - want).abs()
    for q in (0.5, 0.9):
        mine, bound = float(err.quantile(q)), factor * float(ref.quantile(q)) + 1e-3
        assert mine <= bound, (f"quantile {q} of |logprob - float32| over {len(err)} positions: {mine:.4g} against "
                               f"transformers' bf16 {float(ref.quantile(q)):.4g} (bound {bound:.4g})\n"
                               f"pdserve {err.tolist()}\ntransformers {ref.tolist()}")


def assert_gpu_greedy_match(reference: Path, served: Path, prompts: list[list[int]], dtype: str, tie: float,
                            relative: float, max_tokens: int = 16):
    """pdserve on CUDA (``served``: a checkpoint of the ``reference`` model, or that model itself)
    through CUDA graphs and chunks of 64 tokens, against transformers on the same GPU: float32
    within float32 rounding; bf16 within bf16 rounding of transformers' own bf16 arithmetic, up
    to where its bf16 tokens leave its float32 ones (past there bf16 rounding decides). Returns
    the engine."""
    from engine import SamplingParams

    m = hf_model(reference, getattr(torch, dtype), "cuda")
    want = hf_greedy(m, prompts, max_tokens)
    llm = _small_engine(served, dtype, "cuda")
    got = [o.outputs[0].token_ids
           for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]
    assert llm.engine.runner.graphs is not None  # decode steps replayed CUDA graphs
    if dtype == "bfloat16":
        stable = hf_greedy(hf_model(reference, torch.float32, "cuda"), prompts, max_tokens)
        cut = [next((i for i, (a, b) in enumerate(zip(w, s)) if a != b), len(w)) for w, s in zip(want, stable)]
        want, got = [w[:c] for w, c in zip(want, cut)], [g[:c] for g, c in zip(got, cut)]
    assert_greedy_match(m, prompts, want, got, tie=tie, relative=relative)
    return llm
