"""Demand: which pending GPU pods each GPUNodePool should make nodes for. Pure, no I/O.

A pod counts toward a pool when it is unschedulable, asks for `nvidia.com/gpu`, its node
selector and required node affinity can be met by the labels the pool's nodes will carry, and
it tolerates the pool's taints. Among several fitting pools the highest `weight` wins (then the
name, so the choice is stable). Pods are batched like Karpenter does: a short idle window after
the last new pod, and a maximum window after the first.

A pending pod that asks for a GPU resource tgp does not sell (a MIG slice, another vendor's GPUs)
is no demand: no node tgp buys would have it. It is read all the same (`PendingPod.unsold`) so
that it and its pool are told. A pool plans for at most MAX_PODS_TRACKED of its pending pods at a
time, oldest first (`tracked`): what a pool carries across continue-as-new and what one demand
signal holds stay far below Temporal's 2 MiB payload limit whatever a tenant creates; the rest
wait for a later batch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta, timezone
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from tgp.conditions import MAX_QUOTED, bounded
from tgp.crds import GPUNodePoolSpec, NodeSelectorRequirement
from tgp.types import GPU_RESOURCE, LABEL_GPU_TYPE, LABEL_POOL, LABEL_PROVIDER, LABEL_REGION, Taint

# Karpenter's batchIdleDuration / batchMaxDuration defaults.
BATCH_IDLE = timedelta(seconds=1)
BATCH_MAX = timedelta(seconds=10)

# A pool plans for at most this many pending pods at a time, and their keys (namespace/name, up
# to 317 characters each) total at most MAX_TRACKED_KEY_CHARS: ~260 bytes of carried state per pod
# (demand, pending_since, nominations), ~0.3 MB at the cap, under 2 MiB at the longest names.
# 1,000 pods keep a pass's 500 starts busy; the rest are planned as these bind or go.
MAX_PODS_TRACKED = 1000
MAX_TRACKED_KEY_CHARS = 100_000
# Resource name prefixes of GPUs (and accelerators) that a pod may ask for; tgp sells only
# GPU_RESOURCE. A resource name is a tenant's text: it is quoted cut to MAX_RESOURCE_NAME_QUOTED.
_GPU_VENDORS = ("nvidia.com/", "amd.com/", "gpu.intel.com/", "intel.com/gpu", "habana.ai/", "aws.amazon.com/neuron")
MAX_RESOURCE_NAME_QUOTED = 80

# Labels whose value is decided per node at launch (any value a requirement allows).
_CHOSEN_AT_LAUNCH = (LABEL_GPU_TYPE, LABEL_REGION, LABEL_PROVIDER)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class UnreadablePod(ValueError):
    """A pending GPU pod whose spec demand cannot use; the pod is skipped, never the informer.
    `reason` is short and stable (a metric label), `detail` says what was found."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class Toleration(Frozen):
    key: str | None = None
    # Missing means Equal (the API's default). Operators we do not know (newer API versions add
    # some) tolerate nothing here: the pod then fits fewer pools, never a node it cannot use.
    operator: str | None = "Equal"
    value: str | None = None
    effect: str | None = None

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.operator == "Exists":
            return self.key in (None, "", taint.key)
        if self.operator not in (None, "", "Equal"):
            return False
        return self.key == taint.key and (self.value or "") == taint.value


class PodRequirement(Frozen):
    """One requirement of a pod's required node affinity. Wider than a pool's requirement
    (tgp.crds, also the CRD schema): pods may use Gt/Lt, which compare a label as an integer."""

    model_config = ConfigDict(frozen=True, from_attributes=True)

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[str] = []

    @model_validator(mode="after")
    def _gt_lt_take_one_integer(self) -> Self:
        if self.operator in ("Gt", "Lt") and (len(self.values) != 1 or _integer(self.values[0]) is None):
            raise ValueError(f"{self.operator} takes exactly one integer value, not {self.values!r}")
        return self


class PendingPod(Frozen):
    namespace: str
    name: str
    gpus: int = 1
    node_selector: dict[str, str] = {}
    # Required node affinity: OR of terms, each an AND of requirements.
    affinity_terms: list[list[PodRequirement]] = []
    tolerations: list[Toleration] = []
    created: datetime | None = None
    unsold: list[str] = []  # GPU resources it asks for that tgp does not sell (names cut): no demand

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


# A Kubernetes quantity: signed decimal number, then a binary-SI, decimal-SI or exponent suffix.
_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))(?:(Ki|Mi|Gi|Ti|Pi|Ei)|[eE]([+-]?\d+)|(m|k|M|G|T|P|E)?)")
_BINARY_SI = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL_SI = {"m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_INTEGER = re.compile(r"[+-]?\d+")


def _integer(value: str) -> int | None:
    """A label value as the scheduler reads it for Gt/Lt (a base-10 integer), else None."""
    return int(value) if _INTEGER.fullmatch(value) and abs(int(value)) < 2**63 else None


def _gpu_quantity(value: object) -> int:
    """A GPU count from a quantity ("1", 2, "1k" = 1000). Extended resources must be whole."""
    match = _QUANTITY.fullmatch(str(value)) if isinstance(value, str | int) and not isinstance(value, bool) else None
    if match is None:
        raise UnreadablePod("gpu_quantity", f"{GPU_RESOURCE}: {value!r} is not a quantity")
    number, binary, exponent, decimal = match.groups()
    try:
        amount = Decimal(number) * _BINARY_SI[binary] if binary else Decimal(number).scaleb(int(exponent or _DECIMAL_SI.get(decimal or "", 0)))
    except (InvalidOperation, ArithmeticError) as exc:
        raise UnreadablePod("gpu_quantity", f"{GPU_RESOURCE}: {value!r}: {exc}") from None
    if amount != amount.to_integral_value() or not 0 <= amount < 2**63:
        raise UnreadablePod("gpu_quantity", f"{GPU_RESOURCE}: {value!r} is not a whole, non-negative number")
    return int(amount)


def _container_gpus(container: Mapping[str, Any]) -> int:
    """A container's GPU request: its requests, else its limits (the API defaults an extended
    resource's request to its limit and refuses the two differing); the larger if both."""
    resources = container.get("resources") or {}
    values = [(resources.get(kind) or {}).get(GPU_RESOURCE) for kind in ("requests", "limits")]
    return max((_gpu_quantity(v) for v in values if v is not None), default=0)


def gpu_request(pod: Mapping[str, Any]) -> int:
    """GPUs the scheduler reserves for a pod: Kubernetes' effective request. Each init container
    runs alone beside the sidecars (init containers with `restartPolicy: Always`) started before
    it; then the containers run beside all sidecars. The pod needs the largest of those, plus its
    overhead (kube-scheduler's resourcehelper.PodRequests; kubernetes.io "Resource sharing
    within containers")."""
    spec = pod.get("spec") or {}
    sidecars = init_peak = 0
    for container in spec.get("initContainers") or []:
        own = _container_gpus(container)
        if container.get("restartPolicy") == "Always":
            sidecars += own
            init_peak = max(init_peak, sidecars)
        else:
            init_peak = max(init_peak, own + sidecars)
    running = sidecars + sum(_container_gpus(c) for c in spec.get("containers") or [])
    overhead = (spec.get("overhead") or {}).get(GPU_RESOURCE)
    return max(init_peak, running) + (_gpu_quantity(overhead) if overhead is not None else 0)


def unsold_gpu_resources(pod: Mapping[str, Any]) -> list[str]:
    """The GPU resources (by vendor prefix) other than GPU_RESOURCE that the pod's containers,
    init containers or overhead ask for, sorted, each cut to MAX_RESOURCE_NAME_QUOTED characters."""
    spec = pod.get("spec") or {}
    asked: set[str] = set((spec.get("overhead") or {}).keys())
    for container in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = container.get("resources") or {}
        for kind in ("requests", "limits"):
            asked.update((resources.get(kind) or {}).keys())
    unsold = {str(r) for r in asked if str(r) != GPU_RESOURCE and str(r).startswith(_GPU_VENDORS)}
    return sorted({bounded(r, MAX_RESOURCE_NAME_QUOTED) for r in unsold})


def tracked(pods: Iterable[PendingPod], limit: int = MAX_PODS_TRACKED, chars: int = MAX_TRACKED_KEY_CHARS) -> tuple[list[PendingPod], int]:
    """The pods a pool plans for now, oldest first (then by key: stable from batch to batch),
    at most `limit` whose keys total at most `chars`; and how many wait beyond them."""
    chosen: list[PendingPod] = []
    left = chars
    ordered = sorted(pods, key=lambda p: (p.created or _EPOCH, p.key))
    for pod in ordered:
        if len(chosen) >= limit or len(pod.key) > left:
            break
        chosen.append(pod)
        left -= len(pod.key)
    return chosen, len(ordered) - len(chosen)


def unsold_counts(pods: Iterable[PendingPod], limit: int = MAX_QUOTED) -> dict[str, int]:
    """How many of `pods` ask for each GPU resource tgp does not sell: the `limit` most asked-for."""
    counts: dict[str, int] = {}
    for pod in pods:
        for resource in pod.unsold:
            counts[resource] = counts.get(resource, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:limit])


def pending_gpu_pod(pod: Mapping[str, Any]) -> PendingPod | None:
    """The pod as demand, if it is an unschedulable, unbound pod asking for GPUs. Raises
    UnreadablePod (only) for a pod it cannot use: an odd pod must not stop the bridge."""
    try:
        return _pending_gpu_pod(pod)
    except UnreadablePod:
        raise
    except (ValidationError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise UnreadablePod("invalid", f"{type(exc).__name__}: {exc}"[:300]) from None


def _affinity_terms(spec: Mapping[str, Any]) -> list[list[PodRequirement]]:
    """The required node affinity's terms that a new node could meet (any one must be)."""
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    raw_terms = required.get("nodeSelectorTerms") or []
    terms: list[list[PodRequirement]] = []
    dropped: list[UnreadablePod] = []
    for term in raw_terms:
        if term.get("matchFields"):  # a node's name (metadata.name): no node we launch has it yet
            dropped.append(UnreadablePod("match_fields", f"matchFields {term['matchFields']!r}"))
        elif not term.get("matchExpressions"):  # the API: an empty term matches no node
            dropped.append(UnreadablePod("empty_affinity_term", f"term {term!r}"))
        else:
            try:
                terms.append([PodRequirement.model_validate(e) for e in term["matchExpressions"]])
            except ValidationError as exc:
                dropped.append(UnreadablePod("unsupported_requirement", str(exc)[:300]))
    if raw_terms and not terms:
        raise dropped[0]
    return terms


def _pending_gpu_pod(pod: Mapping[str, Any]) -> PendingPod | None:
    spec, status, meta = pod.get("spec") or {}, pod.get("status") or {}, pod.get("metadata") or {}
    if spec.get("nodeName") or meta.get("deletionTimestamp") or status.get("phase", "Pending") != "Pending":
        return None
    unschedulable = any(
        c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
        for c in status.get("conditions") or []
    )
    if not unschedulable:
        return None
    gpus, unsold = gpu_request(pod), unsold_gpu_resources(pod)
    if gpus == 0 and not unsold:
        return None
    terms = _affinity_terms(spec)
    return PendingPod(
        namespace=meta.get("namespace", "default"),
        name=meta["name"],
        gpus=gpus,
        node_selector=dict(spec.get("nodeSelector") or {}),
        affinity_terms=terms,
        tolerations=[Toleration.model_validate(t) for t in spec.get("tolerations") or []],
        created=meta.get("creationTimestamp"),
        unsold=unsold,
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


def _requirement_met(pool: PoolCandidate, req: NodeSelectorRequirement | PodRequirement) -> bool:
    possible = _possible_values(pool, req.key)
    if req.operator in ("Gt", "Lt"):
        # Integer comparison like the scheduler's. Values chosen at launch (GPU type, region,
        # provider) are names, never integers, so only a fixed pool label can satisfy it.
        bound = _integer(req.values[0]) if len(req.values) == 1 else None
        if possible is None or bound is None:
            return False
        numbers = [n for n in map(_integer, possible) if n is not None]
        return any(n > bound if req.operator == "Gt" else n < bound for n in numbers)
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
