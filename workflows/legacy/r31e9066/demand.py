"""Demand: which pending GPU pods each GPUNodePool should make nodes for. Pure, no I/O.

A pod counts toward a pool when it is unschedulable, asks for `nvidia.com/gpu`, its node
selector and required node affinity can be met by the labels the pool's nodes will carry, and
it tolerates the pool's taints. Among several fitting pools the highest `weight` wins (then the
name, so the choice is stable). Pods are batched like Karpenter does: a short idle window after
the last new pod, and a maximum window after the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from workflows.legacy.r31e9066.crds import GPUNodePoolSpec, NodeSelectorRequirement
from workflows.legacy.r31e9066.types import GPU_RESOURCE, LABEL_GPU_TYPE, LABEL_POOL, LABEL_PROVIDER, LABEL_REGION, Taint

# Karpenter's batchIdleDuration / batchMaxDuration defaults.
BATCH_IDLE = timedelta(seconds=1)
BATCH_MAX = timedelta(seconds=10)

# Labels whose value is decided per node at launch (any value a requirement allows).
_CHOSEN_AT_LAUNCH = (LABEL_GPU_TYPE, LABEL_REGION, LABEL_PROVIDER)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Toleration(Frozen):
    key: str | None = None
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    effect: str | None = None

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return self.key in (None, "", taint.key)
        return self.key == taint.key and (self.value or "") == taint.value


class PendingPod(Frozen):
    namespace: str
    name: str
    gpus: int = 1
    node_selector: dict[str, str] = {}
    # Required node affinity: OR of terms, each an AND of requirements.
    affinity_terms: list[list[NodeSelectorRequirement]] = []
    tolerations: list[Toleration] = []
    created: datetime | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class PoolCandidate(Frozen):
    """What demand needs to know of a pool."""

    namespace: str
    name: str
    spec: GPUNodePoolSpec

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def gpu_request(pod: Mapping[str, Any]) -> int:
    """GPUs a pod asks for (the largest of requests/limits per container, summed)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        values = [(resources.get(kind) or {}).get(GPU_RESOURCE) for kind in ("requests", "limits")]
        total += max((int(str(v)) for v in values if v is not None), default=0)
    return total


def pending_gpu_pod(pod: Mapping[str, Any]) -> PendingPod | None:
    """The pod as demand, if it is an unschedulable, unbound pod asking for GPUs."""
    spec, status, meta = pod.get("spec") or {}, pod.get("status") or {}, pod.get("metadata") or {}
    if spec.get("nodeName") or meta.get("deletionTimestamp") or status.get("phase", "Pending") != "Pending":
        return None
    unschedulable = any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in status.get("conditions") or []
    )
    gpus = gpu_request(pod)
    if not unschedulable or gpus == 0:
        return None
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = [
        [NodeSelectorRequirement.model_validate(e) for e in term.get("matchExpressions") or []]
        for term in required.get("nodeSelectorTerms") or []
    ]
    return PendingPod(
        namespace=meta.get("namespace", "default"),
        name=meta["name"],
        gpus=gpus,
        node_selector=dict(spec.get("nodeSelector") or {}),
        affinity_terms=terms,
        tolerations=[Toleration.model_validate(t) for t in spec.get("tolerations") or []],
        created=meta.get("creationTimestamp"),
    )


def _possible_values(pool: PoolCandidate, key: str) -> set[str] | None:
    """Values a pool's node can carry for `key`: None = any value, empty set = label absent."""
    spec = pool.spec
    if key in spec.template.metadata.labels:
        return {spec.template.metadata.labels[key]}
    if key == LABEL_POOL:
        return {pool.name}
    if key in _CHOSEN_AT_LAUNCH:
        allowed = spec.allowed(key)
        excluded = spec.excluded(key)
        if allowed is None:
            return None if not excluded else _AnyExcept(excluded)
        return set(allowed) - excluded
    return set()


class _AnyExcept(set[str]):
    """Any value except these (a pool with only NotIn on a key)."""

    def __init__(self, excluded: Iterable[str]) -> None:
        super().__init__()
        self.excluded = set(excluded)


def _requirement_met(pool: PoolCandidate, req: NodeSelectorRequirement) -> bool:
    possible = _possible_values(pool, req.key)
    if isinstance(possible, _AnyExcept):
        if req.operator == "In":
            return bool(set(req.values) - possible.excluded)
        return req.operator != "DoesNotExist"
    if req.operator == "Exists":
        return possible is None or bool(possible)
    if req.operator == "DoesNotExist":
        return possible is not None and not possible
    if possible is None:
        return True  # a value can be chosen to satisfy In, or to avoid NotIn
    if req.operator == "In":
        return bool(possible & set(req.values))
    return bool(possible - set(req.values))  # NotIn


def pod_fits_pool(pod: PendingPod, pool: PoolCandidate) -> bool:
    """Could a node of `pool` run `pod`?"""
    for key, value in pod.node_selector.items():
        if not _requirement_met(pool, NodeSelectorRequirement(key=key, operator="In", values=[value])):
            return False
    if pod.affinity_terms and not any(all(_requirement_met(pool, r) for r in term) for term in pod.affinity_terms):
        return False
    for taint in pool.spec.template.spec.taints:
        if taint.effect in ("NoSchedule", "NoExecute") and not any(t.tolerates(taint) for t in pod.tolerations):
            return False
    return True


def assign_pods(pods: Iterable[PendingPod], pools: Iterable[PoolCandidate]) -> dict[str, list[PendingPod]]:
    """Pool key -> the pending pods it should serve. Each pod goes to at most one pool."""
    ordered = sorted(pools, key=lambda p: (-p.spec.weight, p.key))
    assigned: dict[str, list[PendingPod]] = {p.key: [] for p in ordered}
    for pod in sorted(pods, key=lambda p: p.key):
        for pool in ordered:
            if pod_fits_pool(pod, pool):
                assigned[pool.key].append(pod)
                break
    return assigned


def nodes_to_launch(*, pending_pods: int, launching: int, live: int, min_nodes: int, max_nodes: int | None) -> int:
    """New nodes a pool should start now.

    Nodes still launching will absorb pending pods (one GPU pod per node), so only the pods
    beyond them need new nodes; `min_nodes` is a floor and `max_nodes` a ceiling on live nodes.
    """
    wanted = max(pending_pods - launching, 0, min_nodes - live)
    if max_nodes is not None:
        wanted = min(wanted, max(max_nodes - live, 0))
    return wanted


class Batch(Frozen):
    """A window of arriving pods: closed after BATCH_IDLE without news or BATCH_MAX in all."""

    first: datetime | None = None
    last: datetime | None = None

    def add(self, now: datetime) -> Batch:
        return Batch(first=self.first or now, last=now)

    def due(self, now: datetime, idle: timedelta = BATCH_IDLE, maximum: timedelta = BATCH_MAX) -> bool:
        if self.first is None or self.last is None:
            return False
        return now - self.last >= idle or now - self.first >= maximum

    def wait(self, now: datetime, idle: timedelta = BATCH_IDLE, maximum: timedelta = BATCH_MAX) -> timedelta:
        """How long until `due` becomes true."""
        if self.first is None or self.last is None:
            return maximum
        return max(min(self.last + idle, self.first + maximum) - now, timedelta(0))
