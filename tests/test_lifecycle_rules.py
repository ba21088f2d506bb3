"""The watch stage's decisions: idle, expiry, interruption, lost nodes. Pure, no I/O."""

from datetime import datetime, timedelta, timezone

from tgp.lifecycle import NODE_LOST_AFTER, EndReason, WatchState, judge_observation, pod_keeps_node_busy
from tgp.types import Instance, InstanceState, LifecycleTimeouts, NodeObservation, NodeSummary, PodSummary

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
TIMEOUTS = LifecycleTimeouts(idle=timedelta(minutes=10), expire_after=timedelta(days=7))
RUNNING = Instance(provider="p", instance_id="i", name="n", state=InstanceState.RUNNING)
READY = NodeSummary(name="n", ready=True)


def look(busy: int = 0, instance: Instance | None = RUNNING, node: NodeSummary | None = READY) -> NodeObservation:
    return NodeObservation(instance=instance, node=node, busy_pods=busy)


def test_daemonset_mirror_finished_and_deleting_pods_do_not_keep_a_node_busy() -> None:
    assert pod_keeps_node_busy(PodSummary(namespace="a", name="job"))
    assert not pod_keeps_node_busy(PodSummary(namespace="a", name="ds", owner_kind="DaemonSet"))
    assert not pod_keeps_node_busy(PodSummary(namespace="a", name="static", is_mirror=True))
    assert not pod_keeps_node_busy(PodSummary(namespace="a", name="done", phase="Succeeded"))
    assert not pod_keeps_node_busy(PodSummary(namespace="a", name="bye", deleting=True))


def test_idle_only_after_the_idle_timeout_of_continuous_idleness() -> None:
    state = WatchState(ready_at=T0)
    v = judge_observation(look(), state, T0 + timedelta(minutes=1), TIMEOUTS)
    assert v.end is None and v.state.idle_since == T0 + timedelta(minutes=1)
    v = judge_observation(look(busy=1), v.state, T0 + timedelta(minutes=5), TIMEOUTS)
    assert v.end is None and v.state.idle_since is None, "a busy look resets idleness"
    v = judge_observation(look(), v.state, T0 + timedelta(minutes=6), TIMEOUTS)
    v = judge_observation(look(), v.state, T0 + timedelta(minutes=15, seconds=59), TIMEOUTS)
    assert v.end is None
    v = judge_observation(look(), v.state, T0 + timedelta(minutes=16), TIMEOUTS)
    assert v.end is EndReason.IDLE


def test_expiry_wins_over_busy() -> None:
    v = judge_observation(look(busy=3), WatchState(ready_at=T0), T0 + timedelta(days=7), TIMEOUTS)
    assert v.end is EndReason.EXPIRED


def test_a_gone_or_preempted_instance_is_an_interruption() -> None:
    for inst in (None, RUNNING.model_copy(update={"state": InstanceState.TERMINATED}), RUNNING.model_copy(update={"interrupted": True})):
        assert judge_observation(look(instance=inst), WatchState(ready_at=T0), T0, TIMEOUTS).end is EndReason.INTERRUPTED


def test_a_node_notready_for_longer_than_the_grace_is_lost() -> None:
    not_ready = NodeSummary(name="n", ready=False)
    v = judge_observation(look(node=not_ready), WatchState(ready_at=T0), T0, TIMEOUTS)
    assert v.end is None and v.state.idle_since is None, "an unhealthy node is never idle"
    v = judge_observation(look(node=None), v.state, T0 + NODE_LOST_AFTER - timedelta(seconds=1), TIMEOUTS)
    assert v.end is None
    v = judge_observation(look(node=None), v.state, T0 + NODE_LOST_AFTER, TIMEOUTS)
    assert v.end is EndReason.LOST and "missing" in v.detail
    v = judge_observation(look(), v.state, T0 + NODE_LOST_AFTER, TIMEOUTS)
    assert v.state.unhealthy_since is None, "recovery clears the clock"


def test_a_node_without_an_idle_timeout_never_idles_out() -> None:
    floor = TIMEOUTS.model_copy(update={"idle": None})
    v = judge_observation(look(), WatchState(ready_at=T0, idle_since=T0), T0 + timedelta(days=3), floor)
    assert v.end is None


def test_one_unhealthy_provider_reading_is_a_blip_not_a_death() -> None:
    failed = RUNNING.model_copy(update={"state": InstanceState.FAILED})
    v = judge_observation(look(busy=1, instance=failed), WatchState(ready_at=T0), T0, TIMEOUTS)
    assert v.end is None, "a single FAILED (Lambda `unhealthy`) reading must not end a Ready node"
    v = judge_observation(look(busy=1), v.state, T0 + timedelta(seconds=30), TIMEOUTS)
    assert v.end is None and v.state.unhealthy_since is None, "a healthy reading clears the clock"


def test_lasting_provider_trouble_drains_a_reachable_node_and_loses_an_unreachable_one() -> None:
    failed = RUNNING.model_copy(update={"state": InstanceState.FAILED})
    v = judge_observation(look(busy=1, instance=failed), WatchState(ready_at=T0), T0, TIMEOUTS)
    v = judge_observation(look(busy=1, instance=failed), v.state, T0 + NODE_LOST_AFTER - timedelta(seconds=1), TIMEOUTS)
    assert v.end is None
    reachable = judge_observation(look(busy=1, instance=failed), v.state, T0 + NODE_LOST_AFTER, TIMEOUTS)
    assert reachable.end is EndReason.UNHEALTHY and "failed" in reachable.detail, "a node that still answers is drained"
    gone = judge_observation(look(busy=1, instance=failed, node=NodeSummary(name="n", ready=False)), v.state, T0 + NODE_LOST_AFTER, TIMEOUTS)
    assert gone.end is EndReason.LOST


def test_item9_a_node_holds_its_pods_place_for_the_bind_grace_whatever_its_idle_timeout() -> None:
    """idleTimeout 30 s and a pod that never binds: the node must still be there when the pool
    judges the pod at the end of the bind grace (else every idle-out bought a new node)."""
    short = TIMEOUTS.model_copy(update={"idle": timedelta(seconds=30), "bind_grace": timedelta(minutes=3)})
    v = judge_observation(look(), WatchState(ready_at=T0), T0, short)
    v = judge_observation(look(), v.state, T0 + timedelta(minutes=2, seconds=59), short)
    assert v.end is None, "idle for longer than idleTimeout, but inside the bind grace"
    v = judge_observation(look(), v.state, T0 + timedelta(minutes=3), short)
    assert v.end is EndReason.IDLE, "after the grace the idle timeout applies as before"
    unheld = short.model_copy(update={"bind_grace": None})
    assert judge_observation(look(), WatchState(ready_at=T0, idle_since=T0), T0 + timedelta(seconds=30), unheld).end is EndReason.IDLE
