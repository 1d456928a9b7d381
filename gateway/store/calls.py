"""The SessionStore from asyncio code: each call in a thread (the store is synchronous), retried while Redis is
unreachable (e.g. restarting) for store_retry_s, then StoreUnavailable. Every store write is a compare-and-set,
so a retry of one that did land is refused, never doubled.

Why not redis-py's own Retry on the client: it retries a number of times, not for a time (store_retry_s), and it
sleeps inside the to_thread worker, so a Redis outage would hold one default-executor thread per waiting call
(every running turn's commits and leases) where this loop waits on the event loop. The backoff schedule is
redis-py's ExponentialBackoff (0.05 s doubling up to 1 s). The client's own few quick retries stay as they are.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from gateway.errors import StoreUnavailable

log = logging.getLogger("rsd.gateway")

STORE_OUTAGES = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)


class StoreCalls:
    """`await calls(store.get_tokens, session_id)`: the call in a thread, retried through an outage."""

    def __init__(self, retry_s: float):
        self.retry_s = retry_s
        self.backoff = ExponentialBackoff(cap=1.0, base=0.05)

    async def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + self.retry_s
        failures = 0
        while True:
            try:
                return await asyncio.to_thread(fn, *args, **kwargs)
            except STORE_OUTAGES as e:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(e) from None
                log.warning("session store unreachable (%s); retrying", e)
                await asyncio.sleep(self.backoff.compute(failures))
                failures += 1
