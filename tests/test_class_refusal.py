"""Issue 20: a pool its class refused does not ask again every pass (220 refusals in 6 minutes);
it asks again when something that could change the answer happened (here: the class's limits
were raised), else after its back-off interval (set to an hour here, so only a change counts).
And a node whose price the class refuses at its settle buys nothing and says why."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world
from tests.test_entities_heal import FAST, start_class
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.crds import GPUNodeClassSpec, GPUNodePoolStatus
from tgp.messages import ClassUpdate, Demand, PoolUpdate, pool_workflow_id
from workflows.pool import GPUNodePoolWorkflow, PoolInput

RESERVES = {"reserve_and_start_node", "reserve_and_start_nodes"}
PODS = [f"ml/train-{i}" for i in range(5)]


async def reserve_calls(pool: WorkflowHandle) -> int:
    history = await pool.fetch_history()
    return sum(
        1
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes") and e.activity_task_scheduled_event_attributes.activity_type.name in RESERVES
    )


async def passes_done(pool: WorkflowHandle, demands: int) -> bool:
    """The pool took `demands` demand signals and has no workflow task left to run."""
    events = (await pool.fetch_history()).events
    taken = sum(1 for e in events if e.HasField("workflow_execution_signaled_event_attributes") and e.workflow_execution_signaled_event_attributes.signal_name == "demand")
    last = events[-1]
    idle = not (last.HasField("workflow_task_scheduled_event_attributes") or last.HasField("workflow_task_started_event_attributes"))
    pending = (await pool.describe()).raw_description.pending_activities
    return taken == demands and idle and not pending


async def test_a_refused_pool_asks_its_class_again_only_when_something_changed(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (_, _, queue):
        klass, name = f"cap-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        capped = GPUNodeClassSpec.model_validate({**CLASS.model_dump(mode="json", by_alias=True), "limits": {"maxNodes": 2}})
        class_run = await start_class(temporal, queue, klass, capped)
        spec = pool_spec(klass, disruption={"idleTimeout": "1h", "drainTimeout": "10s"})
        pool = await temporal.client.start_workflow(
            GPUNodePoolWorkflow.run,
            PoolInput(namespace="ml", name=name, resync_interval=FAST, visibility_lag=timedelta(seconds=2), class_refusal_backoff=timedelta(hours=1)),
            id=pool_workflow_id("ml", name),
            task_queue=queue,
            start_signal="update",
            start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=capped)],
        )
        await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=PODS, observed_at=datetime.now(timezone.utc)))

        async def refused() -> bool:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            budget = {c.type: c for c in status.conditions}.get("BudgetAvailable")
            return budget is not None and budget.reason == "BudgetExhausted" and status.desired_nodes == 2

        await eventually(refused, timeout=60, what="the class to refuse the pool's third node")
        asked = await reserve_calls(pool)
        # More passes, nothing changed: the pool does not ask again.
        for i in range(3):
            await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=PODS, observed_at=datetime.now(timezone.utc)))
        await eventually(lambda: passes_done(pool, 4), timeout=60, what="the pool's passes")
        assert await reserve_calls(pool) == asked, "a refused pool asked its class again though nothing changed"
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        budget = {c.type: c for c in status.conditions}["BudgetAvailable"]
        assert "asking the class again when" in budget.message and "limits.maxNodes" in budget.message

        # The class's limits are raised: the pool asks at once and gets its third node.
        raised = capped.model_copy(update={"limits": capped.limits.model_copy(update={"max_nodes": 3})})
        await class_run.signal("update_class", ClassUpdate(spec=raised, generation=2))
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=raised))

        async def third() -> bool:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return status.desired_nodes == 3

        await eventually(third, timeout=60, what="the third node once the class allows it")
        assert await reserve_calls(pool) >= asked + 1


async def test_a_price_the_class_budget_refuses_buys_nothing_and_ends_the_node_failed_saying_why(temporal: WorkflowEnvironment) -> None:
    """The node's own settle: its offer's price would break the class's maxHourlyCost (the pool
    reserved a slot without a price). Nothing is bought, the node ends
    Failed naming the limit, and the class holds nothing for it."""
    from tests.test_node_lifecycle import assert_nothing_left, request, start
    from tgp.messages import Ledger, class_workflow_id
    from tgp.types import NodePhase
    from workflows.node_class import GPUNodeClassWorkflow

    async with running_world(temporal) as (world, _, queue):
        name = f"cheap-{uuid.uuid4().hex[:6]}"
        spec = GPUNodeClassSpec.model_validate({**CLASS.model_dump(mode="json", by_alias=True), "limits": {"maxHourlyCost": "0.01"}})
        klass = await start_class(temporal, queue, name, spec)
        req = request(node_class=name, class_workflow_id=class_workflow_id(name))
        node = await start(temporal, queue, req)
        try:
            status = await asyncio.wait_for(node.result(), 60)
        except TimeoutError:
            await node.cancel()  # it bought and lives on: cleaned up, and the test fails
            raise AssertionError("the node did not end after the class refused its price") from None

        assert status.phase is NodePhase.FAILED
        assert "class budget refused" in (status.last_error or "") and "maxHourlyCost" in (status.last_error or ""), status.last_error
        assert world.cloud.create_requests == 0, "bought although the class refused the price"
        assert not status.attempts, f"a refused price left a launch attempt to release: {status.attempts}"
        assert_nothing_left(world, req.node_name)
        ledger: Ledger = await klass.query(GPUNodeClassWorkflow.budget)
        assert req.workflow_id not in ledger.reservations
        await klass.terminate("test finished")
