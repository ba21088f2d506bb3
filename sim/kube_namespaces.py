"""Namespaces in the embedded Kubernetes API (`sim.kube`): `KubeNamespaces`, the layer of
`KubeEmulator` on top of kube_eviction's `KubeEviction`, as the API server's namespace registry,
its NamespaceLifecycle admission plugin and kube-controller-manager's namespace controller do:

* `/api/v1/namespaces` and `/api/v1/namespaces/<name>` (and its `status` and `finalize`
  subresources) name the Namespace resource; kmock 0.8 reads them as a namespace with no
  resource and fails (`kubectl get ns` answered `ValueError('not enough values to unpack')`);
* `default`, `kube-system`, `kube-public` and `kube-node-lease` exist from the start;
* a new Namespace is `Active` with the `kubernetes` finalizer in `spec.finalizers`;
* `kubectl create namespace` sends the Namespace as protobuf (`namespace_from_protobuf` reads
  its name, labels and annotations); other protobuf bodies are refused with 415;
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


PROTOBUF = "application/vnd.kubernetes.protobuf"
# The envelope of a protobuf body (k8s.io/apimachinery/pkg/runtime/serializer/protobuf).
_PROTOBUF_MAGIC = b"k8s\x00"


def namespace_from_protobuf(body: bytes) -> Obj:
    """The Namespace in a protobuf body (a runtime.Unknown whose `raw` is a v1.Namespace): its
    metadata's name, generateName, labels and annotations, which is all `kubectl create
    namespace` sets. ApiStatus 415 for any other kind."""
    if not body.startswith(_PROTOBUF_MAGIC):
        raise ApiStatus(400, "BadRequest", "a protobuf body must start with the k8s\\x00 envelope")
    unknown = _fields(body[len(_PROTOBUF_MAGIC):])
    type_meta = _fields(_one(unknown, 1))
    if _one(type_meta, 2) != b"Namespace":
        raise ApiStatus(415, "UnsupportedMediaType", (
            f"the emulator reads only a Namespace as protobuf ({PROTOBUF}); send this object as JSON "
            "(kubectl apply -f <file> does)"
        ))
    meta = _fields(_one(_fields(_one(unknown, 2)), 1))
    metadata: Obj = {"name": _one(meta, 1).decode(), "generateName": _one(meta, 2).decode()}
    for field, name in ((11, "labels"), (12, "annotations")):
        entries = [_fields(entry) for entry in meta.get(field, [])]
        metadata[name] = {_one(e, 1).decode(): _one(e, 2).decode() for e in entries}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {k: v for k, v in metadata.items() if v}}


def _fields(data: bytes) -> dict[int, list[bytes]]:
    """A protobuf message's length-delimited fields by number (varints are skipped: none is read)."""
    fields: dict[int, list[bytes]] = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        if key & 7 == 0:
            _, at = _varint(data, at)
        elif key & 7 == 2:
            size, at = _varint(data, at)
            fields.setdefault(key >> 3, []).append(data[at:at + size])
            at += size
        else:
            raise ApiStatus(400, "BadRequest", f"unexpected protobuf wire type {key & 7}")
    return fields


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ApiStatus(400, "BadRequest", "a truncated protobuf body")
        byte = data[at]
        value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
        if not byte & 0x80:
            return value, at


def _one(fields: dict[int, list[bytes]], number: int) -> bytes:
    return (fields.get(number) or [b""])[0]


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
