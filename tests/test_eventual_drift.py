"""terminationGracePeriod makes drift eventual (issue 35 item 8), as in Karpenter v1: a drifted
node that a do-not-disrupt pod holds goes at the latest the pool's terminationGracePeriod after
the pool told it to (its replacement Ready), its drain ending at the same moment; without a
grace period it waits for as long as the pod runs (tests/test_replacement.py)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from tgp.disruption import DisruptionReason, eventual_end

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@given(st.sampled_from(list(DisruptionReason)), st.none() | st.integers(0, 10**6).map(lambda s: T0 + timedelta(seconds=s)), st.none() | st.integers(1, 10**6).map(lambda s: timedelta(seconds=s)))
def test_only_drift_with_a_grace_period_and_a_time_is_bounded(reason: DisruptionReason, since: datetime | None, grace: timedelta | None) -> None:
    bound = eventual_end(reason.value, since, grace)
    if reason is DisruptionReason.DRIFTED and since is not None and grace is not None:
        assert bound == since + grace
    else:
        assert bound is None, "held for as long as the pod asks"


async def test_a_drifted_node_held_by_do_not_disrupt_goes_at_its_termination_grace_period(time_skipping: WorkflowEnvironment) -> None:
    from tests.conftest import running_world, skip_time
    from tests.test_node_disruption import put_held_pod
    from tests.test_node_lifecycle import assert_nothing_left, request, start, wait_phase
    from tests.test_watch_events import AT_REST, bridge_running, told
    from tgp.types import DisruptRequest, NodePhase, NodeStatus, Stage
    from workflows.node import GPUNodeWorkflow

    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        req = request(timeouts=AT_REST.model_copy(update={"termination_grace": timedelta(hours=1)}))
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_held_pod(world, req.node_name, "train")
        await told(handle, holding=1, holders=["default/train"])

        at = await time_skipping.get_current_time()
        await handle.signal(GPUNodeWorkflow.disrupt, DisruptRequest(reason="Drifted", replacement="rtx-rabcde", detail="rtx-rabcde is Ready", at=at))
        await skip_time(time_skipping, timedelta(minutes=40), step=timedelta(minutes=10))
        status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, "the pod has the grace period first"
        held = [r for r in status.stages if r.stage is Stage.DISRUPTION_HELD]
        assert held and "default/train" in held[-1].reason and "terminationGracePeriod (1h) ends the wait" in held[-1].reason, status.stages

        await skip_time(time_skipping, timedelta(minutes=30), step=timedelta(minutes=10))
        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED, final
        assert final.end_reason is not None and final.end_reason.startswith("drifted: replaced by rtx-rabcde (make-before-break)"), final
        assert "do-not-disrupt held it for its terminationGracePeriod (60m): default/train" in final.end_reason, final
        assert_nothing_left(world, req.node_name)
