"""The drain stage of a node's life, end to end against the simulated world over HTTP: a drain
is re-validated after the cordon (issue 17 item 10) and a drain that times out says who paid
for it (item 11)."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
from prometheus_client import REGISTRY
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.test_launch_settles import calls, quick_world
from tests.test_node_lifecycle import FAST, assert_nothing_left, replay, request, start, wait_phase
from activities.drain import EVENT_DRAIN_TIMED_OUT
from tests.test_pool_races import Reports, about, gated_world, pool_events, pool_spec, start_pool
from tgp.types import NodePhase, NodeStatus, Stage, StageRecord
from workflows.node import GPUNodeWorkflow
from workers.main import make_worker
from workflows.pool import GPUNodePoolWorkflow

MERGE = {"Content-Type": "application/merge-patch+json"}


async def bind_pod(world: SimWorld, node: str, name: str, *, labels: dict[str, str] | None = None, grace: int = 0) -> None:
    """A running Job pod bound to `node`, as the scheduler and the kubelet would leave it."""
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "labels": labels or {}, "ownerReferences": [
            {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": f"u-{name}", "controller": True},
        ]},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "pytorch"}], "terminationGracePeriodSeconds": grace},
    }
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        (await kube.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()
        running = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        (await kube.patch(f"/api/v1/namespaces/ml/pods/{name}/status", json=running, headers=MERGE)).raise_for_status()


async def refuse_evictions(world: SimWorld, app: str) -> None:
    """A PodDisruptionBudget (minAvailable 1) over the pods labelled app=`app`: with one such pod,
    every eviction of it is refused."""
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": app},
           "spec": {"selector": {"matchLabels": {"app": app}}, "minAvailable": 1}}
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        (await kube.post("/apis/policy/v1/namespaces/ml/poddisruptionbudgets", json=pdb)).raise_for_status()


async def kube_get(world: SimWorld, path: str) -> dict[str, Any] | None:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        response = await kube.get(path)
    return response.json() if response.status_code == 200 else None


async def test_a_pod_bound_just_before_the_cordon_calls_the_idle_drain_off(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"idle": timedelta(seconds=2)}))
        assert world.kube is not None
        bound: list[str] = []

        async def scheduler_binds_first(request: Any) -> None:
            # The scheduler binds a pod to the idle node a moment before the cordon lands.
            if not bound:
                bound.append("late")
                await bind_pod(world, req.node_name, "late")

        world.kube[f"patch /api/v1/nodes/{req.node_name}", {"spec": {"unschedulable": True}}] << scheduler_binds_first
        handle = await start(temporal, queue, req)

        async def watching_again() -> NodeStatus | None:
            status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
            return status if bound and status.phase is NodePhase.READY else None

        await eventually(watching_again, what="the node back to Ready after the called-off drain")
        assert await kube_get(world, "/api/v1/namespaces/ml/pods/late") is not None, "the late pod was not evicted"
        node = await kube_get(world, f"/api/v1/nodes/{req.node_name}")
        assert node is not None and not node["spec"].get("unschedulable"), "the node takes pods again"
        assert world.cloud.live_instances(), "the drain that was called off terminated the instance of a node that stays"

        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:  # the job ends; the node idles out for real
            (await kube.delete("/api/v1/namespaces/ml/pods/late")).raise_for_status()
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("idle")
        assert [s.stage for s in final.stages if s.stage is Stage.DRAIN_CALLED_OFF] == [Stage.DRAIN_CALLED_OFF]
        # Its idle drains moved no workload pod: the search attribute went from Ready to the end
        # (no Draining, and no second Ready after the call-off), the stages record both drains.
        phases = (await calls(handle))[2]
        assert "Draining" not in phases and phases.count("Ready") == 1 and phases[-1] == "Terminated", phases
        assert [s.stage for s in final.stages if s.stage is Stage.DRAINING] == [Stage.DRAINING], final.stages
        assert_nothing_left(world, req.node_name)
        await replay(handle, "idle_drain_called_off")


async def test_a_drain_that_times_out_says_which_pods_were_terminated_unevicted_and_why(temporal: WorkflowEnvironment) -> None:
    # Issue 17 item 11: a PDB-protected pod was killed and only a Normal NodeTerminated said so.
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"drain": timedelta(seconds=2)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await bind_pod(world, req.node_name, "db", labels={"app": "db"})
        await refuse_evictions(world, "db")

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)

        assert final.phase is NodePhase.TERMINATED
        assert "Draining" in (await calls(handle))[2], "a drain with pods to move is shown in the search attribute"
        [timed_out] = [s for s in final.stages if s.stage is Stage.DRAIN_TIMED_OUT]
        assert "ml/db" in timed_out.reason and "not evicted" in timed_out.reason, timed_out
        events = (await kube_get(world, "/api/v1/namespaces/ml/events") or {}).get("items") or []
        [warning] = [e for e in events if e["involvedObject"]["name"] == "db" and e["reason"] == EVENT_DRAIN_TIMED_OUT]
        assert warning["type"] == "Warning" and req.node_name in warning["message"], warning
        assert "eviction was refused" in warning["message"] and "disruption budget" in warning["message"], warning["message"]
        assert_nothing_left(world, req.node_name)
        await replay(handle, "drain_timed_out")


async def test_a_drain_that_timed_out_leaves_the_end_report_to_the_workflow(temporal: WorkflowEnvironment) -> None:
    """A drain that released everything tells the pool the end itself, but not after pods stayed:
    the workflow's end report carries the DrainTimedOut record the pool's Warning comes from."""
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"drain": timedelta(seconds=2)}), pool_workflow_id="gpupool/ml/no-such-pool")
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await bind_pod(world, req.node_name, "db", labels={"app": "db"})
        await refuse_evictions(world, "db")
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await asyncio.wait_for(handle.result(), 60)).phase is NodePhase.TERMINATED
        local = [e.user_metadata.summary.data.decode() async for e in handle.fetch_history_events() if e.HasField("marker_recorded_event_attributes")]
        assert '"report Terminated"' in local, local


async def test_the_pool_raises_a_warning_for_a_node_whose_drain_timed_out(temporal: WorkflowEnvironment) -> None:
    async with gated_world(temporal) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        report = Reports(name).of
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.READY, 0))
        terminating = report("a", NodePhase.TERMINATING, 5).model_copy(update={"stages": [
            StageRecord(stage=Stage.DRAIN_TIMED_OUT, at=datetime.now(timezone.utc), reason="timed out after 10m; terminated with pods still on the node: not evicted (disruption budget?): ml/db"),
            StageRecord(stage=Stage.TERMINATING, at=datetime.now(timezone.utc)),
        ]})
        await pool.signal(GPUNodePoolWorkflow.node_phase, terminating)

        async def warned() -> list[tuple[str, str]] | None:
            events = await pool_events(s, name)
            return events if about(events, "DrainTimedOut", "a") else None

        events = await eventually(warned, what="the pool's DrainTimedOut Event")
        [message] = [m for r, m in events if r == "DrainTimedOut"]
        assert "ml/db" in message and "not evicted" in message, message


async def test_a_drained_node_stops_billing_at_the_drains_end_before_its_release(temporal: WorkflowEnvironment) -> None:
    """A node that goes: its drain ends with one terminate call for its instance, so billing stops
    a workflow task before the release (which still terminates until confirmed and cleans up),
    and its terminate is its release's first call (the look-ups by name and reads come after).
    Terminates are held at the cloud: the first one arrives while the drain runs and before the
    workflow has scheduled its release."""
    async with AsyncExitStack() as stack:
        world, activities = await quick_world(stack)
        activities.node.terminate_once_timeout = timedelta(seconds=60)  # held below for as long as the test looks
        queue = f"test-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        # No backstop look while the test counts the cloud's reads (FAST looks each second).
        req = request(timeouts=FAST.model_copy(update={"watch_interval": timedelta(hours=1)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)

        async def at_rest() -> bool:  # its twin watch over (on a loaded machine it outlasts the join)
            return not (await handle.describe()).raw_description.pending_activities

        await eventually(at_rest, what="the Ready node's activities done, its twin watch's look-ups by name among them")
        terminations = REGISTRY.get_sample_value("tgp_terminations_total", {"provider": "simulated"}) or 0.0
        world.cloud.hold_deletes()
        looks = world.cloud.name_lookups + world.cloud.instance_lists + world.cloud.describe_requests
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await asyncio.wait_for(world.cloud.delete_arrived.wait(), 60)
        draining: NodeStatus = await handle.query(GPUNodeWorkflow.status)
        assert draining.phase is NodePhase.DRAINING, f"the terminate came from the release, not the drain: {draining.phase}"
        after_looks = world.cloud.name_lookups + world.cloud.instance_lists + world.cloud.describe_requests
        assert after_looks == looks, "the drain's release looked up or read the instance before it terminated it"
        world.cloud.release_deletes()
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED, final
        assert world.cloud.delete_requests == 1, "the release terminated again what the drain had terminated"
        after = REGISTRY.get_sample_value("tgp_terminations_total", {"provider": "simulated"}) or 0.0
        assert after - terminations == 1, "tgp_terminations_total counts the drain's terminate request (the release found it ended)"
        assert_nothing_left(world, req.node_name)
