"""Pure decisions of the node lifecycle's watch stage: no I/O, unit-tested on their own."""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from workflows.legacy.r31e9066.types import InstanceState, LifecycleTimeouts, NodeObservation, PodSummary

# A Ready node that stays missing or NotReady this long is given up as lost (the kubelet's
# default node-monitor grace is 40 s; 5 minutes rides out a tailnet blip or a reboot).
NODE_LOST_AFTER = timedelta(minutes=5)


class EndReason(StrEnum):
    IDLE = "idle"
    EXPIRED = "expired"
    EVICTED = "evicted"
    INTERRUPTED = "interrupted"
    LOST = "lost"


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
    if instance is None or instance.state in (InstanceState.TERMINATED, InstanceState.FAILED) or instance.interrupted:
        what = "no longer exists" if instance is None else f"is {instance.state.value.lower()}"
        return WatchVerdict(state=state, end=EndReason.INTERRUPTED, detail=f"the provider's instance {what}")

    healthy = obs.node is not None and obs.node.ready
    unhealthy_since = None if healthy else (state.unhealthy_since or now)
    if unhealthy_since is not None and now - unhealthy_since >= NODE_LOST_AFTER:
        what = "missing" if obs.node is None else "NotReady"
        return WatchVerdict(
            state=state.model_copy(update={"unhealthy_since": unhealthy_since}),
            end=EndReason.LOST,
            detail=f"the Node has been {what} for {_minutes(now - unhealthy_since)}",
        )

    if timeouts.expire_after is not None and now - state.ready_at >= timeouts.expire_after:
        return WatchVerdict(state=state, end=EndReason.EXPIRED, detail=f"node reached its expireAfter of {_minutes(timeouts.expire_after)}")

    idle_since = (state.idle_since or now) if obs.busy_pods == 0 and healthy else None
    new_state = WatchState(ready_at=state.ready_at, idle_since=idle_since, unhealthy_since=unhealthy_since)
    if idle_since is not None and timeouts.idle is not None and now - idle_since >= timeouts.idle:
        return WatchVerdict(state=new_state, end=EndReason.IDLE, detail=f"no workload pods for {_minutes(now - idle_since)}")
    return WatchVerdict(state=new_state)


def _minutes(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    return f"{seconds // 60}m{seconds % 60:02d}s"
