"""SweeperWorkflow: on a Temporal Schedule, remove instances and tailnet devices that carry
tgp's marks but belong to no running node workflow (or are not the instance a running node
recorded), after a grace period (so a node that is just starting is never swept); each
termination is verified by reading the instance. Then the account keys kept for nodes that have
all ended are forgotten (activities.kept_accounts)."""

from __future__ import annotations

from datetime import timedelta

from pydantic import BaseModel, ConfigDict
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.sweeper import Orphan, SweeperActivities, SweepInput
    from workflows.retries import SWEEP_RETRY

# Long enough for a node workflow to start and upsert its TgpNodeName search attribute, and
# longer than every provider's consistency window (activities.http.CONSISTENCY_WINDOW): a
# suspect younger than its window is left for the next sweep (activities.sweeper).
SWEEP_GRACE = timedelta(minutes=5)
SWEEP_EVERY = timedelta(minutes=15)
SWEEP_CALL_TIMEOUT = timedelta(minutes=5)


class SweepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sweep: SweepInput = SweepInput()
    grace: timedelta = SWEEP_GRACE


@workflow.defn(name="SweeperWorkflow")
class SweeperWorkflow:
    @workflow.run
    async def run(self, req: SweepRequest) -> list[Orphan]:
        suspects = await workflow.execute_activity_method(
            SweeperActivities.find_orphans, req.sweep, start_to_close_timeout=SWEEP_CALL_TIMEOUT, retry_policy=SWEEP_RETRY
        )
        removed: list[Orphan] = []
        if suspects:
            await workflow.sleep(req.grace, summary="grace before removing orphans")
            removed = await workflow.execute_activity_method(
                SweeperActivities.remove_orphans,
                args=[req.sweep, suspects],
                start_to_close_timeout=SWEEP_CALL_TIMEOUT,
                retry_policy=SWEEP_RETRY,
            )
        # The account keys kept for nodes that have all ended (activities.kept_accounts).
        await workflow.execute_activity_method(
            SweeperActivities.forget_kept_accounts, start_to_close_timeout=SWEEP_CALL_TIMEOUT, retry_policy=SWEEP_RETRY
        )
        return removed
