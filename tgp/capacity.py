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
# labels and taints; the NVIDIA device plugin may take a few minutes more to advertise the
# GPUs, and a busy scheduler queue adds to that.
POD_BIND_GRACE = timedelta(minutes=3)


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Nomination(Frozen):
    """Pod -> the node expected to run it, since when. `bought`: the node was bought (or is
    launching) for this pod; otherwise the pod borrows free GPUs of a node already Ready."""

    workflow_id: str
    since: datetime
    bought: bool = True


class CapacityNode(Frozen):
    """What the accounting needs to know of one live node of the pool."""

    workflow_id: str
    node_name: str
    ready_at: datetime | None = None  # None until it is Ready
    launching: bool = False  # choosing an offer, launching or joining: it will take a pod
    free_gpus: int = 0  # reported by the bridge for Ready nodes


class CapacityPlan(Frozen):
    nominations: dict[str, Nomination]
    newly_unfit: list[str]
    uncovered: list[str]
    borrow_failed: list[str] = []  # did not bind on a node it borrowed from: it needs a node of its own


def plan_capacity(
    pending: Mapping[str, int],
    nodes: list[CapacityNode],
    nominations: Mapping[str, Nomination],
    unfit: set[str],
    now: datetime,
    bind_grace: timedelta = POD_BIND_GRACE,
    no_borrow: set[str] = frozenset(),  # type: ignore[assignment]
) -> CapacityPlan:
    """Cover `pending` (pod key -> GPUs) with the pool's nodes; return what is left.

    Order: a pod keeps its nomination while it lasts; else it is nominated to a launching node
    nobody is waiting for (a floor node, say), then to free GPUs of a Ready node, and only
    then is it uncovered (a new node). A pod that did not bind on the node bought for it is
    unfit; one that did not bind where it borrowed GPUs is not: it gets a node of its own."""
    by_id = {n.workflow_id: n for n in nodes}
    kept: dict[str, Nomination] = {}
    newly_unfit: list[str] = []
    borrow_failed: list[str] = []
    for pod, nom in sorted(nominations.items()):
        node = by_id.get(nom.workflow_id)
        if pod not in pending or pod in unfit or node is None:
            continue  # bound, deleted, known unfit, or its node is gone: look again below
        if node.ready_at is not None and now - max(nom.since, node.ready_at) >= bind_grace:
            (newly_unfit if nom.bought else borrow_failed).append(pod)
            continue
        kept[pod] = nom
    waited_for = {nom.workflow_id for nom in kept.values()}
    spare_launching = sorted(n.workflow_id for n in nodes if n.launching and n.workflow_id not in waited_for)
    left = {n.workflow_id: n.free_gpus for n in nodes if n.ready_at is not None}
    for pod, nom in kept.items():
        if nom.workflow_id in left:
            left[nom.workflow_id] -= pending[pod]
    uncovered: list[str] = []
    blocked = unfit | set(newly_unfit)
    may_not_borrow = set(no_borrow) | set(borrow_failed)
    for pod in sorted(pending):
        if pod in kept or pod in blocked:
            continue
        if spare_launching:
            kept[pod] = Nomination(workflow_id=spare_launching.pop(0), since=now)
            continue
        room = None if pod in may_not_borrow else next((wid for wid, free in sorted(left.items()) if free >= pending[pod]), None)
        if room is None:
            uncovered.append(pod)
            continue
        left[room] -= pending[pod]
        kept[pod] = Nomination(workflow_id=room, since=now, bought=False)
    return CapacityPlan(nominations=kept, newly_unfit=newly_unfit, uncovered=uncovered, borrow_failed=borrow_failed)
