"""The adapters a ProviderRegistry (activities/accounts.py) hands out around a cloud adapter: one
whose look-ups by name share its account's listings (`SharedLookups`), and one that reaches an
instance bought with another key than its Secret holds now (`BoughtWith`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from activities.name_lists import LookupsByAccount
from activities.ports import CloudProvider
from tgp.errors import AuthError, TransientError

__all__ = ["AccountUnavailable", "BoughtWith", "SharedLookups"]


class AccountUnavailable(TransientError):
    """No key this worker has reaches the account an instance was bought with."""


class SharedLookups:
    """An adapter whose `find_all_by_name` goes through its account's shared listings."""

    def __init__(self, adapter: CloudProvider, lookups: LookupsByAccount) -> None:
        self._adapter = adapter
        self._lookups = lookups

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._adapter, attr)  # name, capabilities, describe, terminate, ...

    async def find_all_by_name(self, name: str) -> list[Any]:
        return await self._lookups.find_all_by_name(self._adapter, name)

    async def find_by_name(self, name: str) -> Any:
        found = await self.find_all_by_name(name)
        return found[0] if found else None


class BoughtWith:
    """An instance's adapter when its Secret holds another key than the one that bought it:
    the Secret's current key first (a rotation: the same account, the new key works), then,
    for an instance or name the current key does not see, the key it was bought with (a
    switch to another account). Whichever key found an instance terminates it. Without the
    bought-with key, or when it answers 401 (revoked), an instance the current key does not see
    is `unreachable()`, never "gone": after a switch of account it still bills there, and
    "gone" would mark the node Interrupted, replace it and leave it billing. The price: after a
    rotation within one account whose old key was revoked, an instance that really is gone
    reads as unreachable too (TerminationStuck, with a message saying what to do) until the
    operator confirms it and ends the node."""

    def __init__(
        self,
        current: CloudProvider,
        bought_with: CloudProvider | None,
        elsewhere: Callable[[], None],
        unreachable: Callable[[], AccountUnavailable],
    ) -> None:
        self._current = current
        self._bought_with = bought_with
        self._elsewhere = elsewhere
        self._unreachable = unreachable
        self._found_by: dict[str, CloudProvider] = {}
        # What the current key has seen (ids, names): its 404 or empty list then means gone.
        self._current_saw: set[str] = set()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._current, attr)  # name, capabilities, list_offers, launch, ...

    async def _other(self, call: Callable[[CloudProvider], Any], empty: Any) -> Any:
        if self._bought_with is None:
            raise self._unreachable()
        try:
            found = await call(self._bought_with)
        except AuthError:
            raise self._unreachable() from None  # revoked: what it bought is out of sight, not gone
        if found:
            self._elsewhere()
        return found

    async def describe(self, instance_id: str) -> Any:
        found = await self._current.describe(instance_id)
        if found is not None and instance_id not in self._found_by:
            self._current_saw.add(instance_id)
        if found is None and instance_id not in self._current_saw:
            found = await self._other(lambda p: p.describe(instance_id), None)
            if found is not None:
                self._found_by[instance_id] = self._bought_with  # type: ignore[assignment]
        return found

    async def find_all_by_name(self, name: str) -> list[Any]:
        found = await self._current.find_all_by_name(name)
        if found:
            self._current_saw.add(name)
        if not found and name not in self._current_saw:
            found = await self._other(lambda p: p.find_all_by_name(name), [])
            for instance in found:
                self._found_by[instance.instance_id] = self._bought_with  # type: ignore[assignment]
        return list(found)

    async def find_by_name(self, name: str) -> Any:
        found = await self.find_all_by_name(name)
        return found[0] if found else None

    async def terminate(self, instance_id: str) -> None:
        await self._found_by.get(instance_id, self._current).terminate(instance_id)
