"""An adapter's identity is its files, weights included: adapter "x" loaded again from a
directory whose weights were retrained (``adapter_config.json`` byte for byte the same)
serves the new weights, PEFT's greedy tokens under the new adapter, not the old copy
still sitting in its device slot; and files that change under a registered adapter,
while its tensors are in neither the host cache nor a slot, are refused when a request
needs them ("changed since it was loaded"), until the adapter is loaded again."""
from __future__ import annotations

import re
import shutil

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from engine.request import RequestStatus
from tests.engine.families import assert_greedy_match, hf_greedy, make_family_model, random_prompts
from tests.engine.lora_adapters import make_adapter, peft_model

pytestmark = pytest.mark.slow
MAX_TOKENS = 10
SP = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The base model, two trainings of one adapter (same config, other weights) and
    PEFT's greedy tokens under each."""
    root = tmp_path_factory.mktemp("lora-identity")
    base = make_family_model(root / "base", "qwen3", seed=3)
    old = make_adapter(base, root / "old", seed=41, r=8, alpha=16, scale=2.0)
    new = make_adapter(base, root / "new", seed=42, r=8, alpha=16, scale=2.0)
    assert (old / CONFIG_FILE).read_bytes() == (new / CONFIG_FILE).read_bytes()
    assert (old / WEIGHTS_FILE).read_bytes() != (new / WEIGHTS_FILE).read_bytes()
    prompts = random_prompts([7, 19, 12], seed=5)
    refs = {"old": peft_model(base, old), "new": peft_model(base, new)}
    want = {k: hf_greedy(m, prompts, MAX_TOKENS) for k, m in refs.items()}
    assert want["old"] != want["new"]  # the retraining changes the answers
    return base, old, new, prompts, refs, want


def _retrain(directory, new) -> None:
    """The directory's weights replaced by the other training's (its config left alone)."""
    shutil.copy(new / WEIGHTS_FILE, directory / WEIGHTS_FILE)


def _tokens(llm: LLM, prompts, name: str) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, SP, lora_request=LoRARequest(name))]


def test_reload_with_retrained_weights_serves_the_new_weights(setup, tmp_path):
    base, old, new, prompts, refs, want = setup
    x = shutil.copytree(old, tmp_path / "x")
    llm = LLM(str(base), enable_lora=True, max_loras=1, kv_cache_memory="8MiB", block_size=4)
    lora = llm.engine.lora
    first = lora.register("x", str(x))
    got = _tokens(llm, prompts, "x")
    assert_greedy_match(refs["old"], prompts, want["old"], got)
    assert lora.held() == ["x"]  # the old weights sit in the one slot

    _retrain(x, new)
    second = lora.register("x", str(x))  # loaded again: same name, path and config
    got = _tokens(llm, prompts, "x")
    assert_greedy_match(refs["new"], prompts, want["new"], got)
    assert second.fingerprint != first.fingerprint
    # A fresh engine that only ever saw the new files agrees.
    fresh = LLM(str(base), enable_lora=True, max_loras=1, kv_cache_memory="8MiB", block_size=4)
    fresh.engine.lora.register("x", str(x))
    assert _tokens(fresh, prompts, "x") == got


def test_files_changed_since_loaded_are_refused_until_loaded_again(setup, tmp_path):
    """One slot and one host copy: "y" running pushes "x" out of both, so a request under
    "x" reads its directory again, and finds other weights there than were checked."""
    base, old, new, prompts, refs, want = setup
    x = shutil.copytree(old, tmp_path / "x")
    y = shutil.copytree(new, tmp_path / "y")
    llm = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, kv_cache_memory="8MiB", block_size=4)
    lora = llm.engine.lora
    loaded = lora.register("x", str(x))
    assert_greedy_match(refs["old"], prompts[:1], want["old"][:1], _tokens(llm, prompts[:1], "x"))
    lora.register("y", str(y))
    _tokens(llm, prompts[:1], "y")
    assert lora.held() == ["y"]

    _retrain(x, new)
    # The request under "x" ends with the reason; one under "y" beside it runs on (a step that
    # raised here stopped a server's engine loop, and every request after it).
    engine = llm.engine
    changed = engine.add_request("changed", prompts[0], SP, lora_name="x")
    other = engine.add_request("other", prompts[1], SP, lora_name="y")
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()
    assert changed.status is RequestStatus.FINISHED_ABORTED and changed.error is not None
    assert changed.error.kind == "lora" and changed.num_output_tokens == 0
    assert re.fullmatch(r"request changed: LoRA adapter 'x': the files at .* changed since it was loaded; "
                        r"load it again", changed.error.message), changed.error.message
    assert other.status is RequestStatus.FINISHED_LENGTH and other.num_output_tokens == MAX_TOKENS
    assert engine.stats().kv_blocks_used == 0
    assert lora.get("x") == loaded  # still registered as it was checked

    # Loaded again, the new files are served.
    again = LLM(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1, kv_cache_memory="8MiB", block_size=4)
    again.engine.lora.register("x", str(x))
    assert_greedy_match(refs["new"], prompts, want["new"], _tokens(again, prompts, "x"))
