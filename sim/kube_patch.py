"""Strategic merge patch (`application/strategic-merge-patch+json`) for the embedded Kubernetes
API (`sim.kube`), as kubectl sends it for built-in kinds.

`kubectl label`, `annotate` and `cordon` send small map patches, which a JSON merge patch would
apply the same way. `kubectl apply` (client-side) sends a three-way patch with list directives:
a container's `env` changed under `$setElementOrder/containers` must merge into the container of
that name, not replace the list (a merge patch would drop the container's image). This module
follows k8s.io/apimachinery/pkg/util/strategicpatch for what those patches use:

* maps merge recursively; `null` deletes a key; `$patch: replace` replaces a map, `$patch:
  delete` removes it; `$retainKeys` drops the keys it does not list;
* lists with a merge key (containers by `name`, ports by `containerPort`, conditions by `type`,
  ...: `_MERGE_KEYS`) merge item by item; an item with `$patch: delete` is removed, one with
  `$patch: replace` makes the list the patch's; `$setElementOrder/<field>` orders the result;
* lists of scalars with the merge strategy (`finalizers`) are unions, with
  `$deleteFromPrimitiveList/<field>` removing values;
* every other list (tolerations, taints, args) is replaced, as it is atomic in the API types.

Simplifications: the patch metadata is a table of field-path suffixes rather than the Go types'
struct tags (kind-agnostic, so a field of the same path in another built-in kind merges the same
way); with `$setElementOrder`, items the patch does not mention keep their relative order after
the ordered ones instead of being interleaved; unknown directives are ignored, not refused.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

Obj = dict[str, Any]

# Suffix of a list field's path (map keys, list positions left out) -> its merge key, or "" for
# a list of scalars merged as a set. From the patchStrategy/patchMergeKey tags of k8s.io/api.
_MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("metadata", "finalizers"): "",
    ("metadata", "ownerReferences"): "uid",
    ("spec", "containers"): "name",  # also matches a pod template's spec
    ("spec", "initContainers"): "name",
    ("spec", "ephemeralContainers"): "name",
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("spec", "hostAliases"): "ip",
    ("spec", "topologySpreadConstraints"): "topologyKey",
    ("spec", "schedulingGates"): "name",
    ("spec", "resourceClaims"): "name",
    ("spec", "podCIDRs"): "",
    ("spec", "ports"): "port",  # Service
    ("containers", "ports"): "containerPort",
    ("containers", "env"): "name",
    ("containers", "volumeMounts"): "mountPath",
    ("containers", "volumeDevices"): "devicePath",
    ("initContainers", "ports"): "containerPort",
    ("initContainers", "env"): "name",
    ("initContainers", "volumeMounts"): "mountPath",
    ("initContainers", "volumeDevices"): "devicePath",
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("status", "podIPs"): "ip",
}
_ORDER = "$setElementOrder/"
_DELETE_FROM = "$deleteFromPrimitiveList/"


def _merge_key(path: tuple[str, ...]) -> str | None:
    for suffix, key in _MERGE_KEYS.items():
        if path[-len(suffix):] == suffix:
            return key
    return None


def strategic_merge(original: Mapping[str, Any], patch: Mapping[str, Any]) -> Obj:
    """`original` with the strategic merge `patch` applied (a new object)."""
    merged = _merge_map(copy.deepcopy(dict(original)), patch, ())
    return merged if merged is not None else {}


def _is_directive(key: str) -> bool:
    return key in ("$patch", "$retainKeys") or key.startswith((_ORDER, _DELETE_FROM))


def _strip(value: Any) -> Any:
    """A patch value without directives, for where it replaces what was there."""
    if isinstance(value, Mapping):
        return {k: _strip(v) for k, v in value.items() if not _is_directive(k) and v is not None}
    if isinstance(value, list):
        return [_strip(v) for v in value if not (isinstance(v, Mapping) and v.get("$patch") == "delete")]
    return value


def _merge_map(original: Obj, patch: Mapping[str, Any], path: tuple[str, ...]) -> Obj | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip(patch)  # type: ignore[no-any-return]
    result = original
    retain = patch.get("$retainKeys")
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    for key, value in patch.items():
        if _is_directive(key):
            continue
        field = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, Mapping):
            current = result.get(key)
            merged = _merge_map(current if isinstance(current, dict) else {}, value, field)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _merge_list(result.get(key), value, field)
        else:
            result[key] = value
    for key, value in patch.items():
        if key.startswith(_DELETE_FROM) and isinstance(value, list):
            field_name = key[len(_DELETE_FROM):]
            if isinstance(result.get(field_name), list):
                result[field_name] = [v for v in result[field_name] if v not in value]
    for key, value in patch.items():
        if key.startswith(_ORDER) and isinstance(value, list):
            field_name = key[len(_ORDER):]
            if isinstance(result.get(field_name), list):
                result[field_name] = _reorder(result[field_name], value, _merge_key((*path, field_name)))
    return result


def _merge_list(original: Any, patch: list[Any], path: tuple[str, ...]) -> list[Any]:
    merge_key = _merge_key(path)
    if merge_key is None:
        return [_strip(v) for v in patch]  # atomic: replaced
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [_strip(v) for v in patch if not (isinstance(v, Mapping) and "$patch" in v)]
    merged = list(original) if isinstance(original, list) else []
    if merge_key == "":
        return merged + [v for v in patch if v not in merged]
    for item in patch:
        if not isinstance(item, Mapping):
            merged.append(item)
            continue
        key = item.get(merge_key)
        index = next((i for i, o in enumerate(merged) if isinstance(o, Mapping) and o.get(merge_key) == key), None)
        if item.get("$patch") == "delete":
            merged = [o for o in merged if not (isinstance(o, Mapping) and o.get(merge_key) == key)]
        elif index is None:
            added = _merge_map({}, item, path)
            if added is not None:
                merged.append(added)
        else:
            updated = _merge_map(dict(merged[index]), item, path)
            if updated is None:
                del merged[index]
            else:
                merged[index] = updated
    return merged


def _reorder(items: list[Any], order: list[Any], merge_key: str | None) -> list[Any]:
    """`items` in the order `$setElementOrder` gives; the ones it does not name follow."""
    def identity(item: Any) -> Any:
        return item.get(merge_key) if merge_key and isinstance(item, Mapping) else item

    wanted = [identity(o) for o in order]
    ordered = [item for name in wanted for item in items if identity(item) == name]
    rest = [item for item in items if identity(item) not in wanted]
    return ordered + rest
