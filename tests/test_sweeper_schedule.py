"""The sweeper's Schedule follows the workers (issue 17, item 18): each worker brings it to its
own task queue and interval at start, and sweeps that stop completing are reported (the
`tgp_sweep_overdue` gauge and a `sweeps_overdue` log error), as when the Schedule was created
by a worker on a queue nobody polls any more. Real dev server; the sweeps run on a real worker
against the simulated world. `check_sweeps` takes the time it judges at, so nothing waits for
a clock: the overdue window is placed just before and just after a sweep's real completion."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone

import pytest
import structlog
from prometheus_client import REGISTRY
from temporalio.client import ScheduleActionStartWorkflow, ScheduleOverlapPolicy, WorkflowExecutionStatus
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world
from workers.main import SWEEP_OVERDUE_INTERVALS, SWEEPER_SCHEDULE_ID, check_sweeps, ensure_sweeper_schedule
from workflows.sweeper import SWEEP_EVERY

STUCK_QUEUE = "a-queue-no-worker-polls"


@pytest.fixture
async def no_schedule(temporal: WorkflowEnvironment) -> AsyncIterator[None]:
    """Each test starts without the Schedule and leaves neither it nor a sweep it started."""
    handle = temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID)
    try:
        await handle.delete()
    except RPCError:
        pass
    yield
    try:
        await handle.delete()
    except RPCError:
        pass
    async for w in temporal.client.list_workflows(f"TemporalScheduledById = '{SWEEPER_SCHEDULE_ID}' AND ExecutionStatus = 'Running'"):
        try:
            await temporal.client.get_workflow_handle(w.id, run_id=w.run_id).terminate("test finished")
        except RPCError:
            pass


async def test_the_schedule_follows_the_last_worker_to_start(temporal: WorkflowEnvironment, no_schedule: None) -> None:
    await ensure_sweeper_schedule(temporal.client, STUCK_QUEUE)  # one worker started with --task-queue
    handle = temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID)
    await handle.pause(note="by hand")
    await ensure_sweeper_schedule(temporal.client, "tgp", every=timedelta(minutes=5))  # then the usual ones

    desc = await handle.describe()
    action = desc.schedule.action
    assert isinstance(action, ScheduleActionStartWorkflow) and action.task_queue == "tgp"
    assert [i.every for i in desc.schedule.spec.intervals] == [timedelta(minutes=5)]
    assert desc.schedule.state.paused, "a pause set by hand stays"
    assert desc.schedule.policy.overlap is ScheduleOverlapPolicy.SKIP

    await ensure_sweeper_schedule(temporal.client, "tgp", every=timedelta(minutes=5))  # nothing to change
    assert (await handle.describe()).info.last_updated_at == desc.info.last_updated_at


def overdue_gauge() -> float | None:
    return REGISTRY.get_sample_value("tgp_sweep_overdue")


async def test_sweeps_that_stop_completing_are_a_metric_and_an_error(temporal: WorkflowEnvironment, no_schedule: None) -> None:
    client = temporal.client
    window = SWEEP_OVERDUE_INTERVALS * SWEEP_EVERY
    async with running_world(temporal) as (_, _, queue):
        # The Schedule sends its sweeps to a queue nobody polls: the sweep it starts never runs.
        await ensure_sweeper_schedule(client, STUCK_QUEUE)
        handle = client.get_schedule_handle(SWEEPER_SCHEDULE_ID)
        await handle.trigger()
        later = datetime.now(timezone.utc) + window + SWEEP_EVERY
        with structlog.testing.capture_logs() as logs:
            assert await check_sweeps(client, now=later)
        assert overdue_gauge() == 1
        [error] = [e for e in logs if e["event"] == "sweeps_overdue"]
        assert error["log_level"] == "error" and error["task_queue"] == STUCK_QUEUE and error["running"] == 1

        # A worker on the real queue starts: the Schedule follows it, the sweep stuck on the old
        # queue (which, with overlap SKIP, would hold back every later one) ends, and the next
        # sweep completes.
        await ensure_sweeper_schedule(client, queue)

        async def stuck_sweep_ended() -> bool:
            return not (await handle.describe()).info.running_actions

        await eventually(stuck_sweep_ended, timeout=30, what="the sweep stuck on the old queue to end")
        await handle.trigger()

        async def completed() -> datetime | None:
            query = f"TemporalScheduledById = '{SWEEPER_SCHEDULE_ID}' AND TaskQueue = '{queue}'"
            done = [w async for w in client.list_workflows(query) if w.status is WorkflowExecutionStatus.COMPLETED]
            return done[0].close_time if done else None

        closed = await eventually(completed, timeout=60, what="a sweep on the worker's queue to complete")
        assert not await check_sweeps(client, now=closed + window - timedelta(milliseconds=1))
        assert overdue_gauge() == 0
        # Two intervals after that sweep, with none since, it is overdue again.
        assert await check_sweeps(client, now=closed + window + timedelta(seconds=1))
        assert overdue_gauge() == 1


async def test_a_missing_schedule_is_overdue(temporal: WorkflowEnvironment, no_schedule: None) -> None:
    with structlog.testing.capture_logs() as logs:
        assert await check_sweeps(temporal.client)
    assert overdue_gauge() == 1 and [e["event"] for e in logs] == ["sweeps_overdue"]
