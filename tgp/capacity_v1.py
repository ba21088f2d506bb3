"""The pool's demand accounting before demand by fit (one node per uncovered pod, every node
sized by the largest request). Kept only so that pool histories recorded before the
`demand-by-fit` patch replay with the commands they recorded; new passes use tgp.capacity."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from tgp.capacity import CapacityNode, Nomination


def plan_capacity_v1(
    pending: Mapping[str, int],
    nodes: list[CapacityNode],
    nominations: Mapping[str, Nomination],
    unfit: set[str],
    now: datetime,
    bind_grace: timedelta,
    no_borrow: set[str],
) -> tuple[dict[str, Nomination], list[str], list[str], list[str]]:
    """(nominations, newly_unfit, uncovered, borrow_failed) exactly as release e9a7c55 decided."""
    by_id = {n.workflow_id: n for n in nodes}
    kept: dict[str, Nomination] = {}
    newly_unfit: list[str] = []
    borrow_failed: list[str] = []
    for pod, nom in sorted(nominations.items()):
        node = by_id.get(nom.workflow_id)
        if pod not in pending or pod in unfit or node is None:
            continue
        if node.ready_at is not None and now - max(nom.since, node.ready_at) >= bind_grace:
            (newly_unfit if nom.bought else borrow_failed).append(pod)
            continue
        kept[pod] = nom
    waited_for = {nom.workflow_id for nom in kept.values()}
    spare_launching = sorted(n.workflow_id for n in nodes if n.launching and n.workflow_id not in waited_for)
    left = {n.workflow_id: n.free_gpus or 0 for n in nodes if n.ready_at is not None}
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
    return kept, newly_unfit, uncovered, borrow_failed
