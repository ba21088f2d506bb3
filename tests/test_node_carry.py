"""Review #9: what the node's signals ask of its watch survives continue-as-new, and a budget
grant is not used to drain a node that new facts, come while the pool was asked, now hold."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import assert_nothing_left, request, start, wait_phase
from tests.test_watch_events import AT_REST
from tgp.node import NodeWorkflowInput
from tgp.types import InstanceSighting, InstanceState, NodeFacts, NodePhase, NodeStatus, Stage
from workflows.node import GPUNodeWorkflow
from workflows.pool import PoolInput

pytestmark = pytest.mark.timeout(300)


def test_a_sighting_or_budget_word_received_before_continue_as_new_is_carried() -> None:
    """The workflow's own handlers, then the input its continue-as-new sends (state as JSON, as
    Temporal carries it), then a new run's start: the sighting and the budget's word are there."""
    req = request(demand_since=None)  # as a pool of this release sends it (not a 31e9066 run)
    first = GPUNodeWorkflow(NodeWorkflowInput(request=req))
    sighting = InstanceSighting(instance_id="i-1", state=InstanceState.TERMINATED, interrupted=True, at=datetime.now(timezone.utc))
    first.instance_seen(sighting)
    first.budget_freed()
    carried = NodeWorkflowInput(request=first.req, state=first.state)  # what continue_as_new sends
    second = GPUNodeWorkflow(NodeWorkflowInput.model_validate_json(carried.model_dump_json()))
    assert second._sighting == sighting, "a sighting received just before continue-as-new was lost"
    assert second._budget_freed, "the pool's budget_freed received just before continue-as-new was lost"


async def ask_in_flight(handle: WorkflowHandle) -> bool:
    # A v2 life asks with a local activity, which no pending activity shows: the node says so.
    status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
    pending = (await handle.describe()).raw_description.pending_activities
    return bool(status.asking) or any(a.activity_type.name == "ask_pool_to_disrupt" for a in pending)


async def test_a_do_not_disrupt_pod_that_starts_while_the_pool_is_asked_holds_the_granted_node(temporal: WorkflowEnvironment) -> None:
    """An idle node asks its pool; the pool's workflow has no worker and does not answer, which
    grants (after POOL_ANSWER_TIMEOUT). Meanwhile the bridge says a do-not-disrupt pod now runs
    on the node: the node does not drain on that grant, it is held (DisruptionHeld)."""
    async with running_world(temporal) as (world, _, queue):
        pool_id = f"gpunodepool/ml/unanswering-{uuid.uuid4().hex[:6]}"
        # A pool workflow on a task queue no worker polls: an update to it is never answered.
        pool = await temporal.client.start_workflow("GPUNodePoolWorkflow", PoolInput(namespace="ml", name="unanswering"), id=pool_id, task_queue=f"nobody-{uuid.uuid4().hex[:6]}")
        req = request(timeouts=AT_REST.model_copy(update={"idle": timedelta(seconds=2)}), pool_workflow_id=pool_id)
        handle = await start(temporal, queue, req)
        try:
            await wait_phase(handle, NodePhase.READY, timeout=60)
            await eventually(lambda: ask_in_flight(handle), timeout=60, what="the node to ask its pool")
            facts = NodeFacts(node_name=req.node_name, present=True, ready=True, gpus=1, holding=1, holders=["default/train"], at=datetime.now(timezone.utc))
            await handle.signal(GPUNodeWorkflow.node_facts, facts)

            async def held() -> bool:
                status = await handle.query(GPUNodeWorkflow.status)
                assert status.phase is NodePhase.READY, f"the node went on a grant its new facts forbid: {status.phase} {status.end_reason}"
                return not await ask_in_flight(handle) and any(r.stage is Stage.DISRUPTION_HELD and "default/train" in r.reason for r in status.stages)

            await eventually(held, timeout=60, what="the node to be held by the do-not-disrupt pod")
            await asyncio.sleep(0)  # nothing else: evict ends it
            await handle.signal("evict", {"reason": "test over"})
            final = await asyncio.wait_for(handle.result(), 60)
            assert final.phase is NodePhase.TERMINATED
            assert_nothing_left(world, req.node_name)
        finally:
            await pool.terminate("test over")
