"""Drain a Node the way `kubectl drain` does, before its machine is destroyed.

Cordon it; evict every workload pod through the Eviction API (DaemonSet and static pods stay,
as with `kubectl drain --ignore-daemonsets`), retrying the ones a PodDisruptionBudget blocks;
then wait until the evicted pods are *gone*, not just accepted for eviction: a pod in graceful
deletion is still running its shutdown (a training job writing its checkpoint) for up to its
terminationGracePeriodSeconds, and destroying the machine under it loses that work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import structlog

from activities.ports import Cluster, EvictionBlocked
from tgp.disruption import pod_delete_at
from tgp.errors import TgpError, TransientError
from tgp.lifecycle import holders_of, pod_keeps_node_busy
from tgp.types import DrainInput, DrainResult, PodSummary

log = structlog.get_logger("tgp.drain")

EVENT_UNMANAGED = "EvictedUnmanagedPod"
# On each pod still on the node when the drain times out: the machine goes with it.
EVENT_DRAIN_TIMED_OUT = "DrainTimedOut"
# On each pod deleted over its PodDisruptionBudget at the pool's terminationGracePeriod.
EVENT_DELETED_AT_GRACE = "TerminationGracePeriod"
# Pod phases of a pod whose containers have all stopped for good.
FINISHED_PHASES = ("Succeeded", "Failed")


def drains(pod: PodSummary) -> bool:
    """Whether the drain removes this pod: DaemonSet pods would be recreated on the node at once
    (they tolerate the cordon), mirror pods belong to the kubelet's static manifests, and a pod
    that has completed (Succeeded or Failed) runs nothing to move: evicting it would only
    raise a false alarm; the pod garbage collector removes it with the Node (Karpenter skips
    finished pods too)."""
    return pod.owner_kind != "DaemonSet" and not pod.is_mirror and pod.phase not in FINISHED_PHASES


async def drain(
    cluster: Cluster,
    inp: DrainInput,
    *,
    poll_interval: timedelta,
    heartbeat: Callable[[int], None],
    clock: Callable[[], float] = time.monotonic,
    retry: bool = False,
) -> DrainResult:
    """Cordon `inp.node_name`, evict its workload pods and wait until they are gone, for at
    most `inp.timeout`. Never fails for a stuck pod: the result names the pods not evicted
    (`remaining`, e.g. blocked by a budget) and those still shutting down (`terminating`).

    Each poll lists the node's pods, evicts those not yet being deleted and calls `heartbeat`
    with the number of pods evicted so far. A transient API error skips one poll (the deadline
    still holds) rather than start the drain over. `retry`: an earlier attempt of this drain
    may have cordoned the Node (its worker died), so a cordon found is taken as ours.
    """
    began = clock()
    deadline = began + inp.timeout.total_seconds()
    node = await cluster.get_node(inp.node_name)
    if node is None:
        return DrainResult(evicted=0)
    await cluster.cordon(inp.node_name)
    # The pods listed after the cordon, for the first poll (one listing, not two, when the
    # drain looks again: nothing schedules onto a cordoned Node in between).
    listed: list[PodSummary] | None = None
    if inp.revalidate or inp.holds:
        # The verdict came from a look taken before the cordon (and, asked inside the drain,
        # before the pool's answer): a pod the scheduler bound in between would be evicted a few
        # seconds after it started. Now that nothing more can arrive, look again.
        on_node = listed = await cluster.list_pods_on_node(inp.node_name)
        arrived = [_key(p) for p in on_node if pod_keeps_node_busy(p)] if inp.revalidate else []
        held = [*([f"Node {inp.node_name}"] if node.do_not_disrupt else []), *holders_of(on_node)[0]] if inp.holds else []
        if arrived or held:
            if retry or not node.unschedulable:  # a cordon someone else set stays
                await cluster.uncordon(inp.node_name)
            log.info("drain_called_off", node=inp.node_name, pods=arrived, held=held)
            return DrainResult(evicted=0, called_off=arrived, held=held)
    evicted: set[str] = set()
    deleted: list[str] = []  # pods deleted over their PodDisruptionBudget (delete_at_deadline)
    refusals: dict[str, str] = {}  # pod -> the API's last answer to its eviction
    pods: list[PodSummary] = []
    while True:
        try:
            on_node = listed if listed is not None else await cluster.list_pods_on_node(inp.node_name)
            listed = None
            pods = [p for p in on_node if drains(p)]
            if not pods:
                return DrainResult(evicted=len(evicted), deleted=deleted)
            for pod in pods:
                if not pod.deleting and await _evict(cluster, inp.node_name, pod, refusals):
                    evicted.add(_key(pod))
                elif not pod.deleting and inp.delete_at_deadline and _key(pod) not in deleted:
                    grace = _delete_now(pod, began, deadline, clock())
                    if grace is not None:
                        await _delete(cluster, inp, pod, grace, refusals.get(_key(pod)))
                        deleted.append(_key(pod))
        except TransientError as exc:
            log.info("drain_transient_error", node=inp.node_name, error=str(exc))
        if clock() >= deadline:
            # A pod evicted in this very poll is in graceful deletion now, whatever the list said.
            terminating = [_key(p) for p in pods if p.deleting or _key(p) in evicted or _key(p) in deleted]
            remaining = [_key(p) for p in pods if _key(p) not in terminating]
            for pod in pods:
                await _warn_timed_out(cluster, inp, pod, still_shutting_down=_key(pod) in terminating, refusal=refusals.get(_key(pod)))
            return DrainResult(evicted=len(evicted), remaining=remaining, terminating=terminating, deleted=deleted)
        heartbeat(len(evicted))
        await asyncio.sleep(poll_interval.total_seconds())


def _delete_now(pod: PodSummary, began: float, deadline: float, now: float) -> timedelta | None:
    """With terminationGracePeriod: whether a pod the drain could not evict is to be deleted now
    (tgp.disruption.pod_delete_at: at the node's deadline minus the pod's own grace, so the pod
    gets it before the instance goes), and with what grace (what is left to the deadline, when
    the drain began later than that). None: not yet."""
    if _at(now) < pod_delete_at(_at(deadline), pod.grace_period, _at(began)):
        return None
    return max(timedelta(0), min(pod.grace_period, timedelta(seconds=deadline - now)))


def _at(t: float) -> datetime:
    """A reading of the drain's clock (seconds) as a time, for the rules of tgp.disruption."""
    return datetime.fromtimestamp(t, UTC)


async def _delete(cluster: Cluster, inp: DrainInput, pod: PodSummary, grace: timedelta, refusal: str | None) -> None:
    """Delete a pod the drain could not evict, over its PodDisruptionBudget, and say so on it."""
    await cluster.delete_pod(pod.namespace, pod.name, grace_period=grace, uid=pod.uid)
    log.info("deleted_at_termination_grace", node=inp.node_name, pod=_key(pod), grace_seconds=grace.total_seconds())
    why = f"its eviction was refused ({refusal})" if refusal else "its eviction was refused"
    message = (
        f"Deleted with a grace period of {_human(grace)}: Node {inp.node_name} is terminated at the end of its pool's "
        f"{inp.bound or 'terminationGracePeriod'} ({_human(inp.timeout)}) and {why}; the deletion overrides PodDisruptionBudgets and do-not-disrupt"
    )
    try:
        await cluster.record_pod_event(pod, type="Warning", reason=EVENT_DELETED_AT_GRACE, message=message)
    except TgpError as exc:
        log.warning("pod_event_failed", pod=_key(pod), reason=EVENT_DELETED_AT_GRACE, error=str(exc))


async def _evict(cluster: Cluster, node: str, pod: PodSummary, refusals: dict[str, str]) -> bool:
    """Evict one pod; False when a disruption budget says not now (the next poll asks again).
    The refusal is kept in `refusals`, for the pod's Event if the drain times out."""
    try:
        await cluster.evict_pod(pod.namespace, pod.name)
    except EvictionBlocked as exc:
        log.info("eviction_blocked_by_pdb", node=node, pod=_key(pod), reason=str(exc))
        refusals[_key(pod)] = str(exc)
        return False
    if pod.owner_kind is None:
        await _warn_unmanaged(cluster, node, pod)
    return True


async def _warn_unmanaged(cluster: Cluster, node: str, pod: PodSummary) -> None:
    """No controller will recreate a bare pod elsewhere: say so where `kubectl describe pod`
    and the namespace's events show it. Best effort: the drain goes on without the Event."""
    message = f"Evicted from Node {node}, which tgp is draining and terminating; no controller owns this pod, so it will not be recreated"
    try:
        await cluster.record_pod_event(pod, type="Warning", reason=EVENT_UNMANAGED, message=message)
    except TgpError as exc:
        log.warning("pod_event_failed", pod=_key(pod), reason=EVENT_UNMANAGED, error=str(exc))


async def _warn_timed_out(cluster: Cluster, inp: DrainInput, pod: PodSummary, *, still_shutting_down: bool, refusal: str | None) -> None:
    """Tell the pod's owner, on the pod, that the drain gave up on it and the machine is being
    terminated under it, and why. Best effort, as `_warn_unmanaged`."""
    if still_shutting_down:
        why = "it was evicted but was still shutting down (terminationGracePeriodSeconds longer than the drain timeout?)"
    else:
        why = f"its eviction was refused ({refusal})" if refusal else "its eviction was refused (a PodDisruptionBudget allowed no disruption)"
    ended = f"{inp.bound} ({_human(inp.timeout)}) ended the drain" if inp.bound else f"the drain timed out after {_human(inp.timeout)}"
    message = f"Node {inp.node_name} is terminated with this pod on it: {ended} and {why}"
    try:
        await cluster.record_pod_event(pod, type="Warning", reason=EVENT_DRAIN_TIMED_OUT, message=message)
    except TgpError as exc:
        log.warning("pod_event_failed", pod=_key(pod), reason=EVENT_DRAIN_TIMED_OUT, error=str(exc))


def _human(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    return f"{seconds // 60}m" if seconds >= 60 and not seconds % 60 else f"{seconds}s"


def _key(pod: PodSummary) -> str:
    return f"{pod.namespace}/{pod.name}"
