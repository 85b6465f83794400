"""The kernels package is a leaf: torch, triton and the standard library only."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kernels"
PROJECT_PACKAGES = {"engine", "gateway", "prefill_service", "decode_service", "pdserve", "bench", "tests"}
ALLOWED_IMPORTS = {"__future__", "torch", "triton", "kernels", "os", "functools", "math", "typing", "dataclasses",
                   "logging", "threading", "time", "fcntl", "sys", "argparse", "hashlib", "importlib", "types"}


def test_import_pulls_in_no_project_package():
    # A fresh interpreter: this one has already imported the test packages.
    code = (
        "import json, sys, kernels\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    imported = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert not imported & PROJECT_PACKAGES


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cpu_tensors_without_interpreter_get_a_clear_error():
    code = (
        "import torch, kernels\n"
        "try:\n"
        "    kernels.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert "rms_norm: Triton kernels need CUDA tensors" in done.stdout
    assert "kernels.reference" in done.stdout


def test_modules_import_only_torch_triton_and_stdlib():
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        first = tree.body[1] if ast.get_docstring(tree) else tree.body[0]
        assert ast.unparse(first) == "from __future__ import annotations", f"{path.name}: future import first"
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] in ALLOWED_IMPORTS, f"{path.name} imports {name}"


def test_public_api():
    launchers = {
        "store_kv_cache", "paged_attention", "rms_norm", "fused_add_rms_norm", "rms_norm_add", "rms_norm_add_norm",
        "rotary_embedding", "qk_norm_rope", "silu_and_mul", "gated_activation",
        "fused_moe", "moe_route", "int4_gemm", "fp8_gemm", "fp8_quantize", "lora_group", "lora_shrink", "lora_expand",
        "causal_conv1d", "gated_delta_rule", "gated_rms_norm", "gdn_gating",  # Gated DeltaNet (kernels/gated_delta.py)
    }
    assert launchers | {"reference", "describe_kernels"} == set(kernels.__all__)
    for name in [*launchers, "describe_kernels"]:
        assert callable(getattr(kernels, name)) and callable(getattr(kernels.reference, name))


def test_describe_kernels_names_what_serves_a_step():
    """The model runner's start-up line ("kernels: ..."): on the CPU the compiled attention
    (or the reference, with the reason) and oneDNN's float32 GEMMs, not just a module name."""
    from kernels import cpu_attention, cpu_gemm

    cpu = torch.device("cpu")
    attention = ("compiled (kernels/cpu_attention.py)" if cpu_attention.extension() is not None
                 else f"PyTorch reference ({cpu_attention.unavailable_reason()})")
    gemms = "oneDNN's" if cpu_gemm.onednn_available() else "torch's F.linear"
    rest = "norms, RoPE and activations PyTorch (kernels.reference)"
    assert kernels.reference.describe_kernels(cpu, torch.float32) == f"attention {attention}, GEMMs {gemms}, {rest}"
    assert (kernels.reference.describe_kernels(cpu, torch.bfloat16)
            == f"attention {attention}, GEMMs torch's F.linear, {rest}")
    assert (kernels.reference.describe_kernels(torch.device("cuda", 0), torch.bfloat16)
            == "PyTorch references (kernels.reference), GEMMs torch's")
    from kernels import cpu_ops  # what a CPU step runs ("auto"): its norms and RoPE compiled

    glue = ("norms, RoPE and SiLU-and-mul compiled (kernels/cpu_ops.py)" if cpu_attention.extension() is not None
            else rest)
    assert cpu_ops.describe_kernels(cpu, torch.float32) == f"attention {attention}, GEMMs {gemms}, {glue}"
    assert kernels.describe_kernels(torch.device("cuda", 0), torch.bfloat16) == (
        "Triton (attention, norms, RoPE, activations, MoE, FP8 and int4 GEMMs; kernels/), 16-bit and float32 GEMMs "
        "torch's (cuBLAS)")
