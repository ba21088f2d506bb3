"""List-then-watch of one Kubernetes resource that survives 410 Gone, cut streams and restarts.

The classic informer loop: list (remember the collection's resourceVersion), watch from it,
and on every event move the resourceVersion forward. A stream that ends or breaks is resumed
from the last resourceVersion; a 410 Gone (the server forgot that version) means list again,
and the difference between the old cache and the new list is delivered as events, so nothing
is missed. Any other failure backs off and starts over with a list.

A handler that fails for one object never holds up the others: the failure is logged and
counted, the object is retried (with backoff, or by the next list) until its handler succeeds
or a newer event about it does, and the informer goes on listing, syncing and watching.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import aiohttp
import structlog

from crd_bridge.metrics import HANDLER_ERRORS

log = structlog.get_logger("tgp.bridge.informer")

Obj = dict[str, Any]
Handler = Callable[[str, Obj], Awaitable[None]]
Synced = Callable[[], None]
# A `*_without_preload_content` list call of kubernetes.aio: returns the raw aiohttp response.
ListCall = Callable[..., Awaitable[aiohttp.ClientResponse]]

# The server ends a watch after this; a fresh one is cheap and catches a stalled connection.
WATCH_TIMEOUT = timedelta(minutes=5)
# Wait between failed list attempts (doubling, with jitter, up to the maximum).
BACKOFF_START = timedelta(seconds=0.5)
BACKOFF_MAX = timedelta(seconds=30)
LIST_TIMEOUT = timedelta(seconds=60)


class Gone(Exception):
    """The server no longer has the requested resourceVersion (410)."""


def object_key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name')}"


class Informer:
    """Feeds `handler(event_type, object)` with ADDED / MODIFIED / DELETED for one resource."""

    def __init__(
        self,
        name: str,
        list_call: ListCall,
        handler: Handler,
        *,
        watch_timeout: timedelta = WATCH_TIMEOUT,
        on_synced: Synced | None = None,
        **selectors: str,
    ) -> None:
        self.name = name
        self._on_synced = on_synced  # told after each list has been delivered
        self._list = list_call
        self._handler = handler
        self._watch_timeout = watch_timeout
        self._selectors = selectors
        self.cache: dict[str, Obj] = {}
        self.synced = asyncio.Event()
        self.relists = 0
        self.rewatches = 0
        # Objects whose handler failed on their latest event: key -> (event type, object).
        self.failed: dict[str, tuple[str, Obj]] = {}
        self._retry_at: float | None = None
        self._retry_rounds = 0

    async def run(self) -> None:
        """Run until cancelled."""
        failures = 0
        while True:
            try:
                version = await self._relist()
                failures = 0
                await self._watch(version)
            except Gone:
                log.info("watch_expired_relisting", resource=self.name)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: back off, then list again
                failures += 1
                wait = min(BACKOFF_START.total_seconds() * 2 ** (failures - 1), BACKOFF_MAX.total_seconds())
                log.warning("informer_failed", resource=self.name, error=f"{type(exc).__name__}: {exc}"[:300], retry_in=round(wait, 2))
                await asyncio.sleep(random.uniform(wait / 2, wait))

    async def _relist(self) -> str:
        response = await self._list(**self._selectors, _request_timeout=LIST_TIMEOUT.total_seconds())
        body = await _json_body(response)
        self.relists += 1
        fresh = {object_key(o): o for o in body.get("items") or []}
        retry, self.failed, self._retry_at = self.failed, {}, None  # this list delivers them again
        for key, obj in fresh.items():
            old = self.cache.get(key)
            if old is None or key in retry or _version(old) != _version(obj):
                self.cache[key] = obj
                await self._deliver("ADDED" if old is None else "MODIFIED", key, obj)
        for key in [k for k in self.cache if k not in fresh]:
            await self._deliver("DELETED", key, self.cache.pop(key))
        for key, (kind, obj) in retry.items():
            if kind == "DELETED" and key not in fresh:
                await self._deliver("DELETED", key, obj)
        self._schedule_retry()
        self.synced.set()  # objects that failed are retried; they must not hide all the others
        if self._on_synced is not None:
            self._on_synced()
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch(self, version: str) -> None:
        """Follow changes from `version`; resume after every stream end; raise Gone on 410."""
        while True:
            response = await self._list(
                **self._selectors,
                watch=True,
                resource_version=version,
                allow_watch_bookmarks=True,
                timeout_seconds=int(self._watch_timeout.total_seconds()),
                _request_timeout=self._watch_timeout.total_seconds() + 30,
            )
            if response.status == 410:
                response.release()
                raise Gone()
            if response.status >= 300:
                text = await response.text()
                raise RuntimeError(f"watch {self.name} answered {response.status}: {text[:200]}")
            # One read stays pending across retry rounds: cancelling a readline could lose half a line.
            read = asyncio.ensure_future(response.content.readline())
            try:
                while True:
                    done, _ = await asyncio.wait({read}, timeout=self._retry_wait())
                    if not done:
                        await self._retry_failed()  # between two events: the cache is consistent
                        continue
                    line = read.result()
                    if not line:
                        break  # the server closed the stream (timeout) or the connection was cut
                    version = await self._dispatch(json.loads(line), version)
                    read = asyncio.ensure_future(response.content.readline())
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError):
                pass  # a cut stream: resume from the last version we saw
            finally:
                read.cancel()
                response.release()
            self.rewatches += 1

    async def _dispatch(self, event: Obj, version: str) -> str:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise Gone()
            raise RuntimeError(f"watch {self.name} error: {obj.get('message')}")
        new_version = _version(obj) or version
        if kind == "BOOKMARK":
            return new_version
        key = object_key(obj)
        if kind == "DELETED":
            self.cache.pop(key, None)
        else:
            self.cache[key] = obj
        await self._deliver(str(kind), key, obj)
        return new_version

    async def _deliver(self, kind: str, key: str, obj: Obj) -> None:
        """Hand one event to the handler. A failure is logged, counted and remembered for a
        retry; it never propagates, so the events after it are still delivered."""
        try:
            await self._handler(kind, obj)
        except Exception as exc:  # noqa: BLE001 - whatever one object does, the others go on
            self.failed[key] = (kind, obj)
            HANDLER_ERRORS.labels(self.name).inc()
            log.warning("informer_handler_failed", resource=self.name, object=key, event_type=kind, error=f"{type(exc).__name__}: {exc}"[:300])
            if self._retry_at is None:
                self._schedule_retry()
        else:
            self.failed.pop(key, None)  # this event supersedes a failed one about the same object

    def _schedule_retry(self) -> None:
        """Retry failed objects after a doubling wait; reset once none is left."""
        if not self.failed:
            self._retry_at, self._retry_rounds = None, 0
            return
        wait = min(BACKOFF_START.total_seconds() * 2**self._retry_rounds, BACKOFF_MAX.total_seconds())
        self._retry_at = asyncio.get_running_loop().time() + random.uniform(wait / 2, wait)

    def _retry_wait(self) -> float | None:
        """Seconds until failed objects are due again (None: nothing to retry)."""
        if self._retry_at is None:
            return None
        return max(self._retry_at - asyncio.get_running_loop().time(), 0.0)

    async def _retry_failed(self) -> None:
        retry, self.failed, self._retry_at = self.failed, {}, None
        for key, (kind, obj) in retry.items():
            await self._deliver(kind, key, obj)
        self._retry_rounds = self._retry_rounds + 1 if self.failed else 0
        self._schedule_retry()


def _version(obj: Obj) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


async def _json_body(response: aiohttp.ClientResponse) -> Obj:
    try:
        if response.status >= 300:
            if response.status == 410:
                raise Gone()
            raise RuntimeError(f"list answered {response.status}: {(await response.text())[:200]}")
        return dict(await response.json(content_type=None))
    finally:
        response.release()
