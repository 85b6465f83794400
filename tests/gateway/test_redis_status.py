"""The gateway's view of Redis (gateway/redis_status.py): one outage per stretch of failures,
and a call that began before Redis answered again (a client's retries can outlast an outage)
starts no new one."""
from __future__ import annotations

import logging
import time

from gateway.redis_status import RedisStatus


def test_a_call_begun_before_the_recovery_starts_no_second_outage(caplog):
    flips: list[bool] = []
    status = RedisStatus("redis://127.0.0.1:1/0", on_change=flips.append)
    with caplog.at_level(logging.WARNING, logger="gateway.redis_status"):
        status.failed(ConnectionError("refused"))
        status.failed(ConnectionError("refused"))  # the same outage
        stale = time.monotonic()  # a call under way while Redis is down ...
        status.answered()
        status.failed(ConnectionError("reset"), started=stale)  # ... fails after it came back
        assert not status.is_unreachable and status.num_outages == 1
        status.failed(ConnectionError("refused"), started=time.monotonic())  # a new call: a new outage
    assert status.is_unreachable and status.num_outages == 2
    assert flips == [True, False, True]
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 2


def test_an_answer_to_a_call_begun_before_the_outage_ends_none(caplog):
    """Redis answers call A, then dies; call B fails first, A's answer is read after: still one
    outage, ended only by a call begun after it started."""
    flips: list[bool] = []
    status = RedisStatus("redis://127.0.0.1:1/0", on_change=flips.append)
    with caplog.at_level(logging.INFO, logger="gateway.redis_status"):
        before = time.monotonic()
        status.failed(ConnectionError("reset"), started=time.monotonic())
        status.answered(started=before)  # sent before Redis went away
        assert status.is_unreachable and flips == [True]
        status.failed(ConnectionError("closed"), started=time.monotonic())  # the probe: the same outage
        status.answered(started=time.monotonic())
    assert not status.is_unreachable and status.num_outages == 1 and flips == [True, False]
    assert len([r for r in caplog.records if "answers again" in r.getMessage()]) == 1
