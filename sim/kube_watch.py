"""Watches of the embedded Kubernetes API (`sim.kube`): `KubeWatch`, the layer of `KubeEmulator`
on top of kube_store's `KubeStore`, keeps the history of changes and serves watch streams as
the API server's watch cache does:

* a watch resumes from a `resourceVersion`; once a change of its resource after that has left
  the retained window (`watch_window` changes of all resources, each resource's forgotten
  changes tracked apart, as the watch cache's window is per resource; `compact()` forgets them
  all, as an etcd compaction does) it gets 410
  Gone: an ERROR event in a 200 stream, or HTTP 410 with `expired_watch_as_http`;
* without a resourceVersion it starts with the current state as ADDED events; a streaming list
  (`sendInitialEvents`) ends those with a bookmark (`k8s.io/initial-events-end`);
* label and field selectors apply per watcher: an object that starts matching is ADDED for
  it, one that stops matching is DELETED; a write wakes only the watches of its resource, a
  pod's only those that pick no Node and those of its Node (`spec.nodeName=`: the watch cache's
  trigger index);
* a stream ends after `timeoutSeconds`; `cut_watches()` drops the open streams mid-body, as an
  API server restart or a load balancer's idle timeout does.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator

import attrs
import kmock
from typing_extensions import override

from sim.kube_machinery import PODS, ApiStatus, Obj, api_version, is_true, same_resource, status_body
from sim.kube_selection import Selection, node_name_of
from sim.kube_store import FIRST_RESOURCE_VERSION, KubeStore, parse_resource_version, with_version

# How many changes the emulator keeps for watches that resume from a resourceVersion. A real
# server's watch cache keeps a bounded window per resource too (and etcd compacts every 5 min);
# 1000 is far more than a test produces, so only `compact()` or a small knob expires a watch.
DEFAULT_WATCH_WINDOW = 1000


@attrs.define(kw_only=True)
class KubeWatch(KubeStore):
    """The store with its change history and the open watch streams. A layer of `KubeEmulator`,
    not used alone.

    Test knobs: `compact`, `cut_watches`, `open_watches`, `watch_window`, `expired_watch_as_http`.
    """

    watch_window: int = DEFAULT_WATCH_WINDOW
    """How many changes are kept for watches that resume from a resourceVersion. A watch from
    before the oldest kept change gets 410 Gone, as after an etcd compaction."""

    expired_watch_as_http: bool = False
    """Answer a watch from an expired resourceVersion with HTTP 410 instead of 200 and an ERROR
    event in the stream. Current servers do the latter; old ones (and proxies) the former, and
    clients must handle both."""

    # Watches resume from `_changes`; every revision up to `_horizon` has been forgotten.
    _changes: collections.deque[_Change] = attrs.field(factory=collections.deque, init=False)
    _horizon: int = attrs.field(default=FIRST_RESOURCE_VERSION, init=False)
    # Per resource, as the API server's watch cache keeps a window per resource: the revision
    # of its newest forgotten change. A watch of a resource that has had no change forgotten
    # (pods that nobody touched while 1,000 Nodes changed) resumes from its version; with one
    # window for all, an informer of a quiet resource got 410 Gone at every watch timeout and
    # listed again (`make bench`: the bridge then re-sent every node's facts every 5 minutes).
    _forgotten: dict[kmock.resource, int] = attrs.field(factory=dict, init=False)
    _compacted: int = attrs.field(default=FIRST_RESOURCE_VERSION, init=False)
    # The open watch streams by what wakes them: (plural, trigger), where a watch of pods by
    # `spec.nodeName=` has its Node as trigger (the watch cache's trigger index), any other None.
    _watches: dict[tuple[str, str | None], set[_Watch]] = attrs.field(factory=dict, init=False)

    def compact(self) -> None:
        """Forget the change history, as an etcd compaction does: a watch from any earlier
        resourceVersion gets 410 Gone and its client must list again. Open watches go on."""
        self._changes.clear()
        self._horizon = self._compacted = self._revision

    def cut_watches(self) -> int:
        """Drop every open watch connection mid-stream, as an API server restart or a load
        balancer's idle timeout does: the client sees the connection close without the end of
        the chunked body and must reconnect. Returns how many streams were cut."""
        watches = self._open_watches()
        for watch in watches:
            watch.end("cut")
            self._forget(watch)
        return len(watches)

    @property
    def open_watches(self) -> int:
        """How many watch streams are being served right now."""
        return len(self._open_watches())

    def _open_watches(self) -> list[_Watch]:
        return [watch for watches in self._watches.values() for watch in watches]

    def _forget(self, watch: _Watch) -> None:
        """A stream that ended (or was cut) wakes no more; a key goes with its last watch (a
        kubelet's Node's name)."""
        key = _woken_by(watch)
        watches = self._watches.get(key, set())
        watches.discard(watch)
        if not watches:
            self._watches.pop(key, None)

    @override
    def _publish(self, resource: kmock.resource, kind: str, obj: Obj, previous: Obj | None) -> None:
        super()._publish(resource, kind, obj, previous)
        change = _Change(int(obj["metadata"]["resourceVersion"]), resource, kind, obj, previous)
        self._changes.append(change)
        while len(self._changes) > max(self.watch_window, 0):
            forgotten = self._changes.popleft()
            self._horizon = self._forgotten[forgotten.resource] = forgotten.revision
        # As the watch cache's trigger index for pods by spec.nodeName: a kubelet's watch (of
        # its Node's pods) is woken only by changes of pods on its Node, not by every pod's.
        # Waking and filtering each of 500 kubelets' watches made a pod write cost 10 times
        # as much (`make bench`'s burst of 500).
        triggers = (None, *dict.fromkeys(_node_names(change))) if same_resource(resource, PODS) else (None,)
        for trigger in triggers:
            for watch in self._watches.get((str(resource.plural), trigger), ()):
                if same_resource(watch.resource, resource):
                    watch.queue.append(change)
                    watch.wake.set()

    def _watch_horizon(self, storage: kmock.resource) -> int:
        """A watch of `storage` from before this has missed changes: 410 Gone."""
        return max(self._compacted, self._forgotten.get(storage, FIRST_RESOURCE_VERSION))

    def _end_watches(self) -> None:
        """End every open watch cleanly, as when the server stops."""
        for watch in self._open_watches():
            watch.end("closed")

    def _watch(self, request: kmock.Request, resource: kmock.resource, selection: Selection) -> AsyncIterator[kmock.Payload]:
        """The stream of a watch of `resource`, once the request's options pass the checks a
        real server makes before any byte is sent."""
        since = parse_resource_version(request.params.get("resourceVersion"))
        timeout = _parse_timeout(request.params.get("timeoutSeconds"))
        # Streaming lists (client-go's WatchListClient, e.g. the wait of `kubectl delete`): the
        # current state, then a bookmark marking the end of the initial events, then changes.
        initial_events = is_true(request.params.get("sendInitialEvents"))
        if initial_events:
            if request.params.get("resourceVersionMatch") != "NotOlderThan":
                raise ApiStatus(422, "Invalid", "resourceVersionMatch: Forbidden: sendInitialEvents requires "
                                "setting resourceVersionMatch to NotOlderThan")
            since = None
        horizon = self._watch_horizon(self._storage(resource))
        if since is not None and since < horizon and self.expired_watch_as_http:
            raise ApiStatus(410, "Expired", _too_old(since, horizon))
        return self._stream(
            request, resource, selection, since, timeout,
            initial_events_end=initial_events and is_true(request.params.get("allowWatchBookmarks")),
        )

    async def _stream(
        self,
        request: kmock.Request,
        resource: kmock.resource,
        selection: Selection,
        since: int | None,
        timeout: float | None,
        *,
        initial_events_end: bool = False,
    ) -> AsyncIterator[kmock.Payload]:
        """The watch stream: what happened after `since` (or the current state as ADDED events
        when there is none), then every change as it happens."""
        storage = self._storage(resource)
        horizon = self._watch_horizon(storage)
        if since is not None and since < horizon:
            # In-stream, as the watch cache reports it: 200, one ERROR event, end of stream.
            yield {"type": "ERROR", "object": status_body(410, "Expired", _too_old(since, horizon))}
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        raw_request = request._raw_request
        watch = _Watch(
            resource=storage,
            namespace=request.namespace,
            name=request.name,
            transport=raw_request.transport if raw_request is not None else None,
            trigger=selection.node_of_pods(storage),
        )
        # Backlog and registration in one step (no await between), so no change falls between.
        if since is None:
            watch.queue.extend(
                _Change(int(stored.raw["metadata"]["resourceVersion"]), storage, "ADDED", stored.raw, None)
                for _, stored in self.listed(storage, selection=selection)
            )
        else:
            # From the newest back: a watch resumes from a recent version, the window holds 1,000.
            later = itertools.takewhile(lambda c: c.revision > since, reversed(self._changes))
            watch.queue.extend(reversed([c for c in later if same_resource(c.resource, storage)]))
        if initial_events_end:
            watch.queue.append(_Change(self._revision, storage, "BOOKMARK", {
                "kind": self._kind(resource), "apiVersion": api_version(resource),
                "metadata": {"resourceVersion": str(self._revision), "annotations": {"k8s.io/initial-events-end": "true"}},
            }, None))
        self._watches.setdefault(_woken_by(watch), set()).add(watch)
        try:
            yield b""  # the response headers go out now, as a real server sends them at once
            while True:
                while watch.queue:
                    event = self._watch_event(watch, watch.queue.popleft(), resource, selection)
                    if event is not None:
                        yield event
                if watch.ended is not None:
                    return
                watch.wake.clear()
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return  # timeoutSeconds: the server ends the stream cleanly
                try:
                    await asyncio.wait_for(watch.wake.wait(), remaining)
                except TimeoutError:
                    return
        finally:
            self._forget(watch)

    def _watch_event(
        self, watch: _Watch, change: _Change, resource: kmock.resource, selection: Selection
    ) -> Obj | None:
        """The event a watcher sees for `change`: like the watch cache, an object that starts
        matching the selectors is ADDED for this watcher, one that stops matching is DELETED."""
        if change.type == "BOOKMARK":
            return {"type": "BOOKMARK", "object": change.obj}
        meta = change.obj["metadata"]
        if watch.namespace is not None and meta.get("namespace") != watch.namespace:
            return None
        if watch.name is not None and meta.get("name") != watch.name:
            return None
        matches_now = change.type != "DELETED" and selection.matches(self._present(resource, change.obj))
        matched = change.previous is not None and selection.matches(self._present(resource, change.previous))
        if matches_now:
            return {"type": "MODIFIED" if matched else "ADDED", "object": self._present(resource, change.obj)}
        if not matched:
            return None
        assert change.previous is not None
        gone = change.obj if change.type == "DELETED" else with_version(change.previous, change.revision)
        return {"type": "DELETED", "object": self._present(resource, gone)}


@attrs.frozen
class _Change:
    """One write, as the watch cache remembers it."""

    revision: int
    resource: kmock.resource  # where the object is stored
    type: str  # ADDED, MODIFIED or DELETED (or BOOKMARK, for one watcher only)
    obj: Obj  # after the write; for DELETED the last state with the deletion's revision
    previous: Obj | None  # before the write


@attrs.define(eq=False)
class _Watch:
    """One open watch stream."""

    resource: kmock.resource
    namespace: str | None
    name: str | None
    transport: asyncio.BaseTransport | None
    queue: collections.deque[_Change] = attrs.field(factory=collections.deque)
    wake: asyncio.Event = attrs.field(factory=asyncio.Event)
    ended: str | None = None  # "closed" ends the stream cleanly, "cut" drops the connection
    trigger: str | None = None  # a watch of pods by `spec.nodeName=<this>`: only their changes wake it

    def end(self, how: str) -> None:
        self.ended = how
        if how == "cut" and self.transport is not None:
            # Closing the socket before the chunked body's terminator: the client sees a
            # truncated response, as when a connection to a real API server breaks.
            self.transport.close()
        self.wake.set()


def _woken_by(watch: _Watch) -> tuple[str, str | None]:
    return (str(watch.resource.plural), watch.trigger)


def _node_names(change: _Change) -> tuple[str, ...]:
    """The Nodes a pod was and is on (its old and new spec.nodeName; "" when unbound)."""
    return tuple(node_name_of(o or {}) for o in (change.obj, change.previous))


def _parse_timeout(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    assert value is not None
    try:
        return float(int(value))
    except ValueError:
        raise ApiStatus(400, "BadRequest", f"invalid timeoutSeconds: {value!r}") from None


def _too_old(since: int, horizon: int) -> str:
    return f"too old resource version: {since} ({horizon})"
