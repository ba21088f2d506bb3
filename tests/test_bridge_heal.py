"""Level-triggered entities (issue 17, item 12): a pool or class workflow terminated by hand
(`temporal workflow terminate`) is started again by the bridge within its entity resync
interval, with nothing about the object changed, and the pool serves its pods again.

Runs on the bridge test stack (tests/test_bridge.py): emulator, dev server, simulated world."""

from __future__ import annotations

import uuid

from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from crd_bridge.bridge import Bridge
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_bridge import NO_IDLING, Stack, apply, gpu_class, gpu_pool, pending_pod, ready_nodes, running_stack
from tgp.crds import FINALIZER, GPUNodeClass, GPUNodePool
from tgp.messages import class_workflow_id, pool_workflow_id
from workflows.node_class import GPUNodeClassWorkflow

# Seconds: many entity resync intervals (1 s here), on a busy machine.
WAIT = 60.0


async def run_after(s: Stack, workflow_id: str, terminated: str) -> str | None:
    """The id of a running run of `workflow_id` other than `terminated`."""
    try:
        description = await s.env.client.get_workflow_handle(workflow_id).describe()
    except RPCError:
        return None
    fresh = description.status is WorkflowExecutionStatus.RUNNING and description.run_id != terminated
    return description.run_id if fresh else None


async def test_terminated_pool_and_class_workflows_are_started_again_without_a_change(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s:
        assert (await apply(s.kube, gpu_class())).status_code == 201
        assert (await apply(s.kube, gpu_pool("heal", **{"disruption": NO_IDLING}))).status_code == 201
        await pending_pod(s.kube, "first")
        [node] = await ready_nodes(s, "ml", "heal", 1)

        pool_id, class_id = pool_workflow_id("ml", "heal"), class_workflow_id("sim")
        terminated = {}
        for wid in (pool_id, class_id):
            handle = s.env.client.get_workflow_handle(wid)
            terminated[wid] = (await handle.describe()).run_id
            await handle.terminate("by hand (test)")

        for wid in (pool_id, class_id):
            await eventually(lambda wid=wid: run_after(s, wid, terminated[wid]), timeout=WAIT, what=f"{wid} to run again")
        # The new class counts the running node; the new pool buys for a new pod.
        async def counted() -> bool:
            ledger = await s.env.client.get_workflow_handle(class_id).query(GPUNodeClassWorkflow.budget)
            return node["workflowId"] in ledger.reservations

        await eventually(counted, timeout=WAIT, what="the new class run to count the running node")
        await pending_pod(s.kube, "second")
        await ready_nodes(s, "ml", "heal", 2)


async def test_only_pools_and_classes_without_a_running_workflow_are_started(temporal: WorkflowEnvironment) -> None:
    """The rule on its own, on the dev server without a worker: every known class and pool
    without a running workflow gets one, except a pool whose deletion its workflow finished
    (finalizer gone); a workflow that runs is left alone."""
    tag = uuid.uuid4().hex[:6]
    queue = f"heal-rule-{tag}"
    bridge = Bridge(temporal.client, None, task_queue=queue)  # type: ignore[arg-type]  # no Kubernetes call on this path

    def pool(name: str, **meta: object) -> GPUNodePool:
        obj = gpu_pool(f"{name}-{tag}")
        obj["metadata"].update(meta)
        return GPUNodePool.model_validate(obj)

    pools = {
        "plain": pool("plain", finalizers=[FINALIZER]),
        "deleting": pool("deleting", finalizers=[FINALIZER], deletionTimestamp="2026-01-01T00:00:00Z"),
        "deleted": pool("deleted", deletionTimestamp="2026-01-01T00:00:00Z"),
    }
    bridge.pools = {f"ml/{p.metadata.name}": p for p in pools.values()}
    klass = GPUNodeClass.model_validate(gpu_class(f"cls-{tag}"))
    bridge.classes = {klass.metadata.name: klass}
    ids = {k: pool_workflow_id("ml", p.metadata.name) for k, p in pools.items()} | {"class": class_workflow_id(klass.metadata.name)}
    try:
        started = await bridge.restart_missing_workflows()
        assert sorted(started) == sorted([ids["plain"], ids["deleting"], ids["class"]])
        runs = {wid: (await temporal.client.get_workflow_handle(wid).describe()).run_id for wid in started}
        assert await bridge.restart_missing_workflows() == [], "a running workflow is not started again"
        assert {wid: (await temporal.client.get_workflow_handle(wid).describe()).run_id for wid in started} == runs
    finally:
        for wid in ids.values():
            try:
                await temporal.client.get_workflow_handle(wid).terminate("test finished")
            except RPCError:
                pass
