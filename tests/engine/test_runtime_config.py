"""The runtime config (engine/runtime_config.py): every switch of a step's path typed, read
from the environment in that module only and once, shown in the engine's config line; the
test-only mode impossible to inherit; no other module reads a PDSERVE_* variable but
secrets and file locations."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.runtime_config import RuntimeConfig, parse_mixed_graph_sizes

REPO = Path(__file__).resolve().parents[2]
# Read outside engine/runtime_config.py on purpose: secrets and file locations.
ALLOWED_ELSEWHERE = {"PDSERVE_API_KEY", "PDSERVE_KV_SECRET", "PDSERVE_CACHE_DIR", "PDSERVE_TRACES_FILE"}
PACKAGES = ("engine", "kernels", "rpc", "gateway", "prefill_service", "decode_service", "pdserve")


def test_from_env_reads_every_switch():
    env = {"PDSERVE_KERNELS": "reference", "PDSERVE_MIXED_GRAPHS": "512, 256,512", "PDSERVE_OVERLAP_MIXED_STEPS": "0",
           "PDSERVE_DECODE_BLAS": "8:cublaslt,256:cublas", "PDSERVE_DENSE_PREFILL": "0",
           "PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT": "30"}
    rc = RuntimeConfig.from_env(env, enforce_eager=True)
    assert rc == RuntimeConfig(enforce_eager=True, kernels="reference", mixed_graph_sizes=(256, 512),
                               overlap_mixed_steps=False, decode_blas="8:cublaslt,256:cublas", dense_prefill=False,
                               cpu_attention_build_timeout=30.0)
    assert RuntimeConfig.from_env({}) == RuntimeConfig()
    assert RuntimeConfig.from_env({"PDSERVE_MIXED_GRAPHS": "0"}).mixed_graph_sizes == ()
    assert RuntimeConfig.from_env({"PDSERVE_OVERLAP_MIXED_STEPS": "1"}).overlap_mixed_steps is True
    # a flag (a field passed in) wins over the environment
    assert RuntimeConfig.from_env({"PDSERVE_MIXED_GRAPHS": "16"}, mixed_graph_sizes=(32,)).mixed_graph_sizes == (32,)


def test_every_resolved_switch_shows_in_the_config_line():
    line = RuntimeConfig.from_env({"PDSERVE_MIXED_GRAPHS": "256,512", "PDSERVE_DENSE_PREFILL": "0"}).describe()
    for part in ("enforce_eager=False", "async_scheduling=True", "kernels=auto", "mixed_graphs=256,512",
                 "overlap_mixed_steps=default", "decode_blas=default", "dense_prefill=False"):
        assert part in line, line
    assert "mixed_graphs=0" in RuntimeConfig(mixed_graph_sizes=()).describe()


@pytest.mark.parametrize("env, message", [
    ({"PDSERVE_KERNELS": "cuda-graphs"}, "PDSERVE_KERNELS must be one of auto, triton, reference"),
    ({"PDSERVE_MIXED_GRAPHS": "4,x"}, "PDSERVE_MIXED_GRAPHS must be token counts"),
    ({"PDSERVE_MIXED_GRAPHS": "-4"}, "PDSERVE_MIXED_GRAPHS must be positive"),
    ({"PDSERVE_DECODE_BLAS": "cublass"}, "PDSERVE_DECODE_BLAS"),
    ({"PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT": "soon"}, "PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT must be a number"),
    ({"PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT": "-1"}, "PDSERVE_CPU_ATTENTION_BUILD_TIMEOUT must be a positive"),
    ({"PDSERVE_DECODE_GRAPHS": "eager"}, "PDSERVE_DECODE_GRAPHS is no longer read"),
])
def test_a_bad_or_removed_variable_is_refused_naming_it(env, message):
    with pytest.raises(ValueError, match=message):
        RuntimeConfig.from_env(env)


def test_the_test_mode_comes_from_code_only():
    """graphs_without_capture has no variable: only a field set by code (or an engine server's
    hidden flag) turns it on, so a served process cannot inherit it."""
    assert RuntimeConfig.from_env({"PDSERVE_GRAPHS_WITHOUT_CAPTURE": "1"}).graphs_without_capture is False
    assert RuntimeConfig.from_env({}, graphs_without_capture=True).graphs_without_capture is True
    assert parse_mixed_graph_sizes(" ") == ()


def _pdserve_reads(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each PDSERVE_* name in a file, as a string constant or as the value of a
    module-level constant, where the file reads the environment (os.environ / os.getenv)."""
    text = path.read_text()
    if "environ" not in text and "getenv" not in text:
        return []
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("PDSERVE_") \
                and node.value.replace("_", "").isalnum() and node.value.isupper():
            found.append((node.lineno, node.value))
    return found


def test_no_pdserve_variable_is_read_outside_the_runtime_config():
    """Every PDSERVE_* name in a module that reads the environment is a secret or a file
    location, unless the module is engine/runtime_config.py. (A module that only names a
    variable in a message, without touching the environment, is fine.)"""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path == REPO / "engine" / "runtime_config.py":
                continue
            for line, name in _pdserve_reads(path):
                if name not in ALLOWED_ELSEWHERE:
                    bad.append(f"{path.relative_to(REPO)}:{line}: {name}")
    assert not bad, "PDSERVE_* variables read outside engine/runtime_config.py:\n" + "\n".join(bad)


def test_nothing_sets_the_process_environment_at_import():
    """Importing the engine and the KV transfer leaves os.environ as it was (a pair's NCCL
    setting is set around the group's build only)."""
    import os
    import subprocess
    import sys

    code = ("import os, json; before = dict(os.environ); import engine.llm_engine, kv_transfer.pair, "
            "engine.parallel, rpc.engine_server; after = dict(os.environ); "
            "print(json.dumps(sorted(set(after.items()) ^ set(before.items()))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "TORCH_NCCL_BLOCKING_WAIT"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
