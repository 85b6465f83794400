"""The Triton kernels inside a real forward pass, on CPU: a child process
with TRITON_INTERPRET=1 (fixed when triton.jit decorates the kernels, so it
must be set before anything imports kernels/) and PDSERVE_KERNELS=triton
runs the offline engine on a tiny float32 GQA model, with chunked prefill
and mixed prefill/decode batches, and must produce transformers' greedy
tokens exactly. Every launcher must have run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import make_tiny_model
from tests.processes import REPO

# Shapes kept tiny: the interpreter runs each Triton program in NumPy, one after another.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
PROMPT_LENS = (1, 6, 19)
MAX_TOKENS = 6

CHILD = r"""
import json, sys
from tests.triton_interpreter import install
install()
import kernels
from engine import LLM, SamplingParams

model_dir, prompts, max_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
calls = {}
for name in ("store_kv_cache", "paged_attention", "rms_norm", "fused_add_rms_norm", "rms_norm_add",
             "rms_norm_add_norm", "rotary_embedding", "qk_norm_rope", "silu_and_mul", "gated_activation", "moe_route",
             "fused_moe", "causal_conv1d", "gated_delta_rule", "gated_rms_norm", "gdn_gating"):
    def counted(*args, _name=name, _fn=getattr(kernels, name), **kwargs):
        calls[_name] = calls.get(_name, 0) + 1
        return _fn(*args, **kwargs)
    setattr(kernels, name, counted)
# A budget of 8 tokens splits the 19-token prompt into chunks that share steps with decodes.
llm = LLM(model_dir, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8,
          kv_cache_memory="4MiB")
out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
print(json.dumps({"ops": llm.engine.runner.ops.__name__, "calls": calls,
                  "tokens": [o.outputs[0].token_ids for o in out]}))
"""


def _hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        o = hf.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                        attention_mask=torch.ones_like(ids))
        outs.append(o[0, len(p):].tolist())
    return outs


def _run_interpreted(model_dir, prompts: list[list[int]]) -> dict:
    """The offline engine in a child process on the interpreted Triton kernels: which ops
    ran, how often each launcher was called, the greedy tokens."""
    env = dict(os.environ, TRITON_INTERPRET="1", PDSERVE_KERNELS="triton", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    child = subprocess.run([sys.executable, "-c", CHILD, str(model_dir), json.dumps(prompts), str(MAX_TOKENS)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


def test_triton_kernels_in_the_forward_pass_match_transformers(tmp_path):
    model_dir = make_tiny_model(tmp_path / "tiny", seed=7, **TINY)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist() for n in PROMPT_LENS]
    result = _run_interpreted(model_dir, prompts)
    assert result["ops"] == "kernels"  # the Triton package, not kernels.reference
    num_layers = TINY["num_hidden_layers"]
    assert set(result["calls"]) == {"store_kv_cache", "paged_attention", "rms_norm", "fused_add_rms_norm",
                                    "rotary_embedding", "silu_and_mul"}
    assert result["calls"]["paged_attention"] % num_layers == 0 and result["calls"]["paged_attention"] > num_layers
    assert result["tokens"] == _hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("family, kernels_run", [
    ("qwen3-moe", {"moe_route", "fused_moe", "paged_attention", "qk_norm_rope"}),  # routing, experts, q/k norms
    ("gemma3", {"paged_attention", "store_kv_cache", "qk_norm_rope",  # windowed and full layers,
                "rms_norm", "fused_add_rms_norm"}),  # and the (1 + w) norms
])
def test_triton_kernels_in_new_families_match_transformers(tmp_path, family, kernels_run):
    from tests.engine.families import hf_greedy, hf_model, make_family_model, random_prompts

    model_dir = make_family_model(tmp_path / family, family, seed=3, hidden_size=32, intermediate_size=48,
                                  head_dim=8, num_hidden_layers=3, moe_intermediate_size=16)
    prompts = random_prompts([1, 6, 19], seed=4)  # 19 > the window of 8
    result = _run_interpreted(model_dir, prompts)
    assert result["ops"] == "kernels" and kernels_run <= set(result["calls"])
    assert result["tokens"] == hf_greedy(hf_model(model_dir), prompts, MAX_TOKENS)


def test_triton_kernels_in_a_hybrid_model_match_transformers(tmp_path):
    """Qwen3.5's Gated DeltaNet layers (conv, delta rule, gated norm, gating), its (1 + w)
    norms and its gated attention (q/k norms with partial RoPE, the output gate) through the
    Triton kernels, chunked prefill beside decodes."""
    from tests.engine.families import hf_greedy, hf_model, random_prompts
    from tests.engine.test_qwen3_next import make_checkpoint

    model_dir = make_checkpoint(tmp_path / "qwen3.5", "qwen3.5", seed=5)
    prompts = random_prompts([1, 6, 19], seed=4)
    result = _run_interpreted(model_dir, prompts)
    assert result["ops"] == "kernels"
    assert {"causal_conv1d", "gated_delta_rule", "gated_rms_norm", "gdn_gating", "rms_norm",
            "fused_add_rms_norm", "paged_attention", "qk_norm_rope", "gated_activation"} <= set(result["calls"])
    assert result["tokens"] == hf_greedy(hf_model(model_dir), prompts, MAX_TOKENS)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_triton_kernels_in_gemma4_match_transformers(tmp_path, variant):
    """Gemma 4's norms (w in float32; after the attention, the MLP and the per-layer input, the
    residual added in the same call, with the layer scalar and the next norm), q/k/V norms with
    RoPE in one call, the per-layer input's gate, KV-sharing layers, the experts beside the MLP."""
    from tests.engine.families import hf_greedy, hf_model, random_prompts
    from tests.engine.test_gemma4 import make_gemma4

    model_dir = make_gemma4(tmp_path / variant, variant, seed=2)
    prompts = random_prompts([1, 6, 19], seed=4)  # 19 > the window of 8
    result = _run_interpreted(model_dir, prompts)
    assert result["ops"] == "kernels"
    assert {"rms_norm_add_norm", "qk_norm_rope", "gated_activation", "paged_attention",
            "store_kv_cache"} <= set(result["calls"])
    assert result["tokens"] == hf_greedy(hf_model(model_dir), prompts, MAX_TOKENS)


def test_kernel_choice_is_validated(monkeypatch):
    from engine.model_runner import select_ops

    cpu = torch.device("cpu")
    assert select_ops(cpu, "auto").__name__ == "kernels.cpu_ops"  # the references with compiled CPU parts
    assert select_ops(cpu, "reference").__name__ == "kernels.reference"
    with pytest.raises(ValueError, match="PDSERVE_KERNELS must be one of auto, triton, reference"):
        select_ops(cpu, "cuda-graphs")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs Triton's interpreter: set TRITON_INTERPRET=1"):
        select_ops(cpu, "triton")
