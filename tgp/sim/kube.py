"""An in-process Kubernetes API server for the tests and `tgp demo`, built on kmock.

kmock (`kmock.KubernetesEmulator`) stores objects and serves list/fetch/watch/create/patch/
delete over real HTTP. `KubeEmulator` adds what the `Cluster` adapter relies on and kmock lacks,
each following the real API server as recorded in docs/reference (kubernetes-testing.md):

* create answers 201 and stamps `uid`, `resourceVersion`, `generation: 1`, `creationTimestamp`;
  a name already taken is 409 AlreadyExists; a new Pod starts in phase Pending;
* one cluster-wide `resourceVersion` counter, bumped by every write; a patch that carries a
  stale `metadata.resourceVersion` is 409 Conflict; a failed JSON-patch `test` is 422;
* merge patch and strategic merge patch (treated as merge; 415 on custom resources), JSON patch;
  a JSON-patch content type with an object body is 400;
* the `/status` subresource changes only `status`; the main object ignores `status` and bumps
  `generation` when `spec` changes;
* Nodes carry `node.kubernetes.io/not-ready:NoSchedule` until their Ready condition is True
  (the admission plugin and node-lifecycle controller of a real cluster, applied instantly);
* `labelSelector` and `fieldSelector` on list and watch;
* the Eviction subresource with PodDisruptionBudget checks (policy/v1 and policy/v1beta1).

Evicted and deleted pods disappear at once (a real cluster waits for the kubelet and the grace
period; with no kubelet here there is nothing to wait for).

`register_node` and `set_node_ready` play the kubelet for a simulated cloud. They use plain HTTP,
so they work the same against this emulator and a real API server.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import hashlib
import importlib.resources
import math
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

import aiohttp.web
import attrs
import httpx
import jsonpatch
import kmock
from typing_extensions import override

from tgp.http import error_message, send
from tgp.types import GPU_RESOURCE

NODES = kmock.resource("", "v1", "nodes")
PODS = kmock.resource("", "v1", "pods")
PDBS = kmock.resource("policy", "v1", "poddisruptionbudgets")

TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch"

_EVICTION_PATH = re.compile(r"/api/v1/namespaces/[^/]+/pods/[^/]+/eviction")
# Controllers whose `spec.replicas` a PodDisruptionBudget counts against.
_SCALABLE_OWNERS = {
    "ReplicaSet": kmock.resource("apps", "v1", "replicasets"),
    "StatefulSet": kmock.resource("apps", "v1", "statefulsets"),
    "ReplicationController": kmock.resource("", "v1", "replicationcontrollers"),
}
# The cluster-wide revision starts high enough to look like a real one and to catch clients
# that compare resourceVersions as strings.
_FIRST_RESOURCE_VERSION = 1000

Obj = dict[str, Any]


@attrs.define(kw_only=True)
class KubeEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator plus the API-server behaviours tgp depends on.

    `async with KubeEmulator() as kube:` starts it on 127.0.0.1 and `kube.url` is its base URL.
    kmock's DSL injects faults, e.g. `kube["patch /api/v1/nodes/n1"] << 500`. Unlike plain kmock,
    writes happen in fallback reactions, so a request answered by an injected reaction changes
    nothing, as with a real server that failed.
    """

    eviction_versions: frozenset[str] = frozenset({"policy/v1", "policy/v1beta1"})
    """Eviction apiVersions the server accepts; `{"policy/v1beta1"}` plays a pre-1.22 server."""

    _server: kmock.Server | None = attrs.field(default=None, init=False)
    _revision: int = attrs.field(default=_FIRST_RESOURCE_VERSION, init=False)

    def __attrs_post_init__(self) -> None:
        # kmock's own fallbacks for create/update/delete call the overrides below.
        super().__attrs_post_init__()
        # Built-in resources: discovery, and which kinds have a status subresource.
        bundled = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
        self.resources.load_data(gzip.decompress(bundled))
        self.fallback["post", _EVICTION_PATH] << self._serve_eviction

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
            server, self._server = self._server, None
            await server.__aexit__(exc_type, exc_value, traceback)
        await super().__aexit__(exc_type, exc_value, traceback)

    @property  # type: ignore[override]
    def url(self) -> str:
        """Base URL of the API, e.g. `http://127.0.0.1:40123`."""
        if self._server is None:
            raise RuntimeError("KubeEmulator is not running: use `async with KubeEmulator() as kube`")
        return str(self._server.url).rstrip("/")

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skips KubernetesEmulator._handle, which writes before any reaction is consulted.
        try:
            return await kmock.RawHandler._handle(self, request)
        except ApiStatus as status:
            return status.render()

    def _next_resource_version(self) -> str:
        self._revision += 1
        return str(self._revision)

    # --- writes (kmock's fallback reactions) -----------------------------------------

    @override
    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        assert request.resource is not None
        if not isinstance(request.data, Mapping):
            raise ApiStatus(400, "BadRequest", "the body of a create must be a JSON object")
        obj: Obj = copy.deepcopy(dict(request.data))
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        name = meta.get("name")
        if not name:
            raise ApiStatus(422, "Invalid", "metadata.name: Required value: name or generateName is required")
        namespace = (request.namespace or meta.get("namespace")) if self._namespaced(request.resource) else None
        if self._namespaced(request.resource) and not namespace:
            raise ApiStatus(400, "BadRequest", "the namespace of the object must be set")
        meta.pop("namespace", None)
        if namespace:
            meta["namespace"] = namespace
        for field in ("deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(field, None)
        obj.setdefault("apiVersion", _api_version(request.resource))
        obj.setdefault("kind", self._info(request.resource).kind or request.resource.plural.capitalize())
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        if request.resource == PODS:
            obj["status"] = {"phase": "Pending"}
        if request.resource == NODES:
            _taint_by_readiness(obj)

        key = (request.resource, namespace, name)
        async with self._lock:
            if key in self.objects and not self.objects[key].deleted:
                raise ApiStatus(
                    409, "AlreadyExists", f'{request.resource.plural} "{name}" already exists',
                    {"name": name, "kind": request.resource.plural},
                )
            meta["resourceVersion"] = self._next_resource_version()
            if key in self.objects:
                self.objects[key].create(obj)  # re-created after a deletion: history continues
            else:
                self.objects[key] = obj
        await self._buses[request.resource].put({"type": "ADDED", "object": obj})
        return kmock.Response(status=201, payload=obj)

    @override
    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        events: list[Obj] = []
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise _not_found(request.resource.plural, request.name)
            stored = self.objects[key]
            current: Obj = copy.deepcopy(stored.raw)
            changed = self._apply_patch(request, current)
            if changed == current:
                return current  # a no-op patch writes nothing and keeps the resourceVersion
            changed["metadata"]["resourceVersion"] = self._next_resource_version()
            stored.history.append(changed)
            events.append({"type": "MODIFIED", "object": changed})
            meta = changed["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                stored.delete()  # the last finalizer is gone: deletion completes
                events.append({"type": "DELETED", "object": changed})
        await self._buses[request.resource].put(*events)
        return changed

    @override
    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
        assert request.resource is not None and request.name is not None
        key = (request.resource, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise _not_found(request.resource.plural, request.name)
            event = self._delete_stored(key)
        await self._buses[request.resource].put(event)
        return event["object"]

    def _apply_patch(self, request: kmock.Request, current: Obj) -> Obj:
        """The object after `request`'s patch, or ApiStatus as the API server would refuse it."""
        assert request.resource is not None
        content_type = _content_type(request)
        patch = request.data
        if content_type.startswith(APPLY_PATCH):
            raise ApiStatus(415, "UnsupportedMediaType", "server-side apply is not emulated; send a merge patch")
        if content_type == STRATEGIC_MERGE_PATCH and not _is_builtin(request.resource):
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
        elif isinstance(patch, Mapping):
            wanted_version = (patch.get("metadata") or {}).get("resourceVersion")
            if wanted_version is not None and str(wanted_version) != current["metadata"].get("resourceVersion"):
                raise ApiStatus(
                    409, "Conflict",
                    f'Operation cannot be fulfilled on {request.resource.plural} "{request.name}": the object has been '
                    "modified; please apply your changes to the latest version and try again",
                    {"name": request.name, "kind": request.resource.plural},
                )
            changed = _merge_patch(current, patch)
        else:
            raise ApiStatus(400, "BadRequest", f"a {content_type or 'patch'} body must be a JSON object")
        changed = copy.deepcopy(changed)

        # Identity and server-owned metadata never change through a patch.
        changed_meta = changed.setdefault("metadata", {})
        for field in ("name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation"):
            if field in current["metadata"]:
                changed_meta[field] = current["metadata"][field]
            else:
                changed_meta.pop(field, None)

        if request.subresource == "status":
            changed = {**current, "status": changed.get("status")}
            if changed["status"] is None:
                del changed["status"]
        elif "status" in self._info(request.resource).subresources:
            changed.pop("status", None)
            if "status" in current:
                changed["status"] = current["status"]
        if changed.get("spec") != current.get("spec"):
            changed["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        if request.resource == NODES:
            _taint_by_readiness(changed)
        return changed

    def _delete_stored(self, key: tuple[kmock.resource, str | None, str]) -> Obj:
        """Delete a stored object as the API server would; the watch event to send. The caller
        holds `_lock`. An object with finalizers only gets a deletionTimestamp."""
        stored = self.objects[key]
        current: Obj = copy.deepcopy(stored.raw)
        current["metadata"]["resourceVersion"] = self._next_resource_version()
        if current["metadata"].get("finalizers"):
            current["metadata"].setdefault("deletionTimestamp", _now())
            stored.history.append(current)
            return {"type": "MODIFIED", "object": current}
        stored.history.append(current)
        stored.delete()
        return {"type": "DELETED", "object": current}

    # --- reads -----------------------------------------------------------------------

    @override
    async def _serve_fetch(self, request: kmock.Request) -> kmock.Payload:
        try:
            return await super()._serve_fetch(request)
        except kmock.KubernetesObjectNotFoundError:
            assert request.resource is not None and request.name is not None
            raise _not_found(request.resource.plural, request.name) from None

    @override
    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        listing = await super()._serve_list(request)
        assert isinstance(listing, dict) and request.resource is not None
        selected = _Selection.parse(request.params)
        kind = self._info(request.resource).kind or request.resource.plural.capitalize()
        return {
            "apiVersion": _api_version(request.resource),
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(self._revision)},
            "items": [item for item in listing["items"] if selected.matches(item)],
        }

    @override
    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[kmock.Payload]:
        try:
            selected = _Selection.parse(request.params)
        except ApiStatus:
            selected = _Selection()
        async for event in super()._serve_watch(request):
            if not isinstance(event, Mapping) or selected.matches(event.get("object") or {}):
                yield event

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
        key = (PODS, request.namespace, request.name)
        async with self._lock:
            if key not in self.objects or self.objects[key].deleted:
                raise _not_found("pods", request.name)
            self._check_disruption_budget(self.objects[key].raw, request.namespace)
            event = self._delete_stored(key)
        await self._buses[PODS].put(event)
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

    # --- helpers ---------------------------------------------------------------------

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        return self.resources[resource] if resource in self.resources else kmock.ResourceInfo()

    def _namespaced(self, resource: kmock.resource) -> bool:
        namespaced = self._info(resource).namespaced
        return True if namespaced is None else namespaced


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
        payload: Obj = {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        }
        if self.details:
            payload["details"] = dict(self.details)
        return aiohttp.web.json_response(payload, status=self.code)


def _not_found(plural: str, name: str) -> ApiStatus:
    return ApiStatus(404, "NotFound", f'{plural} "{name}" not found', {"name": name, "kind": plural})


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _content_type(request: kmock.Request) -> str:
    for key, value in request.headers.items():
        if key.lower() == "content-type":
            return value.split(";")[0].strip().lower()
    return ""


def _api_version(resource: kmock.resource) -> str:
    return f"{resource.group}/{resource.version}" if resource.group else str(resource.version)


def _is_builtin(resource: kmock.resource) -> bool:
    """Strategic merge works on built-in kinds only (core, `apps`, `*.k8s.io`), not on CRs."""
    group = resource.group or ""
    return "." not in group or group.endswith(".k8s.io")


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch; strategic merge is treated the same (lists are replaced)."""
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
