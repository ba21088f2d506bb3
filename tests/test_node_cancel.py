"""`temporal workflow cancel` of a node, at any moment of its life, ends it `Cancelled` with
everything it bought released (issue 17 item 17). Against the simulated world over HTTP."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import httpx
import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import FAST, assert_nothing_left, node_exists, request, start, wait_phase
from tgp.types import NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow


async def ends_cancelled(handle: WorkflowHandle) -> NodeStatus:
    with pytest.raises(WorkflowFailureError):
        await asyncio.wait_for(handle.result(), 60)
    assert (await handle.describe()).status is WorkflowExecutionStatus.CANCELED
    status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
    assert status.phase is NodePhase.CANCELLED, status
    return status


async def test_a_cancel_that_lands_while_observe_runs_ends_the_node(temporal: WorkflowEnvironment) -> None:
    # The watch loop caught the cancelled observe as an API outage and carried on watching: the
    # workflow stayed Running and the machine kept billing.
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"watch_interval": timedelta(seconds=1)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)

        looked = world.cloud.describe_requests
        world.cloud.slow_describes(3600, count=1)  # the next look hangs in the provider's API
        await eventually(lambda: asyncio.sleep(0, world.cloud.describe_requests > looked), what="an observe in flight")
        await handle.cancel()
        world.cloud.slow_describes(0)

        await ends_cancelled(handle)
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)


async def test_a_cancel_during_the_last_look_of_a_join_ends_cancelled_and_buys_nothing_more(temporal: WorkflowEnvironment) -> None:
    # The cancelled look came back as a failed look: the attempt failed over, the next offer
    # was bought, and the node went on to Ready as if nobody had cancelled it.
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail_boot("rtx4090-us-east", "never_joins")
        req = request(timeouts=FAST.model_copy(update={"tailnet_join": timedelta(seconds=2)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.JOINING)
        looked = world.cloud.describe_requests
        world.cloud.slow_describes(3600, count=1)  # the look at the join deadline hangs
        await eventually(lambda: asyncio.sleep(0, world.cloud.describe_requests > looked), what="the last look in flight")

        await handle.cancel()
        world.cloud.slow_describes(0)

        status = await ends_cancelled(handle)
        assert len(status.attempts) == 1, "a cancel is not a failed attempt: nothing else is bought"
        assert world.cloud.create_requests == 1
        assert_nothing_left(world, req.node_name)


async def test_a_cancel_during_the_drain_ends_cancelled_not_failed(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        req = request(timeouts=FAST.model_copy(update={"drain": timedelta(minutes=10)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await world_pod(world, req.node_name, grace=3600)  # its shutdown keeps the drain waiting

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await wait_phase(handle, NodePhase.DRAINING)
        await handle.cancel()

        status = await ends_cancelled(handle)
        assert status.last_error is None or "Cancelled" not in status.last_error
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)


async def world_pod(world: SimWorld, node: str, *, grace: int) -> None:
    """A running Job pod on `node` whose shutdown takes `grace` seconds."""
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "trainer", "namespace": "ml", "ownerReferences": [
            {"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "u-1", "controller": True},
        ]},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "pytorch"}], "terminationGracePeriodSeconds": grace},
    }
    async with httpx.AsyncClient(base_url=world.kube_url) as kube:
        (await kube.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()
        running = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        path = "/api/v1/namespaces/ml/pods/trainer/status"
        (await kube.patch(path, json=running, headers={"Content-Type": "application/merge-patch+json"})).raise_for_status()
