"""Namespaces in the embedded Kubernetes API (`sim.kube`): `KubeNamespaces`, the layer of
`KubeEmulator` on top of kube_eviction's `KubeEviction`, as the API server's namespace registry,
its NamespaceLifecycle admission plugin and kube-controller-manager's namespace controller do:

* `/api/v1/namespaces` and `/api/v1/namespaces/<name>` (and its `status` and `finalize`
  subresources) name the Namespace resource; kmock 0.8 reads them as a namespace with no
  resource and fails (`kubectl get ns` answered `ValueError('not enough values to unpack')`);
* `default`, `kube-system`, `kube-public` and `kube-node-lease` exist from the start;
* a new Namespace is `Active` with the `kubernetes` finalizer in `spec.finalizers`;
* deleting one makes it `Terminating`: what is in it is deleted (pods gracefully), new content is
  refused (403), and the Namespace goes with the last object in it.

Unlike a real server, objects may be created in a namespace that does not exist (as with plain
kmock): tests and the demo need no setup.
"""

from __future__ import annotations

import copy
import re

import attrs
import kmock
from kmock._internal import parsing
from typing_extensions import override

from sim.kube_eviction import KubeEviction
from sim.kube_machinery import EVENTS, PODS, ApiStatus, Key, Obj, now_time

NAMESPACES = kmock.resource("", "v1", "namespaces")
# What a fresh cluster has (the API server creates the first three, the kubelets' Leases need the last).
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
_NAMESPACE_FINALIZER = "kubernetes"
_NAMESPACE_PATH = re.compile(r"/api/v1/namespaces(?:/(?P<name>[^/]+)(?:/(?P<sub>status|finalize))?)?/?")
_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock's path parser, with the Namespace resource's own paths read as that resource."""
    match = _NAMESPACE_PATH.fullmatch(path)
    if match is None:
        return _kmock_parse_path(path)
    return parsing.ParsedPath(group="", version="v1", plural="namespaces", name=match["name"], subresource=match["sub"])


# kmock parses every request (and every DSL pattern) through this module attribute.
parsing.parse_path = _parse_path


@attrs.define(kw_only=True)
class KubeNamespaces(KubeEviction):
    """The store with Namespaces and their lifecycle. A layer of `KubeEmulator`, not used alone."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        for name in INITIAL_NAMESPACES:
            self._create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    @override
    def _create(self, resource: kmock.resource, url_namespace: str | None, body: object) -> Obj:
        if resource == NAMESPACES and isinstance(body, dict):
            body = copy.deepcopy(body)
            body.setdefault("spec", {})["finalizers"] = [_NAMESPACE_FINALIZER]
            body["status"] = {"phase": "Active"}
        namespace = url_namespace or (body.get("metadata") or {}).get("namespace") if isinstance(body, dict) else None
        if namespace and resource not in (NAMESPACES, EVENTS) and self._terminating(namespace):
            raise ApiStatus(
                403, "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being terminated",
            )
        return super()._create(resource, url_namespace, body)

    @override
    def _delete(self, key: Key, current: Obj) -> tuple[Obj, bool]:
        if key[0] != NAMESPACES:
            return super()._delete(key, current)
        if current["metadata"].get("deletionTimestamp"):
            return current, False
        marked = copy.deepcopy(current)
        marked["metadata"].update(deletionTimestamp=now_time(), deletionGracePeriodSeconds=0,
                                  resourceVersion=self._next_resource_version())
        marked["status"] = {"phase": "Terminating"}
        self.objects[key].history.append(marked)
        self._publish(NAMESPACES, "MODIFIED", marked, current)
        name = key[2]
        for inner, stored in list(self.objects.items()):
            if inner[1] == name and not stored.deleted and inner[0] != NAMESPACES:
                if inner[0] == PODS:
                    self._delete_pod(inner, stored.raw, None)
                else:
                    self._delete(inner, stored.raw)
        return self._finish_namespace(name) or marked, key not in self.objects or self.objects[key].deleted

    @override
    def _remove(self, key: Key, current: Obj) -> Obj:
        gone = super()._remove(key, current)
        if key[1] is not None and key[0] != NAMESPACES and self._terminating(key[1]):
            self._finish_namespace(key[1])
        return gone

    def _terminating(self, name: str) -> bool:
        key = (NAMESPACES, None, name)
        if key not in self.objects or self.objects[key].deleted:
            return False
        return bool(self.objects[key].raw["metadata"].get("deletionTimestamp"))

    def _finish_namespace(self, name: str) -> Obj | None:
        """Remove Namespace `name` (being deleted) once nothing is left in it; its last state."""
        if any(k[1] == name and not o.deleted for k, o in self.objects.items()):
            return None
        key = (NAMESPACES, None, name)
        return self._remove(key, self.objects[key].raw)
