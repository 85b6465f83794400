"""`pdserve bench throughput` runs end to end on CPU: fixed-length requests submitted at once, each
generating exactly its output length (the default model); TensorRT-LLM's rows picked and scaled,
with no comparison where the device is not one it publishes figures for (a tiny random model long
enough for the rows' lengths: what is checked there is the rows, not the model)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main
from tests.conftest import make_tiny_model
from tests.processes import REPO


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory) -> Path:
    """The tiny model with room for the longest row used here (128 + 2048 tokens)."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-4k"), max_position_embeddings=4096)


def test_fixed_lengths_all_at_once(default_model_dir, tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(default_model_dir), "--device", "cpu",
                 "--kv-cache-memory", "32MiB", "--input-len", "24", "--output-len", "5", "--num-prompts", "6",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["input_len"], row["output_len"], row["num_prompts"], row["output_tokens"]) == (24, 5, 6, 30)
    assert row["output_tokens_per_s"] > 0 and result["gpu"] is None and "ratio_to_trtllm" not in row


def test_the_trtllm_rows_scaled(long_tiny_dir, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--model", str(long_tiny_dir), "--device", "cpu",
                 "--kv-cache-memory", "32MiB", "--trtllm-table", "--rows", "128/128", "--num-prompts-scale",
                 "0.00004", "--output-json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["input_len"], row["output_len"], row["num_prompts"], row["trtllm_requests"]) == (128, 128, 1, 30000)
    assert row["output_tokens"] == 128 and row["trtllm"] == {"H200": 28447, "H100": 27569}
    assert "no TensorRT-LLM figure for cpu" in capsys.readouterr().out
    # a row it does not publish: refused before any engine loads
    assert main(["bench", "throughput", "--model", str(long_tiny_dir), "--trtllm-table", "--rows", "100/100"]) == 2
    assert "not in TensorRT-LLM's table" in capsys.readouterr().err


def test_a_run_cut_off_keeps_the_rows_it_finished(long_tiny_dir, tmp_path):
    """Killed in its second row (as a device's time limit kills it), the results file holds the first."""
    out = tmp_path / "t.json"
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "bench", "throughput", "--model",
                             str(long_tiny_dir), "--device", "cpu", "--kv-cache-memory", "32MiB", "--trtllm-table",
                             "--rows", "128/128,128/2048", "--num-prompts-scale", "0.00004", "--output-json", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("ISL   128 OSL   128"):
                break
        else:
            raise AssertionError(f"no first row (exit {proc.wait()})")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["input_len"], row["output_len"], row["output_tokens"]) == (128, 128, 128)
