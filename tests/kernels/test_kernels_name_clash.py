"""Our top-level ``kernels`` package must not pass for Hugging Face's ``kernels`` library.

``transformers`` probes for a package importable as ``kernels`` and, if it
believes it is HF's at a viable version, imports hub kernels from it. Its probe
(``transformers.utils.import_utils._is_package_available``) takes the version
from the distribution that ships ``kernels``, which for us is ``pdserve``; with
no distribution metadata (repo on ``PYTHONPATH`` only) it imports ``kernels`` and
reads ``__version__``. So the probe stays False only while:

- pdserve's version lies outside transformers' accepted range
  ``[KERNELS_MIN_VERSION, KERNELS_MAX_VERSION)``, and
- our ``kernels`` package defines no ``__version__``.

These tests pin both, and that loading a model through transformers still works.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
OUR_KERNELS = REPO_ROOT / "kernels"


def _pdserve_installed() -> bool:
    try:
        importlib.metadata.distribution("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_kernels_name_resolves_to_our_package() -> None:
    spec = importlib.util.find_spec("kernels")
    assert spec is not None
    locations = [Path(p).resolve() for p in (spec.submodule_search_locations or [])]
    assert OUR_KERNELS.resolve() in locations, (
        f"`kernels` resolves to {spec.origin or locations}, not {OUR_KERNELS}: is Hugging Face's `kernels` "
        "library installed in this environment? It and our package cannot share one interpreter."
    )


def test_transformers_does_not_take_our_kernels_for_hf_kernels() -> None:
    from transformers.utils import import_utils

    import_utils.is_kernels_available.cache_clear()  # it is lru_cached; probe afresh
    assert import_utils.is_kernels_available() is False


def test_our_kernels_package_has_no_version_attribute() -> None:
    # Without distribution metadata transformers imports `kernels` and reads
    # `__version__`; a pdserve-style "0.18.x" there would switch hub kernels on.
    import kernels

    assert not hasattr(kernels, "__version__")


@pytest.mark.skipif(not _pdserve_installed(), reason="pdserve is not installed (run `make install`)")
def test_installed_pdserve_version_is_outside_transformers_kernels_range() -> None:
    from packaging.version import Version
    from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

    owners = importlib.metadata.packages_distributions().get("kernels", [])
    assert "pdserve" in owners, owners
    ours = Version(importlib.metadata.version("pdserve"))
    assert not Version(KERNELS_MIN_VERSION) <= ours < Version(KERNELS_MAX_VERSION), (
        f"pdserve {ours} falls in transformers' accepted `kernels` range [{KERNELS_MIN_VERSION}, "
        f"{KERNELS_MAX_VERSION}): transformers would treat our kernels/ package as Hugging Face's."
    )


@pytest.mark.skipif(not _pdserve_installed(), reason="pdserve is not installed (run `make install`)")
def test_fresh_interpreter_with_installed_pdserve(tmp_path: Path) -> None:
    """Outside the repo (so only the editable install makes `kernels` importable), probe and load a model."""
    code = f"""
import sys
import importlib.util
from pathlib import Path

spec = importlib.util.find_spec("kernels")
assert spec is not None, "pdserve's kernels package is not importable"
assert Path({str(OUR_KERNELS)!r}).resolve() in [Path(p).resolve() for p in spec.submodule_search_locations]

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils.import_utils import is_kernels_available

assert is_kernels_available() is False

torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
LlamaForCausalLM(config).save_pretrained({str(tmp_path / "tiny")!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "tiny")!r}).eval()
ids = torch.tensor([[1, 5, 9, 3]])
with torch.no_grad():
    logits = model(ids).logits
assert logits.shape == (1, 4, 128), logits.shape
assert torch.isfinite(logits).all()
out = model.generate(ids, max_new_tokens=3, do_sample=False)
assert out.shape == (1, 7), out.shape
# The probe found pdserve's metadata and never imported our package as HF's.
assert "kernels" not in sys.modules, "transformers imported our kernels package"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
