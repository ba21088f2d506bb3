"""Client-side request pacing, so tgp stays inside each provider's documented limits instead
of discovering them through 429s (Lambda: ~1 request/s and 1 launch per 12 s; Vast: a minimum
interval per endpoint)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class MinInterval:
    """At most one call per `interval` seconds; callers queue in arrival order.

    One instance per (provider, endpoint class) and worker process: `async with limiter: ...`.
    """

    def __init__(
        self,
        interval: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.interval = interval
        self._clock = clock
        self._sleep = sleep
        self._next = 0.0
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> None:
        async with self._lock:
            wait = self._next - self._clock()
            if wait > 0:
                await self._sleep(wait)
            self._next = max(self._clock(), self._next) + self.interval

    async def __aexit__(self, *exc: object) -> None:
        return None


class Unlimited:
    """A limiter that never waits (providers that publish no limit rely on 429 handling)."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None
