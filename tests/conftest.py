"""Shared fixtures: tiny random-weight models written as Hugging Face
directories, and the converted default model."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch (OpenMP) thread in the test process and everything it starts (tensor-parallel
# ranks, converters, servers): the suite's engines share two cores with each other, and
# OpenMP threads that spin-wait for a descheduled sibling make a small model's forward
# pass ten times slower or worse. Set before torch is imported, which reads it once.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton fixes interpreter mode when a kernel is decorated: set it before any
# test module imports kernels/ (directly or through the engine).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests.triton_interpreter import install

        install()
    if os.environ["OMP_NUM_THREADS"].isdigit():  # in case a plugin imported torch first
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except ImportError:  # pragma: no cover
    pass


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random tiny GQA decoder (transformers' own init) to ``path``."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)

    kw = dict(vocab_size=384, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
              num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    model.save_pretrained(str(path))
    return path


def offline_greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """A request's greedy tokens computed in one offline engine, nothing transferred: what a
    cluster streams for it when nothing is lost (and not paced as a test's decode servers are)."""
    from engine.config import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), kv_cache_memory="8MiB"))
    ref = engine.add_request("ref", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return ref.output_token_ids


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.model_files import ensure_default_model

    return ensure_default_model()


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``make test`` runs two workers, ``--dist loadgroup``), each worker
    takes whole modules, so a module's fixtures start once; the gateway tests that share the
    session's gateway processes (tests/gateway/conftest.py), and the e2e modules that share
    ``hermes_cluster`` (tests/e2e/conftest.py), go to one worker together."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        shares_gateways = module.startswith("tests/gateway/") and "_cluster_processes" in item.fixturenames
        group = ("gateway-cluster" if shares_gateways else
                 "hermes-cluster" if "hermes_cluster" in item.fixturenames else module)
        item.add_marker(pytest.mark.xdist_group(group))


# No server outlives the suite. Each process tests/processes.py starts is in a process group
# of its own (its children with it) and registered there. A fixture whose setup raises, or a
# test that fails, has what it started and left running killed (group and all) at once; at the
# end of the session (in each pytest-xdist worker, after every fixture's teardown) whatever
# those helpers started and is still alive is killed, and the session fails naming it.
def _started_count() -> int:
    import sys

    processes = sys.modules.get("tests.processes")  # not imported: nothing started
    return len(processes.started_processes()) if processes else 0


def _kill_started_since(count: int) -> None:
    import sys

    processes = sys.modules.get("tests.processes")
    if processes is not None:
        for p in processes.started_processes()[count:]:
            if p.group_alive():
                p.kill()


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = _started_count()
    outcome = yield
    if outcome.excinfo is not None:  # its teardown will not run: stop what it started
        _kill_started_since(before)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    before = _started_count()
    outcome = yield
    if outcome.excinfo is not None:
        _kill_started_since(before)


def _leak_report(alive: dict) -> str:
    return "servers started by the tests still alive at the end of the session (killed now):\n" + "\n".join(
        f"  {p.name}: pids {pids} (group {p.proc.pid}): {' '.join(p.argv[1:])}" for p, pids in alive.items())


@pytest.fixture(scope="session", autouse=True)
def _no_server_outlives_the_session():
    """Set up before, so torn down after, every other session fixture."""
    yield
    import sys

    processes = sys.modules.get("tests.processes")
    if processes is not None and (alive := processes.kill_all()):
        pytest.fail(_leak_report(alive), pytrace=False)


def pytest_sessionfinish(session, exitstatus) -> None:
    """The last word (a process started after the fixture above was torn down, or a run
    interrupted before it): kill, report, and fail the session."""
    import sys

    processes = sys.modules.get("tests.processes")
    if processes is not None and (alive := processes.kill_all()):
        sys.stderr.write("\n" + _leak_report(alive) + "\n")
        if session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
