"""Builds of one C++ kernel source side by side, for the benchmarks that time them in one process
(bench/gguf_token_gemms.py, bench/cpu_attention_builds.py): each SOURCE[:FLAGS] argument is built
as its own extension, FLAGS being extra compiler flags (e.g. ``-DGGUF_PREFETCH_GROUPS=0``)."""
from __future__ import annotations

import hashlib
from typing import Any, Sequence


def load_builds(builds: Sequence[str], prefix: str, cflags: Sequence[str]) -> dict[str, Any]:
    """{build: its loaded module} for each SOURCE[:FLAGS] in ``builds``, compiled with ``cflags``
    and the build's own flags, named ``prefix`` and a hash of the build."""
    from torch.utils.cpp_extension import load

    mods = {}
    for build in builds:
        src, _, flags = build.partition(":")
        name = f"{prefix}_" + hashlib.sha256(build.encode()).hexdigest()[:10]
        mods[build] = load(name=name, sources=[src], extra_cflags=[*cflags, *flags.split()],
                           extra_ldflags=["-fopenmp"], verbose=False)
    return mods
