"""Device, dtypes and tolerances shared by the kernel tests."""
from __future__ import annotations

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
