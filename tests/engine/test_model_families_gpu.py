"""Every family in float32 and bfloat16 on the GPU, the Triton kernels (paged attention with
windows, fused MoE) and CUDA graphs against transformers' own bf16 forward on the
same GPU: greedy tokens equal up to a first difference where transformers' top two
logits are within bf16 rounding of each other. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from tests.engine.families import FAMILIES, assert_gpu_greedy_match, make_family_model, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("quick_moe_tuning")]
MAX_TOKENS = 16
# Wider than the CPU models, so bf16 rounding behaves as in real ones; head_dim 64.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=4, initializer_range=0.05)
OVERRIDES = {"qwen3-moe": dict(mlp_only_layers=[1], moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4),
             "qwen3-moe-sparse-step": dict(moe_intermediate_size=128), "mixtral": dict(num_local_experts=8),
             "gemma3": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                         "sliding_attention"], query_pre_attn_scalar=64),
             "phi3-longrope": dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                    "short_factor": [1.0 + 0.05 * i for i in range(32)],
                                                    "long_factor": [2.0 + 0.1 * i for i in range(32)]})}


# bf16: 8 bits of mantissa, so a step's rounding is about 0.4% of a value, and it adds up
# over the layers; transformers sums experts in bf16 where the fused kernel sums in float32.
@pytest.mark.parametrize("dtype, tie, relative", [("float32", 1e-4, 0.0), ("bfloat16", 0.02, 0.01)])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_on_gpu(tmp_path, name, dtype, tie, relative, request):
    """float32 (exact products in the kernels) within float32 rounding; bfloat16 within
    bf16 rounding of transformers' own bf16 arithmetic."""
    if name == "mixtral" and dtype == "bfloat16":
        # Seen on an H200: this random Mixtral is chaotic in bf16 (transformers' own bf16 tokens
        # leave its float32 ones at step 3 of one prompt; pdserve with the reference kernels,
        # transformers' arithmetic, leaves its bf16 ones at step 9), and on a 130-token prompt
        # pdserve's first bf16 token is transformers' second, 4% below its first. float32 is exact.
        request.applymarker(pytest.mark.xfail(reason="bf16 rounding decides this model's tokens", strict=False))
    d = make_family_model(tmp_path / name, name, seed=5, **SHAPE, **OVERRIDES.get(name, {}))
    # longrope: transformers re-rotates a whole sequence once it passes the original length
    # (64 here); pdserve rotates by position (engine/layers/rotary.py), so stay below it.
    lengths = [1, 7, 33, 40] if name == "phi3-longrope" else [1, 7, 33, 65, 130]
    prompts = random_prompts(lengths, seed=6)
    llm = assert_gpu_greedy_match(d, d, prompts, dtype, tie, relative, MAX_TOKENS)
    if llm.engine.runner.model.moe_layers():
        assert llm.engine.expert_load().sum() > 0
