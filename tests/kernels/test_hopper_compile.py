"""The fused glue kernels (with RoPE, which shares their rotation, and the gated RMSNorm,
which reads its gate in place) compile for a Hopper GPU (sm_90) on a machine without
one: Triton's ahead-of-time path (its bundled ptxas) takes each
kernel through every stage a launch would, in a child process without TRITON_INTERPRET (the
interpreter, which runs the kernel tests on CPU, accepts code the GPU compiler refuses: this
catches that before a GPU sees it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.processes import REPO

CHILD = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.activation import _act_mul_kernel
from kernels.gated_delta import _gated_rms_norm_kernel
from kernels.rms_norm import _rms_norm_kernel
from kernels.rope import _qk_norm_rope_kernel, _rope_kernel

def build(fn, constexprs, types):
    # the arguments not in constexprs: typed by types, else pointers to bf16 and 32-bit ints
    signature = {n: "constexpr" if n in constexprs else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
                 for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()})
    return bool(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm.get("cubin"))

rope_types = {"cos_sin_ptr": "*fp32", "positions_ptr": "*i64", "eps": "fp32"}
cases = {
    # Gemma 4's: the whole head turned, V normed, w in float32
    "qk_norm_rope gemma4": (_qk_norm_rope_kernel, dict(
        NUM_Q_HEADS=8, NUM_K_HEADS=1, HEAD_DIM=256, HALF=128, BLOCK_HQ=8, BLOCK_HK=1, BLOCK_HALF=128, BLOCK_REST=1,
        OFFSET=False, FLOAT32_WEIGHT=True, HAS_K=True, NORM_V=True), rope_types),
    # Qwen3.5's gated attention: a quarter of the head turned, 1 + w
    "qk_norm_rope qwen3.5": (_qk_norm_rope_kernel, dict(
        NUM_Q_HEADS=16, NUM_K_HEADS=2, HEAD_DIM=256, HALF=32, BLOCK_HQ=16, BLOCK_HK=2, BLOCK_HALF=32, BLOCK_REST=128,
        OFFSET=True, FLOAT32_WEIGHT=False, HAS_K=True, NORM_V=False), rope_types),
    # RoPE alone, turning heads as the fused kernel does (one helper)
    "rotary_embedding": (_rope_kernel, dict(
        NUM_Q_HEADS=32, NUM_K_HEADS=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64), rope_types),
    "rms_norm_add_norm": (_rms_norm_kernel, dict(
        HIDDEN=1536, BLOCK_H=2048, ADD_RESIDUAL=False, OFFSET=False, FLOAT32_WEIGHT=True, ADD_AFTER=True,
        HAS_SCALE=True, NORM_AFTER=True), {"eps": "fp32"}),
    "gated_activation gelu_tanh": (_act_mul_kernel, dict(HEADS=1, BLOCK=1024, ACTIVATION="gelu_tanh"), {}),
    "gated_activation sigmoid": (_act_mul_kernel, dict(HEADS=16, BLOCK=256, ACTIVATION="sigmoid"), {}),
    # Qwen3.5's DeltaNet output norm, [T, Hv, Dv] views of the stacked projection
    "gated_rms_norm": (_gated_rms_norm_kernel, dict(D=128, BLOCK_D=128, BLOCK_R=16, PROD_DTYPE=tl.bfloat16),
                       {"eps": "fp32"}),
}
print(json.dumps({name: build(*case) for name, case in cases.items()}))
"""


def test_fused_glue_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-4000:]
    built = json.loads(child.stdout.strip().splitlines()[-1])
    assert built and all(built.values()), built
