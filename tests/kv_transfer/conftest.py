"""The peer process and the pairs to it, one of each per test module (``tests.kv_transfer.pairs``)."""
from __future__ import annotations

from typing import Any

import pytest

from tests.kv_transfer.pairs import SMALL, Pair, Peer


@pytest.fixture(scope="module")
def peer() -> Any:
    p = Peer()
    yield p
    p.post("stop")
    p.proc.join(10)
    if p.proc.is_alive():
        p.proc.kill()


@pytest.fixture(scope="module")
def pairs(peer: Peer) -> Any:
    made: dict[str, Pair] = {}

    def get(dtype: str) -> Pair:
        if dtype not in made:
            made[dtype] = Pair(peer, dtype, SMALL, dtype)
        return made[dtype]
    yield get
    for pair in made.values():
        pair.receiver.close()
