"""One read of a listing at a time, shared by the callers that asked before it started (by
default; see `within` below).

Every joining node looks for its device once a second (`wait_for_join`), and a tailnet's API
lists all of its devices per look (Tailscale's `GET /tailnet/-/devices`, Headscale's `GET
/node`): a burst of n joins cost n listings a second of a tailnet growing to n devices, O(n^2)
bytes, and the worker's HTTP pool ~40% of its CPU in a burst of 100 (bench/results/findings.md,
session 13). As activities.name_lists does for launches' look-ups by name, `FreshReads.read`
gives every caller the answer of a read that started after it asked (never an older view than
its own request would have had): while a read is in flight, the callers that arrive gather for
the next one, which starts when the one in flight ends. So a listing has at most one request in
flight, and n callers cost a read per round trip. An error reaches every caller of that read
(each retries as it would have).

A caller that looks again and again (a join, once a second) may accept an answer a little older
than its call: `read(within=s)` takes the read in flight or the last answer if that read began at
most `s` seconds before the call. In a burst the joins' looks arrive all the time, and without it
the listings ran back to back (a read per round trip, each of the whole tailnet, against an API
that throttles); with half a look's interval there are at most about two a second.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FreshReads(Generic[T]):
    """Coalesced calls of one read (`fetch`, the same for every caller): see the module doc."""

    def __init__(self, fetch: Callable[[], Awaitable[T]]) -> None:
        self._fetch = fetch
        self._next: asyncio.Future[T] | None = None  # gathering callers, not started
        self._running: asyncio.Task[None] | None = None
        # The read in flight and when it began; the last answer, with its loop and when its read began.
        self._current: tuple[float, asyncio.Future[T]] | None = None
        self._last: tuple[weakref.ref[asyncio.AbstractEventLoop], float, T] | None = None
        self.reads = 0  # reads made (for tests and the bench)

    async def read(self, *, within: float = 0.0) -> T:
        """The answer of a read that started after this call, or at most `within` seconds before it."""
        loop = asyncio.get_running_loop()
        if self._running is not None and self._running.get_loop() is not loop:
            self._running = self._next = self._current = self._last = None  # left behind by another (closed) event loop
        if within > 0:
            oldest = loop.time() - within
            if self._last is not None and self._last[0]() is loop and self._last[1] >= oldest:
                return self._last[2]
            if self._current is not None and self._current[0] >= oldest:
                return await asyncio.shield(self._current[1])
        if self._next is None:
            self._next = loop.create_future()
            if self._running is None:
                self._running = loop.create_task(self._run())
        # Shielded: a caller cancelled while it waits leaves the read to the others.
        return await asyncio.shield(self._next)

    async def _run(self) -> None:
        try:
            while (gathered := self._next) is not None:
                self._next = None  # callers from now on wait for the next read
                self.reads += 1
                loop = asyncio.get_running_loop()
                began = loop.time()
                self._current = (began, gathered)
                try:
                    value = await self._fetch()
                    self._last = (weakref.ref(loop), began, value)
                    gathered.set_result(value)
                except asyncio.CancelledError:
                    gathered.cancel()
                    raise
                except Exception as exc:  # noqa: BLE001 - every caller of this read hears of it
                    gathered.set_exception(exc)
                    gathered.exception()  # retrieved: callers that gave up waiting leave no warning behind
                finally:
                    self._current = None
        finally:
            self._running = None
            if self._next is not None and not self._next.done():  # only when this task was cancelled
                self._next.cancel()
                self._next = None
