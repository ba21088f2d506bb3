"""The fleet look's workflow: it never fails on an activity error, an account whose listing
failed sits out looks for a growing while, and the history stays small (continue-as-new).
The activity here is a stand-in that plays a throttled provider's outcomes (the real activity
against the simulated cloud: tests/test_fleet_look.py)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.conftest import skip_time
from activities.fleet import AccountLook, FleetLookInput, FleetLookResult
from workflows.fleet import FLEET_BACKOFF_MAX, LOOKS_PER_RUN, FleetLookRequest, FleetLookWorkflow, FleetState, after_look, backoff

EVERY = timedelta(minutes=1)
T0 = datetime(2026, 11, 24, 9, 0, tzinfo=timezone.utc)


def test_backoff_grows_from_two_intervals_and_is_capped_and_honours_retry_after() -> None:
    assert [backoff(EVERY, n) for n in (1, 2, 3)] == [timedelta(minutes=2), timedelta(minutes=4), timedelta(minutes=8)]
    assert backoff(EVERY, 60) == FLEET_BACKOFF_MAX
    assert backoff(EVERY, 1, retry_after=600) == timedelta(minutes=10)


def test_an_account_listed_again_is_well_and_one_that_failed_waits() -> None:
    state = FleetState(failures={"lambdalabs": 2, "*": 1}, due={"lambdalabs": T0 - timedelta(seconds=1)})
    result = FleetLookResult(
        accounts=[AccountLook(account="lambdalabs", provider="lambdalabs"), AccountLook(account="vastai", provider="vastai", failure="TransientError")]
    )
    after = after_look(state, result, T0, EVERY)
    assert after.failures == {"vastai": 1} and after.due == {"vastai": T0 + timedelta(minutes=2)}


ACCOUNTS = ["runpod", "lambdalabs", "vastai:ml/team/key"]


@given(
    looks=st.lists(
        st.tuples(
            st.integers(min_value=1, max_value=600),  # seconds until this look
            st.lists(st.tuples(st.sampled_from(ACCOUNTS), st.booleans(), st.one_of(st.none(), st.integers(0, 3600))), max_size=3, unique_by=lambda t: t[0]),
        ),
        max_size=12,
    )
)
def test_an_account_is_skipped_exactly_while_it_backs_off(looks: list[tuple[int, list[tuple[str, bool, int | None]]]]) -> None:
    """Over any run of looks (each account listed well or failing, with or without a
    Retry-After): an account waits only after a failure, at least two intervals and at least
    its Retry-After, at most the cap (or that Retry-After); a listing that worked clears it."""
    state, now = FleetState(), T0
    for gap, outcomes in looks:
        now += timedelta(seconds=gap)
        skip = {k for k, at in state.due.items() if at > now}
        accounts = [
            AccountLook(account=a, provider=a.split(":")[0], skipped=a in skip, failure=None if ok or a in skip else "TransientError", retry_after=ra)
            for a, ok, ra in outcomes
        ]
        after = after_look(state, FleetLookResult(accounts=accounts), now, EVERY)
        for look in accounts:
            if look.skipped:
                assert after.due.get(look.account) == state.due[look.account], "a skipped account keeps its wait"
            elif look.failure is None:
                assert look.account not in after.due and look.account not in after.failures, "listed well: no wait"
            else:
                wait = after.due[look.account] - now
                assert wait >= 2 * EVERY and wait >= timedelta(seconds=look.retry_after or 0)
                assert wait <= max(FLEET_BACKOFF_MAX, timedelta(seconds=look.retry_after or 0))
                assert after.failures[look.account] == state.failures.get(look.account, 0) + 1
        assert all(at > now for at in after.due.values()), "past waits are forgotten"
        state = after


@dataclass
class Throttled:
    """Plays the look's outcomes: the first look fails as a whole (visibility down), then the
    account `lambdalabs` answers 429 to its first two listings; `simulated` is always well."""

    calls: list[tuple[datetime, list[str]]] = field(default_factory=list)
    lambda_listings: int = 0

    @activity.defn(name="look_at_fleet")
    async def look_at_fleet(self, inp: FleetLookInput) -> FleetLookResult:
        self.calls.append((activity.info().scheduled_time, list(inp.skip)))
        if len(self.calls) == 1:
            raise ApplicationError("could not list the running node workflows (UNAVAILABLE)", type="TransientError")
        accounts = [AccountLook(account="simulated", provider="simulated", listed=3)]
        if "lambdalabs" in inp.skip:
            accounts.append(AccountLook(account="lambdalabs", provider="lambdalabs", skipped=True))
        else:
            self.lambda_listings += 1
            failed = self.lambda_listings <= 2
            accounts.append(AccountLook(account="lambdalabs", provider="lambdalabs", failure="TransientError" if failed else None))
        return FleetLookResult(nodes=3, accounts=accounts)


async def test_the_look_survives_failures_backs_off_per_account_and_continues_as_new(time_skipping: WorkflowEnvironment) -> None:
    queue = f"fleet-{uuid.uuid4().hex[:8]}"
    stand_in = Throttled()
    async with Worker(time_skipping.client, task_queue=queue, workflows=[FleetLookWorkflow], activities=[stand_in.look_at_fleet]):
        handle = await time_skipping.client.start_workflow(
            FleetLookWorkflow.run, FleetLookRequest(every=EVERY), id=f"fleet-look-{uuid.uuid4().hex[:6]}", task_queue=queue
        )
        await skip_time(time_skipping, EVERY * (LOOKS_PER_RUN + 30), step=EVERY * 20)
        desc = await time_skipping.client.get_workflow_handle(handle.id).describe()
        await handle.terminate("test finished")

    assert desc.status is WorkflowExecutionStatus.RUNNING, "an activity error never ends the look"
    assert desc.run_id != handle.result_run_id, "it continued as new: its history stays small"
    times = [at for at, _ in stand_in.calls]
    assert times[1] - times[0] >= backoff(EVERY, 1), "a look that failed as a whole backs off"
    listed = [at for at, skip in stand_in.calls[1:] if "lambdalabs" not in skip]
    assert listed[1] - listed[0] >= backoff(EVERY, 1) and listed[2] - listed[1] >= backoff(EVERY, 2), "the throttled account waits longer each time"
    assert all(at2 - at1 <= EVERY + timedelta(seconds=5) for at1, at2 in zip(listed[2:], listed[3:])), "listed every interval once well"
    assert len(stand_in.calls) > LOOKS_PER_RUN


async def test_every_worker_start_keeps_one_fleet_look_on_its_task_queue(temporal: WorkflowEnvironment) -> None:
    """A second worker starting keeps the running look; a worker on another task queue moves it
    there (a look left on a queue no worker polls would never run)."""
    from workers.main import ensure_fleet_look

    look_id = f"fleet-look-{uuid.uuid4().hex[:6]}"
    await ensure_fleet_look(temporal.client, "queue-a", workflow_id=look_id)
    first = await temporal.client.get_workflow_handle(look_id).describe()
    await ensure_fleet_look(temporal.client, "queue-a", workflow_id=look_id)
    again = await temporal.client.get_workflow_handle(look_id).describe()
    assert again.run_id == first.run_id and again.status is WorkflowExecutionStatus.RUNNING

    await ensure_fleet_look(temporal.client, "queue-b", workflow_id=look_id)
    moved = await temporal.client.get_workflow_handle(look_id).describe()
    assert moved.task_queue == "queue-b" and moved.status is WorkflowExecutionStatus.RUNNING
    await temporal.client.get_workflow_handle(look_id).terminate("test finished")


async def test_two_installations_on_one_namespace_each_keep_their_fleet_look(temporal: WorkflowEnvironment) -> None:
    """Review #7: two installations (task queues) sharing a Temporal namespace: their workers'
    starts, interleaved, leave each its own look on its own queue, never moved or restarted.
    The namespace-wide look of earlier releases is ended where it ran on the starting worker's
    queue (it would look twice there) and left alone on another installation's."""
    from workers.main import ensure_fleet_look
    from workflows.fleet import FLEET_LOOK_ID, fleet_look_id

    a, b = f"install-a-{uuid.uuid4().hex[:6]}", f"install-b-{uuid.uuid4().hex[:6]}"
    legacy = await temporal.client.start_workflow(FleetLookWorkflow.run, FleetLookRequest(), id=FLEET_LOOK_ID, task_queue=b)
    try:
        await ensure_fleet_look(temporal.client, a)
        assert (await legacy.describe()).status is WorkflowExecutionStatus.RUNNING, "another installation's look was ended"
        await ensure_fleet_look(temporal.client, b)
        assert (await legacy.describe()).status is WorkflowExecutionStatus.TERMINATED, "the old namespace-wide look still runs beside the new one"
        first = {q: await temporal.client.get_workflow_handle(fleet_look_id(q)).describe() for q in (a, b)}
        for q in (a, b, a, b):  # workers of both installations restarting, in turns
            await ensure_fleet_look(temporal.client, q)
        for q in (a, b):
            now = await temporal.client.get_workflow_handle(fleet_look_id(q)).describe()
            assert now.task_queue == q and now.status is WorkflowExecutionStatus.RUNNING, f"{q}'s look moved: {now.task_queue} {now.status}"
            assert now.run_id == first[q].run_id, f"{q}'s look was restarted by the other installation's worker"
    finally:
        for wid in (fleet_look_id(a), fleet_look_id(b)):
            await temporal.client.get_workflow_handle(wid).terminate("test finished")
        if (await legacy.describe()).status is WorkflowExecutionStatus.RUNNING:
            await legacy.terminate("test finished")
