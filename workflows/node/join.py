"""Join: the instance runs and its device joins the tailnet (the launch activity's wait once it
has bought, which also ends twins over the provider's consistency window), then the Node is
Ready and its GPUs are registered (told by the bridge's `node_facts`, with backstop looks of the
node's own).

Each stage has its own deadline and failure reason. At a deadline the node looks once more
(the instance booted on its own clock all along) and keeps what is in fact up; otherwise the
attempt fails over to the next offer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.node import NodeActivities
    from tgp.lifecycle import backstop_period
    from tgp.types import GPU_RESOURCE, LaunchResult, NodeFacts, NodePhase, Stage, StageCheck, StageLook, TwinWatchInput
    from workflows.entity import describe
    from workflows.node.life import Life, LaunchAttemptFailed, human
    from workflows.retries import API_RETRY

# A join that heard nothing from the bridge looks for itself this often (or every watch interval
# if shorter): a lost signal, or a Node registered without the pool's labels, which the bridge
# does not follow.
JOIN_BACKSTOP = timedelta(seconds=30)
# Until the bridge has told the node anything (the Node not registered yet, or no bridge at all)
# the looks come sooner: after JOIN_FIRST_LOOK, doubling up to JOIN_BACKSTOP, so a node nobody
# tells is Ready a few seconds late, not half a minute.
JOIN_FIRST_LOOK = timedelta(seconds=2)


async def join(life: Life, launched: LaunchResult) -> None:
    """The join after the launch's wait (the instance runs, its device joined, a first look at
    the Node): the Node Ready, then its GPUs, each with its own timeout and failure reason."""
    joined = launched.join
    waits = joined is not None and joined.error is None and not (joined.node is not None and joined.node.up)
    # Its search attribute only if the join waits on here (for the Node, its GPUs): the launch's
    # activity waited for the tailnet under Launching, and a Node up at once is Ready next.
    life.enter(NodePhase.JOINING, upsert=waits, at=launched.joining_at)
    if joined is None or joined.error is not None:
        raise LaunchAttemptFailed(joined.error if joined else "the join's wait ended without an answer")
    t, req = life.timeouts, life.req
    gpus = life.state.offer.gpu_count if life.state.offer else 1
    if joined.twins is not None:
        for ref in joined.twins:
            life.remember(ref)
    else:  # the window is not over: the rest of it in the background
        life.twin_watch = asyncio.ensure_future(watch_for_twins(life))
    life.stamp(Stage.TAILNET_JOINED)
    if joined.node is not None and joined.node.up:
        life.check_evicted()
        life.stamp(Stage.NODE_READY)
        life.stamp(Stage.GPUS_REGISTERED)
        return
    await wait_for_facts(
        life,
        lambda f: f.present and f.ready,
        timeout=t.node_ready,
        summary="Node Ready",
        timeout_error="join timeout: the Node did not become Ready within {} (kubelet registration or GPU driver)",
        recheck=StageCheck(instance=life.state.instance, node_name=req.node_name),
    )
    life.stamp(Stage.NODE_READY)
    await wait_for_facts(
        life,
        lambda f: f.present and f.ready and f.gpus >= gpus,
        timeout=t.gpu_registration,
        summary=f"{gpus} GPUs registered",
        timeout_error=f"join timeout: the Node's allocatable {GPU_RESOURCE} did not reach {gpus} within {{}} (GPU driver or device plugin)",
        recheck=StageCheck(instance=life.state.instance, node_name=req.node_name, gpus=gpus),
    )
    life.stamp(Stage.GPUS_REGISTERED)


def twin_input(life: Life) -> TwinWatchInput:
    assert life.state.instance is not None
    return TwinWatchInput(instances=list(life.state.seen), keep=life.state.instance.instance_id)


async def watch_for_twins(life: Life) -> None:
    """In the background: end every instance under the node's names but the recorded one until
    the provider's consistency window has passed (a create can land after its caller gave up),
    and remember every id seen. A failure leaves it to the release and the sweeper."""
    try:
        refs = await workflow.execute_activity_method(
            NodeActivities.watch_for_twins,
            twin_input(life),
            start_to_close_timeout=life.timeouts.launch + life.timeouts.api_call,
            heartbeat_timeout=life.heartbeat(),
            retry_policy=API_RETRY,
            summary="end twins over the consistency window",
        )
    except ActivityError as exc:
        workflow.logger.warning("looking for twins failed; the release and the sweeper end them: %s", describe(exc))
        return
    for ref in refs:
        life.remember(ref)


async def wait_for_facts(life: Life, up: Callable[[NodeFacts], bool], *, timeout: timedelta, summary: str, timeout_error: str, recheck: StageCheck) -> None:
    """Wait for a stage on the bridge's `node_facts` (no poll) until its deadline or an `evict`.
    One durable timer at a time: at the deadline, or a backstop look sooner (JOIN_FIRST_LOOK,
    doubling to JOIN_BACKSTOP): a lost signal, or a Node the bridge does not follow, costs a
    backstop period, not the node."""
    deadline = workflow.now() + timeout
    quiet = JOIN_FIRST_LOOK  # the next look's delay while the bridge has said nothing
    while not _facts_up(life, up):
        life.check_evicted()
        now = workflow.now()
        if now >= deadline:
            await _last_look(life, recheck, summary=summary, failure=timeout_error.format(human(timeout)))
            return
        period = JOIN_BACKSTOP if life.state.facts is not None else quiet
        if await _woken_by_facts(life, up, min(deadline, now + min(period, backstop_period(life.timeouts))), summary):
            continue
        if workflow.now() < deadline:
            quiet = min(quiet * 2, JOIN_BACKSTOP)
            look = await check_stage(life, recheck)  # the backstop
            if look is not None and look.up:
                workflow.logger.info("%s: seen by the backstop look (no facts from the bridge): %s", summary, look.seen)
                return
    life.check_evicted()


def _facts_up(life: Life, up: Callable[[NodeFacts], bool]) -> bool:
    return life.state.facts is not None and up(life.state.facts)


async def _woken_by_facts(life: Life, up: Callable[[NodeFacts], bool], wake: datetime, summary: str) -> bool:
    """Sleep until `wake`; True when facts that show the stage up (or an evict) came first."""
    timer = asyncio.ensure_future(workflow.sleep(wake - workflow.now(), summary=f"wait for {summary}"))
    facts = life.state.facts
    try:
        await workflow.wait_condition(
            lambda: timer.done() or life.state.evict_reason is not None or (life.state.facts is not facts and _facts_up(life, up))
        )
    finally:
        if not timer.done():
            timer.cancel()
    return not timer.done() or _facts_up(life, up)


async def _last_look(life: Life, recheck: StageCheck, *, summary: str, failure: str) -> None:
    """A stage's deadline passed: look once more and keep what is in fact up; else fail the
    stage over, saying what the look saw."""
    look = await check_stage(life, recheck)
    if look is not None and look.up:
        workflow.logger.info("%s: deadline passed, but %s: kept", summary, look.seen)
        return
    raise LaunchAttemptFailed(failure + (f"; at the deadline {look.seen}" if look is not None else ""))


async def check_stage(life: Life, recheck: StageCheck) -> StageLook | None:
    """A look at a stage (provider, tailnet, Node); None if even that look failed."""
    try:
        look: StageLook = await life.call(
            NodeActivities.check_stage, recheck, timeout=life.timeouts.api_call, retry=API_RETRY, summary="look at the stage"
        )
        return look
    except ActivityError as exc:
        if life.cancel_requested():
            raise asyncio.CancelledError() from None
        life.state.last_error = f"the last look at the stage deadline failed: {describe(exc)}"
        return None
