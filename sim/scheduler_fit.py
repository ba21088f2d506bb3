"""What sim.scheduler decides on its cache, with no I/O: whether a pod fits a Node (kube-scheduler's
Filter plugins in their order: NodeUnschedulable, TaintToleration, NodeAffinity,
NodeResourcesFit for `nvidia.com/gpu`), a pod's effective GPU request, and the queueing hints
that say when a pod that fit nowhere is worth trying again (`Requeue`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgp.types import GPU_RESOURCE

Obj = Mapping[str, Any]


def pod_gpus(pod: Obj) -> int:
    """The pod's effective GPU request, as kube-scheduler computes it (resourcehelper.PodRequests):
    the largest of each init container's request plus the sidecars (init containers with
    `restartPolicy: Always`) started before it, and the containers' sum plus all sidecars; then
    the pod's overhead. -1: a quantity no node can satisfy."""
    spec = pod.get("spec") or {}

    def one(c: Obj) -> int:
        res = c.get("resources") or {}
        values = [(res.get(k) or {}).get(GPU_RESOURCE) for k in ("requests", "limits")]
        return max((int(str(v)) for v in values if v is not None), default=0)

    try:
        sidecars = init = 0
        for c in spec.get("initContainers") or []:
            if c.get("restartPolicy") == "Always":
                sidecars += one(c)
                init = max(init, sidecars)
            else:
                init = max(init, one(c) + sidecars)
        overhead = (spec.get("overhead") or {}).get(GPU_RESOURCE)
        total = max(init, sidecars + sum(one(c) for c in spec.get("containers") or []))
        return total + (int(str(overhead)) if overhead is not None else 0)
    except ValueError:
        return -1


def node_ready(node: Obj) -> bool:
    """Whether the Node's Ready condition is True."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def allocatable_gpus(node: Obj) -> int:
    """The Node's allocatable GPUs (its capacity when it reports no allocatable; 0 when unreadable)."""
    status = node.get("status") or {}
    value = (status.get("allocatable") or {}).get(GPU_RESOURCE) or (status.get("capacity") or {}).get(GPU_RESOURCE) or 0
    try:
        return int(str(value))
    except ValueError:
        return 0


def _requirement(labels: Mapping[str, str], req: Obj) -> bool:
    key, op, values = req.get("key"), req.get("operator"), [str(v) for v in req.get("values") or []]
    value = labels.get(str(key))
    if op == "In":
        return value in values
    if op == "NotIn":
        return value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and values:
        try:
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        except ValueError:
            return False
    return False


def _tolerates(tolerations: list[Obj], taint: Obj) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t.get("key") == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def fits(pod: Obj, node: Obj, free_gpus: int) -> str | None:
    """Why `pod` cannot run on `node` now, or None when it can."""
    spec, labels = pod.get("spec") or {}, (node.get("metadata") or {}).get("labels") or {}
    if not node_ready(node) or (node.get("spec") or {}).get("unschedulable"):
        return "node not ready or cordoned"
    # kube-scheduler's Filter order: NodeUnschedulable, TaintToleration, NodeAffinity, NodeResourcesFit.
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(spec.get("tolerations") or [], taint):
            return f"untolerated taint {taint.get('key')}"
    for key, value in (spec.get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            return "node selector"
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    if terms and not any(all(_requirement(labels, r) for r in t.get("matchExpressions") or []) for t in terms):
        return "node affinity"
    wanted = pod_gpus(pod)
    if wanted < 0 or wanted > free_gpus:
        return "insufficient nvidia.com/gpu"
    return None


def pod_shape(pod: Obj) -> str:
    """What `fits` reads of a pod: pods of one shape fit the same nodes."""
    spec = pod.get("spec") or {}
    return json.dumps([spec.get("nodeSelector"), spec.get("affinity"), spec.get("tolerations"), pod_gpus(pod)], sort_keys=True)


@dataclass(frozen=True)
class Snapshot:
    """The cluster as a pod failed in it: each Node's static part (`static_view`) and its free GPUs."""

    static: Mapping[str, tuple[Any, ...]]
    free: Mapping[str, int]


@dataclass
class Queued:
    """A pending pod's place in the queue: its failures, when it entered the queue (refreshed at
    each failure: its backoff runs from there), and while it waits for an event, the cluster it
    failed in and its own shape then."""

    since: float
    attempts: int = 0
    unschedulable: Snapshot | None = None
    shape: str = ""
    noted: str = ""  # the note of its last FailedScheduling Event


def static_view(nodes: list[Obj]) -> dict[str, tuple[Any, ...]]:
    """What of each Node can make a pod fit, besides its free GPUs: readiness, cordon, labels,
    taints, allocatable GPUs."""
    view = {}
    for n in nodes:
        meta, spec, name = n.get("metadata") or {}, n.get("spec") or {}, n["metadata"]["name"]
        taints = tuple(sorted((str(t.get("key")), str(t.get("value")), str(t.get("effect"))) for t in spec.get("taints") or []))
        labels = tuple(sorted((meta.get("labels") or {}).items()))
        view[name] = (node_ready(n), bool(spec.get("unschedulable")), labels, taints, allocatable_gpus(n))
    return view


class Requeue:
    """kube-scheduler's queueing hints, for one pass: a waiting pod is tried again when a Node
    added or changed since it failed (its static part, or more GPUs free) now fits it, or when
    the pod itself changed; a Node deleted or taken fits nothing new. The Nodes that changed
    since a snapshot, and whether one fits a shape, are worked out once per pass."""

    def __init__(self, static: Mapping[str, tuple[Any, ...]], free: Mapping[str, int], nodes: Mapping[str, Obj]) -> None:
        self.static, self.free, self.nodes = static, dict(free), nodes
        self._changed: dict[int, list[str]] = {}
        self._fits: dict[tuple[int, str], bool] = {}

    def worth_it(self, q: Queued, pod: Obj) -> bool:
        """Whether the waiting pod `q` is worth trying again this pass."""
        shape = pod_shape(pod)
        if shape != q.shape:
            return True
        before = q.unschedulable
        assert before is not None
        key = (id(before), shape)
        if key not in self._fits:
            if id(before) not in self._changed:
                self._changed[id(before)] = [
                    name for name, state in self.static.items()
                    if before.static.get(name) != state or self.free.get(name, 0) > before.free.get(name, 0)
                ]  # fmt: skip
            self._fits[key] = any(fits(pod, self.nodes[name], self.free.get(name, 0)) is None for name in self._changed[id(before)])
        return self._fits[key]
