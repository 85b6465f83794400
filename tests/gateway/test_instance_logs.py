"""The gateway's log while its engine servers load: one "waiting for ... to load"
line for a server it has never seen healthy (not a warning per poll with the
refused connection), a warning only once it has waited past its deadline, and
a warning for a server that was healthy and stops answering."""
from __future__ import annotations

import asyncio
import logging
import re
import time

from gateway.instances import DECODE, Instance
from tests.gateway.fake_engine import FakeEngine
from tests.processes import free_port


def _records(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "gateway.instances"]


def test_a_loading_server_is_waited_for_quietly_then_warned_about(caplog):
    address = f"127.0.0.1:{free_port()}"  # nothing listens: a server still loading its model

    async def go():
        inst = Instance(DECODE, address, load_warning_s=0.5)
        for _ in range(4):
            await inst.poll(timeout=0.5)
        quiet = _records(caplog)
        await asyncio.sleep(max(0.0, 0.6 - (time.monotonic() - inst.added_at)))
        for _ in range(3):
            await inst.poll(timeout=0.5)
        await inst.close()
        return quiet, inst
    caplog.set_level(logging.INFO, logger="gateway.instances")
    quiet, inst = asyncio.run(go())
    assert quiet == [("INFO", f"waiting for decode server {address} to load")]
    records = _records(caplog)
    assert len(records) == 2 and records[1][0] == "WARNING", records
    assert re.fullmatch(rf"decode server {address} is still not serving \d+ s after the gateway found it: "
                        r"UNAVAILABLE: .*", records[1][1]), records
    assert not inst.is_healthy and inst.error.startswith("UNAVAILABLE")


def test_a_server_that_was_healthy_is_warned_about_at_once(caplog):
    fake = FakeEngine().start()
    caplog.set_level(logging.INFO, logger="gateway.instances")

    async def go():
        inst = Instance(DECODE, fake.decode_address)
        try:
            await inst.poll(timeout=2.0)
        finally:
            fake.stop()
        await inst.poll(timeout=2.0)
        await inst.close()
    asyncio.run(go())
    (healthy, gone) = _records(caplog)
    assert healthy[0] == "INFO" and healthy[1].startswith(f"decode server {fake.decode_address} is healthy")
    assert gone[0] == "WARNING" and gone[1].startswith(f"decode server {fake.decode_address} is unhealthy: "), gone
