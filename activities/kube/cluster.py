"""The Kubernetes API as the node lifecycle needs it: the `Cluster` adapter on `kubernetes.aio`.

Everything Kubernetes-specific stays in activities/kube/: here the calls, with explicit patch
content types, optimistic concurrency on read-modify-write and the Eviction API with its
policy/v1beta1 fallback; beside it the connection (connection.py), the few core/v1 calls without
kubernetes' models (core_calls.py), what tgp reads of Nodes and Pods (summaries.py) and the
mapping of API failures to tgp's typed errors (api_errors.py: 401 -> AuthError, 403 ->
PermissionDenied, 429/5xx/timeouts/connection errors -> TransientError). Messages name the
object and say what to fix; they never carry credentials or the raw response, because they
reach workflow history.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import Any, Self, TypeVar

import aiohttp
from kubernetes.aio import client as k8s
from kubernetes.aio.client.exceptions import ApiException

from activities.kube.api_errors import SYSTEM, api_error, names_the_pod, server_message
from activities.kube.connection import Configure, environment_read_once, kubeconfig_configuration, url_configuration
from activities.kube.core_calls import CoreCalls
from activities.kube.summaries import node_summary_of, pod_summary_of
from activities.ports import EvictionBlocked, ListedSecret, VersionedSecret
from tgp.crds import GROUP, VERSION
from tgp.drift import patch_labels, patch_taints
from tgp.errors import ConfigError, TransientError
from tgp.events import EVENT_MESSAGE_LIMIT
from tgp.types import ANNOTATION_RELEASED, FINALIZER_TERMINATION, NodeSummary, PodSummary, Taint

# API server calls answer in milliseconds; 30 s catches a hung connection or an overloaded
# control plane without pinning a worker slot, and Temporal's retry takes over from there.
REQUEST_TIMEOUT = timedelta(seconds=30)
# Read-modify-write attempts on a Node: conflicts come from kubelet heartbeats and the node
# controller and settle within a few tries; past that Temporal retries the activity.
CONFLICT_ATTEMPTS = 5
# An Event's create is tried with this many generated names before its 409 is an error.
EVENT_NAME_TRIES = 3
# A Node `get_node` read is kept this long for a write that follows the look (`label_and_taint`
# in the launch's activity, milliseconds later); older copies are dropped.
SEEN_FOR = 5.0  # seconds
# Pods per list page. A GPU node runs tens of pods, so one page is the norm.
LIST_PAGE_SIZE = 500

MERGE_PATCH = "application/merge-patch+json"
EVICTION_VERSIONS = ("policy/v1", "policy/v1beta1")  # newest first, as `kubectl drain` tries them

T = TypeVar("T")


@dataclass(frozen=True)
class CustomResource:
    """Where a custom resource lives (namespace None for cluster-scoped kinds)."""

    group: str
    version: str
    plural: str
    kind: str
    name: str
    namespace: str | None = None
    uid: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace + '/' if self.namespace else ''}{self.name}"


class KubernetesCluster:
    """`activities.ports.Cluster` over the official async client (`kubernetes.aio`).

    Build one with `from_url` (the emulator, or a proxy that adds credentials) or
    `from_kubeconfig`; close it with `close()` or use it as an async context manager.
    """

    def __init__(
        self,
        configure: Configure,
        *,
        request_timeout: timedelta = REQUEST_TIMEOUT,
    ) -> None:
        """`configure` yields the client configuration (host, credentials); it runs once, on
        the first call, because kubernetes.aio loads credentials asynchronously."""
        self._configure = configure
        self._timeout = float(request_timeout.total_seconds())
        self._api: k8s.ApiClient | None = None
        self._core: CoreCalls | None = None
        self._connecting = asyncio.Lock()
        # The Nodes `get_node` read in the last SEEN_FOR, by name, oldest first, with when: a
        # launch labels the Node it just looked at without reading it again; its
        # resourceVersion guards the write.
        self._seen: dict[str, tuple[float, dict[str, Any]]] = {}

    @classmethod
    def from_url(
        cls, url: str, *, token: str | None = None, request_timeout: timedelta = REQUEST_TIMEOUT
    ) -> KubernetesCluster:
        """A client for the API server at `url`, unauthenticated unless a bearer `token` is given."""
        return cls(url_configuration(url, token), request_timeout=request_timeout)

    @classmethod
    def from_kubeconfig(
        cls,
        path: str | None = None,
        *,
        context: str | None = None,
        request_timeout: timedelta = REQUEST_TIMEOUT,
    ) -> KubernetesCluster:
        """A client configured from the kubeconfig at `path`. With no path: the pod's service
        account when running in a cluster, else `$KUBECONFIG` or `~/.kube/config`. The file is
        read on the first call, which raises ConfigError if it is unusable."""
        return cls(kubeconfig_configuration(path, context), request_timeout=request_timeout)

    async def close(self) -> None:
        """Close the connection pool."""
        if self._api is not None:
            await self._api.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def _client(self) -> CoreCalls:
        if self._core is None:
            async with self._connecting:
                if self._core is None:
                    self._api = k8s.ApiClient(environment_read_once(await self._configure()))
                    self._core = CoreCalls(self._api)
        return self._core

    # --- Nodes -----------------------------------------------------------------------

    async def get_node(self, name: str) -> NodeSummary | None:
        """The Node called `name`, or None when there is none."""
        node = await self._read_node(name)
        if node is None:
            return None
        now = time.monotonic()
        self._seen.pop(name, None)
        self._seen[name] = (now, node)
        while next(iter(self._seen.values()))[0] < now - SEEN_FOR:
            self._seen.pop(next(iter(self._seen)))
        return node_summary_of(node)

    async def label_and_taint(
        self, name: str, labels: dict[str, str], taints: list[Taint], *, remove_labels: Mapping[str, str] | None = None, remove_taints: Sequence[Taint] = ()
    ) -> None:
        """Merge `labels` into the Node's labels and add the `taints` it lacks; remove each of
        `remove_labels` and `remove_taints` (what tgp had set and the pool no longer lists) only
        while the Node still carries it as tgp set it (tgp.drift.patch_labels, patch_taints).

        A taint is identified by key and effect (the API allows one per pair), so a listed taint
        replaces the value of an existing one. Nothing is written when nothing is missing; a
        write carries the resourceVersion that was read and is redone on a 409 conflict. The
        first try starts from the Node as `get_node` read it within SEEN_FOR, if it did (the
        launch's look, a moment before): a copy changed since costs a conflict and a read.
        """
        core = await self._client()
        at, seen = self._seen.pop(name, (0.0, None))
        if at < time.monotonic() - SEEN_FOR:
            seen = None
        for _ in range(CONFLICT_ATTEMPTS):
            node, seen = seen or await self._read_node(name), None
            if node is None:
                raise TransientError(f"Node {name} does not exist (yet or any more); cannot label and taint it")
            meta = node.get("metadata") or {}
            current_labels = dict(meta.get("labels") or {})
            current_taints = [_taint_wire(t) for t in (node.get("spec") or {}).get("taints") or []]
            new_labels = patch_labels(current_labels, labels, remove_labels or {})
            merged_taints = patch_taints(current_taints, taints, remove_taints)
            finalizers = list(meta.get("finalizers") or [])
            # The termination finalizer (a Node being deleted takes no new one: its watch ends it).
            add_finalizer = FINALIZER_TERMINATION not in finalizers and not meta.get("deletionTimestamp")

            if not new_labels and merged_taints == current_taints and not add_finalizer:
                return
            patch: dict[str, Any] = {"metadata": {"resourceVersion": meta.get("resourceVersion")}}
            if new_labels:
                patch["metadata"]["labels"] = new_labels
            if add_finalizer:  # a merge patch replaces the list whole: guarded by resourceVersion
                patch["metadata"]["finalizers"] = [*finalizers, FINALIZER_TERMINATION]
            if merged_taints != current_taints:
                patch["spec"] = {"taints": merged_taints}  # a merge patch replaces lists whole
            try:
                await self._call(
                    f"label and taint Node {name}",
                    core.patch_node(name, patch, _content_type=MERGE_PATCH, _request_timeout=self._timeout),
                    passthrough={409},
                )
            except ApiException:  # 409: someone wrote in between; read again
                continue
            return
        raise TransientError(f"Node {name} kept changing while it was labelled and tainted; will retry")

    async def cordon(self, name: str) -> None:
        """Mark the Node unschedulable. A Node that no longer exists takes no pods: done."""
        await self._set_unschedulable(name, True)

    async def uncordon(self, name: str) -> None:
        """Mark the Node schedulable again. A Node that no longer exists: nothing to do."""
        # null, not false: a merge patch with null removes the field, as `kubectl uncordon` leaves it.
        await self._set_unschedulable(name, None)

    async def _set_unschedulable(self, name: str, value: bool | None) -> None:
        core = await self._client()
        try:
            await self._call(
                f"{'cordon' if value else 'uncordon'} Node {name}",
                core.patch_node(
                    name, {"spec": {"unschedulable": value}}, _content_type=MERGE_PATCH, _request_timeout=self._timeout
                ),
                passthrough={404},
            )
        except ApiException:
            return

    async def delete_node(self, name: str) -> None:
        """Annotate the Node released (ANNOTATION_RELEASED: its deletion is its workflow's own,
        and the bridge tells the workflow nothing of it), take tgp's termination finalizer off,
        then delete it; one already gone counts as deleted. The annotation is a write of its
        own, before: a Node being deleted (`kubectl delete node`) goes with the finalizer's
        removal, and its DELETED event carries the state stored before that write."""
        core = await self._client()
        try:
            await self._call(
                f"annotate Node {name} released",
                core.patch_node(
                    name, {"metadata": {"annotations": {ANNOTATION_RELEASED: "true"}}}, _content_type=MERGE_PATCH, _request_timeout=self._timeout
                ),
                passthrough={404},
            )
        except ApiException:
            return  # gone already
        if not await self._remove_finalizer(name):
            return  # gone already, or gone with its last finalizer
        try:
            await self._call(
                f"delete Node {name}",
                core.delete_node(name, _request_timeout=self._timeout),
                passthrough={404},
            )
        except ApiException:
            return

    async def _remove_finalizer(self, name: str) -> bool:
        """Take FINALIZER_TERMINATION off Node `name` (a write guarded by resourceVersion, redone
        on conflict: a merge patch replaces the list whole). Whether the Node is still there."""
        core = await self._client()
        for _ in range(CONFLICT_ATTEMPTS):
            node = await self._read_node(name)
            meta = (node or {}).get("metadata")
            if meta is None:
                return False
            finalizers = list(meta.get("finalizers") or [])
            if FINALIZER_TERMINATION not in finalizers:
                return True
            kept = [f for f in finalizers if f != FINALIZER_TERMINATION]
            patch = {"metadata": {"finalizers": kept or None, "resourceVersion": meta.get("resourceVersion")}}
            try:
                await self._call(
                    f"remove finalizer {FINALIZER_TERMINATION} from Node {name}",
                    core.patch_node(name, patch, _content_type=MERGE_PATCH, _request_timeout=self._timeout),
                    passthrough={404, 409},
                )
            except ApiException as exc:
                if exc.status == 404:
                    return False
                continue  # 409: someone wrote in between; read again
            return not (meta.get("deletionTimestamp") and not kept)
        raise TransientError(f"Node {name} kept changing while its finalizer {FINALIZER_TERMINATION} was removed; will retry")

    async def _read_node(self, name: str) -> dict[str, Any] | None:
        """Node `name` as the API serves it (camelCase JSON), or None when there is none."""
        core = await self._client()
        try:
            return await self._call(
                f"read Node {name}",
                core.read_node(name, _request_timeout=self._timeout),
                passthrough={404},
            )
        except ApiException:
            return None

    # --- Pods ------------------------------------------------------------------------

    async def list_pods_on_node(self, name: str) -> list[PodSummary]:
        """Every pod bound to Node `name`, in all namespaces, whatever its phase."""
        core = await self._client()
        pods: list[PodSummary] = []
        token: str | None = None
        while True:
            page = await self._call(
                f"list pods on Node {name}",
                core.list_pod_for_all_namespaces(
                    field_selector=f"spec.nodeName={name}",
                    limit=LIST_PAGE_SIZE,
                    _continue=token,
                    _request_timeout=self._timeout,
                ),
            )
            pods.extend(pod_summary_of(pod) for pod in page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return pods

    async def list_objects(self, kind: str, *, label_selector: str | None = None, field_selector: str | None = None) -> list[dict[str, Any]]:
        """Nodes (`kind` "nodes", cluster-wide) or pods ("pods", all namespaces) matching the
        selectors, as the API serves them (camelCase JSON): for readers that apply the same rules
        as the bridge to watch events (`tgp plan`)."""
        core = await self._client()
        listing = core.list_node if kind == "nodes" else core.list_pod_for_all_namespaces
        found: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = await self._call(
                f"list {kind}",
                listing(label_selector=label_selector, field_selector=field_selector, limit=LIST_PAGE_SIZE, _continue=token, _request_timeout=self._timeout),
            )
            found.extend(page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return found

    async def list_custom(self, group: str, version: str, plural: str) -> list[dict[str, Any]]:
        """Every custom resource of `plural` in all namespaces, as dicts."""
        api = await self._custom()
        listed = await self._call(f"list {plural}", api.list_cluster_custom_object(group, version, plural, _request_timeout=self._timeout))
        return list(dict(listed).get("items") or [])

    async def evict_pod(self, namespace: str, name: str, *, grace_period: timedelta | None = None) -> None:
        """Ask the Eviction API to remove the pod, respecting PodDisruptionBudgets.

        Sends policy/v1 and falls back to policy/v1beta1 when the server does not know v1
        (400, or a 404 that is not about the pod), as `kubectl drain` does. Raises
        EvictionBlocked on 429; a pod that is already gone counts as evicted.
        """
        core = await self._client()
        options = None
        if grace_period is not None:
            options = k8s.V1DeleteOptions(grace_period_seconds=int(grace_period.total_seconds()))
        what = f"evict pod {namespace}/{name}"
        for version in EVICTION_VERSIONS:
            eviction = k8s.V1Eviction(
                api_version=version,
                kind="Eviction",
                metadata=k8s.V1ObjectMeta(name=name, namespace=namespace),
                delete_options=options,
            )
            try:
                await self._call(
                    what,
                    core.create_namespaced_pod_eviction(name, namespace, eviction, _request_timeout=self._timeout),
                    passthrough={400, 404, 429},
                )
                return
            except ApiException as exc:
                if exc.status == 429:
                    raise EvictionBlocked(f"{what}: {server_message(exc)}") from None
                if exc.status == 404 and (names_the_pod(exc) or version == EVICTION_VERSIONS[-1]):
                    return  # already gone
                if version == EVICTION_VERSIONS[-1]:
                    raise ConfigError(f"{what}: the API server rejected the Eviction (400): {server_message(exc)}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def delete_pod(self, namespace: str, name: str, *, grace_period: timedelta, uid: str = "") -> None:
        """Delete the pod (no PodDisruptionBudget is asked), giving its containers `grace_period`
        to stop. `uid`: only that pod, not a namesake created since. One already gone counts."""
        core = await self._client()
        options = k8s.V1DeleteOptions(
            grace_period_seconds=int(grace_period.total_seconds()), preconditions=k8s.V1Preconditions(uid=uid) if uid else None
        )
        try:
            await self._call(
                f"delete pod {namespace}/{name}",
                core.delete_namespaced_pod(name, namespace, body=options, _request_timeout=self._timeout),
                passthrough={404, 409},
            )
        except ApiException:
            return  # gone (404), or a namesake (409: the uid precondition)

    # --- custom resources, Secrets and Events (the pool and class workflows) -----------

    async def _custom(self) -> k8s.CustomObjectsApi:
        await self._client()
        return k8s.CustomObjectsApi(self._api)

    async def patch_custom_status(self, ref: CustomResource, status: Mapping[str, Any]) -> bool:
        """Merge-patch the status subresource of a custom resource. False when it is gone."""
        call = (await self._client()).patch_custom_object_status(
            ref.group, ref.version, ref.namespace or None, ref.plural, ref.name, {"status": dict(status)}, _content_type=MERGE_PATCH, _request_timeout=self._timeout
        )
        try:
            await self._call(f"write the status of {ref}", call, passthrough={404})
        except ApiException:
            return False
        return True

    async def get_custom(self, ref: CustomResource) -> dict[str, Any] | None:
        """The custom resource as a dict, or None when it does not exist."""
        api = await self._custom()
        what = f"read {ref}"
        try:
            if ref.namespace:
                call = api.get_namespaced_custom_object(ref.group, ref.version, ref.namespace, ref.plural, ref.name, _request_timeout=self._timeout)
            else:
                call = api.get_cluster_custom_object(ref.group, ref.version, ref.plural, ref.name, _request_timeout=self._timeout)
            return dict(await self._call(what, call, passthrough={404}))
        except ApiException:
            return None

    async def set_finalizer(self, ref: CustomResource, finalizer: str, present: bool) -> None:
        """Add or remove `finalizer` on a custom resource (a gone object needs no removal).
        Guarded by resourceVersion and redone on conflict."""
        api = await self._custom()
        for _ in range(CONFLICT_ATTEMPTS):
            obj = await self.get_custom(ref)
            if obj is None:
                return
            meta = obj.get("metadata") or {}
            current = list(meta.get("finalizers") or [])
            wanted = sorted(set(current) | {finalizer}) if present else [f for f in current if f != finalizer]
            if wanted == current:
                return
            patch = {"metadata": {"finalizers": wanted, "resourceVersion": meta.get("resourceVersion")}}
            what = f"{'add' if present else 'remove'} finalizer {finalizer} on {ref}"
            try:
                if ref.namespace:
                    call = api.patch_namespaced_custom_object(
                        ref.group, ref.version, ref.namespace, ref.plural, ref.name, patch,
                        _content_type=MERGE_PATCH, _request_timeout=self._timeout,
                    )
                else:
                    call = api.patch_cluster_custom_object(
                        ref.group, ref.version, ref.plural, ref.name, patch, _content_type=MERGE_PATCH, _request_timeout=self._timeout
                    )
                await self._call(what, call, passthrough={404, 409})
                return
            except ApiException as exc:
                if exc.status == 404:
                    return
        raise TransientError(f"{ref} kept changing while its finalizers were updated; will retry")

    async def read_secret(self, namespace: str, name: str) -> dict[str, bytes] | None:
        """A Secret's decoded data, or None when it does not exist. Callers must never log it."""
        found = await self.read_secret_versioned(namespace, name)
        return None if found is None else found.data

    async def read_secret_versioned(self, namespace: str, name: str) -> VersionedSecret | None:
        """A Secret's decoded data and resourceVersion (what a cache of what was built from it
        compares), or None when it does not exist. Callers must never log the data."""
        core = await self._client()
        try:
            secret = await self._call(
                f"read Secret {namespace}/{name}",
                core.read_namespaced_secret(name, namespace, _request_timeout=self._timeout),
                passthrough={404},
            )
        except ApiException:
            return None
        data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
        return VersionedSecret(data=data, resource_version=(secret.metadata.resource_version if secret.metadata else None) or "")

    async def create_secret(
        self, namespace: str, name: str, data: Mapping[str, bytes], *, labels: Mapping[str, str], annotations: Mapping[str, str]
    ) -> bool:
        """Create an Opaque Secret; False when one of that name exists already (409, left as it
        is). Callers must never log `data`."""
        core = await self._client()
        body = k8s.V1Secret(
            metadata=k8s.V1ObjectMeta(name=name, namespace=namespace, labels=dict(labels), annotations=dict(annotations)),
            type="Opaque",
            data={k: base64.b64encode(v).decode() for k, v in data.items()},
        )
        try:
            await self._call(f"create Secret {namespace}/{name}", core.create_namespaced_secret(namespace, body, _request_timeout=self._timeout), passthrough={409})
        except ApiException:
            return False
        return True

    async def annotate_secret(self, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Merge `annotations` into the Secret's (a merge patch of its metadata only); False when
        it does not exist."""
        core = await self._client()
        patch = {"metadata": {"annotations": dict(annotations)}}
        try:
            await self._call(
                f"annotate Secret {namespace}/{name}",
                core.patch_namespaced_secret(name, namespace, patch, _content_type=MERGE_PATCH, _request_timeout=self._timeout),
                passthrough={404},
            )
        except ApiException:
            return False
        return True

    async def list_secrets(self, namespace: str, label_selector: str) -> list[ListedSecret]:
        """The Secrets of `namespace` that `label_selector` selects, decoded. Callers must never
        log the data."""
        core = await self._client()
        found: list[ListedSecret] = []
        token: str | None = None
        while True:
            page = await self._call(
                f"list Secrets in {namespace} ({label_selector})",
                core.list_namespaced_secret(
                    namespace, label_selector=label_selector, limit=LIST_PAGE_SIZE, _continue=token, _request_timeout=self._timeout
                ),
            )
            for secret in page.items or []:
                meta = secret.metadata or k8s.V1ObjectMeta()
                data = {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}
                found.append(ListedSecret(name=meta.name or "", data=data, resource_version=meta.resource_version or "", annotations=dict(meta.annotations or {})))
            token = page.metadata.var_continue if page.metadata else None
            if not token:
                return found

    async def delete_secret(self, namespace: str, name: str, *, resource_version: str) -> bool:
        """Delete the Secret if it is still at `resource_version` (a precondition the API server
        checks); False when it is gone (404) or has changed since (409)."""
        core = await self._client()
        options = k8s.V1DeleteOptions(preconditions=k8s.V1Preconditions(resource_version=resource_version))
        try:
            await self._call(
                f"delete Secret {namespace}/{name}",
                core.delete_namespaced_secret(name, namespace, body=options, _request_timeout=self._timeout),
                passthrough={404, 409},
            )
        except ApiException:
            return False
        return True

    async def create_event(self, ref: CustomResource, *, type: str, reason: str, message: str, component: str = "tgp", count: int = 1) -> None:
        """Record a core/v1 Event about `ref` (shown by `kubectl describe`), standing for `count`
        occurrences."""
        involved = {"apiVersion": f"{ref.group}/{ref.version}", "kind": ref.kind, "name": ref.name, "namespace": ref.namespace, "uid": ref.uid}
        await self._record_event(involved, ref.namespace or "default", str(ref), type=type, reason=reason, message=message, component=component, count=count)

    async def record_class_event(self, name: str, *, type: str, reason: str, message: str, component: str = "tgp") -> None:
        """Record a core/v1 Event about the GPUNodeClass `name` (its uid read first, so that
        `kubectl describe gnc` finds it)."""
        ref = CustomResource(GROUP, VERSION, "gpunodeclasses", "GPUNodeClass", name)
        found = await self.get_custom(ref)
        uid = ((found or {}).get("metadata") or {}).get("uid")
        await self.create_event(replace(ref, uid=uid), type=type, reason=reason, message=message, component=component)

    async def record_pod_event(self, pod: PodSummary, *, type: str, reason: str, message: str, component: str = "tgp", count: int = 1) -> None:
        """Record a core/v1 Event about a Pod (shown by `kubectl describe pod`, which finds it by uid)."""
        involved = {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "namespace": pod.namespace, "uid": pod.uid or None}
        await self._record_event(
            involved, pod.namespace, f"Pod {pod.namespace}/{pod.name}", type=type, reason=reason, message=message, component=component, count=count
        )

    async def _record_event(
        self, involved: dict[str, str | None], namespace: str, what: str, *, type: str, reason: str, message: str, component: str, count: int = 1
    ) -> None:
        """The Event as the API takes it (camelCase JSON, as the Node and pod calls send theirs):
        an Event per node change is the pool's most frequent write, and kubernetes' models cost
        more to build and to read back than the request itself."""
        core = await self._client()
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": {k: v for k, v in involved.items() if v is not None},
            "type": type,
            "reason": reason,
            "message": message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": component},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": count,
        }
        # A generated name already taken is 409 AlreadyExists from a server before 1.32 (later
        # ones generate again themselves): a new name is asked for, as client-go's recorder does.
        for attempt in range(1, EVENT_NAME_TRIES + 1):
            try:
                await self._call(
                    f"record Event {reason} on {what}",
                    core.create_namespaced_event(namespace, event, _request_timeout=self._timeout),
                    passthrough={409} if attempt < EVENT_NAME_TRIES else (),
                )
                return
            except ApiException:
                continue

    # --- error mapping ---------------------------------------------------------------

    async def _call(self, action: str, call: Awaitable[T], *, passthrough: Collection[int] = ()) -> T:
        """Await one API call, turning failures into tgp's typed errors. ApiExceptions whose
        status is in `passthrough` are re-raised for the caller to interpret."""
        try:
            return await call
        except ApiException as exc:
            if exc.status in passthrough:
                raise
            raise api_error(action, exc) from None
        except TimeoutError:
            raise TransientError(f"{SYSTEM}: {action} timed out after {self._timeout:g}s") from None
        except aiohttp.ClientConnectorCertificateError:
            raise ConfigError(
                f"{SYSTEM}: {action}: the server's TLS certificate is not trusted; check the cluster "
                "certificate-authority in the kubeconfig"
            ) from None
        except aiohttp.ClientError as exc:
            raise TransientError(f"{SYSTEM}: {action} failed: {type(exc).__name__}") from None


def _taint_wire(taint: Mapping[str, Any]) -> dict[str, str]:
    """A taint as the API writes it (its key, effect, value when set and `timeAdded` as read, so
    a rewrite does not reset it)."""
    wire = {"key": taint.get("key"), "effect": taint.get("effect")}
    if taint.get("value"):
        wire["value"] = taint["value"]
    if taint.get("timeAdded"):
        wire["timeAdded"] = taint["timeAdded"]
    return wire
