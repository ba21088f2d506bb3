"""Watch: a Ready node, with no request at rest. The watch holds the latest view of the node
(the bridge's facts, the instance as last looked at) and sleeps on one durable timer until the
judge's first deadline (idle, expiry, lost, unhealthy: tgp.lifecycle) or the backstop look. It
wakes early on an eviction, new facts, a sighting from the provider's listing (then it looks
itself), new settings, or the pool's `disrupt`.

tgp.lifecycle's property tests prove that judging only at changes and at `next_deadline` ends a
node when and why a continuous poller would. Every wake is a safe point for continue-as-new."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, FailureError

with workflow.unsafe.imports_passed_through():
    from activities.node import POOL_ANSWER_TIMEOUT, NodeActivities
    from tgp.disruption import DisruptionReason, eventual_end, held_message
    from tgp.lifecycle import BUDGETED_ENDS, DISRUPT_ENDS, EndReason, apply_view, backstop_period, facts_view, held_by, judge_view, next_deadline
    from tgp.messages import DisruptionAnswer, DisruptionAsk, PoolAsk
    from tgp.types import Instance, InstanceState, NodeObservation, NodeSummary, ObserveInput, Stage
    from workflows.entity import describe
    from workflows.node.labels import apply_template, template_due
    from workflows.node.life import Life, describe_failure, human
    from workflows.retries import API_RETRY

# A node a budget holds asks its pool again this often.
BUDGET_ASK_AGAIN = timedelta(minutes=1)
# An ask the pool could not take (Temporal's in-flight update limit) is no refusal: asked again
# after this, plus up to as much again at random (nodes that asked together do not again).
BUDGET_ASK_SOON = timedelta(seconds=5)



async def watch(life: Life) -> EndReason:
    """Watch the node until its life should end, and say why."""
    state = life.state
    assert state.instance is not None and state.watch is not None
    if state.watch.view is None:
        _seed_view(life)
    while True:
        if state.evict_reason is not None:
            state.end_reason = f"evicted: {state.evict_reason}"
            return EndReason.EVICTED
        if template_due(life):
            await apply_template(life)
        if state.budget_freed:
            state.budget_freed = False
            state.watch = _watch(life).model_copy(update={"blocked_until": None})
        if state.sighting is not None or _backstop_due(life) <= workflow.now():
            state.sighting = None
            await _look(life)
        _apply_facts(life)
        _end_hold_when_busy(life)
        end, again = await _judge(life)
        if end is not None:
            return end
        if again:
            continue
        await life.continue_as_new_if_due()
        await _sleep(life)


async def _judge(life: Life) -> tuple[EndReason | None, bool]:
    """The verdict now: an end to take, or none (and whether to judge again at once: facts came
    while the pool was asked)."""
    state, now = life.state, workflow.now()
    if _watch(life).view is None:
        return None, False  # no facts yet and the first look failed: look again at the backstop
    verdict = judge_view(_watch(life), now, life.timeouts)
    state.watch = verdict.state.model_copy(update={"held": verdict.held})
    facts, end = state.facts, verdict.end
    if end is not None and _asks_in_drain(life, end):
        if not _budget_blocked(life):  # the drain asks the budgets first
            state.end_reason = f"{end.value}: {verdict.detail}"
            return end, False
    elif end is not None and not await _budget_allows(life, end):
        pass
    elif end is not None and _held_after_the_ask(life, facts):
        return None, True  # judged again: it holds now (and says so)
    elif end is not None:
        state.end_reason = f"{end.value}: {verdict.detail}"
        if end in (EndReason.REPAIR, EndReason.NOT_READY):
            life.stamp(Stage.NODE_REPAIR, verdict.detail)  # the pool's NodeRepair Warning
        elif end is EndReason.DELETED:
            life.stamp(Stage.NODE_DELETED, verdict.detail)  # the pool's NodeDeleted Warning
        return end, False
    if verdict.held and verdict.held != verdict.state.held:
        workflow.logger.info("disruption held: %s", verdict.held)  # due but held: said once
        life.stamp(Stage.DISRUPTION_HELD, verdict.held)
        life.tell_pool()
        workflow.set_current_details(life.details())
    if state.disrupt is not None:
        return await _disrupt_due(life), False
    return None, False


async def _sleep(life: Life) -> None:
    """Sleep until the next deadline, the backstop look, a budget's ask again or a template
    retry, or until something the judge reads changes."""
    state, now = life.state, workflow.now()
    watch, t = _watch(life), life.timeouts
    due = [d for d in (next_deadline(watch, t), _backstop_due(life)) if d is not None]
    if watch.blocked_until is not None and watch.blocked_until > now:
        due = [d for d in due if d > now] + [watch.blocked_until]  # a budget holds an end already due
    if state.template_retry_at is not None and state.template_retry_at > now:
        due.append(state.template_retry_at)
    if (bound := disrupt_bound(life)) is not None and bound > now:
        due.append(bound)  # a held drift goes at its terminationGracePeriod
    wake_at = now + max(min(due) - now, timedelta(milliseconds=1))
    facts, disrupt, template = state.facts, state.disrupt, state.template
    await _sleep_until(
        life,
        wake_at,
        lambda: state.evict_reason is not None
        or state.sighting is not None
        or state.facts is not facts
        or state.timeouts is not t
        or state.template is not template
        or state.disrupt is not disrupt
        or state.budget_freed,
    )


async def _sleep_until(life: Life, wake_at: datetime, woken: Callable[[], bool]) -> None:
    """The wait, until `wake_at` or `woken()`. An earlier timer is kept (the watch wakes, judges
    again and sleeps on): a signal that moves no deadline starts and cancels no timer."""
    timer = life.watch_timer
    if timer is not None and not timer[1].done() and timer[0] <= wake_at:
        wake_at = timer[0]
    if timer is None or timer[1].done() or timer[0] != wake_at:
        if timer is not None and not timer[1].done():
            timer[1].cancel()
        timer = (wake_at, asyncio.ensure_future(workflow.sleep(max(wake_at - workflow.now(), timedelta(milliseconds=1)), summary="watch")))
        life.watch_timer = timer
    await workflow.wait_condition(lambda: timer[1].done() or woken())


def _watch(life: Life):  # type: ignore[no-untyped-def]
    assert life.state.watch is not None
    return life.state.watch


def _held_after_the_ask(life: Life, facts: object) -> bool:
    """New facts came while the pool was asked (a do-not-disrupt pod, a pod that makes the node
    busy): judged with them, is the voluntary end no longer due?"""
    if life.state.facts is facts:
        return False
    _apply_facts(life)
    return judge_view(_watch(life), workflow.now(), life.timeouts).end is None


async def _disrupt_due(life: Life) -> EndReason | None:
    """The pool's `disrupt` (its replacement is Ready): the end to take now, or None while
    do-not-disrupt holds the node (DisruptionHeld, once per holder set) or a budget does."""
    state = life.state
    d, view = state.disrupt, _watch(life).view
    assert d is not None and view is not None
    end = DISRUPT_ENDS[d.reason]
    holders, holding = held_by(view)
    bound = disrupt_bound(life)
    overridden = ""
    if holders and bound is not None and workflow.now() >= bound:  # terminationGracePeriod: drift is eventual (Karpenter v1)
        overridden = f"; do-not-disrupt held it for its terminationGracePeriod ({human(life.timeouts.termination_grace)}): {', '.join(holders[:3])}"
        holders, holding = [], 0
    if holders:
        held = held_message(DisruptionReason(d.reason), holders, life.timeouts.termination_grace if bound else None, total=holding)
        if held != state.disrupt_held:
            state.disrupt_held = held
            workflow.logger.info("disruption held: %s", held)
            life.stamp(Stage.DISRUPTION_HELD, held)
            life.tell_pool()
        return None
    state.disrupt_held = ""
    facts = state.facts
    if not await _budget_allows(life, end) or state.disrupt is not d:
        return None  # refused, or called off while the pool was asked: it stays
    if state.facts is not facts:  # a do-not-disrupt pod that started during the ask holds it
        _apply_facts(life)
        after = _watch(life).view
        if after is not None and held_by(after)[0] and (bound is None or workflow.now() < bound):
            return None
    if d.replacement:
        state.end_reason = f"{end.value}: replaced by {d.replacement} (make-before-break){': ' + d.detail if d.detail else ''}{overridden}"
    else:  # a consolidation removal: its pods fit on the nodes that stay
        state.end_reason = f"{end.value}: {d.detail or 'consolidated'}"
    return end


def disrupt_bound(life: Life) -> datetime | None:
    """When the pool's `disrupt` goes over do-not-disrupt (tgp.disruption.eventual_end), if ever."""
    d = life.state.disrupt
    return eventual_end(d.reason, d.at, life.timeouts.termination_grace) if d is not None else None


async def _budget_allows(life: Life, end: EndReason) -> bool:
    """Whether a budgeted end may begin now: the pool is asked (bounded: a pool that is gone or
    does not answer does not hold the node). An activity, not a local one: facts that come
    during the ask are delivered before the answer is acted on (`_held_after_the_ask`)."""
    reason = BUDGETED_ENDS.get(end)
    if reason is None or not life.req.pool_workflow_id:
        return True
    if _budget_blocked(life):
        return False
    life.asking = reason.value
    try:
        answer = await life.call(
            NodeActivities.ask_pool_to_disrupt,
            PoolAsk(pool_workflow_id=life.req.pool_workflow_id, ask=DisruptionAsk(workflow_id=life.req.workflow_id, node_name=life.req.node_name, reason=reason.value)),
            timeout=POOL_ANSWER_TIMEOUT + timedelta(seconds=10),
            retry=API_RETRY,
            summary=f"ask the pool: {reason.value} disruption",
            local=False,
        )
    except ActivityError as exc:
        if life.cancel_requested():
            raise asyncio.CancelledError() from None
        workflow.logger.warning("could not ask the pool about the budget, going ahead: %s", describe(exc))
        answer = DisruptionAnswer(allowed=True)
    finally:
        life.asking = ""
    return take_answer(life, answer)


def take_answer(life: Life, answer: DisruptionAnswer) -> bool:
    """The pool's answer to a budget ask: allowed, or held until asked again (soon, when the pool
    could not take the ask; else after BUDGET_ASK_AGAIN, DisruptionBlocked once per message)."""
    watch = _watch(life)
    if answer.allowed:
        life.state.watch = watch.model_copy(update={"blocked_until": None, "blocked": ""})
        return True
    if answer.unasked:  # not a refusal: no DisruptionBlocked, ask again soon (jittered)
        soon = BUDGET_ASK_SOON * (1 + workflow.random().random())
        life.state.watch = watch.model_copy(update={"blocked_until": workflow.now() + soon})
        return False
    life.state.watch = watch.model_copy(update={"blocked_until": workflow.now() + BUDGET_ASK_AGAIN, "blocked": answer.message})
    if answer.message != watch.blocked:
        life.stamp(Stage.DISRUPTION_BLOCKED, answer.message)
        life.tell_pool()
    return False


def _asks_in_drain(life: Life, end: EndReason) -> bool:
    """A voluntary end (idle, expired) of a pool's node: its drain looks for holds and asks the
    pool's budgets itself (tgp's drain leaves the ask out for reasons budgets cannot refuse)."""
    return end in (EndReason.IDLE, EndReason.EXPIRED) and bool(life.req.pool_workflow_id)


def _budget_blocked(life: Life) -> bool:
    blocked_until = _watch(life).blocked_until
    return blocked_until is not None and workflow.now() < blocked_until


def _end_hold_when_busy(life: Life) -> None:
    """A node started with `hold_ends_when_busy`: the first workload pod the bridge shows on it
    ends its bind-grace hold (its pods bound), unless the pool has sent settings since the start
    (then the pool says). The pool models the same rule and sends nothing for it."""
    t, view = life.timeouts, _watch(life).view
    if not life.req.hold_ends_when_busy or life.state.settings_from_pool or t.bind_grace is None:
        return
    if view is not None and view.busy_pods > 0:
        life.state.timeouts = t.model_copy(update={"bind_grace": None})


def _seed_view(life: Life) -> None:
    """The first view, with the instance as the launch left it (running): the bridge's facts if
    they came during bring-up; else the launch's own look, which saw the Node Ready with its
    GPUs just now (`looked_at`; no pod could land before its labels were on). With neither, a
    look is due at once."""
    ref, now, watch = life.state.instance, workflow.now(), _watch(life)
    assert ref is not None
    if life.state.facts is None and watch.looked_at is None:
        life.state.watch = watch.model_copy(update={"looked_at": now - backstop_period(life.timeouts)})
        return
    running = Instance(provider=ref.provider, instance_id=ref.instance_id or "", name=ref.instance_name, state=InstanceState.RUNNING)
    if life.state.facts is not None:
        life.state.watch = watch.model_copy(update={"looked_at": now, "view": NodeObservation(instance=running, node=None, busy_pods=0)})
        return
    gpus = life.state.offer.gpu_count if life.state.offer else 1
    node = NodeSummary(name=life.req.node_name, ready=True, gpus=gpus)
    life.state.watch = apply_view(watch, NodeObservation(instance=running, node=node, busy_pods=0), now, life.timeouts)


def _backstop_due(life: Life) -> datetime:
    watch = _watch(life)
    return (watch.looked_at or watch.ready_at) + backstop_period(life.timeouts)


async def _look(life: Life) -> None:
    """Look for oneself (provider describe, Node, its pods) as a local activity: one marker
    event. A look that fails keeps the node (an outage is no reason to end a life)."""
    assert life.state.instance is not None
    try:
        obs: NodeObservation = await workflow.execute_local_activity_method(
            NodeActivities.observe_node,
            ObserveInput(instance=life.state.instance, node_name=life.req.node_name),
            start_to_close_timeout=life.timeouts.api_call,
            retry_policy=API_RETRY,
            summary="look",
        )
    except FailureError as exc:  # a local activity's failure comes unwrapped, as its cause
        if life.cancel_requested():
            raise asyncio.CancelledError() from None
        life.state.last_error = f"could not observe the node: {describe_failure(exc)}"
        life.state.watch = _watch(life).model_copy(update={"looked_at": workflow.now()})
        return
    now = workflow.now()
    life.state.watch = apply_view(_watch(life), obs, now, life.timeouts).model_copy(update={"looked_at": now})


def _apply_facts(life: Life) -> None:
    """Take the bridge's latest facts into the view, dated when the bridge saw them."""
    facts = life.state.facts
    if facts is None or facts == _watch(life).facts:
        return
    if _watch(life).view is None:
        _seed_view(life)
    view = _watch(life).view
    instance = view.instance if view is not None else None
    at = min(facts.at, workflow.now())
    life.state.watch = apply_view(_watch(life), facts_view(facts, instance), at, life.timeouts).model_copy(update={"facts": facts})
