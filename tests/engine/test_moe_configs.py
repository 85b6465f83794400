"""The fused MoE tile cache: keyed by every input, written once atomically, re-tuned when corrupt, off on CPU."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import triton

from engine import moe_configs

SHAPE = dict(num_experts=128, hidden=2048, intermediate=768, top_k=8, dtype=torch.bfloat16)
TILES = {"block_m": 16,
         "gemm1": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4},
         "gemm2": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4}}


class FakeTune:
    """Stands in for kernels.fused_moe.tune: records its calls, returns tiles that name the call."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, num_experts, hidden, intermediate, top_k, dtype, device) -> dict:
        self.calls.append((num_experts, hidden, intermediate, top_k, dtype, device))
        return {1: {**TILES, "block_m": 16}, 4096: {**TILES, "block_m": 64 + len(self.calls)}}


@pytest.fixture
def gpu_named(monkeypatch, tmp_path):
    """A pretend CUDA device (its name settable) and an empty cache directory."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    name = {"value": "NVIDIA H200"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name["value"])
    return name


def lookup(tune, **changes):
    args = {**SHAPE, **changes}
    return moe_configs.moe_kernel_config(args["num_experts"], args["hidden"], args["intermediate"], args["top_k"],
                                         args["dtype"], "cuda:0", tune_fn=tune)


def cached_files(tmp_path):
    return sorted(p.name for p in (tmp_path / "moe_configs").iterdir())


def test_none_off_cuda_and_nothing_tuned(gpu_named, tmp_path):
    tune = FakeTune()
    assert moe_configs.moe_kernel_config(*SHAPE.values(), torch.device("cpu"), tune_fn=tune) is None
    assert moe_configs.moe_kernel_config(*SHAPE.values(), "cpu", tune_fn=tune) is None
    assert tune.calls == [] and not (tmp_path / "moe_configs").exists()


def test_tuned_once_then_read_from_disk(gpu_named, tmp_path, caplog):
    tune = FakeTune()
    with caplog.at_level(logging.INFO, logger="engine.moe_configs"):
        first = lookup(tune)
    assert len(tune.calls) == 1 and tune.calls[0][-1] == torch.device("cuda:0")
    assert first == {1: TILES, 4096: {**TILES, "block_m": 65}}
    assert "tuned in" in caplog.text
    key = moe_configs.config_key(128, 2048, 768, 8, torch.bfloat16, "NVIDIA H200", triton.__version__)
    assert cached_files(tmp_path) == [f"{key}.json"]  # no temporary file left behind
    assert json.loads((tmp_path / "moe_configs" / f"{key}.json").read_text())["4096"]["block_m"] == 65
    assert lookup(tune) == first and len(tune.calls) == 1


def test_key_changes_with_every_field(gpu_named, tmp_path, monkeypatch):
    tune = FakeTune()
    lookup(tune)
    variants = [dict(num_experts=64), dict(hidden=4096), dict(intermediate=384), dict(top_k=4),
                dict(dtype=torch.float16)]
    for change in variants:
        lookup(tune, **change)
    gpu_named["value"] = "NVIDIA H100 80GB HBM3"
    lookup(tune)
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    lookup(tune)
    assert len(tune.calls) == 2 + len(variants) + 1
    assert len(cached_files(tmp_path)) == len(tune.calls)
    assert any("NVIDIA-H100-80GB-HBM3" in name and "triton-9.9.9" in name for name in cached_files(tmp_path))


@pytest.mark.parametrize("content", ["{not json", "[]", "{}", '{"x": {}}', '{"8": {"block_m": 16}}', ""])
def test_corrupt_file_is_tuned_again_and_replaced(gpu_named, tmp_path, content):
    tune = FakeTune()
    lookup(tune)
    (path,) = (tmp_path / "moe_configs").iterdir()
    path.write_text(content)
    assert lookup(tune)[4096]["block_m"] == 66
    assert len(tune.calls) == 2
    assert json.loads(path.read_text())["4096"]["block_m"] == 66
    assert lookup(tune)[4096]["block_m"] == 66 and len(tune.calls) == 2


def test_unusable_tune_result_is_not_cached(gpu_named, tmp_path):
    with pytest.raises(ValueError, match="tune_fn"):
        lookup(lambda *args: {})
    assert not (tmp_path / "moe_configs").exists() or cached_files(tmp_path) == []


def test_fp8_weights_keyed_by_dtype_and_scale_blocks(gpu_named, tmp_path):
    # FP8 experts tune apart from 16-bit ones, and block-scaled apart from per channel;
    # the block size reaches tune_fn as a keyword (16-bit lookups call it as before).
    seen: list[dict] = []

    def tune(*args, **kw):
        seen.append(kw)
        return FakeTune()(*args)

    fp8 = torch.float8_e4m3fn
    lookup(tune)
    lookup(tune, dtype=fp8)
    moe_configs.moe_kernel_config(*list(SHAPE.values())[:4], fp8, "cuda:0", tune_fn=tune, block_size=(128, 128))
    assert seen == [{}, {}, {"block_size": (128, 128)}]
    key = moe_configs.config_key(128, 2048, 768, 8, fp8, "NVIDIA H200", triton.__version__, (128, 128))
    assert "_float8_e4m3fn-block128x128_" in key
    assert len(cached_files(tmp_path)) == 3 and f"{key}.json" in cached_files(tmp_path)
