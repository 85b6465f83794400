"""tests/triton_interpreter.py: under the interpreter a launch patches triton.language as
often however many programs of its grid call helpers, and the kernel's results stay the
reference's."""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.rope import qk_norm_rope

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU only")


def _inputs(tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    dim = 16
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim)
    freqs = torch.outer(torch.arange(64).float(), inv)
    return (torch.arange(tokens), torch.randn(tokens, 4, dim, generator=gen), torch.randn(tokens, 2, dim, generator=gen),
            None, torch.randn(dim, generator=gen), torch.randn(dim, generator=gen),
            torch.cat([freqs.cos(), freqs.sin()], dim=-1), 1e-6)


def _patches(monkeypatch, tokens: int) -> int:
    """How many module patches (the interpreter's _patch_builtin calls) one qk_norm_rope launch
    over ``tokens`` programs makes, each program calling the norm-and-turn helpers; checks its
    results against the reference."""
    from triton.runtime import interpreter

    calls = []
    patch_builtin = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: (calls.append(a[0]), patch_builtin(*a))[1])
    args = _inputs(tokens)
    q, k, _ = qk_norm_rope(*args)
    monkeypatch.setattr(interpreter, "_patch_builtin", patch_builtin)
    want = reference.qk_norm_rope(*args)
    torch.testing.assert_close(q, want[0])
    torch.testing.assert_close(k, want[1])
    return len(calls)


def test_a_launch_patches_the_language_as_often_whatever_its_grid(monkeypatch):
    from triton.runtime import interpreter

    patch_once = interpreter._patch_lang
    assert getattr(patch_once, "patches_once", False)  # installed by tests/conftest.py
    _patches(monkeypatch, 2)  # the interpreter rewrites a helper on its first call: settle that first
    assert _patches(monkeypatch, 2) == _patches(monkeypatch, 9) > 0
    monkeypatch.setattr(interpreter, "_patch_lang", patch_once.original)  # the interpreter's own
    assert _patches(monkeypatch, 9) > 2 * _patches(monkeypatch, 2)
