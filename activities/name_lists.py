"""Launches' look-ups by name, coalesced per provider account without losing freshness.

Every launch looks for its instance by name two or three times (`Launch._adopt` before
minting and, on a retry, again right before buying; `_live` after the create), and its join's
twin watch after that: a Temporal reset or a killed worker can leave an instance bought under
the name, and clouds do not enforce unique names. On most clouds a look-up by name is a listing
of the whole account (Lambda, RunPod) behind a pacer (Lambda: about one request a second per
account), so a burst of n launches cost 3n or more listings of an account growing to n
instances: O(n^2) bytes, and on Lambda 3n seconds of pacer.

`NameLookups.find_all_by_name(name)` gives the same answer as `adapter.find_all_by_name(name)`
at the moment of the call, or a later one, never an older one: a caller joins a listing only
if that listing has not started yet when the caller asks, so the request it shares goes out
after the caller asked (at least as fresh as the caller's own would be). While a listing is in
flight, the callers that arrive gather for the next one, which starts when the one in flight
ends; one listing serves every caller gathered for it. So an account has at most one listing
in flight, and a burst costs a listing per round trip, not per launch.

A listing for one name is that name's own look-up (`find_all_by_name`, which some APIs filter
on the server); for several, one `list_instances(common prefix)`, each caller taking the
instances under its name as the adapter's own look-up would (`listed_name`: Lambda sends long
names shortened). An error reaches every caller of that listing (each retries as it would have).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from activities.ports import CloudProvider
from tgp.errors import TransientError
from tgp.types import Instance

__all__ = ["NameLookups", "LookupsByAccount"]


@dataclass
class _Listing:
    """One listing: the names gathered for it until it starts, and its result by name."""

    adapter: CloudProvider
    done: asyncio.Future[dict[str, list[Instance]]]
    names: set[str] = field(default_factory=set)


def _fail(listing: _Listing, exc: BaseException) -> None:
    if not listing.done.done():
        listing.done.set_exception(exc)
        listing.done.exception()  # retrieved: callers that gave up waiting leave no warning behind


class NameLookups:
    """Coalesced `find_all_by_name` for one provider account: see the module doc. Holds no
    adapter between listings (the registry keys these by adapter, weakly)."""

    def __init__(self) -> None:
        self._next: _Listing | None = None  # gathering callers, not started
        self._running: asyncio.Task[None] | None = None
        self.listings = 0  # requests of listings made (for tests and the bench)

    async def find_all_by_name(self, adapter: CloudProvider, name: str) -> list[Instance]:
        """Every live instance called `name`, as of a listing that started after this call."""
        loop = asyncio.get_running_loop()
        if self._running is not None and self._running.get_loop() is not loop:
            self._running = self._next = None  # left behind by another (closed) event loop
        listing = self._next
        if listing is None:
            listing = self._next = _Listing(adapter, loop.create_future())
            if self._running is None:
                self._running = loop.create_task(self._run())
        listing.names.add(name)
        # Shielded: a caller cancelled while it waits leaves the listing to the others.
        found = await asyncio.shield(listing.done)
        return list(found.get(name, ()))

    async def _run(self) -> None:
        try:
            while (listing := self._next) is not None:
                # From here on the listing is under way: later callers gather for the next one.
                self._next = None
                try:
                    result = await self._list(listing.adapter, sorted(listing.names))
                except asyncio.CancelledError:
                    _fail(listing, TransientError("the instance listing was stopped (the worker is shutting down)"))
                    raise
                except Exception as exc:  # noqa: BLE001 - handed to every caller of this listing
                    _fail(listing, exc)
                else:
                    if not listing.done.done():
                        listing.done.set_result(result)
        finally:
            self._running = None
            if self._next is not None:  # stopped with callers gathered for the next listing
                pending, self._next = self._next, None
                _fail(pending, TransientError("the instance listing was stopped (the worker is shutting down)"))

    async def _list(self, adapter: CloudProvider, names: list[str]) -> dict[str, list[Instance]]:
        self.listings += 1
        if len(names) == 1:
            return {names[0]: await adapter.find_all_by_name(names[0])}
        listed: Callable[[str], str] = getattr(adapter, "listed_name", lambda n: n)
        wanted = {listed(n): n for n in names}
        prefix = os.path.commonprefix(list(wanted))
        out: dict[str, list[Instance]] = {n: [] for n in names}
        for instance in await adapter.list_instances(prefix, names=wanted.keys()):
            name = wanted.get(instance.name)
            if name is not None:
                out[name].append(instance)
        return out


class LookupsByAccount:
    """One NameLookups per adapter (an adapter is one account's key), for as long as the adapter
    lives."""

    def __init__(self) -> None:
        self._by_adapter: weakref.WeakKeyDictionary[object, NameLookups] = weakref.WeakKeyDictionary()

    def of(self, adapter: CloudProvider) -> NameLookups:
        found = self._by_adapter.get(adapter)
        if found is None:
            found = self._by_adapter[adapter] = NameLookups()
        return found

    async def find_all_by_name(self, adapter: CloudProvider, name: str) -> list[Instance]:
        """`adapter.find_all_by_name(name)`, coalesced with its account's other look-ups."""
        try:
            lookups = self.of(adapter)
        except TypeError:  # an adapter that cannot be weakly referenced or hashed: on its own
            return await adapter.find_all_by_name(name)
        return await lookups.find_all_by_name(adapter, name)
