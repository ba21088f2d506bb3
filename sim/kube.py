"""An in-process Kubernetes API server for the tests and `tgp demo`, built on kmock.

kmock (`kmock.KubernetesEmulator`) routes requests and serves discovery over real HTTP.
`KubeEmulator` stores the objects itself and adds what tgp's adapters and the CRD bridge rely on,
each following the real API server as recorded in docs/reference (kubernetes-testing.md). It is
built in layers, each a class in its own module that extends the one before:

* kube_store (`KubeStore`): the objects and their writes: create, update (PUT), merge,
  strategic merge and JSON patch, the `/status` subresource, delete with finalizers, one
  cluster-wide `resourceVersion`, label and field selectors (kube_selection), the decoding of
  built-in kinds' top-level fields, CustomResourceDefinitions (their structural schemas in
  kube_schema), Events in two API versions (kube_events), Nodes' not-ready taint;
* kube_watch (`KubeWatch`): the change history and the watch streams: resuming from a
  resourceVersion, 410 Gone, bookmarks, `timeoutSeconds`, `compact` and `cut_watches`;
* kube_eviction (`KubeEviction`): the Eviction subresource with PodDisruptionBudget checks and
  the graceful deletion of Pods;
* this module (`KubeEmulator`): the server: its start and stop, the HTTP routes (the resource a
  path names, 404 for one it lacks, 415 for server-side apply, DeleteOptions and their
  preconditions, lists that carry the collection RV, watch requests) and `write_kubeconfig`.

It also serves what kubectl reads, so that the real kubectl works against it
(tests/test_kubectl.py): aggregated discovery (kube_discovery), OpenAPI v3 and v2 (kube_openapi,
kube_openapi_v2), Table responses with CRD printer columns and built-in printers (kube_tables),
`fieldValidation` on writes of custom resources, strategic merge patch (kube_patch), streaming
lists that end their initial events with a bookmark; `write_kubeconfig` points kubectl at the
emulator.

kube_kubelet plays the kubelet for a simulated cloud (`register_node`, `set_node_ready`, and
`SimKubelet`, which keeps a Node alive with Lease and status heartbeats and runs its pods).
kube_control_plane starts the real thing (etcd, kube-apiserver, scheduler, controller-manager
built by `make kube`) for the real-cluster lane.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pathlib
import re
from collections.abc import AsyncIterator, Collection, Mapping
from types import TracebackType
from typing import Any, Self

import aiohttp.web
import attrs
import kmock
from typing_extensions import override

from sim import kube_discovery, kube_openapi, kube_openapi_v2, kube_tables
from sim.kube_dispatch import by_priority, criteria_hold
from sim.kube_eviction import grace_seconds
from sim.kube_controllers import KubeControllers
from sim.kube_namespaces import PROTOBUF, namespace_from_protobuf
from sim.kube_machinery import (
    APPLY_PATCH,
    CRDS,
    PODS,
    ApiStatus,
    FieldError,
    Obj,
    api_version,
    conflict,
    invalid,
    is_true,
    key_of,
    media_type,
    no_such_resource,
)
from sim.kube_store import parse_resource_version

REQUEST_LOG = 100
OBJECT_HISTORY = 4
_EVICTION_PATH = re.compile(r"/api/v1/namespaces/[^/]+/pods/[^/]+/eviction")
_RESOURCE_PATH = re.compile(r"/apis?/.+")
_OPENAPI_V3_PATH = re.compile(r"/openapi/v3(?:/(?P<path>.+))?")


@attrs.define(kw_only=True)
class KubeEmulator(KubeControllers):
    """kmock's Kubernetes emulator plus the API-server behaviours tgp depends on.

    `async with KubeEmulator() as kube:` starts it on 127.0.0.1 and `kube.url` is its base URL.
    kmock's DSL injects faults, e.g. `kube["patch /api/v1/nodes/n1"] << 500`. Unlike plain kmock,
    writes happen in fallback reactions, so a request answered by an injected reaction changes
    nothing, as with a real server that failed.

    Test knobs: `install_crd`, `compact`, `cut_watches`, `watch_window`, `eviction_versions`,
    `expired_watch_as_http`, `field_validation`.
    """

    # How many requests the emulator remembers (for tests' assertions and kmock's reactions):
    # kmock matches each request against its whole log, so an unbounded log makes every
    # request slower than the one before (a demo left up for an hour went from 21% to 80% of a
    # core at rest). Tests look at the last few dozen.
    request_log: int = attrs.field(default=REQUEST_LOG)
    _server: kmock.Server | None = attrs.field(default=None, init=False)
    # The OpenAPI documents and what they were built from (served resources, CRD versions).
    _openapi_cache: tuple[Any, dict[str, Obj]] | None = attrs.field(default=None, init=False)
    # The reactions in kmock's order and the ids of the list they were sorted from (the sorted
    # list holds them, so an id cannot be reused while it is cached).
    _reaction_order: tuple[tuple[int, ...], list[Any]] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()  # kmock's fallbacks call the _serve_* overrides below
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
            self._end_watches()
            self._cancel_grace_timers()
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

    # --- request handling ----------------------------------------------------------------

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skips KubernetesEmulator._handle, which writes before any reaction is consulted.
        self._forget_old_requests()
        try:
            return await self._react(request)
        except ApiStatus as status:
            return status.render()

    async def _react(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """kmock's dispatch (`RawHandler._handle`: the first reaction by priority that sees the
        request and is not used up answers it), with a cheaper test of "sees": kmock asks each
        reaction's view for its requests (the whole log, filtered) and looks for this one, which
        cost ~50% of the CPU of a 100-node test, where `_sees` runs the filters once on it."""
        for payload in self._reactions():
            if not payload._disabled.is_set() and _sees(payload._source, request, self):
                try:
                    return await payload(request)
                except kmock.ReactionMismatchError:  # a mismatch or a used-up reaction
                    payload._disabled.set()
                except NotImplementedError:  # matched, but nothing to respond with
                    pass
        raise NotImplementedError(f"no reaction matches {request.method} {request.url}")

    def _reactions(self) -> list[Any]:
        """The reactions by priority (`by_priority`), sorted again only when the list changed (a
        test added one, or `<<` replaced one): a reaction's priority is fixed once it exists
        (kmock's views are frozen), and sorting them for every request cost a tenth of it."""
        ids = tuple(map(id, self._payloads))
        if self._reaction_order is None or self._reaction_order[0] != ids:
            self._reaction_order = (ids, by_priority(self._payloads))
        return self._reaction_order[1]

    @override
    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        resource = self._served(request)
        body = namespace_from_protobuf(request.body) if media_type(request) == PROTOBUF else request.data
        warning = self._decode(request, resource, body)
        # Always 201 (and the Warning header, None for none): kmock keeps the status and headers
        # of a Response returned from a reaction.
        created = self._create(resource, request.namespace, body)
        return kmock.Response(status=201, headers={"Warning": warning}, payload=created)

    @override
    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        resource = self._served(request, subresources={"status"})
        if media_type(request).startswith(APPLY_PATCH):
            # Before the lookup: server-side apply would create a missing object (`kubectl apply
            # --server-side` must not read "not found").
            raise ApiStatus(415, "UnsupportedMediaType", "server-side apply is not emulated; send a merge patch")
        key, current = self._existing(resource, request.namespace, request.name)
        proposed = self._apply_patch(request, resource, self._present(resource, current))
        warning = self._decode(request, resource, proposed)
        updated = self._update(resource, request.subresource, key, current, proposed)
        return kmock.Response(status=200, headers={"Warning": warning}, payload=updated)

    async def _serve_replace(self, request: kmock.Request) -> kmock.Payload:
        """PUT: the body replaces the object (or its status); its resourceVersion must be current."""
        resource = self._served(request, subresources={"status"})
        if request.name is None:
            raise ApiStatus(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        if not isinstance(request.data, Mapping):
            raise ApiStatus(400, "BadRequest", "the body of a PUT must be a JSON object")
        proposed = copy.deepcopy(dict(request.data))
        # The body is decoded before the object is looked up, as the API server does: a body
        # that cannot be decoded is 400 even for a missing object or a stale resourceVersion.
        warning = self._decode(request, resource, proposed)
        key, current = self._existing(resource, request.namespace, request.name)
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
                raise invalid(resource.group or "", resource.plural or "", request.name, [FieldError(
                    "FieldValueInvalid", "metadata.resourceVersion", "Invalid value: 0x0: must be specified for an update",
                )])
            meta["resourceVersion"] = current_version
        elif str(meta["resourceVersion"]) != current_version:
            raise conflict(resource, request.name)
        updated = self._update(resource, request.subresource, key, current, proposed)
        return kmock.Response(status=200, headers={"Warning": warning}, payload=updated)

    @override
    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
        resource = self._served(request)
        key, current = self._existing(resource, request.namespace, request.name)
        options = request.data if isinstance(request.data, Mapping) else {}
        preconditions = options.get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != current["metadata"].get("uid"):
            raise conflict(resource, request.name, (
                f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                f"UID in object meta: {current['metadata'].get('uid')}"
            ))
        wanted_version = preconditions.get("resourceVersion")
        if wanted_version and wanted_version != current["metadata"]["resourceVersion"]:
            raise conflict(resource, request.name, (
                f"Precondition failed: ResourceVersion in precondition: {wanted_version}, "
                f"ResourceVersion in object meta: {current['metadata']['resourceVersion']}"
            ))
        if resource == CRDS:
            return self._present(resource, self._delete_crd(key, current))
        if resource == PODS:
            # DeleteOptions come from the body when there is one, else from the query.
            requested = options.get("gracePeriodSeconds") if request.data else request.params.get("gracePeriodSeconds")
            return self._present(resource, self._delete_pod(key, current, grace_seconds(requested)))
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
        if is_true(request.params.get("watch")):
            return await self._serve_watch(request)  # `watch=1` and `watch=True` count too
        resource = self._served(request, subresources={"status"})
        _, current = self._existing(resource, request.namespace, request.name)
        if kube_tables.wants_table(_accept(request)):
            return self._table(request, resource, [self._present(resource, current)])
        return self._present(resource, current)

    @override
    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        if is_true(request.params.get("watch")):
            return await self._serve_watch(request)
        resource = self._served(request)
        selection = self._selection(resource, request.params)
        wanted = parse_resource_version(request.params.get("resourceVersion"))
        if request.params.get("resourceVersionMatch") == "Exact" and wanted is not None and wanted < self._horizon:
            raise ApiStatus(410, "Expired", "The resourceVersion for the provided list is too old.")
        storage = self._storage(resource)
        items = []
        for _, stored in self.listed(storage, request.namespace, selection):
            obj = self._present(resource, stored.raw)
            if selection.matches(obj):
                items.append(obj)
        if kube_tables.wants_table(_accept(request)):
            return self._table(request, resource, items, str(self._revision))
        return {
            "apiVersion": api_version(resource),
            "kind": f"{self._list_kind(resource)}",
            "metadata": {"resourceVersion": str(self._revision)},
            "items": items,
        }

    @override
    async def _serve_watch(self, request: kmock.Request) -> kmock.Payload:  # type: ignore[override]
        """Checks the request before any byte is sent (a bad selector is a plain 400), then
        hands kmock the stream."""
        resource = self._served(request)
        stream = self._watch(request, resource, self._selection(resource, request.params))
        if kube_tables.wants_table(_accept(request)):
            stream = self._table_events(request, resource, stream)
        # A Response's headers stick to the reaction (kmock), which is harmless: always JSON.
        return kmock.Response(headers={"Content-Type": "application/json"}, payload=stream)

    def _forget_old_requests(self) -> None:
        """Keep the last `request_log` requests in kmock's log and in each reaction's (the one
        being handled is the newest and stays)."""
        logs = [self._requests, *(getattr(p, "_requests", None) for p in self._payloads)]
        for log in logs:
            if isinstance(log, list) and len(log) > self.request_log:
                del log[: len(log) - self.request_log]

    @override
    def _publish(self, resource: kmock.resource, kind: str, obj: Obj, previous: Obj | None) -> None:
        """Every write: watches get it (KubeWatch), and the object keeps only its last few
        versions (kmock would keep every one: a Lease renewed every 10 s for an hour is 360)."""
        super()._publish(resource, kind, obj, previous)
        key = key_of(resource, obj)
        if key in self.objects:
            history = self.objects[key].history
            if len(history) > OBJECT_HISTORY:
                del history[: len(history) - OBJECT_HISTORY]

    def _served(self, request: kmock.Request, *, subresources: Collection[str] = ()) -> kmock.resource:
        """The resource of `request`, or 404 as the API server answers for a path it lacks."""
        resource = request.resource
        if resource is None or not self._serves(resource):
            raise no_such_resource()
        if request.namespace is not None and not self._namespaced(resource):
            raise no_such_resource()
        if request.subresource is not None and (
            request.subresource not in subresources or request.subresource not in self._info(resource).subresources
        ):
            raise no_such_resource()
        return resource

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
            raise no_such_resource()
        return group

    @override
    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        document = await super()._serve_version(request)
        return kube_discovery.legacy_resource_list(document) if isinstance(document, dict) else document

    def _openapi_documents(self) -> dict[str, Obj]:
        """OpenAPI v3 documents by index key (`api/v1`, `apis/tgp.io/v1`), for every served
        group-version, from the served resources and the installed CRDs' schemas."""
        served = self._served_resources()
        crds = sorted((k[2], o.raw["metadata"]["resourceVersion"]) for k, o in self.stored(CRDS) if not o.deleted)
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
            raise no_such_resource()
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


def _accept(request: kmock.Request) -> str:
    return next((value for key, value in request.headers.items() if key.lower() == "accept"), "")


def _include_object(request: kmock.Request) -> str:
    try:
        return kube_tables.include_object(request.params)
    except ValueError as exc:
        raise ApiStatus(400, "BadRequest", str(exc)) from None


def _sees(view: kmock.View, request: kmock.Request, root: kmock.Root) -> bool:
    """Whether `request` (the newest of `root`'s log) is among `view`'s requests, as
    `request in view` says, without filtering the whole log: filters and priorities run on
    this one request (source first, as a chained filter sees only its source's requests); any
    other view (slices, unions, intersections, exclusions: they depend on the requests before;
    a reaction: it sees only what it served) asks kmock.
    tests/test_kube_emulator.py compares both on every reaction kind."""
    if view is root:
        return True
    if type(view) is kmock.Filter:
        return _sees(view._source, request, root) and criteria_hold(view.criteria, request)
    if type(view) is kmock.Priority:
        return _sees(view._source, request, root)
    return request in view
