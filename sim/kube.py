"""An in-process Kubernetes API server for the tests and `tgp demo`, built on kmock.

kmock (`kmock.KubernetesEmulator`) routes requests and serves discovery over real HTTP.
`KubeEmulator` stores the objects itself and adds what tgp's adapters and the CRD bridge rely on,
each following the real API server as recorded in docs/reference (kubernetes-testing.md):

* create answers 201 and stamps `uid`, `resourceVersion`, `generation: 1`, `creationTimestamp`;
  a name already taken is 409 AlreadyExists; a new Pod starts in phase Pending;
* one cluster-wide `resourceVersion` counter, bumped by every write; a patch or a PUT that
  carries a stale `metadata.resourceVersion` is 409 Conflict; a failed JSON-patch `test` is 422;
* merge patch, strategic merge patch (built-in kinds only, 415 on custom resources; list merge
  keys and directives as kubectl sends them, see kube_patch), JSON patch, PUT; a JSON-patch
  content type with an object body is 400;
* the `/status` subresource changes only `status`; the main object ignores `status`;
  `generation` follows `spec` (custom resources: everything but metadata and status);
* finalizers: deleting an object that has some only sets `deletionTimestamp` (a MODIFIED event);
  it goes when the last finalizer is removed;
* CustomResourceDefinitions (`install_crd` or POST): discovery, REST paths for every served
  version, structural-schema pruning, defaulting and validation (422 naming the field); a CRD
  whose `default` breaks its own field's schema is refused at create and update (422);
* watches resume from a `resourceVersion` (410 Gone once it left the retained window, see
  `watch_window` and `compact`), end after `timeoutSeconds`, apply label and field selectors the
  way the watch cache does; `cut_watches` drops open streams; lists carry the collection RV;
* Events in `v1` and `events.k8s.io/v1` share one storage, as in a real cluster;
* Nodes carry `node.kubernetes.io/not-ready:NoSchedule` until their Ready condition is True
  (the admission plugin and node-lifecycle controller of a real cluster, applied instantly);
* the Eviction subresource with PodDisruptionBudget checks (policy/v1 and policy/v1beta1);
* graceful deletion of Pods: a DELETE or an accepted Eviction sets `deletionTimestamp` (now plus
  the grace period) and `deletionGracePeriodSeconds` (from the DeleteOptions, else the pod's
  `terminationGracePeriodSeconds`, defaulted to 30 at create); the pod stays, Terminating, until
  the grace period has passed, then goes (DELETED). Unbound and finished pods and a grace period
  of 0 go at once; a later delete may shorten the grace period, never lengthen it;
* what kubectl reads, so that the real kubectl works against it (tests/test_kubectl.py):
  aggregated discovery (kube_discovery), OpenAPI v3 and v2 (kube_openapi, kube_openapi_v2), Table
  responses with CRD printer columns and built-in printers (kube_tables), `fieldValidation`
  on writes of custom resources, strategic merge patch (kube_patch), streaming lists that end
  their initial events with a bookmark; `write_kubeconfig` points kubectl at the emulator.

The emulator plays the kubelet's last step of a graceful deletion (the final delete once the
containers stopped) with a wall-clock timer, as if every container used its whole grace period.

`register_node` and `set_node_ready` play the kubelet for a simulated cloud. They use plain HTTP,
so they work the same against this emulator and a real API server.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import gzip
import hashlib
import importlib.resources
import json
import math
import os
import pathlib
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Collection, Iterable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

import aiohttp.web
import attrs
import httpx
import jsonpatch
import kmock
from typing_extensions import override

from activities.http import error_message, send
from sim import kube_discovery, kube_openapi, kube_openapi_v2, kube_patch, kube_tables
from tgp.types import GPU_RESOURCE

NODES = kmock.resource("", "v1", "nodes")
PODS = kmock.resource("", "v1", "pods")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")
EVENTS = kmock.resource("", "v1", "events")
EVENTS_V1 = kmock.resource("events.k8s.io", "v1", "events")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")

TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch"

# The finalizer the API server puts on a CustomResourceDefinition being deleted; it goes once
# every custom resource of that definition is gone.
CRD_CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"

# How many changes the emulator keeps for watches that resume from a resourceVersion. A real
# server's watch cache keeps a bounded window per resource too (and etcd compacts every 5 min);
# 1000 is far more than a test produces, so only `compact()` or a small knob expires a watch.
DEFAULT_WATCH_WINDOW = 1000

_EVICTION_PATH = re.compile(r"/api/v1/namespaces/[^/]+/pods/[^/]+/eviction")
_RESOURCE_PATH = re.compile(r"/apis?/.+")
_OPENAPI_V3_PATH = re.compile(r"/openapi/v3(?:/(?P<path>.+))?")
# Controllers whose `spec.replicas` a PodDisruptionBudget counts against.
_SCALABLE_OWNERS = {
    "ReplicaSet": kmock.resource("apps", "v1", "replicasets"),
    "StatefulSet": kmock.resource("apps", "v1", "statefulsets"),
    "ReplicationController": kmock.resource("", "v1", "replicationcontrollers"),
}
# The cluster-wide revision starts high enough to look like a real one and to catch clients
# that compare resourceVersions as strings.
_FIRST_RESOURCE_VERSION = 1000
# A Pod's spec.terminationGracePeriodSeconds when its creator sets none (API defaulting).
_DEFAULT_GRACE_SECONDS = 30
# Metadata only the server writes; a patch or PUT cannot change it.
_SERVER_OWNED_METADATA = (
    "name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation",
    "deletionTimestamp", "deletionGracePeriodSeconds",
)
# The alphabet of `generateName` suffixes (k8s.io/apiserver/pkg/storage/names): no vowels.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_CUSTOM_RESOURCE_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}

Obj = dict[str, Any]


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator plus the API-server behaviours tgp depends on.

    `async with KubeEmulator() as kube:` starts it on 127.0.0.1 and `kube.url` is its base URL.
    kmock's DSL injects faults, e.g. `kube["patch /api/v1/nodes/n1"] << 500`. Unlike plain kmock,
    writes happen in fallback reactions, so a request answered by an injected reaction changes
    nothing, as with a real server that failed.

    Test knobs: `install_crd`, `compact`, `cut_watches`, `watch_window`, `eviction_versions`,
    `expired_watch_as_http`, `field_validation`.
    """

    eviction_versions: frozenset[str] = frozenset({"policy/v1", "policy/v1beta1"})
    """Eviction apiVersions the server accepts; `{"policy/v1beta1"}` plays a pre-1.22 server."""

    watch_window: int = DEFAULT_WATCH_WINDOW
    """How many changes are kept for watches that resume from a resourceVersion. A watch from
    before the oldest kept change gets 410 Gone, as after an etcd compaction."""

    expired_watch_as_http: bool = False
    """Answer a watch from an expired resourceVersion with HTTP 410 instead of 200 and an ERROR
    event in the stream. Current servers do the latter; old ones (and proxies) the former, and
    clients must handle both."""

    field_validation: bool = True
    """Whether the server checks fields itself (`fieldValidation`, Kubernetes 1.25+) and says so
    in OpenAPI v3. False plays an older server: the option is ignored, and kubectl validates on
    the client against OpenAPI v2."""

    _server: kmock.Server | None = attrs.field(default=None, init=False)
    _revision: int = attrs.field(default=_FIRST_RESOURCE_VERSION, init=False)
    # Watches resume from `_changes`; every revision up to `_horizon` has been forgotten.
    _changes: collections.deque[_Change] = attrs.field(factory=collections.deque, init=False)
    _horizon: int = attrs.field(default=_FIRST_RESOURCE_VERSION, init=False)
    _watches: set[_Watch] = attrs.field(factory=set, init=False)
    _custom: dict[tuple[str, str], _CustomResource] = attrs.field(factory=dict, init=False)
    # The kubelet's final delete of each pod in graceful deletion, due when its grace period ends.
    _grace_timers: dict[tuple[kmock.resource, str | None, str], asyncio.TimerHandle] = attrs.field(factory=dict, init=False)
    # The OpenAPI documents and what they were built from (served resources, CRD versions).
    _openapi_cache: tuple[Any, dict[str, Obj]] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # kmock's fallbacks call the _serve_* overrides below
        # Built-in resources: discovery, and which kinds have a status subresource.
        bundled = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
        self.resources.load_data(gzip.decompress(bundled))
        self.fallback["post", _EVICTION_PATH] << self._serve_eviction
        self.fallback["put", _RESOURCE_PATH] << self._serve_replace
        self.fallback["get", _OPENAPI_V3_PATH] << self._serve_openapi_v3
        self.fallback["get /openapi/v2"] << self._serve_openapi_v2

    async def __aenter__(self) -> Self:
        await super().__aenter__()
        if self._server is None:
            self._server = kmock.Server(self)
            await self._server.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._server is not None and self._entered == 1:
            # Open watches end cleanly first; the server would otherwise wait for them.
            for watch in list(self._watches):
                watch.end("closed")
            for timer in self._grace_timers.values():
                timer.cancel()
            self._grace_timers.clear()
            server, self._server = self._server, None
            await server.__aexit__(exc_type, exc_value, traceback)
        await super().__aexit__(exc_type, exc_value, traceback)

    @property
    def url(self) -> str:  # type: ignore[override]  # a plain str, unlike kmock's yarl.URL
        """Base URL of the API, e.g. `http://127.0.0.1:40123`."""
        if self._server is None:
            raise RuntimeError("KubeEmulator is not running: use `async with KubeEmulator() as kube`")
        return str(self._server.url).rstrip("/")

    def write_kubeconfig(
        self, path: str | os.PathLike[str], *, context: str = "tgp", namespace: str = "default",
    ) -> pathlib.Path:
        """Write a kubeconfig for kubectl (or any client) that points at this emulator and return
        its path: one cluster, user and context named `context`, plain HTTP, no credentials,
        `namespace` as the context's default namespace. The file is only valid while the
        emulator runs (its port is chosen at start). Use it as `KUBECONFIG=<path> kubectl get gnp -A`."""
        target = pathlib.Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(kubeconfig(self.url, context=context, namespace=namespace), indent=2) + "\n")
        return target

    # --- test knobs ------------------------------------------------------------------

    def install_crd(self, crd: Mapping[str, Any]) -> Obj:
        """Install or update a CustomResourceDefinition, as `kubectl apply -f crd.yaml` would.

        Its resource is served at once (a real server takes a moment to report Established).
        Returns the stored CRD; raises `ApiStatus` (422) for a definition the server refuses.
        """
        name = ((crd.get("metadata") or {}).get("name")) or ""
        key = (CRDS, None, name)
        if key in self.objects and not self.objects[key].deleted:
            current = self.objects[key].raw
            proposed = copy.deepcopy(dict(crd))
            proposed.setdefault("metadata", {})["resourceVersion"] = current["metadata"]["resourceVersion"]
            return self._update(CRDS, None, key, current, proposed)
        return self._create(CRDS, None, crd)

    def compact(self) -> None:
        """Forget the change history, as an etcd compaction does: a watch from any earlier
        resourceVersion gets 410 Gone and its client must list again. Open watches go on."""
        self._changes.clear()
        self._horizon = self._revision

    def cut_watches(self) -> int:
        """Drop every open watch connection mid-stream, as an API server restart or a load
        balancer's idle timeout does: the client sees the connection close without the end of
        the chunked body and must reconnect. Returns how many streams were cut."""
        watches = list(self._watches)
        for watch in watches:
            watch.end("cut")
            self._watches.discard(watch)
        return len(watches)

    @property
    def open_watches(self) -> int:
        """How many watch streams are being served right now."""
        return len(self._watches)

    # --- request handling ----------------------------------------------------------------

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skips KubernetesEmulator._handle, which writes before any reaction is consulted.
        try:
            return await kmock.RawHandler._handle(self, request)
        except ApiStatus as status:
            return status.render()

    @override
    def _get_resources(self) -> list[kmock.resource]:
        # kmock also lists the resources of stored objects; a custom resource's storage key is
        # not an endpoint unless its CRD serves that version.
        declared = set(kmock.KubernetesScaffold._get_resources(self))
        seeded = {resource for resource, _, _ in self.objects if (resource.group, resource.plural) not in self._custom}
        return list(declared | seeded)

    @override
    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        resource = self._served(request)
        warning = self._field_validation(request, resource, request.data)
        # Always 201 (and the Warning header, None for none): kmock keeps the status and headers
        # of a Response returned from a reaction.
        created = self._create(resource, request.namespace, request.data)
        return kmock.Response(status=201, headers={"Warning": warning}, payload=created)

    @override
    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        resource = self._served(request, subresources={"status"})
        if _content_type(request).startswith(APPLY_PATCH):
            # Before the lookup: server-side apply would create a missing object (`kubectl apply
            # --server-side` must not read "not found").
            raise ApiStatus(415, "UnsupportedMediaType", "server-side apply is not emulated; send a merge patch")
        key, current = self._existing(resource, request.namespace, request.name)
        proposed = self._apply_patch(request, resource, self._present(resource, current))
        warning = self._field_validation(request, resource, proposed)
        updated = self._update(resource, request.subresource, key, current, proposed)
        return kmock.Response(status=200, headers={"Warning": warning}, payload=updated)

    async def _serve_replace(self, request: kmock.Request) -> kmock.Payload:
        """PUT: the body replaces the object (or its status); its resourceVersion must be current."""
        resource = self._served(request, subresources={"status"})
        if request.name is None:
            raise ApiStatus(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        key, current = self._existing(resource, request.namespace, request.name)
        if not isinstance(request.data, Mapping):
            raise ApiStatus(400, "BadRequest", "the body of a PUT must be a JSON object")
        proposed = copy.deepcopy(dict(request.data))
        meta = proposed.setdefault("metadata", {})
        if meta.get("name") not in (None, request.name):
            raise ApiStatus(
                400, "BadRequest",
                f"the name of the object ({meta['name']}) does not match the name on the URL ({request.name})",
            )
        current_version = current["metadata"]["resourceVersion"]
        if not meta.get("resourceVersion"):
            if self._custom_version(resource) is not None:
                # Custom resources do not allow unconditional updates (AllowUnconditionalUpdate).
                raise _invalid(resource.group or "", resource.plural or "", request.name, [_FieldError(
                    "FieldValueInvalid", "metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update",
                )])
            meta["resourceVersion"] = current_version
        elif str(meta["resourceVersion"]) != current_version:
            raise _conflict(resource, request.name)
        warning = self._field_validation(request, resource, proposed)
        updated = self._update(resource, request.subresource, key, current, proposed)
        return kmock.Response(status=200, headers={"Warning": warning}, payload=updated)

    def _field_validation(self, request: kmock.Request, resource: kmock.resource, obj: Any) -> str | None:
        """The `fieldValidation` option of a write (Strict, Warn (the default) or Ignore) applied
        to the fields of a custom resource that its schema does not declare (and pruning would
        drop): Strict refuses the write (400), Warn returns the Warning header to send, one
        warning per field, as the API server does. kubectl sends Strict. Built-in kinds are not
        checked (the emulator has no complete schemas for them)."""
        mode = request.params.get("fieldValidation") or "Warn"
        if mode not in ("Ignore", "Warn", "Strict"):
            raise ApiStatus(400, "BadRequest", f'fieldValidation: Unsupported value: "{mode}": supported values: '
                            '"Ignore", "Strict", "Warn"')
        custom = self._custom_version(resource)
        if custom is None or mode == "Ignore" or not self.field_validation or not isinstance(obj, Mapping):
            return None
        pruned = copy.deepcopy(dict(obj))
        _prune(pruned, custom[1].schema, root=True)
        unknown = _removed_fields(obj, pruned, "")
        if not unknown:
            return None
        if mode == "Strict":
            kind = custom[0].kind
            raise ApiStatus(400, "BadRequest", (
                f'{kind} in version "{resource.version}" cannot be handled as a {kind}: strict decoding error: '
                + ", ".join(f'unknown field "{field}"' for field in unknown)
            ))
        return ", ".join('299 - ' + json.dumps(f'unknown field "{field}"') for field in unknown)

    @override
    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
        resource = self._served(request)
        key, current = self._existing(resource, request.namespace, request.name)
        options = request.data if isinstance(request.data, Mapping) else {}
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != current["metadata"].get("uid"):
            raise _conflict(resource, request.name, (
                f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                f"UID in object meta: {current['metadata'].get('uid')}"
            ))
        wanted_version = preconditions.get("resourceVersion")
        if wanted_version and wanted_version != current["metadata"]["resourceVersion"]:
            raise _conflict(resource, request.name, (
                f"Precondition failed: ResourceVersion in precondition: {wanted_version}, "
                f"ResourceVersion in object meta: {current['metadata']['resourceVersion']}"
            ))
        if resource == CRDS:
            return self._present(resource, self._delete_crd(key, current))
        if resource == PODS:
            # DeleteOptions come from the body when there is one, else from the query.
            requested = options.get("gracePeriodSeconds") if request.data else request.params.get("gracePeriodSeconds")
            return self._present(resource, self._delete_pod(key, current, _grace_seconds(requested)))
        obj, removed = self._delete(key, current)
        if removed and self._custom_version(resource) is not None:
            # The generic registry answers with a Status unless the store returns the object
            # (built-in kinds such as Pods do; custom resources do not).
            meta = obj["metadata"]
            return {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": meta["name"], "group": resource.group, "kind": resource.plural, "uid": meta["uid"]},
            }
        return self._present(resource, obj)

    @override
    async def _serve_fetch(self, request: kmock.Request) -> kmock.Payload:
        if _is_true(request.params.get("watch")):
            return await self._serve_watch(request)  # `watch=1` and `watch=True` count too
        resource = self._served(request, subresources={"status"})
        _, current = self._existing(resource, request.namespace, request.name)
        if kube_tables.wants_table(_accept(request)):
            return self._table(request, resource, [self._present(resource, current)])
        return self._present(resource, current)

    @override
    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        if _is_true(request.params.get("watch")):
            return await self._serve_watch(request)
        resource = self._served(request)
        selection = self._selection(resource, request.params)
        wanted = _parse_resource_version(request.params.get("resourceVersion"))
        if request.params.get("resourceVersionMatch") == "Exact" and wanted is not None and wanted < self._horizon:
            raise ApiStatus(410, "Expired", "The resourceVersion for the provided list is too old.")
        storage = self._storage(resource)
        items = []
        for (kind, namespace, _), stored in sorted(self.objects.items(), key=_storage_order):
            if kind != storage or stored.deleted:
                continue
            if request.namespace is not None and namespace != request.namespace:
                continue
            obj = self._present(resource, stored.raw)
            if selection.matches(obj):
                items.append(obj)
        if kube_tables.wants_table(_accept(request)):
            return self._table(request, resource, items, str(self._revision))
        return {
            "apiVersion": _api_version(resource),
            "kind": f"{self._list_kind(resource)}",
            "metadata": {"resourceVersion": str(self._revision)},
            "items": items,
        }

    @override
    async def _serve_watch(self, request: kmock.Request) -> kmock.Payload:  # type: ignore[override]
        """Checks the request before any byte is sent (a bad selector is a plain 400), then
        hands kmock the stream."""
        resource = self._served(request)
        selection = self._selection(resource, request.params)
        since = _parse_resource_version(request.params.get("resourceVersion"))
        timeout = _parse_timeout(request.params.get("timeoutSeconds"))
        # Streaming lists (client-go's WatchListClient, e.g. the wait of `kubectl delete`): the
        # current state, then a bookmark marking the end of the initial events, then changes.
        initial_events = _is_true(request.params.get("sendInitialEvents"))
        if initial_events:
            if request.params.get("resourceVersionMatch") != "NotOlderThan":
                raise ApiStatus(422, "Invalid", "resourceVersionMatch: Forbidden: sendInitialEvents requires "
                                "setting resourceVersionMatch to NotOlderThan")
            since = None
        if since is not None and since < self._horizon and self.expired_watch_as_http:
            raise ApiStatus(410, "Expired", _too_old(since, self._horizon))
        # A Response's headers stick to the reaction (kmock), which is harmless: always JSON.
        stream = self._stream(
            request, resource, selection, since, timeout,
            initial_events_end=initial_events and _is_true(request.params.get("allowWatchBookmarks")),
        )
        if kube_tables.wants_table(_accept(request)):
            stream = self._table_events(request, resource, stream)
        return kmock.Response(headers={"Content-Type": "application/json"}, payload=stream)

    async def _stream(
        self,
        request: kmock.Request,
        resource: kmock.resource,
        selection: _Selection,
        since: int | None,
        timeout: float | None,
        *,
        initial_events_end: bool = False,
    ) -> AsyncIterator[kmock.Payload]:
        """The watch stream: what happened after `since` (or the current state as ADDED events
        when there is none), then every change as it happens."""
        if since is not None and since < self._horizon:
            # In-stream, as the watch cache reports it: 200, one ERROR event, end of stream.
            yield {"type": "ERROR", "object": _status_body(410, "Expired", _too_old(since, self._horizon))}
            return
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        storage = self._storage(resource)
        raw_request = request._raw_request
        watch = _Watch(
            resource=storage,
            namespace=request.namespace,
            name=request.name,
            transport=raw_request.transport if raw_request is not None else None,
        )
        # Backlog and registration in one step (no await between), so no change falls between.
        if since is None:
            watch.queue.extend(
                _Change(int(stored.raw["metadata"]["resourceVersion"]), storage, "ADDED", stored.raw, None)
                for (kind, _, _), stored in sorted(self.objects.items(), key=_storage_order)
                if kind == storage and not stored.deleted
            )
        else:
            watch.queue.extend(c for c in self._changes if c.resource == storage and c.revision > since)
        if initial_events_end:
            watch.queue.append(_Change(self._revision, storage, "BOOKMARK", {
                "kind": self._kind(resource), "apiVersion": _api_version(resource),
                "metadata": {"resourceVersion": str(self._revision), "annotations": {"k8s.io/initial-events-end": "true"}},
            }, None))
        self._watches.add(watch)
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
            self._watches.discard(watch)

    def _watch_event(
        self, watch: _Watch, change: _Change, resource: kmock.resource, selection: _Selection
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
        gone = change.obj if change.type == "DELETED" else _with_version(change.previous, change.revision)
        return {"type": "DELETED", "object": self._present(resource, gone)}

    # --- writes ----------------------------------------------------------------------

    def _create(self, resource: kmock.resource, url_namespace: str | None, body: Any) -> Obj:
        """Admit and store a new object; the stored object as the client's version shows it."""
        if not isinstance(body, Mapping):
            raise ApiStatus(400, "BadRequest", "the body of a create must be a JSON object")
        obj: Obj = copy.deepcopy(dict(body))
        if not isinstance(obj.setdefault("metadata", {}), dict):
            raise ApiStatus(400, "BadRequest", "metadata must be a JSON object")
        custom = self._custom_version(resource)
        if custom is not None:
            _check_type_meta(resource, custom[0], obj)
        if resource == EVENTS_V1:
            obj = _event_to_core(obj)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            # etcd3 storage refuses it; the API server passes that on as an internal error.
            raise ApiStatus(500, "InternalError", "resourceVersion should not be set on objects to be created")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
        name = meta.get("name")
        if not name:
            raise ApiStatus(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        namespace: str | None = None
        if self._namespaced(resource):
            if url_namespace and meta.get("namespace") not in (None, "", url_namespace):
                raise ApiStatus(
                    400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request",
                )
            namespace = url_namespace or meta.get("namespace")
            if not namespace:
                raise ApiStatus(400, "BadRequest", "the namespace of the object must be set")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "uid", "creationTimestamp", "generation"):
            meta.pop(field, None)
        obj.setdefault("apiVersion", _api_version(EVENTS if resource == EVENTS_V1 else resource))
        obj.setdefault("kind", self._kind(resource))

        if resource in (EVENTS, EVENTS_V1):
            errors = _event_errors(obj, resource)
            if errors:
                raise _invalid(resource.group or "", "Event", name, errors)
        if custom is not None:
            crd, version = custom
            if crd.terminating:
                raise ApiStatus(405, "MethodNotAllowed", "create not allowed while custom resource definition is terminating")
            if "status" in version.subresources:
                obj.pop("status", None)  # create cannot set status
            obj = version.shape(obj)
            meta = obj["metadata"]
            errors = [*_name_errors(name), *version.validate(obj)]
            if errors:
                raise _invalid(resource.group or "", crd.kind, name, errors)
        if resource == CRDS:
            _check_crd(obj)
            _default_crd(obj)

        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now())
        if resource not in (EVENTS, EVENTS_V1):  # Events have no generation
            meta["generation"] = 1
        if resource == PODS:
            obj["status"] = {"phase": "Pending"}
            if isinstance(obj.setdefault("spec", {}), dict):
                obj["spec"].setdefault("terminationGracePeriodSeconds", _DEFAULT_GRACE_SECONDS)
        if resource == NODES:
            _taint_by_readiness(obj)

        stored = self._to_storage(resource, obj)
        key = (self._storage(resource), namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise ApiStatus(
                409, "AlreadyExists", f'{_qualified_resource(resource)} "{name}" already exists',
                {"name": name, "group": resource.group, "kind": resource.plural},
            )
        stored["metadata"]["resourceVersion"] = self._next_resource_version()
        if key in self.objects:
            self.objects[key].create(stored)  # re-created after a deletion: history continues
        else:
            self.objects[key] = stored
        self._publish(key[0], "ADDED", stored, None)
        if resource == CRDS:
            self._register_crd(stored)
        return self._present(resource, stored)

    def _update(
        self,
        resource: kmock.resource,
        subresource: str | None,
        key: tuple[kmock.resource, str | None, str],
        current: Obj,
        proposed: Obj,
    ) -> Obj:
        """Admit and store `proposed` (in the request's version) as the new state of `current`."""
        presented = self._present(resource, current)
        changed = self._admit_update(resource, subresource, presented, proposed)
        stored = self._to_storage(resource, changed)
        if stored == current:
            return presented  # a no-op writes nothing and keeps the resourceVersion
        meta = stored["metadata"]
        if _last_finalizer_removed(current, stored):
            # The object is deleted instead of written. The reply is the object as sent;
            # watchers see DELETED with its last stored state.
            self._remove(key, current)
            return self._present(resource, stored)
        meta["resourceVersion"] = self._next_resource_version()
        self.objects[key].history.append(stored)
        self._publish(key[0], "MODIFIED", stored, current)
        if resource == CRDS:
            self._register_crd(stored)
        return self._present(resource, stored)

    def _admit_update(self, resource: kmock.resource, subresource: str | None, current: Obj, proposed: Obj) -> Obj:
        """The object the API server would store for `proposed`, or ApiStatus as it would refuse it."""
        if not isinstance(proposed.get("metadata", {}), dict):
            raise ApiStatus(400, "BadRequest", "metadata must be a JSON object")
        changed = copy.deepcopy(proposed)
        # Identity, type and server-owned metadata never change through an update.
        for field in ("apiVersion", "kind"):
            changed[field] = current.get(field)
        changed_meta = changed.setdefault("metadata", {})
        for field in _SERVER_OWNED_METADATA:
            if field in current["metadata"]:
                changed_meta[field] = current["metadata"][field]
            else:
                changed_meta.pop(field, None)

        info = self._info(resource)
        if subresource == "status":
            status = changed.get("status")
            changed = copy.deepcopy(current)
            if status is None:
                changed.pop("status", None)
            else:
                changed["status"] = status
        elif "status" in info.subresources:
            changed.pop("status", None)
            if "status" in current:
                changed["status"] = copy.deepcopy(current["status"])

        old_finalizers = current["metadata"].get("finalizers") or []
        added = [f for f in changed["metadata"].get("finalizers") or [] if f not in old_finalizers]
        if current["metadata"].get("deletionTimestamp") and added:
            raise _invalid(resource.group or "", self._kind(resource), current["metadata"]["name"], [_FieldError(
                "FieldValueForbidden", "metadata.finalizers",
                "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers "
                "[]string{" + ", ".join(json.dumps(f) for f in added) + "}",
            )])

        if resource == CRDS:
            _check_crd(changed)
            if changed["spec"].get("scope") != current["spec"].get("scope"):
                raise _invalid("apiextensions.k8s.io", "CustomResourceDefinition", current["metadata"]["name"], [
                    _FieldError.invalid("spec.scope", changed["spec"].get("scope"), "field is immutable"),
                ])
            _default_crd(changed)
        custom = self._custom_version(resource)
        if custom is not None:
            crd, version = custom
            changed = version.shape(changed)
            ignored = {"metadata", "status"} if "status" in version.subresources else {"metadata"}
            if _without(changed, ignored) != _without(current, ignored):
                changed["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
            errors = version.validate(changed)
            if errors:
                raise _invalid(resource.group or "", crd.kind, current["metadata"]["name"], errors)
        elif changed.get("spec") != current.get("spec") and "generation" in current["metadata"]:
            changed["metadata"]["generation"] = int(current["metadata"]["generation"]) + 1
        if resource == NODES:
            _taint_by_readiness(changed)
        return changed

    def _apply_patch(self, request: kmock.Request, resource: kmock.resource, current: Obj) -> Obj:
        """The object after `request`'s patch, or ApiStatus as the API server would refuse it."""
        content_type = _content_type(request)
        patch = request.data
        if content_type.startswith(APPLY_PATCH):
            raise ApiStatus(415, "UnsupportedMediaType", "server-side apply is not emulated; send a merge patch")
        if content_type == STRATEGIC_MERGE_PATCH and not _is_builtin(resource):
            raise ApiStatus(
                415, "UnsupportedMediaType",
                f"the body of the request was in an unknown format - accepted media types include: {JSON_PATCH}, {MERGE_PATCH}",
            )
        if content_type == JSON_PATCH:
            if not isinstance(patch, list):
                raise ApiStatus(400, "BadRequest", "json: cannot unmarshal object into Go value of type []handlers.jsonPatchOp")
            try:
                changed: Obj = jsonpatch.apply_patch(current, patch, in_place=False)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise ApiStatus(422, "Invalid", f"the server rejected our request due to an error in our request: {exc}")
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
                raise ApiStatus(422, "Invalid", str(exc))
        elif isinstance(patch, Mapping) and content_type == STRATEGIC_MERGE_PATCH:
            changed = kube_patch.strategic_merge(current, patch)
        elif isinstance(patch, Mapping):
            changed = _merge_patch(current, patch)
        else:
            raise ApiStatus(400, "BadRequest", f"a {content_type or 'patch'} body must be a JSON object")
        if not isinstance(changed, dict):
            raise ApiStatus(400, "BadRequest", "the patched object must be a JSON object")
        # A resourceVersion in the patched object is a precondition, as with a PUT.
        wanted_version = (changed.get("metadata") or {}).get("resourceVersion")
        if wanted_version is not None and str(wanted_version) != current["metadata"].get("resourceVersion"):
            raise _conflict(resource, request.name)
        return copy.deepcopy(changed)

    def _delete(self, key: tuple[kmock.resource, str | None, str], current: Obj) -> tuple[Obj, bool]:
        """Delete a stored object as the API server would: the object afterwards and whether it
        is gone. One with finalizers only gets a deletionTimestamp (and a generation bump)."""
        meta = current["metadata"]
        if not meta.get("finalizers"):
            return self._remove(key, current), True
        if meta.get("deletionTimestamp"):
            return current, False  # already being deleted: nothing changes
        marked = copy.deepcopy(current)
        marked_meta = marked["metadata"]
        if int(marked_meta.get("generation") or 0) > 0:
            marked_meta["generation"] = int(marked_meta["generation"]) + 1
        marked_meta.update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0)
        marked_meta["resourceVersion"] = self._next_resource_version()
        self.objects[key].history.append(marked)
        self._publish(key[0], "MODIFIED", marked, current)
        return marked, False

    def _delete_pod(self, key: tuple[kmock.resource, str | None, str], current: Obj, requested: int | None) -> Obj:
        """Delete a Pod gracefully, as the API server's pod strategy and generic registry do
        (CheckGracefulDelete, BeforeDelete); the pod afterwards. `requested` is the
        DeleteOptions' gracePeriodSeconds."""
        meta, spec = current["metadata"], current.get("spec") or {}
        if requested is not None and requested < 0:
            requested = 1  # a negative grace period means 1 s
        now = datetime.now(UTC).timestamp()
        pending = meta.get("deletionGracePeriodSeconds")
        if meta.get("deletionTimestamp"):
            if pending and (requested is None or requested >= pending):
                return current  # a graceful deletion under way can only be shortened
            period = requested if pending and requested is not None else 0
            if not pending and meta.get("finalizers"):
                return current  # due already, waiting for its finalizers
            # The deletionTimestamp is when the deletion is due: it moves earlier by the difference.
            due = _parse_time(meta["deletionTimestamp"]) - pending + period if pending else now
        else:
            default = spec.get("terminationGracePeriodSeconds")
            period = requested if requested is not None else (_DEFAULT_GRACE_SECONDS if default is None else int(default))
            if not spec.get("nodeName") or (current.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                period = 0  # no kubelet runs it, or its containers have stopped already
            due = now + period
        timer = self._grace_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if period == 0 and not meta.get("finalizers"):
            return self._remove(key, current)
        marked = copy.deepcopy(current)
        marked_meta = marked["metadata"]
        if not meta.get("deletionTimestamp") and int(marked_meta.get("generation") or 0) > 0:
            marked_meta["generation"] = int(marked_meta["generation"]) + 1
        marked_meta.update(deletionTimestamp=_format_time(due), deletionGracePeriodSeconds=period)
        marked_meta["resourceVersion"] = self._next_resource_version()
        self.objects[key].history.append(marked)
        self._publish(key[0], "MODIFIED", marked, current)
        if period > 0:
            self._grace_timers[key] = asyncio.get_running_loop().call_later(
                max(0.0, due - now), self._grace_elapsed, key, meta.get("uid"),
            )
        return marked

    def _grace_elapsed(self, key: tuple[kmock.resource, str | None, str], uid: str | None) -> None:
        """The kubelet's final delete (grace period 0) of a pod whose grace period has passed."""
        self._grace_timers.pop(key, None)
        if key not in self.objects or self.objects[key].deleted:
            return
        current = self.objects[key].raw
        if current["metadata"].get("uid") == uid and current["metadata"].get("deletionTimestamp"):
            try:
                self._delete_pod(key, current, 0)
            except Exception as exc:  # a timer's exception would only be logged; tests check `errors`
                self.errors.append(exc)

    def _remove(self, key: tuple[kmock.resource, str | None, str], current: Obj) -> Obj:
        """Remove a stored object now; the DELETED event carries its last state and a new RV."""
        gone = _with_version(current, int(self._next_resource_version()))
        self.objects[key].history.append(gone)
        self.objects[key].delete()
        self._publish(key[0], "DELETED", gone, current)
        custom = self._custom.get((key[0].group or "", key[0].plural or ""))
        if custom is not None and custom.terminating:
            self._finish_crd_deletion(custom)
        return gone

    def _publish(self, resource: kmock.resource, kind: str, obj: Obj, previous: Obj | None) -> None:
        change = _Change(int(obj["metadata"]["resourceVersion"]), resource, kind, obj, previous)
        self._changes.append(change)
        while len(self._changes) > max(self.watch_window, 0):
            self._horizon = self._changes.popleft().revision
        for watch in self._watches:
            if watch.resource == resource:
                watch.queue.append(change)
                watch.wake.set()

    def _next_resource_version(self) -> str:
        self._revision += 1
        return str(self._revision)

    # --- CustomResourceDefinitions -----------------------------------------------------

    def _register_crd(self, crd: Obj) -> None:
        """Serve the CRD's resource: discovery, REST paths for served versions, schemas."""
        spec = crd["spec"]
        group, names = spec["group"], spec["names"]
        plural = names["plural"]
        previous = self._custom.get((group, plural))
        versions = {
            v["name"]: _CustomVersion.from_crd(v)
            for v in spec["versions"] if v.get("served")
        }
        storage_version = next(v["name"] for v in spec["versions"] if v.get("storage"))
        custom = _CustomResource(
            kind=names["kind"],
            list_kind=names.get("listKind") or f"{names['kind']}List",
            namespaced=spec["scope"] == "Namespaced",
            # Objects stay where they were first stored when the storage version changes later.
            storage=previous.storage if previous else kmock.resource(group, storage_version, plural),
            versions=versions,
            terminating=bool(crd["metadata"].get("deletionTimestamp")),
        )
        if previous is not None:
            for name in previous.versions.keys() - versions.keys():
                del self.resources[kmock.resource(group, name, plural)]
        self._custom[(group, plural)] = custom
        for name, version in versions.items():
            self.resources[kmock.resource(group, name, plural)] = kmock.ResourceInfo(
                namespaced=custom.namespaced,
                kind=custom.kind,
                singular=names.get("singular") or custom.kind.lower(),
                shortnames=names.get("shortNames") or (),
                categories=names.get("categories") or (),
                verbs=_CUSTOM_RESOURCE_VERBS,
                subresources=version.subresources,
            )

    def _delete_crd(self, key: tuple[kmock.resource, str | None, str], current: Obj) -> Obj:
        """Deleting a CRD deletes its custom resources (finalizers respected); the CRD goes when
        the last of them has gone, as the API server's finalizing controller does."""
        if current["metadata"].get("deletionTimestamp"):
            return current
        marked = copy.deepcopy(current)
        meta = marked["metadata"]
        meta["finalizers"] = [*(meta.get("finalizers") or []), CRD_CLEANUP_FINALIZER]
        meta.update(deletionTimestamp=_now(), deletionGracePeriodSeconds=0, resourceVersion=self._next_resource_version())
        status = marked.setdefault("status", {})
        status["conditions"] = [
            *[c for c in status.get("conditions") or [] if c.get("type") != "Terminating"],
            {"type": "Terminating", "status": "True", "reason": "InstanceDeletionInProgress",
             "message": "CustomResource deletion is in progress", "lastTransitionTime": _now()},
        ]
        self.objects[key].history.append(marked)
        self._publish(CRDS, "MODIFIED", marked, current)
        spec = marked["spec"]
        custom = self._custom[(spec["group"], spec["names"]["plural"])]
        custom.terminating = True
        for object_key, stored in list(self.objects.items()):
            if object_key[0] == custom.storage and not stored.deleted:
                self._delete(object_key, stored.raw)
        self._finish_crd_deletion(custom)
        return self.objects[key].last.raw

    def _finish_crd_deletion(self, custom: _CustomResource) -> None:
        if any(k[0] == custom.storage and not o.deleted for k, o in self.objects.items()):
            return
        group, plural = custom.storage.group or "", custom.storage.plural or ""
        key = (CRDS, None, f"{plural}.{group}")
        if key not in self.objects or self.objects[key].deleted:
            return
        current = self.objects[key].raw
        released = copy.deepcopy(current)
        released["metadata"]["finalizers"] = [
            f for f in released["metadata"].get("finalizers") or [] if f != CRD_CLEANUP_FINALIZER
        ]
        if released["metadata"]["finalizers"]:
            released["metadata"]["resourceVersion"] = self._next_resource_version()
            self.objects[key].history.append(released)
            self._publish(CRDS, "MODIFIED", released, current)
            return
        del self._custom[(group, plural)]
        for name in custom.versions:
            del self.resources[kmock.resource(group, name, plural)]
        for object_key in [k for k in self.objects.keys() if k[0] == custom.storage]:
            del self.objects[object_key]
        self._remove(key, current)

    def _custom_version(self, resource: kmock.resource) -> tuple[_CustomResource, _CustomVersion] | None:
        custom = self._custom.get((resource.group or "", resource.plural or ""))
        if custom is None or resource.version not in custom.versions:
            return None
        return custom, custom.versions[resource.version]

    # --- resources and their representations ------------------------------------------

    def _served(self, request: kmock.Request, *, subresources: Collection[str] = ()) -> kmock.resource:
        """The resource of `request`, or 404 as the API server answers for a path it lacks."""
        resource = request.resource
        if resource is None or resource not in self._get_resources():
            raise _no_such_resource()
        if request.namespace is not None and not self._namespaced(resource):
            raise _no_such_resource()
        if request.subresource is not None and (
            request.subresource not in subresources or request.subresource not in self._info(resource).subresources
        ):
            raise _no_such_resource()
        return resource

    def _existing(
        self, resource: kmock.resource, namespace: str | None, name: str | None
    ) -> tuple[tuple[kmock.resource, str | None, str], Obj]:
        key = (self._storage(resource), namespace if self._namespaced(resource) else None, name or "")
        if name is None or key not in self.objects or self.objects[key].deleted:
            raise ApiStatus(
                404, "NotFound", f'{_qualified_resource(resource)} "{name}" not found',
                {"name": name, "group": resource.group, "kind": resource.plural},
            )
        return key, self.objects[key].raw

    def _storage(self, resource: kmock.resource) -> kmock.resource:
        """Where objects of `resource` are stored: one place for all versions of a kind."""
        if resource == EVENTS_V1:
            return EVENTS
        custom = self._custom.get((resource.group or "", resource.plural or ""))
        return custom.storage if custom is not None else resource

    def _to_storage(self, resource: kmock.resource, obj: Obj) -> Obj:
        if resource == EVENTS_V1:
            return _event_to_core(obj)
        storage = self._storage(resource)
        if storage != resource:
            return {**obj, "apiVersion": _api_version(storage)}
        return obj

    def _present(self, resource: kmock.resource, obj: Obj) -> Obj:
        """A stored object as a client of `resource`'s version sees it."""
        if resource == EVENTS_V1:
            return _event_to_v1(obj)
        if obj.get("apiVersion") != _api_version(resource) and (resource.group, resource.plural) in self._custom:
            return {**obj, "apiVersion": _api_version(resource)}  # conversion strategy None
        return obj

    def _selection(self, resource: kmock.resource, params: Mapping[str, str]) -> _Selection:
        selection = _Selection.parse(params)
        custom = self._custom_version(resource)
        if custom is not None:
            allowed = {"metadata.name", "metadata.namespace", *custom[1].selectable_fields}
            for path, _, _ in selection.fields:
                if path not in allowed:
                    raise ApiStatus(400, "BadRequest", f"field label not supported: {path}")
        return selection

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        return self.resources[resource] if resource in self.resources else kmock.ResourceInfo()

    def _kind(self, resource: kmock.resource) -> str:
        return self._info(resource).kind or (resource.plural or "").capitalize()

    def _list_kind(self, resource: kmock.resource) -> str:
        custom = self._custom.get((resource.group or "", resource.plural or ""))
        return custom.list_kind if custom is not None else f"{self._kind(resource)}List"

    def _namespaced(self, resource: kmock.resource) -> bool:
        namespaced = self._info(resource).namespaced
        return True if namespaced is None else namespaced

    # --- what kubectl reads: discovery, OpenAPI, Tables (kube_discovery, kube_openapi*, kube_tables)

    def _served_resources(self) -> dict[kmock.resource, kmock.ResourceInfo]:
        return {r: self._info(r) for r in self._get_resources() if r.plural and r.version is not None}

    @override
    async def _serve_api(self, request: kmock.Request) -> kmock.Payload:
        # Every answer of a reaction sets its Content-Type: kmock keeps a Response's headers.
        if kube_discovery.wants_aggregated(_accept(request)):
            document = kube_discovery.aggregated(self._served_resources(), core=True)
            return kmock.Response(headers={"Content-Type": kube_discovery.AGGREGATED_V2}, payload=document)
        return kmock.Response(headers={"Content-Type": "application/json"}, payload=await super()._serve_api(request))

    @override
    async def _serve_apis(self, request: kmock.Request) -> kmock.Payload:
        if kube_discovery.wants_aggregated(_accept(request)):
            document = kube_discovery.aggregated(self._served_resources(), core=False)
            return kmock.Response(headers={"Content-Type": kube_discovery.AGGREGATED_V2}, payload=document)
        return kmock.Response(
            headers={"Content-Type": "application/json"}, payload=kube_discovery.legacy_groups(self._get_resources()),
        )

    @override
    async def _serve_group(self, request: kmock.Request) -> kmock.Payload:
        group = kube_discovery.legacy_group(self._get_resources(), (request.resource and request.resource.group) or "")
        if group is None:
            raise _no_such_resource()
        return group

    @override
    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        document = await super()._serve_version(request)
        return kube_discovery.legacy_resource_list(document) if isinstance(document, dict) else document

    def _openapi_documents(self) -> dict[str, Obj]:
        """OpenAPI v3 documents by index key (`api/v1`, `apis/tgp.io/v1`), for every served
        group-version, from the served resources and the installed CRDs' schemas."""
        served = self._served_resources()
        crds = sorted((k[2], o.raw["metadata"]["resourceVersion"]) for k, o in self.objects.items()
                      if k[0] == CRDS and not o.deleted)
        key = (frozenset(served), tuple(crds), self.field_validation)
        if self._openapi_cache is not None and self._openapi_cache[0] == key:
            return self._openapi_cache[1]
        documents = {}
        for group, version in sorted({(r.group or "", str(r.version)) for r in served}):
            custom = {
                c.kind: c.versions[version].schema for (g, _), c in self._custom.items()
                if g == group and version in c.versions
            }
            document = kube_openapi.group_version(group, version, served, custom, field_validation=self.field_validation)
            if document is not None:
                documents[kube_openapi.document_path(group, version)] = document
        self._openapi_cache = (key, documents)
        return documents

    async def _serve_openapi_v3(self, request: kmock.Request) -> kmock.Payload:
        documents = self._openapi_documents()
        match = _OPENAPI_V3_PATH.fullmatch(request.url.path)
        path = match.group("path") if match else None
        if path is None:
            payload = kube_openapi.index(documents)
        elif path in documents:
            payload = documents[path]
        else:
            raise _no_such_resource()
        return kmock.Response(status=200, headers={"Content-Type": "application/json"}, payload=payload)

    async def _serve_openapi_v2(self, request: kmock.Request) -> kmock.Payload:
        """Swagger 2.0: protobuf when asked for (kubectl), else JSON."""
        document = kube_openapi_v2.swagger(self._openapi_documents().values())
        if kube_openapi_v2.wants_protobuf(_accept(request)):
            return kmock.Response(
                # kube-openapi answers the protobuf as octet-stream: the media type kubectl asks
                # for has an `@`, which Go's media-type parser refuses in a Content-Type.
                status=200, headers={"Content-Type": "application/octet-stream"}, payload=kube_openapi_v2.protobuf(document),
            )
        return kmock.Response(status=200, headers={"Content-Type": "application/json"}, payload=document)

    def _table_convertor(self, resource: kmock.resource) -> kube_tables.Convertor:
        custom = self._custom_version(resource)
        if custom is not None:
            return kube_tables.custom_resource(custom[1].printer_columns)
        return kube_tables.built_in(resource.group or "", self._kind(resource))

    def _table(
        self, request: kmock.Request, resource: kmock.resource, objects: list[Obj], resource_version: str | None = None,
    ) -> Obj:
        """`objects` as the Table a client asked for with `Accept: ...;as=Table;g=meta.k8s.io`."""
        include = _include_object(request)
        return kube_tables.table(self._table_convertor(resource), objects, include=include, resource_version=resource_version)

    def _table_events(
        self, request: kmock.Request, resource: kmock.resource, events: AsyncIterator[kmock.Payload],
    ) -> AsyncIterator[kmock.Payload]:
        """A watch whose objects are one-row Tables (`kubectl get -w`); as from a real server,
        only the first carries the column definitions."""
        include = _include_object(request)  # a bad option is a 400 before the stream starts
        convertor = self._table_convertor(resource)

        async def tables() -> AsyncIterator[kmock.Payload]:
            first = True
            async with contextlib.aclosing(events) as stream:  # type: ignore[type-var]
                async for event in stream:
                    if isinstance(event, dict) and event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        obj = event["object"]
                        version = (obj.get("metadata") or {}).get("resourceVersion")
                        event = {"type": event["type"], "object": kube_tables.table(
                            convertor, [obj], include=include, resource_version=version, columns=first,
                        )}
                        first = False
                    yield event

        return tables()

    # --- eviction --------------------------------------------------------------------

    async def _serve_eviction(self, request: kmock.Request) -> kmock.Payload:
        """POST pods/<name>/eviction: 201 when allowed, 429 when a PDB forbids it."""
        assert request.namespace is not None and request.name is not None
        body = request.data if isinstance(request.data, Mapping) else {}
        if body.get("kind") != "Eviction" or body.get("apiVersion") not in self.eviction_versions:
            raise ApiStatus(
                400, "BadRequest",
                f'no kind "{body.get("kind")}" is registered for version "{body.get("apiVersion")}"',
            )
        if (body.get("metadata") or {}).get("name") != request.name:
            raise ApiStatus(400, "BadRequest", "name in URL does not match name in Eviction object")
        key, pod = self._existing(PODS, request.namespace, request.name)
        self._check_disruption_budget(pod, request.namespace)
        self._delete_pod(key, pod, _grace_seconds((body.get("deleteOptions") or {}).get("gracePeriodSeconds")))
        return kmock.Response(status=201, payload={
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201,
        })

    def _check_disruption_budget(self, pod: Obj, namespace: str) -> None:
        """Raise 429 if a PodDisruptionBudget forbids evicting `pod` now. Pods that are not
        Running (or already deleting) go regardless, as in the real eviction handler."""
        if pod.get("status", {}).get("phase") != "Running" or pod["metadata"].get("deletionTimestamp"):
            return
        labels = pod["metadata"].get("labels") or {}
        budgets = [
            obj.raw for (resource, ns, _), obj in self.objects.items()
            if resource == PDBS and ns == namespace and not obj.deleted
            if _selector_matches(obj.raw.get("spec", {}).get("selector"), labels)
        ]
        if not budgets:
            return
        if len(budgets) > 1:
            raise ApiStatus(
                500, "InternalError",
                "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
            )
        budget = budgets[0]
        selector = budget.get("spec", {}).get("selector")
        covered = [
            obj.raw for (resource, ns, _), obj in self.objects.items()
            if resource == PODS and ns == namespace and not obj.deleted
            if _selector_matches(selector, obj.raw["metadata"].get("labels") or {})
        ]
        healthy = sum(1 for p in covered if _pod_healthy(p))
        spec = budget.get("spec", {})
        name = budget["metadata"]["name"]
        if isinstance(spec.get("minAvailable"), int):
            desired = spec["minAvailable"]
        else:
            # maxUnavailable and percentages count against the owners' replicas, as the
            # disruption controller does; without known owners it cannot compute a budget.
            expected = self._expected_pods(covered, namespace)
            if expected is None:
                raise ApiStatus(
                    429, "TooManyRequests",
                    f"Cannot evict pod as it would violate the pod's disruption budget. The disruption budget {name} "
                    "does not have a computed status: its pods have no known controller with replicas",
                )
            desired = _desired_healthy(spec, expected=expected)
        # policy/v1's default unhealthyPodEvictionPolicy (IfHealthyBudget): an unhealthy pod may
        # go while the budget is met; a healthy one only while a disruption is still allowed.
        allowed = healthy - desired >= 1 if _pod_healthy(pod) else healthy >= desired
        if allowed:
            return
        raise ApiStatus(
            429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.",
            {"causes": [{
                "reason": "DisruptionBudget",
                "message": f"The disruption budget {name} needs {desired} healthy pods and has {healthy} currently",
            }]},
        )

    def _expected_pods(self, pods: list[Obj], namespace: str) -> int | None:
        """Sum of `spec.replicas` of the pods' controllers, or None if one is unknown."""
        owners: set[tuple[str, str]] = set()
        for pod in pods:
            ref = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
            if ref is None or ref.get("kind") not in _SCALABLE_OWNERS:
                return None
            owners.add((ref["kind"], ref["name"]))
        total = 0
        for kind, owner_name in owners:
            key = (_SCALABLE_OWNERS[kind], namespace, owner_name)
            if key not in self.objects or self.objects[key].deleted:
                return None
            total += int(self.objects[key].raw.get("spec", {}).get("replicas", 1))
        return total


# --- watch bookkeeping -----------------------------------------------------------------


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

    def end(self, how: str) -> None:
        self.ended = how
        if how == "cut" and self.transport is not None:
            # Closing the socket before the chunked body's terminator: the client sees a
            # truncated response, as when a connection to a real API server breaks.
            self.transport.close()
        self.wake.set()


def _is_true(value: str | None) -> bool:
    """Go's strconv.ParseBool, which the API server uses for `watch`."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _parse_resource_version(value: str | None) -> int | None:
    """None for "" and "0" (any version: the current state first), else the revision."""
    if value in (None, "", "0"):
        return None
    assert value is not None
    if not value.isdigit():
        raise ApiStatus(400, "BadRequest", f"invalid resource version: {value!r}")
    return int(value)


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


def _grace_seconds(value: Any) -> int | None:
    """DeleteOptions.gracePeriodSeconds from a JSON body or a query parameter."""
    if value in (None, ""):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ApiStatus(400, "BadRequest", f"invalid gracePeriodSeconds: {value!r}") from None


def _last_finalizer_removed(current: Obj, changed: Obj) -> bool:
    """Whether an update deletes the object (the generic store's shouldDeleteDuringUpdate): it
    had finalizers, has none now, and its deletion is due (grace period 0). A pod in graceful
    deletion without finalizers is written as usual."""
    old, new = current["metadata"], changed["metadata"]
    return bool(old.get("finalizers")) and not new.get("finalizers") and bool(new.get("deletionTimestamp")) \
        and new.get("deletionGracePeriodSeconds") == 0


def _with_version(obj: Obj, revision: int) -> Obj:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(revision)}}


def _storage_order(item: tuple[tuple[kmock.resource, str | None, str], Any]) -> tuple[str, str]:
    """etcd key order, /registry/<resource>/<namespace>/<name>, in which lists come back."""
    (_, namespace, name), _ = item
    return namespace or "", name


# --- custom resources ----------------------------------------------------------------------


@attrs.frozen
class _CustomVersion:
    """One served version of a CRD: its schema and subresources."""

    schema: Mapping[str, Any]
    subresources: frozenset[str]
    selectable_fields: frozenset[str]
    printer_columns: tuple[Mapping[str, Any], ...] = ()  # additionalPrinterColumns, for Tables

    @classmethod
    def from_crd(cls, version: Mapping[str, Any]) -> _CustomVersion:
        return cls(
            schema=(version.get("schema") or {}).get("openAPIV3Schema") or {},
            subresources=frozenset((version.get("subresources") or {}).keys()),
            selectable_fields=frozenset(
                str(f.get("jsonPath", "")).lstrip(".") for f in version.get("selectableFields") or []
            ),
            printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
        )

    def shape(self, obj: Obj) -> Obj:
        """What the API server stores for `obj`: unknown fields pruned, non-nullable nulls
        dropped, defaults applied (structural schema semantics)."""
        shaped = copy.deepcopy(obj)
        _prune(shaped, self.schema, root=True)
        _drop_nulls(shaped, self.schema)
        _apply_defaults(shaped, self.schema)
        return shaped

    def validate(self, obj: Obj) -> list[_FieldError]:
        errors: list[_FieldError] = []
        _validate(obj, self.schema, "", errors)
        return errors


@attrs.define
class _CustomResource:
    """A registered CustomResourceDefinition."""

    kind: str
    list_kind: str
    namespaced: bool
    storage: kmock.resource
    versions: dict[str, _CustomVersion]
    terminating: bool = False


def _check_type_meta(resource: kmock.resource, custom: _CustomResource, obj: Obj) -> None:
    """A custom resource is decoded as unstructured JSON: apiVersion and kind must be right."""
    if not obj.get("kind"):
        raise ApiStatus(400, "BadRequest", f"Object 'Kind' is missing in '{json.dumps(obj, separators=(',', ':'))}'")
    if obj.get("apiVersion") != _api_version(resource):
        raise ApiStatus(
            400, "BadRequest",
            f"the API version in the data ({obj.get('apiVersion')}) does not match the expected API version "
            f"({_api_version(resource)})",
        )
    if obj["kind"] != custom.kind:
        raise ApiStatus(
            400, "BadRequest",
            f"the kind in the data ({obj['kind']}) does not match the expected kind ({custom.kind})",
        )


def _check_crd(crd: Obj) -> None:
    """The CustomResourceDefinition validation tgp's CRDs could trip over; 422 like the server."""
    name = (crd.get("metadata") or {}).get("name") or ""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural, kind = spec.get("group") or "", names.get("plural") or "", names.get("kind") or ""
    errors: list[_FieldError] = []
    if not group:
        errors.append(_FieldError.required("spec.group"))
    elif "." not in group:
        errors.append(_FieldError.invalid("spec.group", group, "should be a domain with at least one dot"))
    if not plural:
        errors.append(_FieldError.required("spec.names.plural"))
    if not kind:
        errors.append(_FieldError.required("spec.names.kind"))
    if name != f"{plural}.{group}":
        errors.append(_FieldError.invalid("metadata.name", name, 'must be spec.names.plural+"."+spec.group'))
    if spec.get("scope") not in ("Cluster", "Namespaced"):
        errors.append(_FieldError.not_supported("spec.scope", spec.get("scope") or "", ["Cluster", "Namespaced"]))
    versions = spec.get("versions") or []
    if sum(1 for v in versions if v.get("storage")) != 1:
        errors.append(_FieldError.invalid("spec.versions", versions, "must have exactly one version marked as storage version"))
    for index, version in enumerate(versions):
        path = f"spec.versions[{index}]"
        if not version.get("name"):
            errors.append(_FieldError.required(f"{path}.name"))
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            errors.append(_FieldError.required(f"{path}.schema.openAPIV3Schema", "schemas are required"))
        elif not schema.get("type"):
            errors.append(_FieldError.required(f"{path}.schema.openAPIV3Schema.type", "must not be empty at the root"))
        elif schema["type"] != "object":
            errors.append(_FieldError.invalid(f"{path}.schema.openAPIV3Schema.type", schema["type"], "must be object at the root"))
        else:
            _default_errors(schema, f"{path}.schema.openAPIV3Schema", errors)
    if errors:
        raise _invalid("apiextensions.k8s.io", "CustomResourceDefinition", name, errors)


def _default_errors(schema: Mapping[str, Any], path: str, errors: list[_FieldError]) -> None:
    """apiextensions' ValidateDefaults at CRD create and update: each `default` must have no
    unknown fields and be valid against its own field's schema (nulls of non-nullable members
    dropped first), or the whole CRD is refused. additionalProperties is not followed: defaults
    are forbidden there."""
    if schema.get("default") is not None:
        default = copy.deepcopy(schema["default"])
        _drop_nulls(default, schema)
        pruned = copy.deepcopy(default)
        _prune(pruned, schema)
        if pruned != default:
            errors.append(_FieldError.invalid(f"{path}.default", schema["default"], "must not have unknown fields"))
        _validate(default, schema, f"{path}.default", errors)
    if isinstance(schema.get("items"), Mapping):
        _default_errors(schema["items"], f"{path}.items", errors)
    for key, sub in (schema.get("properties") or {}).items():
        _default_errors(sub, f"{path}.properties[{key}]", errors)


def _default_crd(crd: Obj) -> None:
    """The defaults a stored CRD gets, and the status its controllers set (instantly here)."""
    spec = crd["spec"]
    names = spec["names"]
    names.setdefault("singular", names["kind"].lower())
    names.setdefault("listKind", f"{names['kind']}List")
    spec.setdefault("conversion", {"strategy": "None"})
    now = _now()
    status = crd.setdefault("status", {})
    status["acceptedNames"] = copy.deepcopy(names)
    stored = {*(status.get("storedVersions") or []), *(v["name"] for v in spec["versions"] if v.get("storage"))}
    status["storedVersions"] = sorted(stored)
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    for kind, reason, message in (
        ("NamesAccepted", "NoConflicts", "no conflicts found"),
        ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
    ):
        if (conditions.get(kind) or {}).get("status") != "True":
            conditions[kind] = {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": now}
    status["conditions"] = list(conditions.values())


def _without(obj: Obj, fields: set[str]) -> Obj:
    return {k: v for k, v in obj.items() if k not in fields}


# --- structural schemas (k8s.io/apiextensions-apiserver pruning, defaulting, validation) ---


_RESOURCE_FIELDS = ("apiVersion", "kind", "metadata")


def _prune(value: Any, schema: Mapping[str, Any] | None, *, root: bool = False) -> None:
    """Remove, in place, the fields `schema` does not declare."""
    if schema is not None and schema.get("x-kubernetes-preserve-unknown-fields"):
        _prune_declared(value, schema, root=root)
        return
    if isinstance(value, dict):
        if schema is None:
            value.clear()
            return
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key in list(value):
            if embedded and key in _RESOURCE_FIELDS:
                continue
            if key in properties:
                _prune(value[key], properties[key])
            elif extra is not None and extra is not False:
                _prune(value[key], extra if isinstance(extra, Mapping) else None)
            else:
                del value[key]
    elif isinstance(value, list):
        for item in value:
            _prune(item, schema.get("items") if schema is not None else None)


def _prune_declared(value: Any, schema: Mapping[str, Any], *, root: bool = False) -> None:
    """x-kubernetes-preserve-unknown-fields: keep unknown fields, prune inside declared ones."""
    if isinstance(value, dict):
        embedded = root or schema.get("x-kubernetes-embedded-resource")
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if embedded and key in _RESOURCE_FIELDS:
                continue
            if key in properties:
                _prune(item, properties[key])
            elif isinstance(extra, Mapping):
                _prune(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _prune_declared(item, schema["items"])


def _removed_fields(before: Any, after: Any, path: str) -> list[str]:
    """The fields of `before` that pruning removed (`spec.foo`, `spec.items[0].bar`)."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        removed = []
        for key, value in before.items():
            field = _child_path(path, key)
            removed += [field] if key not in after else _removed_fields(value, after[key], field)
        return removed
    if isinstance(before, list) and isinstance(after, list):
        return [f for i, (b, a) in enumerate(zip(before, after, strict=False)) for f in _removed_fields(b, a, f"{path}[{i}]")]
    return []


def _child_schema(schema: Mapping[str, Any], key: str) -> Mapping[str, Any] | None:
    properties: Mapping[str, Mapping[str, Any]] = schema.get("properties") or {}
    if key in properties:
        return properties[key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


def _drop_nulls(value: Any, schema: Mapping[str, Any]) -> None:
    """Drop nulls the schema does not allow and cannot default (they would fail validation)."""
    if isinstance(value, dict):
        for key in list(value):
            sub = _child_schema(schema, key)
            if sub is None:
                continue
            if value[key] is None and not sub.get("nullable") and "default" not in sub:
                del value[key]
            else:
                _drop_nulls(value[key], sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _drop_nulls(item, schema["items"])


def _apply_defaults(value: Any, schema: Mapping[str, Any]) -> None:
    """Set absent (or non-nullable null) properties that have a default, then recurse, so the
    defaults inside a defaulted object apply too."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if "default" in sub and (key not in value or (value[key] is None and not sub.get("nullable"))):
                value[key] = copy.deepcopy(sub["default"])
                _drop_nulls(value[key], sub)  # a default's null members of non-nullable fields are dropped
        for key, item in value.items():
            sub = _child_schema(schema, key)
            if sub is not None:
                _apply_defaults(item, sub)
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        items = schema["items"]
        for index, item in enumerate(value):
            if item is None and not items.get("nullable") and "default" in items:
                value[index] = copy.deepcopy(items["default"])
            _apply_defaults(value[index], items)


def _validate(value: Any, schema: Mapping[str, Any], path: str, errors: list[_FieldError]) -> None:
    """OpenAPI v3 validation as kube-openapi reports it (messages name the field)."""
    if value is None and schema.get("nullable"):
        return
    declared = ["integer", "string"] if schema.get("x-kubernetes-int-or-string") else (
        [schema["type"]] if schema.get("type") else []
    )
    actual = _json_type(value)
    if declared and not any(_has_type(value, t) for t in declared):
        errors.append(_FieldError(
            "FieldValueTypeInvalid", path,
            f'Invalid value: {_go_value(actual)}: {path} in body must be of type {",".join(declared)}: "{actual}"',
        ))
        return
    if "enum" in schema and not any(_json_equal(value, allowed) for allowed in schema["enum"]):
        errors.append(_FieldError.not_supported(
            path, value, [a if isinstance(a, str) else json.dumps(a) for a in schema["enum"]],
        ))
    if isinstance(value, str):
        length = len(value)
        if "maxLength" in schema and length > schema["maxLength"]:
            errors.append(_FieldError("FieldValueTooLong", path, f"Too long: may not be longer than {schema['maxLength']}"))
        if "minLength" in schema and length < schema["minLength"]:
            errors.append(_FieldError.invalid(path, value, f"{path} in body should be at least {schema['minLength']} chars long"))
        if "pattern" in schema and _go_regexp(schema["pattern"]).search(value) is None:
            errors.append(_FieldError.invalid(path, value, f"{path} in body should match '{schema['pattern']}'"))
    elif actual in ("integer", "number"):
        _validate_number(value, schema, path, errors)
    elif isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errors.append(_FieldError("FieldValueTooMany", path, f"Too many: {len(value)}: must have at most {schema['maxItems']} items"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            errors.append(_FieldError.invalid(path, len(value), f"{path} in body should have at least {schema['minItems']} items"))
        if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) < len(value):
            errors.append(_FieldError.invalid(path, "", f"{path} in body shouldn't contain duplicates"))
        if isinstance(schema.get("items"), Mapping):
            for index, item in enumerate(value):
                _validate(item, schema["items"], f"{path}[{index}]", errors)
    elif isinstance(value, dict):
        for required in schema.get("required") or []:
            if required not in value:
                errors.append(_FieldError.required(_child_path(path, required)))
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            errors.append(_FieldError("FieldValueTooMany", path, f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"))
        if "minProperties" in schema and len(value) < schema["minProperties"]:
            errors.append(_FieldError.invalid(path, schema["minProperties"], f"{path} in body should have at least {schema['minProperties']} properties"))
        for key, item in value.items():
            if not path and key in _RESOURCE_FIELDS and key not in (schema.get("properties") or {}):
                continue
            sub = _child_schema(schema, key)
            if sub is not None:
                _validate(item, sub, _child_path(path, key), errors)


_GO_PATTERNS: dict[str, re.Pattern[str]] = {}


def _go_regexp(pattern: str) -> re.Pattern[str]:
    """A schema pattern with Go's RE2 meaning of `$`: the very end of the text. Python's `$`
    also matches before a final newline, so `^[a-z]+$` would take "abc\n", which the API
    server refuses (the difference an injected newline slips through)."""
    compiled = _GO_PATTERNS.get(pattern)
    if compiled is None:
        out, i, n = [], 0, len(pattern)
        while i < n:
            char = pattern[i]
            if char == "\\" and i + 1 < n:
                out.append("\\Z" if pattern[i + 1] == "z" else pattern[i : i + 2])  # RE2 \z: end of text
                i += 2
            elif char == "[":  # a character class is copied as is ($ is literal in it)
                j = i + 1
                j += pattern[j : j + 1] == "^"
                j += pattern[j : j + 1] == "]"
                while j < n and pattern[j] != "]":
                    j += 2 if pattern[j] == "\\" else 1
                out.append(pattern[i : j + 1])
                i = j + 1
            else:
                out.append("\\Z" if char == "$" else char)
                i += 1
        compiled = _GO_PATTERNS[pattern] = re.compile("".join(out))
    return compiled


def _validate_number(value: float, schema: Mapping[str, Any], path: str, errors: list[_FieldError]) -> None:
    if "maximum" in schema:
        limit = schema["maximum"]
        if schema.get("exclusiveMaximum") and value >= limit:
            errors.append(_FieldError.invalid(path, value, f"{path} in body should be less than {_go_number(limit)}"))
        elif value > limit:
            errors.append(_FieldError.invalid(path, value, f"{path} in body should be less than or equal to {_go_number(limit)}"))
    if "minimum" in schema:
        limit = schema["minimum"]
        if schema.get("exclusiveMinimum") and value <= limit:
            errors.append(_FieldError.invalid(path, value, f"{path} in body should be greater than {_go_number(limit)}"))
        elif value < limit:
            errors.append(_FieldError.invalid(path, value, f"{path} in body should be greater than or equal to {_go_number(limit)}"))
    factor = schema.get("multipleOf")
    if factor and not float(value / factor).is_integer():
        errors.append(_FieldError.invalid(path, value, f"{path} in body should be a multiple of {_go_number(factor)}"))


def _child_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _has_type(value: Any, wanted: str) -> bool:
    actual = _json_type(value)
    if wanted == "integer":  # JSON has one number type; a whole number decodes as an integer
        return actual == "integer" or (actual == "number" and float(value).is_integer())
    if wanted == "number":
        return actual in ("integer", "number")
    return actual == wanted


def _json_equal(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _go_number(value: float) -> str:
    """A number as Go's %v prints it."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e21:
        return str(int(value))
    return str(value)


def _go_value(value: Any) -> str:
    """A bad value as field.Error prints it: strings quoted, numbers and booleans bare."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return _go_number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, separators=(",", ":"))


@attrs.frozen
class _FieldError:
    """k8s.io/apimachinery field.Error: a cause of a 422 Invalid."""

    reason: str  # the cause type, e.g. FieldValueInvalid
    field: str
    body: str  # the message without the field, e.g. `Invalid value: 200: ...`

    def __str__(self) -> str:
        return f"{self.field}: {self.body}"

    @classmethod
    def invalid(cls, field: str, value: Any, detail: str) -> _FieldError:
        return cls("FieldValueInvalid", field, f"Invalid value: {_go_value(value)}: {detail}")

    @classmethod
    def required(cls, field: str, detail: str = "") -> _FieldError:
        return cls("FieldValueRequired", field, f"Required value: {detail}" if detail else "Required value")

    @classmethod
    def not_supported(cls, field: str, value: Any, supported: list[str]) -> _FieldError:
        quoted = ", ".join(json.dumps(s) for s in supported)
        return cls("FieldValueNotSupported", field, f"Unsupported value: {_go_value(value)}: supported values: {quoted}")


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def _name_errors(name: str) -> list[_FieldError]:
    """Custom resource names must be DNS subdomains (as most built-in kinds' names)."""
    errors = []
    if len(name) > 253:
        errors.append(_FieldError.invalid("metadata.name", name, "must be no more than 253 characters"))
    if not _DNS_SUBDOMAIN.fullmatch(name):
        errors.append(_FieldError.invalid("metadata.name", name, (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
            "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
            "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
        )))
    return errors


# --- Events: one storage, two API versions ------------------------------------------------

# events.k8s.io/v1 field -> core/v1 field (pkg/apis/events/v1/conversion.go); the rest share names.
_EVENT_FIELDS = {
    "regarding": "involvedObject",
    "note": "message",
    "reportingController": "reportingComponent",
    "deprecatedSource": "source",
    "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp",
    "deprecatedCount": "count",
}


def _event_to_core(event: Obj) -> Obj:
    core = {_EVENT_FIELDS.get(k, k): v for k, v in event.items()}
    core.update(apiVersion="v1", kind="Event")
    return core


def _event_to_v1(event: Obj) -> Obj:
    back = {v: k for k, v in _EVENT_FIELDS.items()}
    converted = {back.get(k, k): v for k, v in event.items()}
    converted.update(apiVersion="events.k8s.io/v1", kind="Event")
    return converted


def _event_errors(event: Obj, resource: kmock.resource) -> list[_FieldError]:
    """ValidateEventCreate (pkg/apis/core/validation/events.go) on the core form of `event`."""
    errors: list[_FieldError] = []
    namespace = event["metadata"].get("namespace") or ""
    involved_namespace = (event.get("involvedObject") or {}).get("namespace") or ""
    controller_field = "reportingComponent" if resource == EVENTS else "reportingController"
    if not event.get("eventTime"):
        # Old-style events: the namespace must be the involved object's ("default" for
        # cluster-scoped objects such as Nodes).
        if involved_namespace != namespace and not (not involved_namespace and namespace == "default"):
            errors.append(_FieldError.invalid("involvedObject.namespace", involved_namespace, "does not match event.namespace"))
    else:
        if not involved_namespace and namespace not in ("default", "kube-system"):
            errors.append(_FieldError.invalid("involvedObject.namespace", involved_namespace, "does not match event.namespace"))
        for field, key in ((controller_field, "reportingComponent"), ("reportingInstance", "reportingInstance"),
                           ("action", "action"), ("reason", "reason")):
            if not event.get(key):
                errors.append(_FieldError.required(field))
    if resource == EVENTS:
        return errors
    # events.k8s.io/v1 is strict.
    if not event.get("eventTime"):
        errors.append(_FieldError.required("eventTime"))
    if event.get("type") not in ("Normal", "Warning"):
        errors.append(_FieldError.invalid("type", "", f"has invalid value: {event.get('type') or ''}"))
    for field in ("firstTimestamp", "lastTimestamp", "count"):
        if event.get(field):
            errors.append(_FieldError.invalid(field, "", "needs to be unset"))
    source = event.get("source") or {}
    if source.get("component") or source.get("host"):
        errors.append(_FieldError.invalid("source", "", "needs to be unset"))
    return errors


# --- the simulated kubelet -----------------------------------------------------------

# What a kubelet on one of tgp's GPU instances reports; the numbers only need to look plausible.
_KUBELET_CAPACITY = {"cpu": "16", "memory": "128Gi", "pods": "110", "ephemeral-storage": "500Gi"}
_PRESSURE_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure")
_KUBELET_SYSTEM = "Kubernetes API (simulated kubelet)"
# Read-modify-write attempts when another writer (the node controller) changes the Node.
_KUBELET_CONFLICT_ATTEMPTS = 5
# The API answers a kubelet's call in milliseconds; 10 s catches a hung server without stalling
# the simulated cloud for long.
_KUBELET_TIMEOUT = httpx.Timeout(10.0)


async def register_node(
    api_url: str,
    name: str,
    *,
    labels: dict[str, str] | None = None,
    ready: bool = True,
    gpus: int = 1,
    client: httpx.AsyncClient | None = None,
) -> None:
    """Register Node `name` the way a kubelet does: create it, then report its status (Ready
    condition, addresses, capacity including `nvidia.com/gpu`).

    A Node that already exists is adopted, as a restarted kubelet does. Pass `client` (with
    credentials and TLS settings) to talk to a real API server; `api_url` is its base URL.
    """
    async with _kubelet_client(client) as http:
        base = api_url.rstrip("/")
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    **(labels or {}),
                },
            },
            "spec": {},
        }
        response = await send(http, "POST", f"{base}/api/v1/nodes", system=_KUBELET_SYSTEM, ok=(409,), json=node)
        _raise_unexpected(response, f"register Node {name}")
        capacity = {**_KUBELET_CAPACITY, GPU_RESOURCE: str(gpus)}
        now = _now()
        status = {
            "conditions": [_condition(kind, False, now) for kind in _PRESSURE_CONDITIONS]
            + [_condition("Ready", ready, now)],
            "addresses": [
                {"type": "InternalIP", "address": _tailnet_address(name)},
                {"type": "Hostname", "address": name},
            ],
            "capacity": capacity,
            "allocatable": capacity,
            "nodeInfo": {
                "kubeletVersion": "v1.31.0",
                "containerRuntimeVersion": "containerd://1.7.0",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "osImage": "tgp simulated node",
                "kernelVersion": "6.8.0",
                "kubeProxyVersion": "",
                "machineID": hashlib.sha256(name.encode()).hexdigest()[:32],
                "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, name)),
                "bootID": str(uuid.uuid4()),
            },
        }
        response = await send(
            http, "PATCH", f"{base}/api/v1/nodes/{name}/status", system=_KUBELET_SYSTEM,
            json={"status": status}, headers={"Content-Type": MERGE_PATCH},
        )
        _raise_unexpected(response, f"report the status of Node {name}")


async def set_node_ready(api_url: str, name: str, ready: bool, *, client: httpx.AsyncClient | None = None) -> None:
    """Report Node `name` Ready (or NotReady) as its kubelet would, keeping other conditions."""
    async with _kubelet_client(client) as http:
        url = f"{api_url.rstrip('/')}/api/v1/nodes/{name}"
        for _ in range(_KUBELET_CONFLICT_ATTEMPTS):
            response = await send(http, "GET", url, system=_KUBELET_SYSTEM)
            _raise_unexpected(response, f"read Node {name}")
            node = response.json()
            now = _now()
            conditions = [c for c in node.get("status", {}).get("conditions") or [] if c.get("type") != "Ready"]
            previous = next((c for c in node.get("status", {}).get("conditions") or [] if c.get("type") == "Ready"), None)
            ready_condition = _condition("Ready", ready, now)
            if previous is not None and previous.get("status") == ready_condition["status"]:
                ready_condition["lastTransitionTime"] = previous.get("lastTransitionTime", now)
            patch = {
                "metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                "status": {"conditions": [*conditions, ready_condition]},
            }
            response = await send(
                http, "PATCH", f"{url}/status", system=_KUBELET_SYSTEM, ok=(409,),
                json=patch, headers={"Content-Type": MERGE_PATCH},
            )
            if response.status_code != 409:
                _raise_unexpected(response, f"report the readiness of Node {name}")
                return
        raise RuntimeError(f"Node {name} kept changing while its readiness was reported")


def kubeconfig(url: str, *, context: str = "tgp", namespace: str = "default") -> Obj:
    """A kubeconfig (as a dict; JSON is valid YAML) for an API server at `url` that needs no
    credentials, such as the emulator."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": url}}],
        "users": [{"name": context, "user": {}}],
        "contexts": [{"name": context, "context": {"cluster": context, "user": context, "namespace": namespace}}],
        "current-context": context,
        "preferences": {},
    }


@contextlib.asynccontextmanager
async def _kubelet_client(client: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The caller's client, or a short-lived one without credentials (for the emulator)."""
    if client is not None:
        yield client
        return
    async with httpx.AsyncClient(timeout=_KUBELET_TIMEOUT) as owned:
        yield owned


def _raise_unexpected(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400 and response.status_code != 409:
        raise RuntimeError(f"could not {what}: {response.status_code} {error_message(response)}")


def _condition(kind: str, true: bool, now: str) -> Obj:
    reasons = {
        ("Ready", True): ("KubeletReady", "kubelet is posting ready status"),
        ("Ready", False): ("KubeletNotReady", "container runtime network not ready"),
    }
    reason, message = reasons.get((kind, true), (f"KubeletHasNo{kind}" if not true else f"KubeletHas{kind}", ""))
    return {
        "type": kind,
        "status": "True" if true else "False",
        "reason": reason,
        "message": message,
        "lastHeartbeatTime": now,
        "lastTransitionTime": now,
    }


def _tailnet_address(name: str) -> str:
    """A stable address in Tailscale's 100.64.0.0/10 range, derived from the node name."""
    digest = hashlib.sha256(name.encode()).digest()
    return f"100.{64 + digest[0] % 64}.{digest[1]}.{1 + digest[2] % 254}"



# --- pure API-server rules -------------------------------------------------------------


class ApiStatus(Exception):
    """A failure the emulator answers with a `kind: Status` body, as the API server does."""

    def __init__(self, code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def render(self) -> aiohttp.web.Response:
        return aiohttp.web.json_response(_status_body(self.code, self.reason, self.message, self.details), status=self.code)


def _status_body(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> Obj:
    payload: Obj = {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }
    if details:
        payload["details"] = {k: v for k, v in details.items() if v not in (None, "")}
    return payload


def _qualified_resource(resource: kmock.resource) -> str:
    """`plural.group` (or `plural` for the core group), as errors name a resource."""
    return f"{resource.plural}.{resource.group}" if resource.group else str(resource.plural)


def _no_such_resource() -> ApiStatus:
    return ApiStatus(404, "NotFound", "the server could not find the requested resource")


def _conflict(resource: kmock.resource, name: str | None, problem: str | None = None) -> ApiStatus:
    problem = problem or "the object has been modified; please apply your changes to the latest version and try again"
    return ApiStatus(
        409, "Conflict", f'Operation cannot be fulfilled on {_qualified_resource(resource)} "{name}": {problem}',
        {"name": name, "group": resource.group, "kind": resource.plural},
    )


def _invalid(group: str, kind: str, name: str, errors: list[_FieldError]) -> ApiStatus:
    """422 Invalid, as apierrors.NewInvalid builds it: one message naming every field."""
    messages = list(dict.fromkeys(str(e) for e in errors))
    aggregate = messages[0] if len(messages) == 1 else f"[{', '.join(messages)}]"
    qualified = f"{kind}.{group}" if group else kind
    return ApiStatus(422, "Invalid", f'{qualified} "{name}" is invalid: {aggregate}', {
        "name": name, "group": group, "kind": kind,
        "causes": [{"reason": e.reason, "message": e.body, "field": e.field} for e in errors],
    })


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _format_time(timestamp: float) -> str:
    """RFC 3339 with whole seconds, as metav1.Time is written."""
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(value: str) -> float:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def _content_type(request: kmock.Request) -> str:
    for key, value in request.headers.items():
        if key.lower() == "content-type":
            return value.split(";")[0].strip().lower()
    return ""


def _accept(request: kmock.Request) -> str:
    return next((value for key, value in request.headers.items() if key.lower() == "accept"), "")


def _include_object(request: kmock.Request) -> str:
    try:
        return kube_tables.include_object(request.params)
    except ValueError as exc:
        raise ApiStatus(400, "BadRequest", str(exc)) from None


def _api_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


def _is_builtin(resource: kmock.resource) -> bool:
    """Strategic merge works on built-in kinds only (core, `apps`, `*.k8s.io`), not on CRs."""
    group = resource.group or ""
    return "." not in group or group.endswith(".k8s.io")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (lists are replaced)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge_patch(result.get(key), value)
    return result


def _ready_status(node: Mapping[str, Any]) -> str | None:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return str(condition.get("status"))
    return None


def _taint_by_readiness(node: Obj) -> None:
    """TaintNodesByCondition: not-ready while Ready is False or unreported, unreachable while
    Unknown, neither once Ready is True."""
    ready = _ready_status(node)
    wanted = {"True": None, "Unknown": TAINT_UNREACHABLE}.get(ready or "", TAINT_NOT_READY)
    spec = node.setdefault("spec", {})
    taints = [
        t for t in spec.get("taints") or []
        if not (t.get("key") in (TAINT_NOT_READY, TAINT_UNREACHABLE) and t.get("effect") == "NoSchedule")
    ]
    if wanted is not None:
        taints.append({"key": wanted, "effect": "NoSchedule"})
    if taints:
        spec["taints"] = taints
    else:
        spec.pop("taints", None)


def _pod_healthy(pod: Mapping[str, Any]) -> bool:
    """Counted as healthy by the disruption controller: Running, not deleting, not un-Ready."""
    status = pod.get("status") or {}
    if status.get("phase") != "Running" or (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    ready = [c for c in status.get("conditions") or [] if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") == "True"


def _desired_healthy(spec: Mapping[str, Any], *, expected: int) -> int:
    if spec.get("minAvailable") is not None:
        return _scaled(spec["minAvailable"], expected)
    if spec.get("maxUnavailable") is not None:
        return max(0, expected - _scaled(spec["maxUnavailable"], expected))
    return expected  # policy/v1 requires one of them; be strict if neither is set


def _scaled(value: int | str, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * total / 100)
    return int(value)


def _selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions); an empty selector matches all."""
    if selector is None:
        return False  # policy/v1beta1 semantics of a nil selector; policy/v1 always sets one
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


_SET_TERM = re.compile(r"^\s*(!?)([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\(([^)]*)\))?\s*$")


@attrs.frozen
class _Selection:
    """`labelSelector` and `fieldSelector` of a list or watch request."""

    labels: tuple[tuple[str, str, str, frozenset[str]], ...] = ()
    fields: tuple[tuple[str, str, str], ...] = ()

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> _Selection:
        labels: list[tuple[str, str, str, frozenset[str]]] = []
        for term in _split_terms(params.get("labelSelector", "")):
            match = _SET_TERM.match(term)
            if match is None:
                raise ApiStatus(400, "BadRequest", f"unable to parse requirement: {term!r}")
            negated, key, op, value, set_op, set_values = match.groups()
            if set_op:
                labels.append((key, set_op, "", frozenset(v.strip() for v in set_values.split(",") if v.strip())))
            elif op:
                labels.append((key, "!=" if op == "!=" else "=", value, frozenset()))
            else:
                labels.append((key, "!" if negated else "exists", "", frozenset()))
        fields: list[tuple[str, str, str]] = []
        for term in _split_terms(params.get("fieldSelector", "")):
            match = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", term)
            if match is None:
                raise ApiStatus(400, "BadRequest", f"invalid field selector: {term!r}")
            path, op, value = match.groups()
            fields.append((path, "!=" if op == "!=" else "=", value))
        return cls(tuple(labels), tuple(fields))

    def matches(self, obj: Mapping[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for key, op, value, values in self.labels:
            ok = {
                "=": labels.get(key) == value,
                "!=": labels.get(key) != value,
                "exists": key in labels,
                "!": key not in labels,
                "in": labels.get(key) in values,
                "notin": labels.get(key) not in values,
            }[op]
            if not ok:
                return False
        for path, op, value in self.fields:
            actual = _field(obj, path)
            if (actual == value) != (op == "="):
                return False
        return True


def _split_terms(selector: str) -> Iterable[str]:
    """Split on commas outside parentheses: `a in (x,y),b=c` -> `a in (x,y)`, `b=c`."""
    depth, start = 0, 0
    for index, char in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            if selector[start:index].strip():
                yield selector[start:index]
            start = index + 1
    if selector[start:].strip():
        yield selector[start:]


def _field(obj: Mapping[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
