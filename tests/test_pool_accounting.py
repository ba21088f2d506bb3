"""The pool's demand accounting, on the dev server with a pool that passes each second: a pod
that never binds buys exactly one node, however long it stays pending.

The pool, class and node workflows run for real against the simulated world; the test sends
the signals the bridge would (the pool, its class, the pending pod) and plays a scheduler that
never binds the pod (it asks for something the node does not have)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import FAST, request, start, wait_phase
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec, GPUNodePoolStatus
from tgp.types import NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow
from tgp.messages import ClassInput, ClassUpdate, Demand, NodeReport, PoolUpdate, class_workflow_id, pool_workflow_id
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow, PoolInput

CLASS = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}})


def pool_spec(class_name: str, **fields: object) -> GPUNodePoolSpec:
    return GPUNodePoolSpec.model_validate(
        {
            "nodeClassRef": {"name": class_name},
            "template": {"spec": {"requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}]}},
            **fields,
        }
    )


async def start_pool(env: WorkflowEnvironment, queue: str, spec: GPUNodePoolSpec, **inp: Any) -> WorkflowHandle:
    """The pool of `spec` and its class; `inp`: PoolInput's intervals (a test's shorter ones)."""
    class_name = spec.node_class_ref.name
    await env.client.start_workflow(
        GPUNodeClassWorkflow.run,
        ClassInput(name=class_name),
        id=class_workflow_id(class_name),
        task_queue=queue,
        start_signal="update_class",
        start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
    )
    name = f"pool-{uuid.uuid4().hex[:6]}"
    return await env.client.start_workflow(
        GPUNodePoolWorkflow.run,
        PoolInput(namespace="ml", name=name, **inp),
        id=pool_workflow_id("ml", name),
        task_queue=queue,
        start_signal="update",
        start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=CLASS)],
    )


async def end_entities(env: WorkflowEnvironment, pool: WorkflowHandle, class_name: str) -> None:
    """End the pool, its class and any node still running: on the shared time-skipping server a
    workflow left behind (a class resyncing every minute) makes every later skip fire its timers."""
    status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
    for wid in [n.workflow_id for n in status.nodes] + [pool.id, class_workflow_id(class_name)]:
        try:
            await env.client.get_workflow_handle(wid).terminate("test finished")
        except RPCError:
            pass  # it ended meanwhile


# A pool's pass (and consolidation look) interval in the whole-life tests on the dev server: it
# is a minute by default. (Not on the time-skipping server: it refuses a workflow task that
# cancels a timer which fired meanwhile and strands the run, sdk-java#2606; a pool cancels its
# pass's timer whenever news wake it, and under load that met a firing timer.)
LOOK = timedelta(seconds=1)
# The never-binding pod's grace before the pool judges it.
BIND_GRACE = timedelta(seconds=3)


async def passes(pool: WorkflowHandle) -> int:
    """The pool's passes at rest so far in its current run (its fired timers: one a resync)."""
    return sum(1 for e in (await pool.fetch_history()).events if e.event_type == EventType.EVENT_TYPE_TIMER_FIRED)


async def test_a_pod_that_never_binds_buys_exactly_one_node(temporal: WorkflowEnvironment) -> None:
    """On the dev server, the pool passing each second (LOOK) and a 3 s bind grace: ten passes
    after the grace, the pod that fits no node has bought one node, and PodsFit says why."""
    async with running_world(temporal) as (world, _, queue):
        class_name = f"ts-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(temporal, queue, pool_spec(class_name), resync_interval=LOOK, bind_grace=BIND_GRACE)
        await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=["ml/needs-2tb-ram"], observed_at=datetime.now(timezone.utc)))

        async def ready() -> GPUNodePoolStatus | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return status if status.ready_nodes == 1 else None

        await eventually(ready, timeout=60, what="the node bought for the pod to be Ready")
        # The scheduler never binds the pod; the bind grace and ten more passes go by.
        since = await passes(pool)

        async def ten_more() -> bool:
            return await passes(pool) >= since + BIND_GRACE // LOOK + 10

        await eventually(ten_more, timeout=90, what="the bind grace and ten more of the pool's passes")

        assert world.cloud.create_requests == 1, "the pool bought another node for a pod that does not fit"
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        fit = next(c for c in status.conditions if c.type == "PodsFit")
        assert fit.status == "False" and fit.reason == "PodDoesNotFit" and "ml/needs-2tb-ram" in fit.message
        await end_entities(temporal, pool, class_name)


async def test_a_terminate_the_provider_refuses_for_a_while_shows_termination_stuck_then_terminated(temporal: WorkflowEnvironment) -> None:
    """On the dev server with a 1-second threshold: Temporal's activity retry backoff is not
    skipped by the time-skipping server, so a real clock it is."""
    async with running_world(temporal) as (world, _, queue):
        pool = await start_pool(temporal, queue, pool_spec(f"stuck-{uuid.uuid4().hex[:6]}"))
        namespace, name = pool.id.split("/")[1:]
        req = request(namespace=namespace, pool=name, pool_workflow_id=pool.id, timeouts=FAST.model_copy(update={"termination_stuck": timedelta(seconds=1)}))
        node = await start(temporal, queue, req)
        await wait_phase(node, NodePhase.READY)
        # Terminates answer 500 for a while: three Temporal attempts (1 s, 2 s apart) fail.
        world.cloud.fail_deletes(3 * 3)
        await node.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await node.result()

        assert final.phase is NodePhase.TERMINATED and final.last_error is None
        assert "TerminationStuck" in final.stage_times, "a terminate stuck past the threshold is shown"
        assert world.cloud.live_instances() == [], "termination never gave up"

        async def warned() -> list[dict[str, object]] | None:
            async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
                items = (await kube.get(f"/api/v1/namespaces/{namespace}/events")).json()["items"]
            return [e for e in items if e.get("reason") == "TerminationStuck"] or None

        [event] = await eventually(warned, what="a TerminationStuck Warning Event on the pool")
        assert event["type"] == "Warning" and req.node_name in str(event["message"])
        await pool.terminate("test finished")


async def test_a_late_phase_report_never_replaces_a_newer_one(temporal: WorkflowEnvironment) -> None:
    """A node's phase reports are separate signals, which Temporal may deliver out of order (the
    fault matrix's 40-node burst saw Joining arrive after Ready: the pool showed the node Joining
    for good, 36/40 ready). An older report is ignored, and so is one about a node that ended."""
    async with running_world(temporal) as (_, _, queue):
        pool = await start_pool(temporal, queue, pool_spec(f"order-{uuid.uuid4().hex[:6]}"))
        t0 = datetime.now(timezone.utc)

        def report(node: str, phase: NodePhase, second: float) -> NodeReport:
            return NodeReport(workflow_id=f"gpunode/ml/x/{node}", node_name=node, phase=phase, at=t0 + timedelta(seconds=second))

        async def phases() -> dict[str, str]:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return {n.name: n.phase for n in status.nodes}

        for r in (report("a", NodePhase.READY, 2), report("a", NodePhase.JOINING, 1), report("b", NodePhase.LAUNCHING, 1)):
            await pool.signal(GPUNodePoolWorkflow.node_phase, r)
        # Signals from one client arrive in order: once b is seen, a's late Joining was handled.
        assert await eventually(lambda: _has(phases, "b"), what="node b") == {"a": "Ready", "b": "Launching"}

        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.TERMINATED, 3))
        await eventually(lambda: _lacks(phases, "a"), what="the ended node to be forgotten")
        for r in (report("a", NodePhase.READY, 2), report("c", NodePhase.PENDING, 4)):
            await pool.signal(GPUNodePoolWorkflow.node_phase, r)
        assert await eventually(lambda: _has(phases, "c"), what="node c") == {"b": "Launching", "c": "Pending"}, "the ended node came back"
        await pool.terminate("test finished")


async def _has(phases: object, node: str) -> dict[str, str] | None:
    seen: dict[str, str] = await phases()  # type: ignore[operator]
    return seen if node in seen else None


async def _lacks(phases: object, node: str) -> bool:
    return node not in await phases()  # type: ignore[operator]


async def test_an_older_update_that_overtakes_the_deletion_does_not_undelete_the_pool(temporal: WorkflowEnvironment) -> None:
    """The bridge sends a pool's update from two paths (the pool's own events, and every pool of
    a class whose status changed); an update built before the deletion can reach the workflow
    after it (seen in the fault matrix: the finalizer stayed 5 minutes, until the next event). A
    deletionTimestamp is never taken back, so the pool tears down all the same."""
    async with running_world(temporal) as (_, _, queue):
        spec = pool_spec(f"class-{uuid.uuid4().hex[:6]}")
        pool = await start_pool(temporal, queue, spec)
        uid = "3f0c2c1e-0000-4000-8000-000000000001"
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=CLASS, uid=uid))
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=CLASS, uid=uid, deleting=True))
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=CLASS, uid=uid))  # the older one

        async def ended() -> bool:
            return (await pool.describe()).status.name == "COMPLETED"

        try:
            await eventually(ended, timeout=30, what="the deleted pool to let its finalizer go and end")
        finally:
            await end_entities(temporal, pool, spec.node_class_ref.name)
