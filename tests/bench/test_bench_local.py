"""`pdserve bench local` runs end to end on CPU: fresh measuring processes, the streamed
tokens the offline engine gives the same prompt, the medians (llama.cpp is left out here:
llama-cpp-python is not a test dependency)."""
from __future__ import annotations

import json

from pdserve.cli import main


def test_local_bench_streams_the_engines_greedy_tokens(default_model_dir, tmp_path):
    from engine import LLM, SamplingParams
    from engine.tokenizer import apply_chat_template, load_tokenizer

    out = tmp_path / "local.json"
    assert main(["bench", "local", "--model", str(default_model_dir), "--skip-llama-cpp",
                 "--repeats", "1", "--output-len", "6", "--threads", "1", "--batch", "2", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    runs = result["runs"]["pdserve"]
    assert len(runs) == 1 and set(result["summary"]) == {"pdserve"}
    s = result["summary"]["pdserve"]
    assert s["gen_tok_s"] > 0 and s["ttft_ms"] > 0 and s["peak_rss_mib"] > 100 and s["batch_tok_s"] > 0
    prompt = apply_chat_template(load_tokenizer(default_model_dir),
                                 [{"role": "user", "content": "Write a short story about a lighthouse keeper."}])
    assert result["prompt_tokens"] == len(prompt)
    want = LLM(str(default_model_dir), device="cpu", dtype="float32", kv_cache_memory="16MiB").generate(
        [list(prompt)], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    assert [r["token_ids"] for r in runs] == [list(want)]
