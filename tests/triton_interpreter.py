"""Triton's interpreter (TRITON_INTERPRET=1: the kernels' CPU tests) without its repeated
language patching.

To run a kernel, the interpreter (triton 3.6) points the builtins of ``triton.language``
at NumPy versions for the launch, and undoes that after it. It also does it again on every
call of a ``@triton.jit`` helper from inside the kernel, for every program of the grid,
though the launch has done it already: about a millisecond a call, a third of the time of
an interpreted forward pass (tests/engine/test_triton_forward_parity.py), where kernels
call their helpers per tile. ``install()`` makes a helper's call skip the patching when
the launch has already patched the modules that helper sees (``triton.language`` and
``triton.language.core``); anything else goes through the interpreter's own code as
before. The kernels compute the same either way: it only removes work the launch has
done."""
from __future__ import annotations

import inspect


def install() -> None:
    """Idempotent; does nothing unless Triton runs interpreted."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    if getattr(patch_lang, "patches_once", False):
        return
    patched: set[int] = set()  # ids of the language modules the running launch has patched

    def seen(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}

    def patch_once(fn):
        mine = seen(fn)
        if patched and mine <= patched:  # a helper inside a launch: already patched
            return interpreter._LangPatchScope()
        scope = patch_lang(fn)
        if not patched:  # a launch: its scope's restore ends it
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        patched.update(mine)
        return scope

    patch_once.patches_once, patch_once.original = True, patch_lang
    interpreter._patch_lang = patch_once
