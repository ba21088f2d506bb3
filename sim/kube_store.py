"""The object store of the embedded Kubernetes API (`sim.kube`): `KubeStore`, the first layer
of `KubeEmulator` (kmock.KubernetesEmulator, then KubeStore, KubeWatch, KubeEviction and
KubeEmulator), holds the objects and writes them as the API server's registry does:

* create answers the stored object with `uid`, `resourceVersion`, `generation: 1`,
  `creationTimestamp` stamped; a name already taken is 409 AlreadyExists; `generateName` gets a
  random suffix, another while the name is taken (up to GENERATE_NAME_TRIES, as the API server
  since 1.32); a new Pod starts in phase Pending (`terminationGracePeriodSeconds` defaulted);
* one cluster-wide `resourceVersion` counter, bumped by every write; a patch or a PUT that
  carries a stale `metadata.resourceVersion` is 409 Conflict; a failed JSON-patch `test` is 422;
* merge patch, strategic merge patch (built-in kinds only, 415 on custom resources; list merge
  keys and directives as kubectl sends them, see kube_patch), JSON patch; a JSON-patch content
  type with an object body is 400;
* the `/status` subresource changes only `status`; the main object ignores `status`;
  `generation` follows `spec` (custom resources: everything but metadata and status);
* finalizers: deleting an object that has some only sets `deletionTimestamp` (a MODIFIED event);
  it goes when the last finalizer is removed;
* CustomResourceDefinitions (`install_crd` or POST): REST paths for every served version, one
  storage for all of them, structural-schema pruning, defaulting and validation (kube_schema),
  `fieldValidation` on writes of custom resources; deleting a CRD deletes its custom resources
  (finalizers respected) and the CRD goes with the last of them;
* Events in `v1` and `events.k8s.io/v1` share one storage (kube_events);
* Nodes carry `node.kubernetes.io/not-ready:NoSchedule` until their Ready condition is True
  (the admission plugin and node-lifecycle controller of a real cluster, applied instantly);
* `labelSelector` and `fieldSelector` of lists and watches (kube_selection); a list of pods by
  `spec.nodeName=` (a kubelet's), and a watch's first events, read that Node's pods through an
  index, as the watch cache does.

Every write ends in `_publish`, where kube_watch records it for watches. Graceful deletion of
Pods is kube_eviction's; the HTTP routes that call the store are sim.kube's.
"""

from __future__ import annotations

import copy
import gzip
import importlib.resources
import json
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import jsonpatch
import kmock
from typing_extensions import override

from sim import kube_patch
from sim.kube_events import event_errors, event_to_core, event_to_v1
from sim.kube_machinery import (
    APPLY_PATCH,
    CRDS,
    EVENTS,
    EVENTS_V1,
    JSON_PATCH,
    MERGE_PATCH,
    NODES,
    PODS,
    STRATEGIC_MERGE_PATCH,
    ApiStatus,
    FieldError,
    Key,
    Obj,
    api_version,
    conflict,
    decode_builtin,
    invalid,
    key_of,
    media_type,
    now_time,
    qualified_resource,
    same_resource,
)
from sim.kube_schema import (
    CustomResource,
    CustomVersion,
    check_crd,
    check_type_meta,
    default_crd,
    label_errors,
    name_errors,
    prune,
    removed_fields,
)
from sim.kube_selection import Selection, node_name_of

TAINT_NOT_READY = "node.kubernetes.io/not-ready"
TAINT_UNREACHABLE = "node.kubernetes.io/unreachable"

# The finalizer the API server puts on a CustomResourceDefinition being deleted; it goes once
# every custom resource of that definition is gone.
CRD_CLEANUP_FINALIZER = "customresourcecleanup.apiextensions.k8s.io"

# The cluster-wide revision starts high enough to look like a real one and to catch clients
# that compare resourceVersions as strings.
FIRST_RESOURCE_VERSION = 1000
# A Pod's spec.terminationGracePeriodSeconds when its creator sets none (API defaulting).
DEFAULT_GRACE_SECONDS = 30
# Metadata only the server writes; a patch or PUT cannot change it.
_SERVER_OWNED_METADATA = (
    "name", "namespace", "uid", "creationTimestamp", "resourceVersion", "generation",
    "deletionTimestamp", "deletionGracePeriodSeconds",
)
# The alphabet of `generateName` suffixes (k8s.io/apiserver/pkg/storage/names): no vowels.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# How many names a create with `generateName` is given before a taken one is 409 AlreadyExists:
# the API server generates again on a collision (RetryGenerateName, GA in Kubernetes 1.32).
GENERATE_NAME_TRIES = 8
_CUSTOM_RESOURCE_VERBS = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}


@attrs.define(kw_only=True)
class KubeStore(kmock.KubernetesEmulator):
    """kmock's emulator with the objects stored and written as the API server's registry does.
    A layer of `KubeEmulator`, not used alone: sim.kube routes the requests to it.

    Test knobs: `install_crd`, `field_validation`.
    """

    field_validation: bool = True
    """Whether the server checks fields itself (`fieldValidation`, Kubernetes 1.25+) and says so
    in OpenAPI v3. False plays an older server: the option is ignored, and kubectl validates on
    the client against OpenAPI v2."""

    _revision: int = attrs.field(default=FIRST_RESOURCE_VERSION, init=False)
    _custom: dict[tuple[str, str], CustomResource] = attrs.field(factory=dict, init=False)
    # Every stored object by its kind's (group, plural): its key, the order it was first created
    # in, and kmock's record of it (`stored`).
    _kinds: dict[tuple[str, str], dict[Key, tuple[int, kmock.Object]]] = attrs.field(factory=dict, init=False)
    _created: int = attrs.field(default=0, init=False)
    # The live pods by spec.nodeName ("" unbound), as the API server's watch cache indexes them
    # for kubelets: a kubelet's list of its Node's pods reads its own, not every pod (`make
    # bench`: a burst of 500 made 1,000 such lists of all 500 pods).
    _pods_on: dict[str, set[Key]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # Built-in resources: discovery, and which kinds have a status subresource.
        bundled = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
        self.resources.load_data(gzip.decompress(bundled))

    def stored(self, *kinds: kmock.resource) -> list[tuple[Key, kmock.Object]]:
        """The stored objects (deleted ones too) of the storage resources `kinds`, in the order
        they were first created, as the store itself holds them: read through an index by kind,
        so that a list, a watch's start, an eviction or a controllers' pass reads its own kinds,
        not every object of every kind (a burst's Events and Leases outnumber its pods)."""
        found = [(seq, key, obj) for kind in kinds for key, (seq, obj) in self._kinds.get(_kind_of(kind), {}).items() if same_resource(key[0], kind)]
        if len(kinds) > 1:
            found.sort(key=lambda f: f[0])
        return [(key, obj) for _, key, obj in found]

    def listed(self, storage: kmock.resource, namespace: str | None = None, selection: Selection | None = None) -> list[tuple[Key, kmock.Object]]:
        """The live objects of `storage` (in `namespace`, or every one), in the order a list
        returns them (etcd's key order): what a list and a watch's first events show. With a
        `selection` that picks pods by `spec.nodeName=`, only that Node's pods are read; the
        caller still applies the whole selection."""
        node = selection.node_of_pods(storage) if selection is not None else None
        if node is None:
            candidates = self.stored(storage)
        else:
            candidates = [(k, self.objects[k]) for k in self._pods_on.get(node, ()) if same_resource(k[0], storage)]
        chosen = [(k, o) for k, o in candidates if not o.deleted and (namespace is None or k[1] == namespace)]
        return sorted(chosen, key=storage_order)

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

    @override
    def _get_resources(self) -> list[kmock.resource]:
        # kmock also lists the resources of stored objects; a custom resource's storage key is
        # not an endpoint unless its CRD serves that version.
        declared = set(kmock.KubernetesScaffold._get_resources(self))
        seeded = {resource for resource, _, _ in self.objects if (resource.group, resource.plural) not in self._custom}
        return list(declared | seeded)

    def _serves(self, resource: kmock.resource) -> bool:
        """`resource in self._get_resources()`, without building that list for every request:
        it walks every stored object (3,000 in `make bench`'s burst of 500: a fifth of the
        emulator's time went to hashing their resources), and kmock's part walks every reaction's
        filters; a declared resource (built-in kinds, served CRD versions) is in it at once."""
        if self._declared(resource) is not None or resource in kmock.KubernetesScaffold._get_resources(self):
            return True
        return (resource.group, resource.plural) not in self._custom and bool(self.stored(resource))

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
            check_type_meta(resource, custom[0], obj)
        if resource == EVENTS_V1:
            obj = event_to_core(obj)
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            # etcd3 storage refuses it; the API server passes that on as an internal error.
            raise ApiStatus(500, "InternalError", "resourceVersion should not be set on objects to be created")
        generated = not meta.get("name") and bool(meta.get("generateName"))
        if generated:
            meta["name"] = _generated(meta["generateName"])
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
        obj.setdefault("apiVersion", api_version(EVENTS if resource == EVENTS_V1 else resource))
        obj.setdefault("kind", self._kind(resource))

        if resource in (EVENTS, EVENTS_V1):
            errors = event_errors(obj, resource)
            if errors:
                raise invalid(resource.group or "", "Event", name, errors)
        if custom is not None:
            crd, version = custom
            if crd.terminating:
                raise ApiStatus(405, "MethodNotAllowed", "create not allowed while custom resource definition is terminating")
            if "status" in version.subresources:
                obj.pop("status", None)  # create cannot set status
            version.shape_in_place(obj)  # obj is this write's own copy of the body
            meta = obj["metadata"]
            errors = [*name_errors(name), *version.validate(obj)]
            if errors:
                raise invalid(resource.group or "", crd.kind, name, errors)
        errors = label_errors(obj.get("metadata") or {})
        if errors:
            raise invalid(resource.group or "", self._kind(resource), name, errors)
        if resource == CRDS:
            check_crd(obj)
            default_crd(obj)

        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_time())
        if resource not in (EVENTS, EVENTS_V1):  # Events have no generation
            meta["generation"] = 1
        if resource == PODS:
            obj["status"] = {"phase": "Pending"}
            if isinstance(obj.setdefault("spec", {}), dict):
                obj["spec"].setdefault("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
        if resource == NODES:
            _taint_by_readiness(obj)

        stored = self._to_storage(resource, obj)
        key = (self._storage(resource), namespace, name)
        for _ in range(GENERATE_NAME_TRIES - 1):  # a generated name taken: generated again, as the API server does
            if not (generated and key in self.objects and not self.objects[key].deleted):
                break
            name = stored["metadata"]["name"] = _generated(meta["generateName"])
            key = (self._storage(resource), namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise ApiStatus(
                409, "AlreadyExists", f'{qualified_resource(resource)} "{name}" already exists',
                {"name": name, "group": resource.group, "kind": resource.plural},
            )
        stored["metadata"]["resourceVersion"] = self._next_resource_version()
        if key in self.objects:
            self.objects[key].create(stored)  # re-created after a deletion: history continues
        else:
            self.objects[key] = stored
            self._created += 1
            self._kinds.setdefault(_kind_of(key[0]), {})[key] = (self._created, self.objects[key])
        self._publish(key[0], "ADDED", stored, None)
        if resource == CRDS:
            self._register_crd(stored)
        return self._present(resource, stored)

    def _update(
        self,
        resource: kmock.resource,
        subresource: str | None,
        key: Key,
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

        errors = label_errors(changed["metadata"])
        if errors:
            raise invalid(resource.group or "", self._kind(resource), current["metadata"]["name"], errors)
        old_finalizers = current["metadata"].get("finalizers") or []
        added = [f for f in changed["metadata"].get("finalizers") or [] if f not in old_finalizers]
        if current["metadata"].get("deletionTimestamp") and added:
            raise invalid(resource.group or "", self._kind(resource), current["metadata"]["name"], [FieldError(
                "FieldValueForbidden", "metadata.finalizers",
                "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers "
                "[]string{" + ", ".join(json.dumps(f) for f in added) + "}",
            )])

        if resource == CRDS:
            check_crd(changed)
            if changed["spec"].get("scope") != current["spec"].get("scope"):
                raise invalid("apiextensions.k8s.io", "CustomResourceDefinition", current["metadata"]["name"], [
                    FieldError.invalid("spec.scope", changed["spec"].get("scope"), "field is immutable"),
                ])
            default_crd(changed)
        custom = self._custom_version(resource)
        if custom is not None:
            crd, version = custom
            version.shape_in_place(changed)  # changed is this update's own copy
            ignored = {"metadata", "status"} if "status" in version.subresources else {"metadata"}
            if _without(changed, ignored) != _without(current, ignored):
                changed["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
            # Ratcheting (CRDValidationRatcheting, on by default since 1.30): an error the stored
            # object already had is not held against an update that leaves it as it was (a
            # finalizer patch of a pool admitted before a rule).
            errors = version.validate(changed)
            if errors:  # the stored object is validated only when the update has errors to ratchet
                before = {str(e) for e in version.validate(current)}
                errors = [
                    e for e in errors
                    if not (str(e) in before and _value_at(changed, e.field) == _value_at(current, e.field) is not _UNKNOWN)
                ]
            if errors:
                raise invalid(resource.group or "", crd.kind, current["metadata"]["name"], errors)
        elif changed.get("spec") != current.get("spec") and "generation" in current["metadata"]:
            changed["metadata"]["generation"] = int(current["metadata"]["generation"]) + 1
        if resource == NODES:
            _taint_by_readiness(changed)
        return changed

    def _apply_patch(self, request: kmock.Request, resource: kmock.resource, current: Obj) -> Obj:
        """The object after `request`'s patch, or ApiStatus as the API server would refuse it."""
        content_type = media_type(request)
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
            raise conflict(resource, request.name)
        # It may share parts with `current` (a merge patch copies only what it changes): not to be
        # changed in place; `_admit_update` works on a copy of its own.
        return changed

    def _decode(self, request: kmock.Request, resource: kmock.resource, obj: Any) -> str | None:
        """A write's object decoded as the API server decodes it, before anything else looks at
        it; the Warning header to send (None for none).

        A built-in kind's top-level field of a JSON type its Go type cannot take (a spec that is
        a string) is refused: 400 for a create or a PUT, 422 naming the patch for a patch
        (measured on 1.34 for merge and JSON patches; a strategic merge patch's message differs
        there), and a null one becomes what Go stores (`decode_builtin`). Then the
        `fieldValidation` option (Strict, Warn (the default) or Ignore) applies to the fields of
        a custom resource that its schema does not declare (and pruning would drop): Strict
        refuses the write (400; 422 for a patch), Warn returns one warning per field, as the API
        server does. kubectl sends Strict. Built-in kinds' unknown fields are not checked (the
        emulator has no complete schemas for them)."""
        kind = self._kind(resource)
        builtin = self._custom_version(resource) is None  # a custom resource may take a built-in kind's name
        problem = decode_builtin(kind, obj) if builtin and isinstance(obj, dict) else None
        if problem is not None:
            if request.method.upper() == "PATCH":
                raise invalid("", "", "", [FieldError.invalid("patch", json.dumps(obj, separators=(",", ":")), problem)])
            raise ApiStatus(400, "BadRequest", f'{kind} in version "{resource.version}" cannot be handled as a {kind}: {problem}')
        mode = request.params.get("fieldValidation") or "Warn"
        if mode not in ("Ignore", "Warn", "Strict"):
            raise ApiStatus(400, "BadRequest", f'fieldValidation: Unsupported value: "{mode}": supported values: '
                            '"Ignore", "Strict", "Warn"')
        custom = self._custom_version(resource)
        if custom is None or mode == "Ignore" or not self.field_validation or not isinstance(obj, Mapping):
            return None
        pruned = copy.deepcopy(dict(obj))
        prune(pruned, custom[1].schema, root=True)
        unknown = removed_fields(obj, pruned, "")
        if not unknown:
            return None
        if mode == "Strict":
            kind = custom[0].kind
            problem = "strict decoding error: " + ", ".join(f'unknown field "{field}"' for field in unknown)
            if request.method.upper() == "PATCH":
                # A patch is decoded after it is applied: the server answers 422, quoting the
                # patched object (measured on 1.34).
                raise invalid("", "", "", [FieldError.invalid("patch", json.dumps(obj, separators=(",", ":")), problem)])
            raise ApiStatus(400, "BadRequest", (
                f'{kind} in version "{resource.version}" cannot be handled as a {kind}: strict decoding error: '
                + ", ".join(f'unknown field "{field}"' for field in unknown)
            ))
        return ", ".join('299 - ' + json.dumps(f'unknown field "{field}"') for field in unknown)

    def _delete(self, key: Key, current: Obj) -> tuple[Obj, bool]:
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
        marked_meta.update(deletionTimestamp=now_time(), deletionGracePeriodSeconds=0)
        marked_meta["resourceVersion"] = self._next_resource_version()
        self.objects[key].history.append(marked)
        self._publish(key[0], "MODIFIED", marked, current)
        return marked, False

    def _remove(self, key: Key, current: Obj) -> Obj:
        """Remove a stored object now; the DELETED event carries its last state and a new RV."""
        gone = with_version(current, int(self._next_resource_version()))
        self.objects[key].history.append(gone)
        self.objects[key].delete()
        self._publish(key[0], "DELETED", gone, current)
        custom = self._custom.get((key[0].group or "", key[0].plural or ""))
        if custom is not None and custom.terminating:
            self._finish_crd_deletion(custom)
        if current["metadata"].get("uid"):
            self._collect_garbage(str(current["metadata"]["uid"]))
        return gone

    def _collect_garbage(self, uid: str) -> None:
        """The garbage collector, at once and in the background: an object whose owners are
        all gone now (one of them the object just removed, `uid`) is deleted, as a Node's
        Lease goes with the Node. Owners that never existed are not looked for."""
        live: set[str] | None = None
        for key, stored in list(self.objects.items()):
            if stored.deleted:
                continue
            owners = stored.raw["metadata"].get("ownerReferences") or []
            if not any(o.get("uid") == uid for o in owners):
                continue
            if live is None:
                live = {str(o.raw["metadata"].get("uid")) for o in self.objects.values() if not o.deleted}
            if all(str(o.get("uid")) not in live for o in owners):
                self._delete_dependent(key, stored.raw)

    def _delete_dependent(self, key: Key, current: Obj) -> None:
        self._delete(key, current)

    def _publish(self, resource: kmock.resource, kind: str, obj: Obj, previous: Obj | None) -> None:
        """Every write ends here: `kind` (ADDED, MODIFIED or DELETED) of the object stored at
        `resource`, `obj` after the write (for DELETED its last state with the deletion's
        revision), `previous` before it. The store keeps no history (KubeWatch records the change
        for watches), only its index of pods by Node."""
        if same_resource(resource, PODS):
            key = key_of(resource, obj)
            if previous is not None:
                was = node_name_of(previous)
                on = self._pods_on.get(was, set())
                on.discard(key)
                if not on:  # a Node's name goes with its last pod: Nodes come and go
                    self._pods_on.pop(was, None)
            if kind != "DELETED":
                self._pods_on.setdefault(node_name_of(obj), set()).add(key)

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
            v["name"]: CustomVersion.from_crd(v)
            for v in spec["versions"] if v.get("served")
        }
        storage_version = next(v["name"] for v in spec["versions"] if v.get("storage"))
        custom = CustomResource(
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

    def _delete_crd(self, key: Key, current: Obj) -> Obj:
        """Deleting a CRD deletes its custom resources (finalizers respected); the CRD goes when
        the last of them has gone, as the API server's finalizing controller does."""
        if current["metadata"].get("deletionTimestamp"):
            return current
        marked = copy.deepcopy(current)
        meta = marked["metadata"]
        meta["finalizers"] = [*(meta.get("finalizers") or []), CRD_CLEANUP_FINALIZER]
        meta.update(deletionTimestamp=now_time(), deletionGracePeriodSeconds=0, resourceVersion=self._next_resource_version())
        status = marked.setdefault("status", {})
        status["conditions"] = [
            *[c for c in status.get("conditions") or [] if c.get("type") != "Terminating"],
            {"type": "Terminating", "status": "True", "reason": "InstanceDeletionInProgress",
             "message": "CustomResource deletion is in progress", "lastTransitionTime": now_time()},
        ]
        self.objects[key].history.append(marked)
        self._publish(CRDS, "MODIFIED", marked, current)
        spec = marked["spec"]
        custom = self._custom[(spec["group"], spec["names"]["plural"])]
        custom.terminating = True
        for object_key, stored in self.stored(custom.storage):
            if not stored.deleted:
                self._delete(object_key, stored.raw)
        self._finish_crd_deletion(custom)
        return self.objects[key].last.raw

    def _finish_crd_deletion(self, custom: CustomResource) -> None:
        if any(not o.deleted for _, o in self.stored(custom.storage)):
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
        for object_key, _ in self.stored(custom.storage):
            del self.objects[object_key]
            del self._kinds[_kind_of(custom.storage)][object_key]
        self._remove(key, current)

    def _custom_version(self, resource: kmock.resource) -> tuple[CustomResource, CustomVersion] | None:
        custom = self._custom.get((resource.group or "", resource.plural or ""))
        if custom is None or resource.version not in custom.versions:
            return None
        return custom, custom.versions[resource.version]

    # --- resources and their representations ------------------------------------------

    def _existing(
        self, resource: kmock.resource, namespace: str | None, name: str | None
    ) -> tuple[Key, Obj]:
        key = (self._storage(resource), namespace if self._namespaced(resource) else None, name or "")
        if name is None or key not in self.objects or self.objects[key].deleted:
            raise ApiStatus(
                404, "NotFound", f'{qualified_resource(resource)} "{name}" not found',
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
            return event_to_core(obj)
        storage = self._storage(resource)
        if storage != resource:
            return {**obj, "apiVersion": api_version(storage)}
        return obj

    def _present(self, resource: kmock.resource, obj: Obj) -> Obj:
        """A stored object as a client of `resource`'s version sees it."""
        if resource == EVENTS_V1:
            return event_to_v1(obj)
        if obj.get("apiVersion") != api_version(resource) and (resource.group, resource.plural) in self._custom:
            return {**obj, "apiVersion": api_version(resource)}  # conversion strategy None
        return obj

    def _selection(self, resource: kmock.resource, params: Mapping[str, str]) -> Selection:
        selection = Selection.parse(params)
        custom = self._custom_version(resource)
        if custom is not None:
            allowed = {"metadata.name", "metadata.namespace", *custom[1].selectable_fields}
            for path, _, _ in selection.fields:
                if path not in allowed:
                    raise ApiStatus(400, "BadRequest", f"field label not supported: {path}")
        return selection

    def _info(self, resource: kmock.resource) -> kmock.ResourceInfo:
        info = self._declared(resource)
        return kmock.ResourceInfo() if info is None else info

    def _declared(self, resource: kmock.resource) -> kmock.ResourceInfo | None:
        """`self.resources[resource]` if declared: read from kmock's dict behind `resources`,
        whose own lookup parses the key through a runtime Protocol check (a tenth of a request)."""
        return self.resources._resources.get(resource) if isinstance(resource, kmock.resource) else None

    def _kind(self, resource: kmock.resource) -> str:
        return self._info(resource).kind or (resource.plural or "").capitalize()

    def _list_kind(self, resource: kmock.resource) -> str:
        custom = self._custom.get((resource.group or "", resource.plural or ""))
        return custom.list_kind if custom is not None else f"{self._kind(resource)}List"

    def _namespaced(self, resource: kmock.resource) -> bool:
        namespaced = self._info(resource).namespaced
        return True if namespaced is None else namespaced


def parse_resource_version(value: str | None) -> int | None:
    """None for "" and "0" (any version: the current state first), else the revision."""
    if value in (None, "", "0"):
        return None
    assert value is not None
    if not value.isdigit():
        raise ApiStatus(400, "BadRequest", f"invalid resource version: {value!r}")
    return int(value)


def _kind_of(resource: kmock.resource) -> tuple[str, str]:
    return resource.group or "", resource.plural or ""


def storage_order(item: tuple[Key, Any]) -> tuple[str, str]:
    """etcd key order, /registry/<resource>/<namespace>/<name>, in which lists come back."""
    (_, namespace, name), _ = item
    return namespace or "", name


def with_version(obj: Obj, revision: int) -> Obj:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(revision)}}


def _last_finalizer_removed(current: Obj, changed: Obj) -> bool:
    """Whether an update deletes the object (the generic store's shouldDeleteDuringUpdate): it
    had finalizers, has none now, and its deletion is due (grace period 0). A pod in graceful
    deletion without finalizers is written as usual."""
    old, new = current["metadata"], changed["metadata"]
    return bool(old.get("finalizers")) and not new.get("finalizers") and bool(new.get("deletionTimestamp")) \
        and new.get("deletionGracePeriodSeconds") == 0


def _without(obj: Obj, fields: set[str]) -> Obj:
    return {k: v for k, v in obj.items() if k not in fields}


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


_UNKNOWN = object()


def _value_at(obj: Any, field: str) -> Any:
    """The value at a field path such as `spec.template.metadata.labels` (_UNKNOWN when the
    path has indexes or does not resolve: such an error is never ratcheted)."""
    if not field or "[" in field:
        return _UNKNOWN
    for part in field.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return _UNKNOWN
        obj = obj[part]
    return obj


def _generated(prefix: str) -> str:
    """A name for `generateName` `prefix`: five random characters of the API server's alphabet."""
    return prefix + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
