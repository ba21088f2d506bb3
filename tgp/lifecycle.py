"""Pure decisions of the node lifecycle's watch stage: no I/O, unit-tested on their own."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from tgp.disruption import DisruptionReason, do_not_disrupt, held_message
from tgp.types import MAX_HOLDERS_NAMED, WATCH_INTERVAL, Instance, InstanceState, LifecycleTimeouts, NodeFacts, NodeObservation, NodeSummary, PodSummary

# A Ready node that stays missing or NotReady this long is given up as lost (the kubelet's
# default node-monitor grace is 40 s; 5 minutes rides out a tailnet blip or a reboot). The
# provider's own health readings (Lambda's `unhealthy`, a stopped VM) get the same grace: one
# bad reading is often a monitoring blip while the machine keeps running its job.
NODE_LOST_AFTER = timedelta(minutes=5)
# The watch's look without a reason (provider describe, GET Node, list its pods) comes every
# `watch_interval` (tgp.types.WATCH_INTERVAL, 45 minutes): a timer and a local activity's marker
# per look keep a Ready node at rest under 10 history events an hour.
# A Ready node whose allocatable nvidia.com/gpu stays 0 this long is repaired: drained and
# terminated, its pods rescheduled and replaced by the pool's demand. A device plugin that
# restarts re-registers its GPUs within seconds (the kubelet shows 0 in between); a driver or
# a card that fell off the bus does not come back by itself. Karpenter's node repair waits
# 10-30 minutes per condition; GPUs idle at $2/h are worth less patience.
GPUS_LOST_AFTER = timedelta(minutes=5)
# A Node that stays NotReady this long while its instance runs is repaired (node repair for
# NotReady): terminated without a drain, within the pool's budget, never held by do-not-disrupt.
# Longer than a GPU VM's reboot with its driver load and tailnet re-join (a few minutes), and
# than the 5 minutes after which Kubernetes' own NoExecute taint (node.kubernetes.io/unreachable
# and not-ready, tolerationSeconds 300) has evicted its pods anyway; shorter than Karpenter's 30
# minutes, since a GPU machine that serves nothing bills $1-4 an hour. A Node that is missing,
# or an instance the provider reports stopped or failed, ends lost after NODE_LOST_AFTER
# instead (a tailnet outage that turns every Node NotReady must not end the whole fleet at once).
NODE_NOT_READY_REPAIR_AFTER = timedelta(minutes=10)


class EndReason(StrEnum):
    IDLE = "idle"
    EXPIRED = "expired"
    EVICTED = "evicted"
    INTERRUPTED = "interrupted"
    LOST = "lost"
    UNHEALTHY = "unhealthy"  # the provider reports trouble past the grace, the Node still answers: drain
    REPAIR = "repair"  # Ready but its GPUs are no longer advertised past the grace: drain and replace
    DRIFTED = "drifted"  # replaced (make-before-break): its class or pool changed what made it
    CHEAPER = "cheaper"  # replaced (make-before-break) by a cheaper offer that fits its pods
    UNDERUTILIZED = "underutilized"  # replaced (make-before-break): its pods fit on fewer nodes
    NOT_READY = "not-ready"  # node repair: NotReady past NODE_NOT_READY_REPAIR_AFTER, instance running: terminate, no drain
    DELETED = "deleted"  # its Node was deleted by hand (kubectl delete node; tgp's finalizer holds it): drain and terminate at once


# The ends a pool's budgets count (repair too: Karpenter caps concurrent repairs, and a device
# plugin rollout that takes every node's GPUs away must not end the whole pool at once).
BUDGETED_ENDS = {
    EndReason.IDLE: DisruptionReason.EMPTY,
    EndReason.EXPIRED: DisruptionReason.EXPIRED,
    EndReason.REPAIR: DisruptionReason.REPAIR,
    EndReason.NOT_READY: DisruptionReason.REPAIR,
    EndReason.DRIFTED: DisruptionReason.DRIFTED,
    EndReason.CHEAPER: DisruptionReason.CHEAPER,
    EndReason.UNDERUTILIZED: DisruptionReason.UNDERUTILIZED,
}
# The ends a pool's `disrupt` asks for, by its reason (make-before-break, consolidation).
DISRUPT_ENDS = {
    DisruptionReason.DRIFTED.value: EndReason.DRIFTED,
    DisruptionReason.CHEAPER.value: EndReason.CHEAPER,
    DisruptionReason.UNDERUTILIZED.value: EndReason.UNDERUTILIZED,
}


def pod_holds_node(pod: PodSummary) -> bool:
    """A pod holds its node against voluntary disruption (expiry, idle) while it asks not to be
    disrupted and is still active: tgp.disruption.pod_holds_node of the pod as read."""
    return pod.do_not_disrupt and pod.phase not in ("Succeeded", "Failed") and not pod.deleting


def holders_of(pods: list[PodSummary]) -> tuple[list[str], int]:
    """The names (namespace/name, the first MAX_HOLDERS_NAMED, sorted) of the pods that hold
    their node, and how many there are."""
    names = sorted(f"{p.namespace}/{p.name}" for p in pods if pod_holds_node(p))
    return names[:MAX_HOLDERS_NAMED], len(names)


def pod_keeps_node_busy(pod: PodSummary) -> bool:
    """A pod keeps its node from being idle unless it is a DaemonSet pod, a static (mirror)
    pod, already finished, or already being deleted."""
    if pod.owner_kind == "DaemonSet" or pod.is_mirror or pod.deleting:
        return False
    return pod.phase not in ("Succeeded", "Failed")


class WatchState(BaseModel):
    """What the watch stage remembers between looks; survives continue-as-new."""

    model_config = ConfigDict(frozen=True)
    ready_at: datetime
    idle_since: datetime | None = None
    unhealthy_since: datetime | None = None
    # What is known of the node now, since when, the bridge's facts it was last told, and when
    # it last looked itself.
    view: NodeObservation | None = None
    seen_at: datetime | None = None
    facts: NodeFacts | None = None
    looked_at: datetime | None = None
    gpus_lost_since: datetime | None = None  # Ready with no allocatable GPUs since
    held: str = ""  # what holds a voluntary end now (held_message), "" when nothing does
    blocked_until: datetime | None = None  # a disruption budget holds a due voluntary end until then
    blocked: str = ""  # the pool's message when it last refused


class WatchVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)
    state: WatchState
    end: EndReason | None = None
    detail: str = ""
    held: str = ""  # a voluntary end is due but held by do-not-disrupt: held_message says by what


def judge_observation(obs: NodeObservation, state: WatchState, now: datetime, timeouts: LifecycleTimeouts) -> WatchVerdict:
    """Decide from one look at the node whether its life should end, and why."""
    instance = obs.instance
    if instance is None or instance.state is InstanceState.TERMINATED or instance.interrupted:
        what = "no longer exists" if instance is None else ("was interrupted" if instance.interrupted else "is terminated")
        return WatchVerdict(state=state, end=EndReason.INTERRUPTED, detail=f"the provider's instance {what}")
    if obs.node is not None and obs.node.deleting:
        # `kubectl delete node` (Karpenter's meaning): drain and terminate now, as an evict.
        # Neither budgets nor do-not-disrupt hold it: it is an operator's explicit request.
        detail = f"its Node {obs.node.name} was deleted (kubectl delete node); tgp's finalizer keeps the Node until the instance is terminated"
        return WatchVerdict(state=state, end=EndReason.DELETED, detail=detail)

    healthy = obs.node is not None and obs.node.ready
    provider_trouble = instance.state in (InstanceState.FAILED, InstanceState.STOPPED)
    unhealthy_since = None if healthy and not provider_trouble else (state.unhealthy_since or now)
    if unhealthy_since is not None and now - unhealthy_since >= NODE_LOST_AFTER:
        lasting = _minutes(now - unhealthy_since)
        kept = state.model_copy(update={"unhealthy_since": unhealthy_since})
        if healthy:
            # The machine still serves the cluster: drain its pods before it goes.
            detail = f"the provider has reported the instance {instance.state.value.lower()} for {lasting}"
            return WatchVerdict(state=kept, end=EndReason.UNHEALTHY, detail=detail)
        if not _repairs_not_ready(state, obs):
            what = "missing" if obs.node is None else "NotReady"
            replaced = "; the instance is terminated (nothing to drain) and the pool's demand replaces it"
            return WatchVerdict(state=kept, end=EndReason.LOST, detail=f"the Node has been {what} for {lasting}{replaced}")
    if unhealthy_since is not None and _repairs_not_ready(state, obs) and now - unhealthy_since >= NODE_NOT_READY_REPAIR_AFTER:
        detail = (
            f"node repair: the Node has been NotReady for {_minutes(now - unhealthy_since)} while its instance runs "
            "(kubelet, network or machine gone); terminated without a drain (its pods cannot be evicted) and replaced"
        )
        kept = state.model_copy(update={"unhealthy_since": unhealthy_since, "idle_since": None, "gpus_lost_since": None})
        return WatchVerdict(state=kept, end=EndReason.NOT_READY, detail=detail)

    # Node repair: a Ready node that no longer advertises its GPUs is no
    # use to a GPU pod. Never held by do-not-disrupt: the pods on it cannot use the GPUs either.
    gpus_gone = healthy and not provider_trouble and obs.node is not None and obs.node.gpus == 0
    gpus_lost_since = (state.gpus_lost_since or now) if gpus_gone else None
    if gpus_lost_since is not None and now - gpus_lost_since >= GPUS_LOST_AFTER:
        detail = (
            f"node repair: the Node has advertised no allocatable nvidia.com/gpu for {_minutes(now - gpus_lost_since)} "
            "(GPU driver or device plugin gone); drained and replaced"
        )
        return WatchVerdict(state=state.model_copy(update={"gpus_lost_since": gpus_lost_since, "unhealthy_since": unhealthy_since}), end=EndReason.REPAIR, detail=detail)

    holders, holding = held_by(obs)
    idle_since = (state.idle_since or now) if obs.busy_pods == 0 and healthy else None
    new_state = state.model_copy(update={"idle_since": idle_since, "unhealthy_since": unhealthy_since, "gpus_lost_since": gpus_lost_since})
    if timeouts.expire_after is not None and now - state.ready_at >= timeouts.expire_after:
        if not holders:
            # A budget may hold the expiry: the health clocks keep running meanwhile, so a node
            # that dies while held still ends lost or repaired.
            return WatchVerdict(state=new_state, end=EndReason.EXPIRED, detail=f"node reached its expireAfter of {_minutes(timeouts.expire_after)}")
        lifetime = longest_life(state, timeouts)
        if lifetime is not None and now >= lifetime:
            detail = (
                f"node reached its expireAfter of {_minutes(timeouts.expire_after)} and do-not-disrupt held it for its "
                f"terminationGracePeriod ({_minutes(lifetime - state.ready_at - timeouts.expire_after)}) more: {', '.join(holders[:3])}"
            )
            return WatchVerdict(state=new_state, end=EndReason.EXPIRED, detail=detail)
        grace = timeouts.termination_grace if lifetime is not None else None
        return WatchVerdict(state=new_state, held=held_message(DisruptionReason.EXPIRED, holders, grace=grace, total=holding))

    # A node holds the place of the pods bought for it until the pool's bind grace has passed:
    # the pool judges a pod that did not bind by then, so the node must not idle out first.
    placed = timeouts.bind_grace is not None and now - state.ready_at < timeouts.bind_grace
    if idle_since is not None and timeouts.idle is not None and now - idle_since >= timeouts.idle and not placed:
        if holders:
            return WatchVerdict(state=new_state, held=held_message(DisruptionReason.EMPTY, holders, total=holding))
        return WatchVerdict(state=new_state, end=EndReason.IDLE, detail=f"no workload pods for {_minutes(now - idle_since)}")
    return WatchVerdict(state=new_state)


def _repairs_not_ready(state: WatchState, obs: NodeObservation) -> bool:
    """Whether a NotReady node is repaired (after NODE_NOT_READY_REPAIR_AFTER) rather than lost
    (after NODE_LOST_AFTER): a Node that is there but NotReady while the provider
    reports its instance running. A missing Node or a stopped or failed instance is lost."""
    if obs.node is None or obs.node.ready or obs.instance is None:
        return False
    return obs.instance.state not in (InstanceState.FAILED, InstanceState.STOPPED)


def longest_life(state: WatchState, timeouts: LifecycleTimeouts) -> datetime | None:
    """With both set: `expireAfter + terminationGracePeriod`
    after Ready, the longest a node lives (Karpenter's): a do-not-disrupt hold of an expired node
    ends there, and the drain that follows ends there too. None: no such bound."""
    if timeouts.expire_after is None or timeouts.termination_grace is None:
        return None
    return state.ready_at + timeouts.expire_after + timeouts.termination_grace


def held_by(obs: NodeObservation) -> tuple[list[str], int]:
    """What holds the node against voluntary disruption, as its view says: the Node itself
    (annotated do-not-disrupt) and the first of its do-not-disrupt pods; and how many hold it."""
    node = [f"Node {obs.node.name}"] if obs.node is not None and obs.node.do_not_disrupt else []
    return [*node, *obs.holders], len(node) + max(obs.holding, len(obs.holders))


def backstop_period(timeouts: LifecycleTimeouts) -> timedelta:
    """How often the watch looks without a reason: the request's watch interval."""
    return timeouts.watch_interval


def facts_view(facts: NodeFacts, instance: Instance | None) -> NodeObservation:
    """The node as the bridge's facts tell it, with the instance as the node last looked at it."""
    node = (
        NodeSummary(name=facts.node_name, ready=facts.ready, gpus=facts.gpus, do_not_disrupt=facts.do_not_disrupt, deleting=facts.deleting)
        if facts.present
        else None
    )
    return NodeObservation(instance=instance, node=node, busy_pods=facts.busy_pods, holders=facts.holders, holding=facts.holding)


def apply_view(state: WatchState, view: NodeObservation, at: datetime, timeouts: LifecycleTimeouts) -> WatchState:
    """The watch's state once the node is known to be as `view` says since `at`: idleness and
    trouble are dated from when they began (not from when the watch heard of them), and never
    before Ready or a view already applied (clocks of the bridge and the workflow differ)."""
    at = max(at, state.seen_at or state.ready_at, state.ready_at)
    judged = judge_observation(view, state, at, timeouts).state
    return judged.model_copy(update={"view": view, "seen_at": at})


def judge_view(state: WatchState, now: datetime, timeouts: LifecycleTimeouts) -> WatchVerdict:
    """The verdict at `now` on the view the state holds (`judge_observation` of it)."""
    assert state.view is not None, "the watch judges only once it has a view"
    return judge_observation(state.view, state, now, timeouts)


def next_deadline(state: WatchState, timeouts: LifecycleTimeouts) -> datetime | None:
    """The first moment at which `judge_view` may end the node while the view stays as it is:
    the lost or unhealthy grace, the expiry, or the idle timeout (not before the bind-grace hold
    ends). None: nothing ends it without a change. Before this moment every verdict on the same
    view is the same (no end); at it the judge must be asked again."""
    view = state.view
    if view is None:
        return None
    instance = view.instance
    if instance is None or instance.state is InstanceState.TERMINATED or instance.interrupted:
        return state.seen_at or state.ready_at
    if view.node is not None and view.node.deleting:
        return state.seen_at or state.ready_at
    due: list[datetime] = []
    if state.unhealthy_since is not None:
        due.append(state.unhealthy_since + (NODE_NOT_READY_REPAIR_AFTER if _repairs_not_ready(state, view) else NODE_LOST_AFTER))
    if state.gpus_lost_since is not None:
        due.append(state.gpus_lost_since + GPUS_LOST_AFTER)
    if held_by(view)[0]:
        # Held: no voluntary end comes while the view stays as it is; a change of it (the
        # holders leave, the annotation is removed) wakes the watch; or terminationGracePeriod
        # past the expiry, which a hold does not outlast.
        lifetime = longest_life(state, timeouts)
        return min([*due, *([lifetime] if lifetime is not None else [])], default=None)
    if timeouts.expire_after is not None:
        due.append(state.ready_at + timeouts.expire_after)
    if state.idle_since is not None and timeouts.idle is not None:
        idle_end = state.idle_since + timeouts.idle
        if timeouts.bind_grace is not None:
            idle_end = max(idle_end, state.ready_at + timeouts.bind_grace)
        due.append(idle_end)
    return min(due, default=None)


def _minutes(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    return f"{seconds // 60}m{seconds % 60:02d}s"
