"""Review #9: what the node's signals ask of its watch survives continue-as-new, and a budget
grant is not used to drain a node that new facts, come while the pool was asked, now hold."""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timedelta, timezone

import httpx
import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import assert_nothing_left, request, start, wait_phase
from tests.test_watch_events import AT_REST
from tgp.node import NodeWorkflowInput
from tgp.types import InstanceSighting, InstanceState, NodeFacts, NodePhase, NodeStatus, Stage
from workflows.node import GPUNodeWorkflow
from workflows.pool import PoolInput

pytestmark = pytest.mark.timeout(300)
# The evict at each test's end drains the do-not-disrupt pod, which the emulator (no kubelet)
# never finishes deleting: the drain waits its timeout out, so it is short.
EVICT_DRAIN = timedelta(seconds=2)
# How long a node waits for its silent pool before that counts as a grant (POOL_ANSWER_TIMEOUT,
# 10 s): time enough for the test to start its pod while the node asks.
POOL_SILENT = timedelta(seconds=5)


async def unanswering_pool(temporal: WorkflowEnvironment) -> WorkflowHandle:
    """A pool workflow on a task queue no worker polls: an update to it is never answered."""
    pool_id = f"gpunodepool/ml/unanswering-{uuid.uuid4().hex[:6]}"
    return await temporal.client.start_workflow("GPUNodePoolWorkflow", PoolInput(namespace="ml", name="unanswering"), id=pool_id, task_queue=f"nobody-{uuid.uuid4().hex[:6]}")


async def guarded_pod(kube_url: str, node: str, name: str) -> None:
    """A Running pod on `node` annotated do-not-disrupt (the emulator has no scheduler or kubelet)."""
    meta = {"name": name, "namespace": "default", "annotations": {"karpenter.sh/do-not-disrupt": "true"}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}}
    async with httpx.AsyncClient(verify=default_tls(), base_url=kube_url) as kube:
        (await kube.post("/api/v1/namespaces/default/pods", json=pod)).raise_for_status()
        running = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        patched = await kube.patch(f"/api/v1/namespaces/default/pods/{name}/status", json=running, headers={"Content-Type": "application/merge-patch+json"})
        patched.raise_for_status()


async def guarded_pod_while_asking(kube_url: str, handle: WorkflowHandle, node: str) -> None:
    """Once the Ready node asks its (unanswering) pool, a do-not-disrupt pod "train" starts on it."""
    await wait_phase(handle, NodePhase.READY, timeout=60)
    await eventually(lambda: ask_in_flight(handle), timeout=60, what="the node to ask its pool")
    await guarded_pod(kube_url, node, "train")


async def pod_of(kube_url: str, name: str) -> dict[str, object] | None:
    async with httpx.AsyncClient(verify=default_tls(), base_url=kube_url) as kube:
        response = await kube.get(f"/api/v1/namespaces/default/pods/{name}")
        return response.json() if response.status_code == 200 else None


def test_a_sighting_or_budget_word_received_before_continue_as_new_is_carried() -> None:
    """The workflow's own handlers, then the input its continue-as-new sends (state as JSON, as
    Temporal carries it), then a new run's start: the sighting and the budget's word are there."""
    req = request(demand_since=None)
    first = GPUNodeWorkflow(NodeWorkflowInput(request=req))
    sighting = InstanceSighting(instance_id="i-1", state=InstanceState.TERMINATED, interrupted=True, at=datetime.now(timezone.utc))
    first.instance_seen(sighting)
    first.budget_freed()
    carried = NodeWorkflowInput(request=first.life.req, state=first.life.state)  # what continue_as_new sends
    second = GPUNodeWorkflow(NodeWorkflowInput.model_validate_json(carried.model_dump_json()))
    assert second.life.state.sighting == sighting, "a sighting received just before continue-as-new was lost"
    assert second.life.state.budget_freed, "the pool's budget_freed received just before continue-as-new was lost"


async def ask_in_flight(handle: WorkflowHandle) -> bool:
    # A v2 life asks with a local activity, which no pending activity shows: the node says so.
    # A v5 life asks inside its drain (`drain_node` with an `ask`), a pending activity.
    status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
    pending = (await handle.describe()).raw_description.pending_activities
    return bool(status.asking) or any(a.activity_type.name in ("ask_pool_to_disrupt", "drain_node") for a in pending)


async def test_a_do_not_disrupt_pod_that_starts_while_the_pool_is_asked_holds_the_granted_node(temporal: WorkflowEnvironment) -> None:
    """An idle node asks its pool; the pool's workflow has no worker and does not answer, which
    grants (after POOL_SILENT here). Meanwhile a do-not-disrupt pod starts on the node (and
    the bridge says so): the node does not drain on that grant, it is held (DisruptionHeld).
    A v5 life asks inside its drain, which finds the pod right after its cordon: the drain is
    called off (DrainCalledOff), nothing is evicted, the Node is uncordoned."""
    async with running_world(temporal, pool_answer_timeout=POOL_SILENT) as (world, _, queue):
        pool = await unanswering_pool(temporal)
        req = request(timeouts=AT_REST.model_copy(update={"idle": timedelta(seconds=2), "drain": EVICT_DRAIN}), pool_workflow_id=pool.id)
        handle = await start(temporal, queue, req)
        try:
            await guarded_pod_while_asking(world.kube_url, handle, req.node_name)
            facts = NodeFacts(node_name=req.node_name, present=True, ready=True, gpus=1, busy_pods=1, holding=1, holders=["default/train"], at=datetime.now(timezone.utc))
            await handle.signal(GPUNodeWorkflow.node_facts, facts)

            async def held() -> bool:
                pod = await pod_of(world.kube_url, "train")
                assert pod is not None and not pod["metadata"].get("deletionTimestamp"), "the node drained on a grant its new facts forbid"
                status = await handle.query(GPUNodeWorkflow.status)
                return (
                    status.phase is NodePhase.READY
                    and not await ask_in_flight(handle)
                    # Held by the facts judged after the grant, or (v5) by the drain's look after its cordon.
                    and any(r.stage in (Stage.DISRUPTION_HELD, Stage.DRAIN_CALLED_OFF) and "default/train" in r.reason for r in status.stages)
                )

            await eventually(held, timeout=60, what="the node to be held by the do-not-disrupt pod")
            async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
                assert not (await kube.get(f"/api/v1/nodes/{req.node_name}")).json()["spec"].get("unschedulable"), "left cordoned"
            await asyncio.sleep(0)  # nothing else: evict ends it
            await handle.signal("evict", {"reason": "test over"})
            final = await asyncio.wait_for(handle.result(), 60)
            assert final.phase is NodePhase.TERMINATED
            assert_nothing_left(world, req.node_name)
        finally:
            await pool.terminate("test over")


async def test_an_expired_node_whose_drain_finds_do_not_disrupt_after_its_cordon_stays(temporal: WorkflowEnvironment) -> None:
    """A v5 life: an expired node asks its (unanswering) pool inside its drain; meanwhile a
    do-not-disrupt pod starts on it and nobody tells the node (no bridge runs). Granted by the
    pool's silence, the drain finds the pod right after its cordon: it is called off, the Node
    uncordoned, the pod never evicted, and the node, Ready again, is held (DisruptionHeld)
    rather than drained again and again. An eviction still ends it."""
    async with running_world(temporal, pool_answer_timeout=POOL_SILENT) as (world, _, queue):
        pool = await unanswering_pool(temporal)
        req = request(timeouts=AT_REST.model_copy(update={"expire_after": timedelta(seconds=2), "drain": EVICT_DRAIN}), pool_workflow_id=pool.id)
        handle = await start(temporal, queue, req)
        try:
            await guarded_pod_while_asking(world.kube_url, handle, req.node_name)

            async def held() -> bool:
                pod = await pod_of(world.kube_url, "train")
                assert pod is not None and not pod["metadata"].get("deletionTimestamp"), "the drain evicted a do-not-disrupt pod"
                status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
                return status.phase is NodePhase.READY and any(r.stage is Stage.DISRUPTION_HELD and "default/train" in r.reason for r in status.stages)

            await eventually(held, timeout=60, what="the expired node to be held by the do-not-disrupt pod its drain found")
            async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
                assert not (await kube.get(f"/api/v1/nodes/{req.node_name}")).json()["spec"].get("unschedulable"), "left cordoned"
            drains = [e async for e in handle.fetch_history_events() if e.activity_task_scheduled_event_attributes.activity_type.name == "drain_node"]
            assert len(drains) == 1, f"drained again while held: {len(drains)} drains"
            assert world.cloud.live_instances(), "the drain do-not-disrupt held terminated the instance of a node that stays"
            await handle.signal("evict", {"reason": "test over"})
            final = await asyncio.wait_for(handle.result(), 60)
            assert final.phase is NodePhase.TERMINATED
            assert_nothing_left(world, req.node_name)
        finally:
            await pool.terminate("test over")
