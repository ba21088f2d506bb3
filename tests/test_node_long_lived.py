"""Timers measured in minutes and days, on the time-skipping test server: idle timeout ->
drain -> terminate, and a node that lives 30 simulated days with bounded history."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import running_world, skip_time
from tests.test_node_lifecycle import assert_nothing_left, node_exists, replay, request, start, wait_phase
from sim.world import SimWorld
from tgp.types import LifecycleTimeouts, NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow
from workflows.node.life import HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW

# Every skipped watch interval is a real timer + activity round trip (360 for the 30 days): under
# a minute alone, several minutes on a loaded machine. No deadline inside the tests; this is the
# outer guard only.
pytestmark = pytest.mark.timeout(900)


async def put_pod(world: SimWorld, node: str, name: str, owner_kind: str | None = None) -> None:
    """A Running pod bound to `node` (the emulator has no scheduler or kubelet)."""
    meta: dict[str, object] = {"name": name, "namespace": "default"}
    if owner_kind:
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": owner_kind, "name": "x", "uid": "u-1", "controller": True}]
    # It shuts down within a second of being deleted: the drain waits for that in real time.
    spec = {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}], "terminationGracePeriodSeconds": 1}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        (await kube.post("/api/v1/namespaces/default/pods", json=pod)).raise_for_status()
        (
            await kube.patch(
                f"/api/v1/namespaces/default/pods/{name}/status",
                json={"status": {"phase": "Running"}},
                headers={"Content-Type": "application/merge-patch+json"},
            )
        ).raise_for_status()


async def remove_pod(world: SimWorld, name: str) -> None:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        (await kube.delete(f"/api/v1/namespaces/default/pods/{name}")).raise_for_status()


async def pod_exists(world: SimWorld, name: str) -> bool:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        return (await kube.get(f"/api/v1/namespaces/default/pods/{name}")).status_code == 200


async def test_idle_node_is_drained_and_terminated(time_skipping: WorkflowEnvironment) -> None:
    timeouts = LifecycleTimeouts(idle=timedelta(minutes=10), watch_interval=timedelta(minutes=1), drain=timedelta(minutes=5))
    async with running_world(time_skipping) as (world, _, queue):
        req = request(timeouts=timeouts)
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_pod(world, req.node_name, "job")
        await put_pod(world, req.node_name, "logs-agent", owner_kind="DaemonSet")

        await skip_time(time_skipping, timedelta(hours=2), step=timedelta(minutes=10))  # 10 checks per call
        busy: NodeStatus = await handle.query(GPUNodeWorkflow.status)
        assert busy.phase is NodePhase.READY, "a node with a workload pod is not idle"

        await remove_pod(world, "job")
        final: NodeStatus = await handle.result()

        assert final.phase is NodePhase.TERMINATED
        assert (final.end_reason or "").startswith("idle")
        idle_for = final.stage_times["Draining"] - final.stage_times["Ready"]
        assert idle_for >= timedelta(hours=2, minutes=10)
        assert await pod_exists(world, "logs-agent"), "drain leaves DaemonSet pods alone"
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)
        await replay(handle, "idle_drained")


async def test_a_node_living_30_days_keeps_each_run_history_small(time_skipping: WorkflowEnvironment) -> None:
    timeouts = LifecycleTimeouts(watch_interval=timedelta(hours=2))
    async with running_world(time_skipping) as (world, _, queue):
        req = request(timeouts=timeouts)
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_pod(world, req.node_name, "long-training")

        await skip_time(time_skipping, timedelta(days=30), step=timedelta(hours=12))  # 6 checks per call

        current = time_skipping.client.get_workflow_handle_for(GPUNodeWorkflow.run, req.workflow_id)
        desc = await current.describe()
        assert desc.run_id != handle.first_execution_run_id, "the watch continued as new"
        events = [e async for e in current.fetch_history_events()]
        assert len(events) < 1000
        assert len(events) <= HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW + 20
        status: NodeStatus = await current.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY
        assert status.stage_times["Ready"] - status.stage_times["Pending"] < timedelta(hours=1), "stage times survive continue-as-new"

        await current.signal(GPUNodeWorkflow.evict, {"reason": "30 days is enough"})
        await remove_pod(world, "long-training")
        final: NodeStatus = await current.result()
        assert final.phase is NodePhase.TERMINATED and final.end_reason == "evicted: 30 days is enough"
        assert_nothing_left(world, req.node_name)
        await replay(current, "thirty_days")
