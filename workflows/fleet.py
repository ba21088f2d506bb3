"""FleetLookWorkflow: one entity workflow per task queue (id `tgp-fleet-look/<queue>`, started by
every worker, kept if running) that looks at the fleet every FLEET_LOOK_EVERY: each provider
account that holds a Ready node's instance is listed once, and the nodes whose instance the
listing shows interrupted, stopped, failed, terminated or missing are told (activities.fleet).
This replaced every Ready node describing its own instance every 30 s (issue 20: 33 provider
requests a second at 1,000 nodes; Lambda allows about one a second per account).

Why an entity workflow and not a Schedule like the sweeper's: the look's state (which accounts
back off until when after a failed listing) lives in one place and survives a worker restart,
and a look a minute does not start a workflow a minute (1,440 executions a day in visibility).
It never fails on an activity error: a look that fails backs off and looks again; its history
stays small by continuing as new every LOOKS_PER_RUN looks.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from activities.fleet import FleetActivities, FleetLookInput, FleetLookResult
    from workflows.continuation import continue_as_new

# One look per task queue (an installation: its workers and the nodes they run), so that two
# installations sharing a Temporal namespace each keep theirs. Before, one id per namespace:
# each installation's worker start moved the other's look to its own queue.
FLEET_LOOK_ID = "tgp-fleet-look"  # the prefix; alone, the id of the looks of earlier releases


def fleet_look_id(task_queue: str) -> str:
    return f"{FLEET_LOOK_ID}/{task_queue}"

# How often each account is listed: a node's instance that the provider ended is noticed
# within this (plus the node's own describe). One list call per account per interval, which
# even Lambda's ~1 request/s per account affords beside launches and terminates.
FLEET_LOOK_EVERY = timedelta(minutes=1)
# One look: a paced, paged listing per account (Lambda's pacer: ~1 request/s) plus signals.
FLEET_LOOK_TIMEOUT = timedelta(minutes=5)
# After n failed listings in a row an account waits FLEET_LOOK_EVERY * 2^n (so it sits out at
# least the next look), at most this, or longer when the provider's Retry-After says so.
FLEET_BACKOFF_MAX = timedelta(minutes=15)
# About 8 history events per look: continue as new well before histories get long.
LOOKS_PER_RUN = 120
# The loop is the retry: an activity that failed is not retried blind inside the look.
ONE_TRY = RetryPolicy(maximum_attempts=1)
WHOLE_LOOK = "*"  # the backoff key of a look that failed as a whole (visibility unreadable)


class FleetState(BaseModel):
    """What survives continue-as-new: per account, failed listings in a row and until when it
    waits."""

    model_config = ConfigDict(extra="forbid")
    failures: dict[str, int] = {}
    due: dict[str, datetime] = {}


class FleetLookRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # None: FLEET_LOOK_EVERY of the code that runs the look, so a release that changes it
    # applies from the look's next run (it continues as new every LOOKS_PER_RUN looks).
    every: timedelta | None = None
    state: FleetState = FleetState()


def backoff(every: timedelta, failures: int, retry_after: float | None = None) -> timedelta:
    """How long an account waits after `failures` failed listings in a row."""
    wait = min(every * (2 ** min(failures, 16)), FLEET_BACKOFF_MAX)
    return max(wait, timedelta(seconds=retry_after or 0))


def after_look(state: FleetState, result: FleetLookResult, now: datetime, every: timedelta) -> FleetState:
    """The state after a look: accounts listed are well again, accounts that failed wait."""
    failures, due = dict(state.failures), {k: v for k, v in state.due.items() if v > now}
    failures.pop(WHOLE_LOOK, None)
    for look in result.accounts:
        if look.skipped:
            continue
        if look.failure is None:
            failures.pop(look.account, None)
            due.pop(look.account, None)
        else:
            failures[look.account] = failures.get(look.account, 0) + 1
            due[look.account] = now + backoff(every, failures[look.account], look.retry_after)
    return FleetState(failures=failures, due=due)


@workflow.defn(name="FleetLookWorkflow")
class FleetLookWorkflow:
    @workflow.run
    async def run(self, req: FleetLookRequest) -> None:
        state, every = req.state, req.every or FLEET_LOOK_EVERY
        for _ in range(LOOKS_PER_RUN):
            now = workflow.now()
            wait = every
            try:
                result = await workflow.execute_activity_method(
                    FleetActivities.look_at_fleet,
                    FleetLookInput(skip=sorted(k for k, at in state.due.items() if at > now), task_queue=workflow.info().task_queue),
                    start_to_close_timeout=FLEET_LOOK_TIMEOUT,
                    heartbeat_timeout=FLEET_LOOK_TIMEOUT,
                    retry_policy=ONE_TRY,
                    summary="look at the fleet",
                )
            except ActivityError as exc:
                failures = state.failures.get(WHOLE_LOOK, 0) + 1
                state = state.model_copy(update={"failures": {**state.failures, WHOLE_LOOK: failures}})
                wait = backoff(every, failures)
                workflow.logger.warning("fleet look failed (%d in a row), next in %s: %s", failures, wait, type(exc.cause).__name__)
            else:
                state = after_look(state, result, workflow.now(), every)
            await workflow.sleep(wait, summary="until the next fleet look")
            if workflow.info().is_target_worker_deployment_version_changed():
                break  # a safe point: onto the new build
        continue_as_new(FleetLookRequest(every=req.every, state=state))
