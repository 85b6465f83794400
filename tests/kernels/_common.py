"""Device, dtypes and tolerances shared by the kernel tests."""
from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The interpreter's tl.dot on bfloat16 returns garbage, so bfloat16 runs on CUDA only.
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 needs CUDA (interpreter tl.dot)"),
    ),
]

# (atol, rtol) of a launcher against its reference.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (3e-2, 3e-2),
}


def has_compiler() -> bool:
    """Whether a C++ compiler (``$CXX``, else ``c++``) is on PATH: the CPU extensions can build."""
    cxx = os.environ.get("CXX", "c++").split()[0]
    return any(os.access(os.path.join(d, cxx), os.X_OK) for d in os.get_exec_path())
