"""Pure decisions of the node lifecycle's watch stage: no I/O, unit-tested on their own."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from tgp.types import InstanceState, LifecycleTimeouts, NodeObservation, PodSummary

# A Ready node that stays missing or NotReady this long is given up as lost (the kubelet's
# default node-monitor grace is 40 s; 5 minutes rides out a tailnet blip or a reboot). The
# provider's own health readings (Lambda's `unhealthy`, a stopped VM) get the same grace: one
# bad reading is often a monitoring blip while the machine keeps running its job.
NODE_LOST_AFTER = timedelta(minutes=5)


class EndReason(StrEnum):
    IDLE = "idle"
    EXPIRED = "expired"
    EVICTED = "evicted"
    INTERRUPTED = "interrupted"
    LOST = "lost"
    UNHEALTHY = "unhealthy"  # the provider reports trouble past the grace, the Node still answers: drain


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


class WatchVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)
    state: WatchState
    end: EndReason | None = None
    detail: str = ""


def judge_observation(obs: NodeObservation, state: WatchState, now: datetime, timeouts: LifecycleTimeouts) -> WatchVerdict:
    """Decide from one look at the node whether its life should end, and why."""
    instance = obs.instance
    if instance is None or instance.state is InstanceState.TERMINATED or instance.interrupted:
        what = "no longer exists" if instance is None else ("was interrupted" if instance.interrupted else "is terminated")
        return WatchVerdict(state=state, end=EndReason.INTERRUPTED, detail=f"the provider's instance {what}")

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
        what = "missing" if obs.node is None else "NotReady"
        return WatchVerdict(state=kept, end=EndReason.LOST, detail=f"the Node has been {what} for {lasting}")

    if timeouts.expire_after is not None and now - state.ready_at >= timeouts.expire_after:
        return WatchVerdict(state=state, end=EndReason.EXPIRED, detail=f"node reached its expireAfter of {_minutes(timeouts.expire_after)}")

    idle_since = (state.idle_since or now) if obs.busy_pods == 0 and healthy else None
    new_state = WatchState(ready_at=state.ready_at, idle_since=idle_since, unhealthy_since=unhealthy_since)
    # A node holds the place of the pods bought for it until the pool's bind grace has passed:
    # the pool judges a pod that did not bind by then, so the node must not idle out first.
    held = timeouts.bind_grace is not None and now - state.ready_at < timeouts.bind_grace
    if idle_since is not None and timeouts.idle is not None and now - idle_since >= timeouts.idle and not held:
        return WatchVerdict(state=new_state, end=EndReason.IDLE, detail=f"no workload pods for {_minutes(now - idle_since)}")
    return WatchVerdict(state=new_state)


def _minutes(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    return f"{seconds // 60}m{seconds % 60:02d}s"
