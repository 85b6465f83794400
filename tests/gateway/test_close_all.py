"""The gateway's last step (gateway/server.py close_all): each client closes within a bound; one
that does not is named once, with where it waits, and the others still close."""
from __future__ import annotations

import asyncio
import logging

from gateway.server import close_all


def test_a_close_that_never_ends_is_named_and_the_rest_still_close(caplog):
    closed: list[str] = []

    async def ok(name: str) -> None:
        await asyncio.sleep(0)
        closed.append(name)

    async def waits_for_ever() -> None:
        await asyncio.Event().wait()

    async def hangs() -> None:
        await waits_for_ever()

    async def fails() -> None:
        raise RuntimeError("already closed")

    with caplog.at_level(logging.WARNING, logger="gateway"):
        stuck = asyncio.run(close_all([("first", ok("first")), ("the stuck one", hangs()),
                                       ("a failing one", fails()), ("last", ok("last"))], 0.1))
    assert stuck == ["the stuck one"] and closed == ["first", "last"]
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith("gateway: closing the stuck one took over 0 s; exiting without it. It waits in:")
    assert "in hangs" in message and "in waits_for_ever" in message
