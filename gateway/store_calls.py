"""The SessionStore from asyncio code: each call in a thread (the store is synchronous), retried while Redis is
unreachable (e.g. restarting) for store_retry_s, then StoreUnavailable. Every store write is a compare-and-set,
so a retry of one that did land is refused, never doubled."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis

from gateway.errors import StoreUnavailable

log = logging.getLogger("rsd.gateway")

STORE_OUTAGES = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


class StoreCalls:
    """`await calls(store.get_tokens, session_id)`: the call in a thread, retried through an outage."""

    def __init__(self, retry_s: float):
        self.retry_s = retry_s

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        deadline, delay = time.monotonic() + self.retry_s, 0.05
        while True:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except STORE_OUTAGES as e:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(e) from None
                log.warning("session store unreachable (%s); retrying", e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
