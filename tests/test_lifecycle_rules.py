"""The watch stage's decisions: idle, expiry, interruption, lost nodes. Pure, no I/O."""

from datetime import datetime, timedelta, timezone

from tgp.lifecycle import NODE_LOST_AFTER, EndReason, WatchState, judge_observation, pod_keeps_node_busy
from tgp.types import Instance, InstanceState, LifecycleTimeouts, NodeObservation, NodeSummary, PodSummary

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
TIMEOUTS = LifecycleTimeouts(idle=timedelta(minutes=10), expire_after=timedelta(days=7))
RUNNING = Instance(provider="p", instance_id="i", name="n", state=InstanceState.RUNNING)
READY = NodeSummary(name="n", ready=True, gpus=1)


def look(busy: int = 0, instance: Instance | None = RUNNING, node: NodeSummary | None = READY, holders: tuple[str, ...] = ()) -> NodeObservation:
    return NodeObservation(instance=instance, node=node, busy_pods=busy, holders=list(holders), holding=len(holders))


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


# --- the event-driven watch: judged at changes and deadlines, as a continuous poller -----------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tgp.lifecycle import apply_view, judge_view, next_deadline  # noqa: E402

_INSTANCES = st.sampled_from(
    [
        RUNNING,
        RUNNING.model_copy(update={"state": InstanceState.STOPPED}),
        RUNNING.model_copy(update={"state": InstanceState.FAILED}),
        RUNNING.model_copy(update={"state": InstanceState.TERMINATED}),
        RUNNING.model_copy(update={"interrupted": True}),
        None,
    ]
)
_NODES = st.sampled_from(
    [READY, NodeSummary(name="n", ready=False), None, READY.model_copy(update={"do_not_disrupt": True}), READY.model_copy(update={"gpus": 0})]
)
_VIEWS = st.builds(look, busy=st.integers(0, 2), instance=_INSTANCES, node=_NODES, holders=st.sampled_from([(), ("ml/train",)]))
_MINUTES = st.integers(1, 40).map(lambda m: timedelta(minutes=m))
_TIMEOUTS = st.builds(
    LifecycleTimeouts,
    idle=st.none() | _MINUTES,
    expire_after=st.none() | _MINUTES,
    bind_grace=st.none() | _MINUTES,
    termination_grace=st.none() | _MINUTES,
)
# A life: the view at Ready, then changes of the view at (minute, second) offsets.
_CHANGES = st.lists(st.tuples(st.integers(1, 60 * 60), _VIEWS), max_size=8).map(lambda cs: sorted(cs, key=lambda c: c[0]))
HORIZON = 2 * 60 * 60  # seconds


def _poller(
    first: NodeObservation, changes: list[tuple[int, NodeObservation]], timeouts: LifecycleTimeouts
) -> tuple[int, EndReason | None]:
    """The ideal watch: it looks every second (every change happens on a whole second), so it
    sees each view from the moment it holds."""
    state, view, pending = WatchState(ready_at=T0), first, list(changes)
    for t in range(HORIZON + 1):
        while pending and pending[0][0] <= t:
            view = pending.pop(0)[1]
        verdict = judge_observation(view, state, T0 + timedelta(seconds=t), timeouts)
        state = verdict.state
        if verdict.end is not None:
            return t, verdict.end
    return HORIZON, None


def _event_driven(
    first: NodeObservation, changes: list[tuple[int, NodeObservation]], timeouts: LifecycleTimeouts
) -> tuple[int, EndReason | None]:
    """The event-driven watch's loop (workflows/node.py): apply each change when it arrives,
    judge, and otherwise sleep until `next_deadline`."""
    state = apply_view(WatchState(ready_at=T0), first, T0, timeouts)
    now, pending = T0, list(changes)
    while True:
        verdict = judge_view(state, now, timeouts)
        if verdict.end is not None:
            return int((now - T0).total_seconds()), verdict.end
        state = verdict.state
        deadline = next_deadline(state, timeouts)
        assert deadline is None or deadline > now, "a deadline already due would have ended the node"
        wake = [d for d in (deadline, T0 + timedelta(seconds=pending[0][0]) if pending else None) if d is not None]
        if not wake or min(wake) > T0 + timedelta(seconds=HORIZON):
            return HORIZON, None
        now = min(wake)
        while pending and T0 + timedelta(seconds=pending[0][0]) <= now:
            state = apply_view(state, pending.pop(0)[1], now, timeouts)


@settings(max_examples=150)
@given(first=_VIEWS, changes=_CHANGES, timeouts=_TIMEOUTS)
def test_the_event_driven_watch_ends_when_and_why_a_continuous_poller_would(
    first: NodeObservation, changes: list[tuple[int, NodeObservation]], timeouts: LifecycleTimeouts
) -> None:
    """Invariant: for any life (a view at Ready, then changes of the instance, the Node, its
    busy pods and what holds it against disruption at any moments) and any idle, expiry and
    bind-grace settings and do-not-disrupt holders, a watch that judges
    only when the view changes and at `next_deadline` ends the node at the same moment and for
    the same reason as one that looks continuously; and it never sleeps past a due deadline."""
    assert _event_driven(first, changes, timeouts) == _poller(first, changes, timeouts)


@settings(max_examples=150)
@given(first=_VIEWS, changes=_CHANGES, timeouts=_TIMEOUTS)
def test_do_not_disrupt_holds_only_voluntary_ends_and_only_while_it_holds(
    first: NodeObservation, changes: list[tuple[int, NodeObservation]], timeouts: LifecycleTimeouts
) -> None:
    """Invariant: a node never ends idle or expired while its view has a do-not-disrupt pod or
    Node annotation, unless expireAfter + terminationGracePeriod has passed; every other end (interrupted, lost, unhealthy,
    repair) comes when and why it would with no holder."""
    end_at, end = _event_driven(first, changes, timeouts)
    if end in (EndReason.IDLE, EndReason.EXPIRED):
        view = first
        for at, changed in changes:
            if at <= end_at:
                view = changed
        from tgp.lifecycle import held_by

        grace_ended = (
            end is EndReason.EXPIRED
            and timeouts.expire_after is not None
            and timeouts.termination_grace is not None
            and end_at >= (timeouts.expire_after + timeouts.termination_grace).total_seconds()
        )
        assert grace_ended or not held_by(view)[0], "a voluntary end while do-not-disrupt held the node"
    stripped_at, stripped = _event_driven(_unheld(first), [(at, _unheld(v)) for at, v in changes], timeouts)
    if stripped not in (EndReason.IDLE, EndReason.EXPIRED, None):
        assert (end_at, end) == (stripped_at, stripped), "a hold changed an involuntary end"
    if not any(held_by_any(v) for v in [first, *(v for _, v in changes)]):
        assert (end_at, end) == (stripped_at, stripped)


def _unheld(view: NodeObservation) -> NodeObservation:
    node = view.node.model_copy(update={"do_not_disrupt": False}) if view.node is not None else None
    return view.model_copy(update={"node": node, "holders": [], "holding": 0})


def held_by_any(view: NodeObservation) -> bool:
    from tgp.lifecycle import held_by

    return bool(held_by(view)[0])


def test_expiry_waits_for_a_do_not_disrupt_pod_and_says_so() -> None:
    timeouts = LifecycleTimeouts(idle=None, expire_after=timedelta(hours=1))
    state = WatchState(ready_at=T0)
    verdict = judge_observation(look(busy=1, holders=("ml/train",)), state, T0 + timedelta(hours=2), timeouts)
    assert verdict.end is None and "past its expireAfter" in verdict.held and "ml/train" in verdict.held, verdict
    assert judge_observation(look(busy=1), state, T0 + timedelta(hours=2), timeouts).end is EndReason.EXPIRED
    node_held = look(node=READY.model_copy(update={"do_not_disrupt": True}))
    verdict = judge_observation(node_held, state, T0 + timedelta(hours=2), timeouts.model_copy(update={"idle": timedelta(minutes=1)}))
    assert verdict.end is None and "Node n" in verdict.held


def test_the_next_deadline_is_the_idle_timeout_after_the_pods_left_held_by_the_bind_grace() -> None:
    timeouts = LifecycleTimeouts(idle=timedelta(minutes=10), bind_grace=timedelta(minutes=15))
    state = apply_view(WatchState(ready_at=T0), look(busy=1), T0, timeouts)
    assert next_deadline(state, timeouts) is None, "a busy healthy node has no deadline without an expiry"
    state = apply_view(state, look(busy=0), T0 + timedelta(minutes=2), timeouts)
    assert state.idle_since == T0 + timedelta(minutes=2), "idle from when the pod left, not from when it was heard"
    assert next_deadline(state, timeouts) == T0 + timedelta(minutes=15), "the hold outlasts the idle timeout"
    state = apply_view(state, look(busy=0, node=None), T0 + timedelta(minutes=3), timeouts)
    assert next_deadline(state, timeouts) == T0 + timedelta(minutes=3) + NODE_LOST_AFTER


def test_a_view_from_before_ready_or_before_the_last_one_is_dated_no_earlier_than_them() -> None:
    state = apply_view(WatchState(ready_at=T0), look(), T0 - timedelta(minutes=5), TIMEOUTS)
    assert state.idle_since == T0 and state.seen_at == T0
    state = apply_view(state, look(busy=1), T0 + timedelta(minutes=4), TIMEOUTS)
    state = apply_view(state, look(), T0 + timedelta(minutes=1), TIMEOUTS)  # a late signal
    assert state.idle_since == T0 + timedelta(minutes=4)


def test_a_ready_node_whose_gpus_stay_gone_is_repaired_never_held() -> None:
    from tgp.lifecycle import GPUS_LOST_AFTER, next_deadline

    timeouts = LifecycleTimeouts(idle=None)
    no_gpus = look(busy=1, node=READY.model_copy(update={"gpus": 0, "do_not_disrupt": True}), holders=("ml/train",))
    state = apply_view(WatchState(ready_at=T0), no_gpus, T0 + timedelta(minutes=1), timeouts)
    assert next_deadline(state, timeouts) == T0 + timedelta(minutes=1) + GPUS_LOST_AFTER
    assert judge_view(state, T0 + timedelta(minutes=5), timeouts).end is None, "a device plugin restart is not a repair"
    verdict = judge_view(state, T0 + timedelta(minutes=1) + GPUS_LOST_AFTER, timeouts)
    assert verdict.end is EndReason.REPAIR and "no allocatable nvidia.com/gpu" in verdict.detail, verdict
    back = apply_view(state, look(busy=1), T0 + timedelta(minutes=3), timeouts)
    assert back.gpus_lost_since is None and next_deadline(back, timeouts) is None, "GPUs back: no repair"


def test_a_node_whose_expiry_a_budget_holds_still_ends_lost_when_it_dies() -> None:
    """Review finding: the expiry verdict dropped the health clocks it had just started, so a node
    held past its expiry by a budget (a zero budget during business hours) never became lost:
    a dead machine billed until the window ended. Loss is never limited by a budget."""
    timeouts = LifecycleTimeouts(idle=None, expire_after=timedelta(hours=1))
    state = WatchState(ready_at=T0)
    from tgp.lifecycle import NODE_NOT_READY_REPAIR_AFTER

    start = T0 + timedelta(hours=2)
    missing = look(node=None)
    first = judge_observation(missing, state, start, timeouts)
    assert first.end is EndReason.EXPIRED  # the budget refuses it; the node watches on with this state
    later = judge_observation(missing, first.state, start + NODE_LOST_AFTER, timeouts)
    assert later.end is EndReason.LOST, later
    not_ready = look(node=READY.model_copy(update={"ready": False}))  # there, NotReady, instance running: repaired
    first = judge_observation(not_ready, state, start, timeouts)
    later = judge_observation(not_ready, first.state, start + NODE_NOT_READY_REPAIR_AFTER, timeouts)
    assert later.end is EndReason.NOT_READY, later


# --- node repair for NotReady (issue 21 item 5) -----------------------------------------------


def _not_ready_running(view: NodeObservation) -> bool:
    """A Node that is there but NotReady while the provider says its instance runs."""
    return view.node is not None and not view.node.ready and view.instance is not None and view.instance.state is InstanceState.RUNNING and not view.instance.interrupted


def _unhealthy(view: NodeObservation) -> bool:
    inst = view.instance
    return view.node is None or not view.node.ready or inst is None or inst.state is not InstanceState.RUNNING or inst.interrupted


def _view_at(first: NodeObservation, changes: list[tuple[int, NodeObservation]], t: int) -> NodeObservation:
    view = first
    for at, changed in changes:
        if at <= t:
            view = changed
    return view


# Mostly running instances: a life the provider ends at once teaches nothing about repair.
_MOSTLY_RUNNING = st.builds(
    look,
    busy=st.integers(0, 2),
    instance=st.just(RUNNING) | _INSTANCES,
    node=st.just(NodeSummary(name="n", ready=False)) | _NODES,
    holders=st.sampled_from([(), ("ml/train",)]),
)
_MOSTLY_RUNNING_CHANGES = st.lists(st.tuples(st.integers(1, 60 * 60), _MOSTLY_RUNNING), max_size=5).map(lambda cs: sorted(cs, key=lambda c: c[0]))


@settings(max_examples=100)
@given(first=_MOSTLY_RUNNING, changes=_MOSTLY_RUNNING_CHANGES, timeouts=_TIMEOUTS)
def test_a_node_notready_while_its_instance_runs_is_repaired_after_the_threshold_never_lost(
    first: NodeObservation, changes: list[tuple[int, NodeObservation]], timeouts: LifecycleTimeouts
) -> None:
    """Invariants of node repair for NotReady, over any life: (1) the event-driven watch ends
    the node when and why a continuous poller would (its deadline for a NotReady node is the
    repair's); (2) a node is never ended lost while its Node is there, NotReady, and its instance
    runs; (3) a repair comes only after NODE_NOT_READY_REPAIR_AFTER of continuous trouble, with
    that view at the end."""
    from tgp.lifecycle import NODE_NOT_READY_REPAIR_AFTER

    end_at, end = _event_driven(first, changes, timeouts)
    assert (end_at, end) == _poller(first, changes, timeouts)
    at_end = _view_at(first, changes, end_at)
    if end is EndReason.LOST:
        assert not _not_ready_running(at_end), "a NotReady node with a running instance was ended lost"
    if end is EndReason.NOT_READY:
        assert _not_ready_running(at_end)
        window = int(NODE_NOT_READY_REPAIR_AFTER.total_seconds())
        assert end_at >= window and all(_unhealthy(_view_at(first, changes, t)) for t in range(end_at - window, end_at + 1)), "repaired early"


def test_notready_repair_waits_its_threshold_and_a_missing_node_is_still_lost_at_five_minutes() -> None:
    from tgp.lifecycle import NODE_NOT_READY_REPAIR_AFTER

    timeouts = LifecycleTimeouts(idle=None)
    state = WatchState(ready_at=T0)
    not_ready = look(node=READY.model_copy(update={"ready": False}), holders=("ml/train",))
    held = apply_view(state, not_ready, T0, timeouts)
    assert judge_view(held, T0 + NODE_LOST_AFTER, timeouts).end is None, "lost at 5 minutes, not repaired"
    assert next_deadline(held, timeouts) == T0 + NODE_NOT_READY_REPAIR_AFTER
    verdict = judge_view(held, T0 + NODE_NOT_READY_REPAIR_AFTER, timeouts)
    assert verdict.end is EndReason.NOT_READY and "NotReady for 10m00s" in verdict.detail, verdict  # do-not-disrupt does not hold it
    missing = apply_view(state, look(node=None), T0, timeouts)
    assert judge_view(missing, T0 + NODE_LOST_AFTER, timeouts).end is EndReason.LOST
    stopped = apply_view(state, look(node=READY.model_copy(update={"ready": False}), instance=RUNNING.model_copy(update={"state": InstanceState.STOPPED})), T0, timeouts)
    assert judge_view(stopped, T0 + NODE_LOST_AFTER, timeouts).end is EndReason.LOST


# --- terminationGracePeriod bounds a do-not-disrupt hold of an expired node (review #8) ---------


# Mostly healthy, running nodes that do-not-disrupt pods hold: the lives the bound is about.
_MOSTLY_HELD = st.builds(
    look,
    busy=st.integers(0, 2),
    instance=st.just(RUNNING) | _INSTANCES,
    node=st.just(READY) | _NODES,
    holders=st.just(("ml/train",)) | st.sampled_from([(), ("ml/train",)]),
)
_MOSTLY_HELD_CHANGES = st.lists(st.tuples(st.integers(1, 60 * 60), _MOSTLY_HELD), max_size=4).map(lambda cs: sorted(cs, key=lambda c: c[0]))
_EXPIRING = st.builds(LifecycleTimeouts, idle=st.none() | _MINUTES, expire_after=_MINUTES | st.none(), bind_grace=st.none() | _MINUTES, termination_grace=_MINUTES | st.none())


@settings(max_examples=100)
@given(first=_MOSTLY_HELD, changes=_MOSTLY_HELD_CHANGES, timeouts=_EXPIRING)
def test_a_hold_never_keeps_an_expired_node_past_expire_after_plus_termination_grace(
    first: NodeObservation, changes: list[tuple[int, NodeObservation]], timeouts: LifecycleTimeouts
) -> None:
    """Invariants, with every rule on: (1) the event-driven watch ends the node when and why a
    continuous poller would; (2) a node held by do-not-disrupt past its expiry ends expired no
    later than expireAfter + terminationGracePeriod after Ready, unless something ended it
    sooner; (3) it never ends expired while held before that."""
    from tgp.lifecycle import held_by

    end_at, end = _event_driven(first, changes, timeouts)
    assert (end_at, end) == _poller(first, changes, timeouts)
    if timeouts.expire_after is None or timeouts.termination_grace is None:
        return
    bound = int((timeouts.expire_after + timeouts.termination_grace).total_seconds())
    assert end_at <= bound, "a hold kept an expired node past expireAfter + terminationGracePeriod"
    if end is EndReason.EXPIRED and held_by(_view_at(first, changes, end_at))[0]:
        assert end_at >= bound, "ended while held before expireAfter + terminationGracePeriod"


def test_an_expired_node_held_by_do_not_disrupt_says_when_termination_grace_ends_the_wait() -> None:
    from tgp.lifecycle import longest_life

    timeouts = LifecycleTimeouts(idle=None, expire_after=timedelta(hours=1), termination_grace=timedelta(minutes=30))
    state = apply_view(WatchState(ready_at=T0), look(busy=1, holders=("ml/train",)), T0, timeouts)
    held = judge_view(state, T0 + timedelta(hours=1), timeouts)
    assert held.end is None and "terminationGracePeriod (30m) ends the wait" in held.held, held
    assert next_deadline(held.state, timeouts) == longest_life(state, timeouts) == T0 + timedelta(hours=1, minutes=30)
    ended = judge_view(held.state, T0 + timedelta(hours=1, minutes=30), timeouts)
    assert ended.end is EndReason.EXPIRED and "ml/train" in ended.detail and "terminationGracePeriod (30m00s)" in ended.detail, ended
