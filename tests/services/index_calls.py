"""A prefix index's query from a test's synchronous code."""
from __future__ import annotations

import asyncio
from typing import Any

from gateway.prefix_index import RedisPrefixIndex


def index_call(index: Any, method: str, *args: Any) -> Any:
    """``index.<method>(*args)`` run to its result; an index given as a Redis URL is opened for
    this one call (the asyncio client belongs to one event loop)."""
    async def call():
        if not isinstance(index, str):
            return await getattr(index, method)(*args)
        redis_index = RedisPrefixIndex(index, timeout_s=1.0)
        try:
            return await getattr(redis_index, method)(*args)
        finally:
            await redis_index.close()
    return asyncio.run(call())
