"""`kubectl delete node` on a tgp node means what it means to Karpenter's users: drain and
terminate. tgp puts its termination finalizer (tgp.types.FINALIZER_TERMINATION) on the Node when
it labels it, so the deletion only marks the Node; the node's watch ends at once (EndReason
DELETED), the node drains (the pool says Draining, not Ready), its instance is terminated, a
`NodeDeleted` Warning names the Node, and the release removes the finalizer: the Node goes.
Every way out removes the finalizer (`delete_node`); a Node the kubelet re-registers meanwhile
(sim.kube_kubelet) is no reason to keep billing."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.kube_machinery import MERGE_PATCH
from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.kube_env import KubeApi
from tests.test_node_lifecycle import FAST, assert_nothing_left, node_exists, request, start, wait_phase
from tgp.types import FINALIZER_TERMINATION, NodePhase, NodeStatus, Stage
from workflows.node import GPUNodeWorkflow

# The watch looks every second (no bridge in these worlds): ended within a few of them.
ENDS_WITHIN = 30.0


async def node_object(world: SimWorld, name: str) -> dict[str, Any] | None:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        response = await kube.get(f"/api/v1/nodes/{name}")
    return response.json() if response.status_code == 200 else None


async def kubectl_delete_node(world: SimWorld, name: str) -> None:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        (await kube.delete(f"/api/v1/nodes/{name}")).raise_for_status()


async def test_a_deleted_node_is_drained_and_terminated_at_once(temporal: WorkflowEnvironment) -> None:
    """A Ready node whose Node is deleted by hand: the Node stays (deletionTimestamp, tgp's
    finalizer) while the node drains; within seconds the instance is terminated, the life ends
    `deleted` with a NodeDeleted record naming the Node, and the Node object is gone."""
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"idle": None}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        node = await node_object(world, req.node_name)
        assert node is not None and FINALIZER_TERMINATION in node["metadata"].get("finalizers", []), node

        await kubectl_delete_node(world, req.node_name)
        marked = await node_object(world, req.node_name)
        assert marked is not None and marked["metadata"].get("deletionTimestamp"), "the finalizer holds the Node"

        final: NodeStatus = await asyncio.wait_for(handle.result(), ENDS_WITHIN)
        assert final.phase is NodePhase.TERMINATED, final
        assert (final.end_reason or "").startswith("deleted"), final.end_reason
        stages = [r.stage for r in final.stages]
        assert Stage.DRAINING in stages, "drained before the terminate"
        [deleted] = [r for r in final.stages if r.stage is Stage.NODE_DELETED]
        assert req.node_name in deleted.reason and "kubectl delete node" in deleted.reason, deleted
        assert world.cloud.live_instances() == [], "the instance was terminated"
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name), "the finalizer was removed: the Node is gone"


async def test_a_deleted_pool_node_is_draining_not_ready_and_the_pool_warns(temporal: WorkflowEnvironment) -> None:
    """A pool's node (the bridge telling its facts): after `kubectl delete node` the pool
    counts it Draining, not Ready, while its pods leave, and writes a Warning NodeDeleted Event
    naming it; the node then ends and nothing is left."""
    from tests.test_pool_races import about, gated_world, pool_events, pool_spec, start_pool
    from tests.test_watch_events import bridge_running, told
    from tgp.messages import pool_workflow_id
    from workflows.pool import GPUNodePoolWorkflow

    async with gated_world(temporal) as s, bridge_running(temporal, s.world, s.queue):
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        req = request(namespace="ml", pool=name, pool_workflow_id=pool_workflow_id("ml", name), timeouts=FAST.model_copy(update={"idle": None}))
        handle = await start(temporal, s.queue, req)
        s.workflow_ids.add(handle.id)
        await wait_phase(handle, NodePhase.READY)
        # A workload pod that takes a few seconds to stop: the drain lasts that long.
        async with httpx.AsyncClient(verify=default_tls(), base_url=s.world.kube_url) as kube:
            meta = {"name": "train", "namespace": "default", "annotations": {"tgp.io/sim-stop-seconds": "4"}}
            spec = {"nodeName": req.node_name, "containers": [{"name": "c", "image": "busybox"}], "terminationGracePeriodSeconds": 30}
            (await kube.post("/api/v1/namespaces/default/pods", json={"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})).raise_for_status()
            (await kube.patch("/api/v1/namespaces/default/pods/train/status", json={"status": {"phase": "Running"}}, headers={"Content-Type": MERGE_PATCH})).raise_for_status()
        await told(handle, busy_pods=1)

        async def ready_in_pool() -> bool:
            return (await pool.query(GPUNodePoolWorkflow.status)).ready_nodes == 1

        await eventually(ready_in_pool, what="the pool counting the node Ready")
        await kubectl_delete_node(s.world, req.node_name)
        await told(handle, deleting=True)

        async def draining_in_pool() -> bool:
            status = await pool.query(GPUNodePoolWorkflow.status)
            return status.ready_nodes == 0 and [n.phase for n in status.nodes if n.name == req.node_name] == [NodePhase.DRAINING.value]

        await eventually(draining_in_pool, what="the pool counting the node Draining, not Ready")

        async def warned() -> list[tuple[str, str]] | None:
            events = await pool_events(s, name)
            return events if about(events, "NodeDeleted", req.node_name) else None

        events = await eventually(warned, what="the pool's NodeDeleted Warning")
        assert any(r == "NodeDeleted" and "kubectl delete node" in m for r, m in events), events
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("deleted"), final
        assert_nothing_left(s.world, req.node_name)
        assert not await node_exists(s.world, req.node_name)


@pytest.mark.parametrize("way_out", ["evicted", "cancelled"])
async def test_every_way_out_removes_the_finalizer(temporal: WorkflowEnvironment, way_out: str) -> None:
    """The Node of a life that ends any other way (an evict, a cancel) carries tgp's finalizer
    until the release, which removes it as it deletes the Node: no Node is left stuck deleting."""
    async with running_world(temporal) as (world, _, queue):
        req = request()
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        node = await node_object(world, req.node_name)
        assert node is not None and FINALIZER_TERMINATION in node["metadata"].get("finalizers", [])
        if way_out == "evicted":
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            await asyncio.wait_for(handle.result(), ENDS_WITHIN)
        else:
            await handle.cancel()
            with pytest.raises(WorkflowFailureError):
                await asyncio.wait_for(handle.result(), ENDS_WITHIN)
        assert_nothing_left(world, req.node_name)
        assert await node_object(world, req.node_name) is None, "the Node is left, held by tgp's finalizer"


async def test_an_idle_node_removes_the_finalizer(temporal: WorkflowEnvironment) -> None:
    """An idle node's release removes the finalizer as it deletes the Node."""
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"idle": timedelta(seconds=3)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        node = await node_object(world, req.node_name)
        assert node is not None and FINALIZER_TERMINATION in node["metadata"].get("finalizers", [])
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert (final.end_reason or "").startswith("idle"), final.end_reason
        assert_nothing_left(world, req.node_name)
        assert await node_object(world, req.node_name) is None, "the Node is left, held by tgp's finalizer"


async def test_delete_node_removes_the_finalizer_and_keeps_others(kube_api: KubeApi) -> None:
    """`delete_node` (every release's last Kubernetes step) takes tgp's finalizer off, leaves
    another controller's, and deletes the Node; on a Node already deleted by hand, the removal
    of the last finalizer is its deletion. Real-cluster capable."""
    from sim.kube_kubelet import register_node

    for others in ([], ["example.com/keep"]):
        name = kube_api.unique("fin")
        await register_node(kube_api.url, name, client=kube_api.http)
        await kube_api.cluster.label_and_taint(name, {"tgp.io/managed": "true"}, [])
        node = await kube_api.get(f"/api/v1/nodes/{name}")
        assert node is not None and node["metadata"]["finalizers"] == [FINALIZER_TERMINATION]
        if others:
            patch = {"metadata": {"finalizers": [FINALIZER_TERMINATION, *others]}}
            (await kube_api.http.patch(f"/api/v1/nodes/{name}", json=patch, headers={"Content-Type": MERGE_PATCH})).raise_for_status()
        (await kube_api.http.delete(f"/api/v1/nodes/{name}")).raise_for_status()
        deleting = await kube_api.cluster.get_node(name)
        assert deleting is not None and deleting.deleting
        # A Node being deleted takes no new finalizer (the API refuses one): labelling it again is fine.
        await kube_api.cluster.label_and_taint(name, {"tgp.io/managed": "true", "x": "y"}, [])

        await kube_api.cluster.delete_node(name)
        left = await kube_api.get(f"/api/v1/nodes/{name}")
        if not others:
            assert left is None, left
            continue
        assert left is not None and left["metadata"]["finalizers"] == others, left
        (await kube_api.http.patch(f"/api/v1/nodes/{name}", json={"metadata": {"finalizers": None}}, headers={"Content-Type": MERGE_PATCH})).raise_for_status()
        await eventually(lambda n=name: _gone(kube_api, n), what="the Node gone")


async def _gone(kube_api: KubeApi, name: str) -> bool:
    return await kube_api.get(f"/api/v1/nodes/{name}") is None


def test_the_judge_ends_a_deleting_node_at_once_held_or_not() -> None:
    """Pure rule: a Node with a deletionTimestamp ends the watch now (`deleted`), even while
    do-not-disrupt pods hold it; `next_deadline` says so (the judge is asked at once)."""
    from datetime import datetime, timezone

    from tgp.lifecycle import EndReason, WatchState, judge_observation, next_deadline
    from tgp.types import Instance, InstanceState, NodeObservation, NodeSummary

    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    running = Instance(provider="sim", instance_id="i-1", name="n1", state=InstanceState.RUNNING)
    node = NodeSummary(name="n1", ready=True, gpus=1, deleting=True)
    obs = NodeObservation(instance=running, node=node, busy_pods=1, holders=["ml/train"], holding=1)
    state = WatchState(ready_at=now - timedelta(minutes=1), view=obs, seen_at=now)
    verdict = judge_observation(obs, state, now, FAST)
    assert verdict.end is EndReason.DELETED and "n1" in verdict.detail and not verdict.held
    assert next_deadline(state, FAST) == now
