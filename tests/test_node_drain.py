"""The drain stage of a node's life, end to end against the simulated world over HTTP: a drain
is re-validated after the cordon (issue 17 item 10) and a drain that times out says who paid
for it (item 11)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
from temporalio.testing import WorkflowEnvironment

from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import FAST, assert_nothing_left, request, start, wait_phase
from tgp.types import NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow

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
    async with httpx.AsyncClient(base_url=world.kube_url) as kube:
        (await kube.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()
        running = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        (await kube.patch(f"/api/v1/namespaces/ml/pods/{name}/status", json=running, headers=MERGE)).raise_for_status()


async def kube_get(world: SimWorld, path: str) -> dict[str, Any] | None:
    async with httpx.AsyncClient(base_url=world.kube_url) as kube:
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

        async with httpx.AsyncClient(base_url=world.kube_url) as kube:  # the job ends; the node idles out for real
            (await kube.delete("/api/v1/namespaces/ml/pods/late")).raise_for_status()
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("idle")
        assert_nothing_left(world, req.node_name)
