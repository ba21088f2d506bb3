"""Demand accounting of a pool: which pending pods are already covered by a node, which need a
new one, and which do not fit the nodes bought for them. Pure, no I/O.

A pending pod is *nominated* to one node: the node bought for it, or a Ready node of the pool
with free GPUs (the bridge reports free GPUs per Ready node). While its node launches, and for
`bind_grace` after the node is Ready, the pod is covered and buys nothing. A pod still pending
after that does not fit the node (it asks for more memory, has anti-affinity, a zonal
volume...): it is remembered as unfit and buys no more nodes, until it stops pending or the
pool's spec changes. This replaces a timer that bought a new node every few minutes for such a
pod, for ever.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict

# The scheduler binds a fitting pod within seconds of a node turning Ready and getting its
# labels and taints; a minute also covers a slow scheduler queue on a busy cluster.
POD_BIND_GRACE = timedelta(minutes=1)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Nomination(Frozen):
    """Pod -> the node expected to run it, since when."""

    workflow_id: str
    since: datetime


class CapacityNode(Frozen):
    """What the accounting needs to know of one live node of the pool."""

    workflow_id: str
    node_name: str
    ready_at: datetime | None = None  # None while it is still launching or joining
    free_gpus: int = 0  # reported by the bridge for Ready nodes


class CapacityPlan(Frozen):
    nominations: dict[str, Nomination]
    newly_unfit: list[str]
    uncovered: list[str]


def plan_capacity(
    pending: Mapping[str, int],
    nodes: list[CapacityNode],
    nominations: Mapping[str, Nomination],
    unfit: set[str],
    now: datetime,
    bind_grace: timedelta = POD_BIND_GRACE,
) -> CapacityPlan:
    """Cover `pending` (pod key -> GPUs) with the pool's nodes; return what is left."""
    by_id = {n.workflow_id: n for n in nodes}
    kept: dict[str, Nomination] = {}
    newly_unfit: list[str] = []
    for pod, nom in sorted(nominations.items()):
        node = by_id.get(nom.workflow_id)
        if pod not in pending or pod in unfit or node is None:
            continue  # bound, deleted, known unfit, or its node is gone: look again below
        if node.ready_at is not None and now - max(nom.since, node.ready_at) >= bind_grace:
            newly_unfit.append(pod)
            continue
        kept[pod] = nom
    left = {n.workflow_id: n.free_gpus for n in nodes if n.ready_at is not None}
    for pod, nom in kept.items():
        if nom.workflow_id in left:
            left[nom.workflow_id] -= pending[pod]
    uncovered: list[str] = []
    blocked = unfit | set(newly_unfit)
    for pod in sorted(pending):
        if pod in kept or pod in blocked:
            continue
        room = next((wid for wid, free in sorted(left.items()) if free >= pending[pod]), None)
        if room is None:
            uncovered.append(pod)
            continue
        left[room] -= pending[pod]
        kept[pod] = Nomination(workflow_id=room, since=now)
    return CapacityPlan(nominations=kept, newly_unfit=newly_unfit, uncovered=uncovered)
