"""Release: the way out of every path. Terminate whatever any attempt may have bought (verified:
done only when a read shows it terminated or gone), remove the tailnet device and key, delete
the Node, give the place back to the class ledger; then end in the final phase once the pool has
every report. A cancel that lands meanwhile does not stop the cleanup half-way."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.node import RELEASE_STEP_TIMEOUT, REPORT_WAIT, NodeActivities, ReleaseInput, ReleaseResult
    from activities.node_class import LedgerCall, NodeClassActivities
    from activities.termination import VERIFY_FOR
    from tgp.messages import PoolReport
    from tgp.types import InstanceRef, NodePhase, Stage, TailnetCleanupInput
    from workflows.node.life import Life, human
    from workflows.retries import CLEANUP_RETRY


async def finish(life: Life, final: NodePhase) -> NodePhase:
    """Release what was bought, then end in `final`, or Cancelled if a cancel came meanwhile
    (the cleanup runs shielded in its own task and is awaited to its end either way)."""
    cleanup = asyncio.ensure_future(release_all(life))
    try:
        await asyncio.shield(cleanup)
    except asyncio.CancelledError:
        await cleanup
        final = NodePhase.CANCELLED
    life.enter(final)
    if not (final is NodePhase.TERMINATED and life.drained is not None and life.drained.ended_at is not None):
        life.tell_pool()  # unless the drain's release told the pool this end already
    await asyncio.gather(*life.reports)  # the pool has every report, this last one included
    await workflow.wait_condition(workflow.all_handlers_finished)
    return final


async def release_all(life: Life) -> None:
    """Terminate what every attempt may have bought (the current one's already, if its drain
    released it), and give the class its place back."""
    state, drained, earlier = life.state, life.drained, _earlier(life)
    done = drained.released if drained is not None else None
    class_waits = bool(life.req.class_workflow_id) and not (done is not None and done.released)
    # Upserted only if waited in: else the end phase, in this same task, is the one to find.
    cleanup_waits = done is not None and not (done.tailnet_cleaned and done.node_deleted)
    waits = bool(earlier) or class_waits or cleanup_waits or (bool(state.attempts) and done is None)
    life.enter(NodePhase.TERMINATING, upsert=waits, at=drained.released_at if drained is not None else None)
    # A drain that released carried its Terminating report; this stamp goes with the end's.
    report = life.tell_pool(carry=bool(state.attempts) and state.instance is not None) if done is None else None
    released = False
    if state.attempts:
        # The ledger's release goes with the life's last terminate (never before one).
        released = await release_attempt(life, report, ledger=None if earlier else life.ledger_call(state.offer), done=done)
        for ref in earlier:  # every earlier attempt's name too: a late create may have landed
            await _terminate(life, ref)
        life.stamp(Stage.RELEASED)
    if life.req.class_workflow_id and not released:
        ledger = life.ledger_call(state.offer)
        await life.call(NodeClassActivities.release_reservation, ledger, timeout=life.timeouts.api_call, retry=CLEANUP_RETRY, local=False, summary="release class budget")


def _earlier(life: Life) -> list[InstanceRef]:
    current = life.state.instance.instance_name if life.state.instance else None
    return [ref for ref in life.state.seen if ref.instance_name != current]


def _tailnet(life: Life) -> TailnetCleanupInput:
    req = life.req
    return TailnetCleanupInput(hostname=req.node_name, tags=req.tailnet_tags, key_ids=life.state.key_ids, tailnet=req.tailnet, tailnet_ref=req.tailnet_ref)


def last_release(life: Life) -> bool:
    """Whether the current attempt's release is the life's last: no earlier attempt's name to end."""
    return not _earlier(life)


def release_input(life: Life) -> ReleaseInput | None:
    """The current attempt's release, for its drain (with the class ledger's, if the life's last)."""
    if life.state.instance is None:
        return None
    ledger = life.ledger_call(life.state.offer) if last_release(life) else None
    return ReleaseInput(instance=life.state.instance, tailnet=_tailnet(life), node_name=life.req.node_name, ledger=ledger)


async def release_attempt(life: Life, report: PoolReport | None = None, ledger: LedgerCall | None = None, done: ReleaseResult | None = None) -> bool:
    """Give back everything the current attempt bought: instance, tailnet key and device, Node.
    One activity (`release_attempt`, or the drain's: `done`) does every step it can; what it
    could not, is done here. `report` goes with the terminate, `ledger` (the life's last
    release) too. Whether the ledger's release was made."""
    life.stop_twin_watch()
    state, req, tailnet = life.state, life.req, _tailnet(life)
    if done is None and state.instance is not None:
        done = await _release(life, ReleaseInput(instance=state.instance, tailnet=tailnet, node_name=req.node_name, ledger=ledger), report)
    done = done or ReleaseResult(anything_seen=False)
    if not done.tailnet_cleaned:
        await life.call(NodeActivities.remove_from_tailnet, tailnet, timeout=life.timeouts.api_call, retry=CLEANUP_RETRY, summary="remove from tailnet")
    if not done.node_deleted:
        await life.call(NodeActivities.delete_node, req.node_name, timeout=life.timeouts.api_call, retry=CLEANUP_RETRY, summary="delete Node")
    state.key_ids = []
    state.facts = None  # they were the deleted Node's: the next attempt's join waits for its own
    return done.released


async def _release(life: Life, rest: ReleaseInput, report: PoolReport | None) -> ReleaseResult:
    """The release activity, until the provider confirms. It says itself when it is stuck past
    `termination_stuck`: then TerminationStuck shows (search attribute, pool Event) while it is
    made again, until it succeeds. An activity, not a local one: a signal that lands as it
    completes re-decides nothing."""
    timeout = life.timeouts.api_call + VERIFY_FOR + 3 * RELEASE_STEP_TIMEOUT + REPORT_WAIT
    first = rest.model_copy(update={"stuck_at": workflow.now() + life.timeouts.termination_stuck})
    result: ReleaseResult = await _start(life, NodeActivities.release_attempt, [first, report], timeout)
    if not result.stuck:
        return result
    return await _while_stuck(life, rest.instance, _start(life, NodeActivities.release_attempt, [rest, None], timeout))


async def _terminate(life: Life, ref: InstanceRef) -> None:
    """Terminate an earlier attempt's instance until the provider confirms (TerminationStuck
    shown past `termination_stuck`)."""
    handle = _start(life, NodeActivities.terminate_instance, [ref, None], life.timeouts.api_call + VERIFY_FOR)
    done, _ = await workflow.wait([handle], timeout=life.timeouts.termination_stuck.total_seconds())
    if not done:
        await _while_stuck(life, ref, handle)


async def _while_stuck(life: Life, ref: InstanceRef, handle: Any) -> Any:
    state = life.state
    before, error = state.phase, state.last_error
    state.last_error = (
        f"{ref.provider} has not confirmed the termination of {ref.instance_id or ref.instance_name} after "
        f"{human(life.timeouts.termination_stuck)}; still retrying (the pending activity shows the provider's answer)"
    )
    life.enter(NodePhase.TERMINATION_STUCK)
    life.tell_pool()
    result = await handle
    state.last_error = error
    life.enter(before)
    life.tell_pool()
    return result


def _start(life: Life, activity: Any, args: list[Any], timeout: timedelta) -> Any:
    return workflow.start_activity_method(
        activity, args=args, start_to_close_timeout=timeout, heartbeat_timeout=life.heartbeat(), retry_policy=CLEANUP_RETRY, summary="terminate instance"
    )
