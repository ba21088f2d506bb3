"""Drain: cordon and evict the node's pods (Eviction API, PDB-aware), bounded by the drain
timeout and the pool's terminationGracePeriod. A voluntary end's drain asks the pool's budgets
first and looks again for do-not-disrupt after its cordon; it may be refused or called off, and
the node is Ready again. A drain that goes ends with the current attempt's release, so billing
stops at the drain's end (a terminate not confirmed there is left to the workflow's release)."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.node import DRAIN_RELEASE_BOUND, POOL_ANSWER_TIMEOUT, DrainOutcome, DrainRelease, NodeActivities
    from tgp.disruption import termination_deadline
    from tgp.lifecycle import BUDGETED_ENDS, EndReason, apply_view, longest_life
    from tgp.messages import DisruptionAsk, PoolAsk
    from tgp.types import DrainInput, DrainResult, NodePhase, Stage
    from workflows.entity import describe
    from workflows.node.life import Life, human
    from workflows.node.release import last_release, release_input
    from workflows.node.watch import disrupt_bound, take_answer
    from workflows.retries import API_RETRY


async def drain(life: Life, end: EndReason) -> bool:
    """Drain the node; False when the drain was refused by a budget or called off (a workload
    pod arrived, or do-not-disrupt came): the node is Ready again. An idle node's drain moves no
    workload pod: its search attribute (a visibility write and an action) stays Ready until the end."""
    shown = end is not EndReason.IDLE
    life.enter(NodePhase.DRAINING, upsert=shown)
    report = life.tell_pool(carry=True)
    inp, release = _drain_input(life, end), release_input(life)
    # A node that goes is released by its drain (one activity and task fewer), Terminating reported.
    # The end's report too if this release is the life's last.
    told = life.report_ahead(NodePhase.TERMINATED) if last_release(life) else None
    then = DrainRelease(release=release, report=life.report_ahead(NodePhase.TERMINATING), end=told, at=workflow.now()) if release is not None else None
    result: DrainOutcome = await workflow.execute_activity_method(
        NodeActivities.drain_node,
        args=[inp, report, then],
        # An activity: it may wait on pods (heartbeating), and the window between its schedule
        # and its end is the Draining that the pool's budgets count.
        start_to_close_timeout=inp.timeout + life.timeouts.api_call
        + (POOL_ANSWER_TIMEOUT if inp.ask else timedelta(0)) + (DRAIN_RELEASE_BOUND if then else timedelta(0)),
        heartbeat_timeout=life.timeouts.api_call,
        retry_policy=API_RETRY,
        summary="drain",
    )
    if result.answer is not None and not result.answer.allowed:
        # The budgets said not now; nothing was touched (nor reported: the pool has it Ready).
        _ready_again(life, shown, tell=False)
        take_answer(life, result.answer)
        return False
    if result.held and not result.called_off:
        watch = life.state.watch
        if watch is not None and watch.view is not None:  # held until the bridge says otherwise
            held = watch.view.model_copy(update={"holders": result.held, "holding": max(watch.view.holding, len(result.held))})
            life.state.watch = apply_view(watch, held, workflow.now(), life.timeouts)
        workflow.logger.info("drain called off, do-not-disrupt holds the node: %s", ", ".join(result.held))
        _ready_again(life, shown)
        return False
    _say_what_stayed(life, result, inp)
    life.drained = result if result.released is not None else None
    if result.called_off:
        arrived = ", ".join(result.called_off)
        workflow.logger.info("drain called off, %s arrived after the idle verdict: watching again", arrived)
        life.stamp(Stage.DRAIN_CALLED_OFF, f"{arrived} arrived on the node after it was judged idle")
        watch = life.state.watch
        assert watch is not None
        watch = watch.model_copy(update={"idle_since": None})
        if watch.view is not None:  # busy until the bridge says otherwise
            busy = watch.view.model_copy(update={"busy_pods": max(watch.view.busy_pods, len(result.called_off))})
            watch = apply_view(watch, busy, workflow.now(), life.timeouts)
        life.state.watch = watch
        _ready_again(life, shown)
        return False
    return True


def _drain_input(life: Life, end: EndReason) -> DrainInput:
    """The drain's bounds and asks. The pool's terminationGracePeriod bounds it from when it
    began (and an expired node's life at expireAfter + terminationGracePeriod): at the deadline
    the instance is terminated, over PDBs and do-not-disrupt pods."""
    began, t = workflow.now(), life.timeouts
    timeout, bound = t.drain, ""
    deadline = termination_deadline(began, t.termination_grace)
    lifetime = longest_life(life.state.watch, t) if end is EndReason.EXPIRED and life.state.watch is not None else None
    if end is EndReason.DRIFTED:
        lifetime = disrupt_bound(life)  # a held drift's drain ends with its terminationGracePeriod too
    if deadline is not None and lifetime is not None:
        deadline = max(began, min(deadline, lifetime))
    if deadline is not None and deadline - began < timeout:
        timeout, bound = deadline - began, "terminationGracePeriod"
    ask, holds = None, False
    if end in (EndReason.IDLE, EndReason.EXPIRED) and life.req.pool_workflow_id:
        reason = BUDGETED_ENDS[end].value
        holds = not (lifetime is not None and began >= lifetime)  # do-not-disrupt holds no longer than that
        if reason not in t.unlimited_reasons:  # a reason the budgets can never refuse is not asked
            ask = PoolAsk(
                pool_workflow_id=life.req.pool_workflow_id,
                ask=DisruptionAsk(workflow_id=life.req.workflow_id, node_name=life.req.node_name, reason=reason),
            )
    return DrainInput(
        node_name=life.req.node_name,
        timeout=timeout,
        revalidate=end is EndReason.IDLE,  # an idle node looks again after the cordon (a pod may have come)
        bound=bound,
        delete_at_deadline=bool(bound),
        ask=ask,
        holds=holds,
    )


def _say_what_stayed(life: Life, result: DrainResult, inp: DrainInput) -> None:
    """Pods the drain could not move: the node's last error and a DrainTimedOut record."""
    stuck = [
        *([f"not evicted (disruption budget?): {', '.join(result.remaining)}"] if result.remaining else []),
        *([f"still shutting down: {', '.join(result.terminating)}"] if result.terminating else []),
    ]
    if result.deleted:  # deleted over their PDBs at the deadline minus their own grace (Karpenter's rule)
        stuck.insert(0, f"deleted at the deadline minus their terminationGracePeriodSeconds: {', '.join(result.deleted)}")
    if stuck and inp.bound:
        left = "terminated with pods still on the node" if result.remaining or result.terminating else "its last pods deleted"
        why = f"terminationGracePeriod ({human(inp.timeout)}) ended the drain; {left}, over their PodDisruptionBudgets and do-not-disrupt"
        life.state.last_error = f"{why}; {'; '.join(stuck)}"
        life.stamp(Stage.DRAIN_TIMED_OUT, f"{why}: {'; '.join(stuck)}")
    elif stuck:
        drain = life.timeouts.drain
        life.state.last_error = f"drain timed out after {drain}; terminated with pods still on the node; {'; '.join(stuck)}"
        life.stamp(Stage.DRAIN_TIMED_OUT, f"timed out after {human(drain)}; terminated with pods still on the node: {'; '.join(stuck)}")


def _ready_again(life: Life, shown: bool, *, tell: bool = True) -> None:
    life.state.end_reason = None
    life.enter(NodePhase.READY, upsert=shown)  # the search attribute, if it said Draining
    if tell:
        life.tell_pool()


async def drain_before_ready(life: Life) -> None:
    """Evicted before Ready, with workload pods already on the Node (the bridge says so): drain
    them rather than kill them. A failed drain does not keep the instance (the release follows)."""
    facts = life.state.facts
    if life.state.phase is NodePhase.READY or facts is None or not facts.present or facts.busy_pods == 0:
        return
    try:
        await drain(life, EndReason.EVICTED)
    except ActivityError as exc:
        if life.cancel_requested():
            raise asyncio.CancelledError() from None
        workflow.logger.warning("the drain of a node evicted before Ready failed; terminating: %s", describe(exc))
