"""Whether this gateway reaches its Redis (``--redis-url``): one owner of an
outage's log lines, gauge and /cluster field, for every user of that Redis
in the gateway (the prefix index, discovery's ``redis`` entries).

    outage starts (a user's call fails, or the probe's PING does): one warning line,
        pdserve:gateway_prefix_index_unreachable 1; prefix matches are empty (routing by load
        alone), discovery keeps the servers it last found there
    outage ends (the probe's PING, or a user's call, answers): one info line, the gauge back to 0

The probe PINGs every ``interval`` seconds under a timeout of its own
(``timeout_s``, longer than ``--redis-timeout``: one slow match under load is
not an outage), so the state follows Redis with or without traffic. While
Redis is unreachable nobody else calls it: each request costs nothing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0


def redis_client(url: str, timeout_s: float) -> Any:
    """An asyncio Redis client for the gateway's users of Redis: ``timeout_s`` on each socket
    read and connect, and a call whose connection fails is tried once more on a fresh one (a
    pooled connection made before Redis restarted fails its next call though Redis answers)."""
    import redis.asyncio as aredis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return aredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                 retry=Retry(NoBackoff(), 1))


def _strip_password(url: str) -> str:
    """The URL without a password (for logs)."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not sep or not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user + ':***' if ':' in creds else creds}@{host}"


class RedisStatus:
    """Reachable or not, as this gateway's users of one Redis find it."""

    def __init__(self, url: str, on_change: Callable[[bool], None] | None = None,
                 interval: float = PROBE_INTERVAL_S, timeout_s: float = 1.0) -> None:
        self.url = _strip_password(url)
        self._on_change = on_change  # called with is_unreachable when it flips (the gauge)
        self.interval = interval
        self._timeout_s = timeout_s
        self._client_url = url
        self.is_unreachable = False
        self.num_outages = 0
        self._since = 0.0  # time.monotonic() the current outage started
        self._answered_at = 0.0  # time.monotonic() Redis last answered after an outage
        self._task: asyncio.Task[None] | None = None
        self._redis: Any = None

    def failed(self, exc: BaseException | str, started: float | None = None) -> None:
        """A call to Redis failed: an outage starts unless one is on. ``started``: when the
        call began (time.monotonic()); a call begun before Redis last answered again failed
        in the outage that is over (a client's retries can outlast it), and starts none."""
        if self.is_unreachable or (started is not None and started < self._answered_at):
            return
        self.is_unreachable, self._since = True, time.monotonic()
        self.num_outages += 1
        logger.warning("Redis at %s is unreachable (%s): routing by load alone (no prefix matches) and keeping "
                       "the engine servers already discovered; requests are served as usual. Probing every "
                       "%.0f s", self.url, str(exc) or type(exc).__name__, self.interval)
        if self._on_change is not None:
            self._on_change(True)

    def answered(self, started: float | None = None) -> None:
        """A call to Redis succeeded: the outage, if any, is over. ``started``: when the call
        began; a call begun before the outage started may carry an answer Redis sent before it
        went away (read after another call's failure), and ends none."""
        if not self.is_unreachable or (started is not None and started < self._since):
            return
        self.is_unreachable = False
        self._answered_at = time.monotonic()
        logger.info("Redis at %s answers again after %.1f s: prefix routing resumes as the engine servers "
                    "publish their blocks", self.url, time.monotonic() - self._since)
        if self._on_change is not None:
            self._on_change(False)

    def to_json(self) -> dict[str, Any]:
        """This Redis in /cluster."""
        return {"url": self.url, "unreachable": self.is_unreachable, "num_outages": self.num_outages,
                "unreachable_seconds": round(time.monotonic() - self._since, 3) if self.is_unreachable else 0.0}

    async def start(self) -> None:
        """Probe once (so the state is known), then every ``interval`` seconds."""
        self._redis = redis_client(self._client_url, self._timeout_s)
        await self.probe()
        self._task = asyncio.create_task(self._probe_forever(), name="redis-probe")

    async def probe(self) -> None:
        import redis

        started = time.monotonic()
        try:
            await asyncio.wait_for(self._redis.ping(), 2 * self._timeout_s)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            self.failed(exc, started)
            return
        self.answered(started)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.probe()
            except Exception:  # a bug here must not stop probing
                logger.exception("Redis probe failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()
