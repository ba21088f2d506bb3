"""API discovery for the embedded Kubernetes API (`sim.kube`), as kubectl reads it.

kubectl (1.26+) first asks `/api` and `/apis` for *aggregated* discovery
(`Accept: application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList`): every group,
version and resource, subresources nested under their resource, in two requests. Older clients
(and tgp's own adapters) read the legacy documents (`/api/v1`, `/apis/<group>/<version>`), which
kmock serves; `legacy_resource_list` only corrects what kmock gets wrong there (a subresource
repeating its resource's short names, which makes kubectl warn that `gnp` is ambiguous).

The order of groups and versions is the server's preference: the core group, then the built-in
groups in the order a real server lists them (kmock's bundled discovery dump, taken from one),
then the groups of CustomResourceDefinitions. Within a group the first version is preferred.
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

import kmock

Obj = dict[str, Any]

AGGREGATED_V2 = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
_STATUS_VERBS = ["get", "patch", "update"]


def wants_aggregated(accept: str) -> bool:
    """Whether an Accept header asks for aggregated discovery (apidiscovery.k8s.io/v2), which
    a server prefers whenever the client lists it."""
    for media in accept.split(","):
        params = {k.strip(): v.strip() for k, _, v in (p.partition("=") for p in media.split(";")[1:])}
        if params.get("g") == "apidiscovery.k8s.io" and params.get("v") == "v2" \
                and params.get("as") == "APIGroupDiscoveryList":
            return True
    return False


@functools.cache
def _bundled() -> list[Obj]:
    """kmock's dump of a real server's legacy discovery (one APIResourceList per group-version)."""
    data = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
    docs: list[Obj] = json.loads(gzip.decompress(data))
    return docs


@functools.cache
def _bundled_order() -> dict[str, int]:
    """`group/version` (`v1` for core) -> its place in the real server's discovery order."""
    return {doc["groupVersion"]: index for index, doc in enumerate(_bundled())}


@functools.cache
def _bundled_subresources() -> dict[tuple[str, str], Obj]:
    """(`group/version`, `plural/sub`) -> the subresource's legacy discovery entry."""
    return {
        (doc["groupVersion"], entry["name"]): entry
        for doc in _bundled() for entry in doc.get("resources", []) if "/" in entry["name"]
    }


def _group_version(group: str, version: str) -> str:
    return f"{group}/{version}" if group else version


_VERSION = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def version_priority(version: str) -> tuple[int, int, int, str]:
    """Kubernetes' version order (GA before beta before alpha, higher first) as a sort key."""
    match = _VERSION.match(version)
    if match is None:
        return (3, 0, 0, version)  # not kube-like: after all kube-like versions, by name
    major, stage, minor = match.groups()
    rank = {None: 0, "beta": 1, "alpha": 2}[stage]
    return (rank, -int(major), -int(minor or 0), version)


def _ordered(resources: Iterable[kmock.resource]) -> list[tuple[str, list[str]]]:
    """(group, [versions, preferred first]) in the server's order."""
    order = _bundled_order()
    versions: dict[str, set[str]] = {}
    for resource in resources:
        versions.setdefault(resource.group or "", set()).add(str(resource.version))

    def group_key(group: str) -> tuple[int, int, str]:
        known = [order[_group_version(group, v)] for v in versions[group] if _group_version(group, v) in order]
        if group == "":
            return (0, 0, group)
        return (1, min(known), group) if known else (2, 0, group)

    def version_key(group: str, version: str) -> tuple[int, tuple[int, int, int, str]]:
        return (order.get(_group_version(group, version), len(order)), version_priority(version))

    return [
        (group, sorted(versions[group], key=lambda v, g=group: version_key(g, v)))  # type: ignore[misc]
        for group in sorted(versions, key=group_key)
    ]


def _kind(resource: kmock.resource, info: kmock.ResourceInfo) -> str:
    return info.kind or str(resource.plural).capitalize()


def _subresource(resource: kmock.resource, info: kmock.ResourceInfo, sub: str) -> Obj:
    group, version = resource.group or "", str(resource.version)
    known = _bundled_subresources().get((_group_version(group, version), f"{resource.plural}/{sub}"))
    if known is not None:
        kind = known.get("kind") or _kind(resource, info)
        kind_group = known.get("group", group)
        kind_version = known.get("version", version)
        verbs = list(known.get("verbs") or [])
    else:  # a custom resource's status or scale
        kind, kind_group, kind_version = _kind(resource, info), group, version
        if sub == "scale":
            kind, kind_group, kind_version = "Scale", "autoscaling", "v1"
        verbs = list(_STATUS_VERBS)
    return {
        "subresource": sub,
        "responseKind": {"group": kind_group, "version": kind_version, "kind": kind},
        "verbs": verbs,
    }


def aggregated(
    served: Mapping[kmock.resource, kmock.ResourceInfo], *, core: bool,
) -> Obj:
    """The APIGroupDiscoveryList of `/api` (`core=True`: the legacy core group only) or `/apis`
    (every named group), built from the resources the emulator serves."""
    items = []
    for group, versions in _ordered(served):
        if (group == "") != core:
            continue
        version_items = []
        for version in versions:
            resources = []
            for resource in sorted((r for r in served if (r.group or "") == group and r.version == version),
                                   key=lambda r: str(r.plural)):
                info = served[resource]
                entry: Obj = {
                    "resource": resource.plural,
                    "responseKind": {"group": group, "version": version, "kind": _kind(resource, info)},
                    "scope": "Cluster" if info.namespaced is False else "Namespaced",
                    "singularResource": info.singular or str(resource.plural),
                    "verbs": sorted(info.verbs),
                }
                if info.shortnames:
                    entry["shortNames"] = sorted(info.shortnames)
                if info.categories:
                    entry["categories"] = sorted(info.categories)
                if info.subresources:
                    entry["subresources"] = [_subresource(resource, info, s) for s in sorted(info.subresources)]
                resources.append(entry)
            version_items.append({"version": version, "resources": resources, "freshness": "Current"})
        items.append({"metadata": {"name": group} if group else {}, "versions": version_items})
    return {"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2", "metadata": {}, "items": items}


def legacy_groups(served: Iterable[kmock.resource]) -> Obj:
    """`/apis` as an APIGroupList, with each group's preferred version first."""
    groups = []
    for group, versions in _ordered(served):
        if not group:
            continue
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        groups.append({"name": group, "versions": entries, "preferredVersion": entries[0]})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def legacy_group(served: Iterable[kmock.resource], group: str) -> Obj | None:
    """`/apis/<group>` as an APIGroup, or None if no version of it is served."""
    for name, versions in _ordered(served):
        if name == group and group:
            entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
            return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": entries,
                    "preferredVersion": entries[0]}
    return None


def legacy_resource_list(document: Obj) -> Obj:
    """kmock's APIResourceList with subresources described as a real server does: no short
    names, categories or singular name of their own (else `kubectl get gnp` calls the short
    name ambiguous), and `namespaced` never null."""
    for entry in document.get("resources") or []:
        if entry.get("namespaced") is None:
            entry["namespaced"] = True
        if "/" in str(entry.get("name")):
            entry["shortNames"], entry["categories"], entry["singularName"] = [], [], ""
    return document
