"""A node is Ready for tgp only once its GPUs are (issue 17 item 16): like Karpenter's
RequestedResourcesRegistered, the join waits until the Node's allocatable nvidia.com/gpu
reaches the offer's count, and a node whose driver never registers them fails over."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import running_world
from sim.kube_kubelet import register_node
from tests.kube_env import KubeApi
from tests.test_node_lifecycle import FAST, assert_nothing_left, replay, request, start, wait_phase
from tgp.types import GPU_RESOURCE, NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow


async def test_a_node_whose_gpus_never_register_fails_its_join_and_fails_over(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail_boot("rtx4090-us-east", "gpus_never_register")  # Ready, allocatable nvidia.com/gpu: 0
        req = request(timeouts=FAST.model_copy(update={"gpu_registration": timedelta(seconds=2)}))
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)

        first, second = ready.attempts
        assert first.offer.offer_id == "rtx4090-us-east"
        assert "join timeout" in first.outcome and GPU_RESOURCE in first.outcome and "0 of 1 GPUs" in first.outcome, first.outcome
        assert world.cloud.instances[first.instance_id or ""].status == "terminated"
        assert second.offer.offer_id == "rtx4090-eu-west" and [i.id for i in world.cloud.live_instances()] == [second.instance_id]
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            node = (await kube.get(f"/api/v1/nodes/{req.node_name}")).json()
        assert node["status"]["allocatable"][GPU_RESOURCE] == "1", "the node that is Ready has its GPU"

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED
        assert_nothing_left(world, req.node_name)
        await replay(handle, "gpus_never_register_failover")


async def test_the_cluster_adapter_reads_a_nodes_allocatable_gpus(kube_api: KubeApi) -> None:
    eight, none = kube_api.unique("eight"), kube_api.unique("none")
    await register_node(kube_api.url, eight, gpus=8, client=kube_api.http)
    await register_node(kube_api.url, none, gpus=0, client=kube_api.http)
    await kube_api.create_node(bare := kube_api.unique("bare"))  # no status reported yet

    assert [(await kube_api.cluster.get_node(n)).gpus for n in (eight, none, bare)] == [8, 0, 0]  # type: ignore[union-attr]
