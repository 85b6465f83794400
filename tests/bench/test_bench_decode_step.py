"""`pdserve bench decode-step` and its transformers peer run end to end on
CPU (the figures come from GPUs; here the code paths)."""
from __future__ import annotations

import json

from pdserve.cli import main


def test_decode_step_and_its_peer(tiny_llama_dir, tmp_path):
    ours, peer = tmp_path / "ours.json", tmp_path / "peer.json"
    common = ["bench", "decode-step", "--model", str(tiny_llama_dir), "--batch-sizes", "1,3",
              "--context-len", "20", "--steps", "3"]
    assert main([*common, "--kv-cache-memory", "16MiB", "--max-model-len", "128", "--profile", "2",
                 "--output-json", str(ours)]) == 0
    assert main([*common, "--peer", "transformers", "--output-json", str(peer)]) == 0
    a, b = json.loads(ours.read_text()), json.loads(peer.read_text())
    for size in ("1", "3"):
        assert a["steps"][size]["rows"] == [int(size)] and a["steps"][size]["median_ms"] > 0
        prof = a["steps"][size]["profile"]
        assert prof["gpu_busy_ms"] == 0 and prof["top_host_ops_ms"] and prof["top_python_ms"]
        assert b["steps"][size]["median_ms"] > 0 and b["steps"][size]["context"][0] > 20
    assert b["peer"] == "transformers" and not b["compiled"]
