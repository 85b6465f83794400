"""Fixtures the engine tests share."""
from __future__ import annotations

import pytest


@pytest.fixture
def quick_moe_tuning(tmp_path, monkeypatch):
    """A small real tune of the fused MoE kernel (few token counts, one candidate each) into a
    fresh cache: the GPU tests check tokens, not the tiles' speed."""
    import functools
    import importlib

    module = importlib.import_module("kernels.fused_moe")  # `kernels.fused_moe` is also the launcher's name
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "tune", functools.partial(module.tune, token_counts=(1, 8, 64), max_candidates=1,
                                                          rep_ms=2))
