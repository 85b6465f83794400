"""A Triton compile after start-up is logged (it stalls the step that meets it)."""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_compile_after_start_up_is_logged_and_a_cached_kernel_is_not(caplog):
    from kernels import compiles, rms_norm

    compiles.watch(logging.getLogger("pdserve-test"))
    caplog.set_level(logging.INFO, logger="pdserve-test")
    x = torch.randn(3, 4000 + torch.randint(1, 999, ()).item(), device="cuda")  # a width no one compiled
    w = torch.ones(x.shape[1], device="cuda")
    n = compiles.count
    rms_norm(x, w, 1e-6)
    assert compiles.count == n + 1 and "compiled _rms_norm_kernel after start-up" in caplog.text
    rms_norm(x, w, 1e-6)
    assert compiles.count == n + 1
