"""Entity workflows heal themselves: a pool or class run that starts over rebuilds its state
from the node workflows actually running, a node workflow closed by hand releases its pool
place and class budget, and an activity error never ends a pool or class.

The pool and class workflows are started directly (as the bridge would, with short resync
intervals); the node workflows, the simulated cloud, tailnet and Kubernetes API are real."""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec, GPUNodePoolStatus
from tgp.messages import ClassInput, ClassUpdate, Ledger, PoolUpdate, class_workflow_id, pool_workflow_id
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow, PoolInput

FAST = timedelta(seconds=1)


async def start_class(env: WorkflowEnvironment, queue: str, name: str, spec: GPUNodeClassSpec = CLASS) -> WorkflowHandle:
    return await env.client.start_workflow(
        GPUNodeClassWorkflow.run,
        ClassInput(name=name, resync_interval=FAST, reservation_grace=timedelta(seconds=2)),
        id=class_workflow_id(name),
        task_queue=queue,
        start_signal="update_class",
        start_signal_args=[ClassUpdate(spec=spec, generation=1)],
    )


async def start_pool(env: WorkflowEnvironment, queue: str, name: str, spec: GPUNodePoolSpec, klass: GPUNodeClassSpec = CLASS) -> WorkflowHandle:
    return await env.client.start_workflow(
        GPUNodePoolWorkflow.run,
        PoolInput(namespace="ml", name=name, resync_interval=FAST, visibility_lag=timedelta(seconds=2)),
        id=pool_workflow_id("ml", name),
        task_queue=queue,
        start_signal="update",
        start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=klass)],
    )


async def ready_nodes(pool: WorkflowHandle, count: int) -> GPUNodePoolStatus:
    async def check() -> GPUNodePoolStatus | None:
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        return status if status.ready_nodes == count else None

    return await eventually(check, timeout=60, what=f"{count} Ready node(s)")


async def passes(handle: WorkflowHandle, activity: str = "running_nodes") -> int:
    """How many times the current run looked at the running node workflows."""
    history = await handle.fetch_history()
    return sum(
        1
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes") and e.activity_task_scheduled_event_attributes.activity_type.name in (activity, f"{activity}_changed")
    )


async def test_a_pool_and_class_starting_over_adopt_the_running_nodes(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        klass, name = f"heal-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(klass, minNodes=1, maxNodes=1)
        await start_class(temporal, queue, klass)
        pool = await start_pool(temporal, queue, name, spec)
        [node] = (await ready_nodes(pool, 1)).nodes

        # Both entity runs die (failed, terminated, reset) and new runs start with empty state.
        for handle in (pool, temporal.client.get_workflow_handle(class_workflow_id(klass))):
            await handle.terminate("simulated crash")
        klass_run = await start_class(temporal, queue, klass)
        pool = await start_pool(temporal, queue, name, spec)

        async def adopted() -> Ledger | None:
            ledger: Ledger = await klass_run.query(GPUNodeClassWorkflow.budget)
            return ledger if node.workflow_id in ledger.reservations else None

        await eventually(adopted, what="the new ledger run to hold the running node's reservation")
        await ready_nodes(pool, 1)

        async def settled() -> bool:
            return await passes(pool) >= 3

        await eventually(settled, what="three passes of the new pool run")
        assert world.cloud.create_requests == 1, "the new pool run bought a second floor node"
        assert len((await klass_run.query(GPUNodeClassWorkflow.budget)).reservations) == 1
        await pool.terminate("test finished")
        await klass_run.terminate("test finished")


async def test_a_node_workflow_terminated_by_hand_frees_its_pool_place_and_class_budget(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        klass, name = f"heal-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        klass_run = await start_class(temporal, queue, klass)
        pool = await start_pool(temporal, queue, name, pool_spec(klass, minNodes=1))
        [node] = (await ready_nodes(pool, 1)).nodes

        await temporal.client.get_workflow_handle(node.workflow_id).terminate("by hand")

        async def released() -> bool:
            ledger: Ledger = await klass_run.query(GPUNodeClassWorkflow.budget)
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return node.workflow_id not in ledger.reservations and all(n.workflow_id != node.workflow_id for n in status.nodes)

        await eventually(released, timeout=60, what="the pool and the ledger to let go of the closed node")
        # The floor is met again by a new node; the budget counts only that one.
        replacement = (await ready_nodes(pool, 1)).nodes
        assert [n.workflow_id for n in replacement] != [node.workflow_id]
        ledger: Ledger = await klass_run.query(GPUNodeClassWorkflow.budget)
        assert set(ledger.reservations) == {replacement[0].workflow_id}
        for handle in (pool, klass_run):
            await handle.terminate("test finished")
        await temporal.client.get_workflow_handle(replacement[0].workflow_id).terminate("test finished")
        # The sweeper ends what the workflows terminated by hand left; here, the test does.
        for inst in world.cloud.live_instances():
            await world.cloud.preempt(inst.id)


async def test_a_rejected_provider_key_is_a_condition_not_a_failed_pool(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        world.cloud._api_key = "rotated"  # every call with the old key now answers 401
        klass, name = f"heal-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        klass_run = await start_class(temporal, queue, klass)
        pool = await start_pool(temporal, queue, name, pool_spec(klass))

        async def reported() -> GPUNodePoolStatus | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            offers = next((c for c in status.conditions if c.type == "OffersAvailable"), None)
            return status if offers is not None and offers.status == "False" else None

        status = await eventually(reported, timeout=60, what="the failed offer check to become a condition")
        offers = next(c for c in status.conditions if c.type == "OffersAvailable")
        assert offers.reason == "OfferCheckFailed" and "could not be listed" in offers.message
        assert (await pool.describe()).status is WorkflowExecutionStatus.RUNNING
        assert (await klass_run.describe()).status is WorkflowExecutionStatus.RUNNING
        await pool.terminate("test finished")
        await klass_run.terminate("test finished")
