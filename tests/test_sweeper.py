"""The sweeper removes what no running node workflow owns, after a grace, and nothing else."""

from __future__ import annotations

import uuid
from typing import Any
from datetime import timedelta

import httpx
from pydantic import SecretStr
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from activities.sweeper import Orphan, SweepInput, node_of_instance
from activities.tailnets.tailscale import TailscaleTailnet
from tests.conftest import running_world
from tests.test_node_lifecycle import node_exists, request, start, wait_phase
from tgp.messages import class_workflow_id
from sim.world import NODE_TAG, SimWorld
from tgp.types import NodePhase, instance_name
from workers.main import SWEEPER_SCHEDULE_ID, ensure_sweeper_schedule
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.sweeper import SweeperWorkflow, SweepRequest


def test_node_names_are_read_from_instance_names() -> None:
    assert node_of_instance("tgp-gpu-a1b2c-3") == "gpu-a1b2c"
    assert node_of_instance("tgp-pool-x-12345-1") == "pool-x-12345"
    assert node_of_instance("someone-elses-vm") is None
    assert node_of_instance("tgp-no-attempt") is None


async def buy(world: SimWorld, *names: str) -> list[dict[str, Any]]:
    """Instances bought behind tgp's back, as the simulated cloud answers their creates."""
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.cloud.url, headers={"Authorization": f"Bearer {world.cloud_api_key}"}) as cloud:
        return [(await cloud.post("/v1/instances", json={"offerId": "l40s-us-east", "name": name})).json() for name in names]


async def test_orphans_are_removed_and_live_nodes_kept(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        live = request()
        handle = await start(temporal, queue, live)
        ready = await wait_phase(handle, NodePhase.READY)

        # What a workflow terminated by hand leaves behind: an instance and a tailnet device.
        ghost, other = await buy(world, "tgp-ghost-1", "not-ours")
        async with TailscaleTailnet(base_url=world.tailscale.url, client_id=world.oauth_client_id, client_secret=SecretStr(world.oauth_client_secret)) as ts:
            key = await ts.mint_auth_key(hostname="ghost", tags=[NODE_TAG], expiry=timedelta(hours=1))
        world.tailscale.register(key.secret.get_secret_value(), "ghost")

        removed: list[Orphan] = await temporal.client.execute_workflow(
            SweeperWorkflow.run, SweepRequest(sweep=SweepInput(tags=[NODE_TAG]), grace=timedelta(seconds=1)), id="sweep-test", task_queue=queue
        )

        assert {(o.kind, o.name) for o in removed} == {("instance", "tgp-ghost-1"), ("device", "ghost")}
        assert world.cloud.instances[ghost["id"]].status == "terminated"
        assert world.cloud.instances[other["id"]].status != "terminated", "not ours: never touched"
        assert world.cloud.instances[ready.instance_id or ""].status == "running", "a live node keeps its instance"
        assert world.tailnet_devices(live.node_name) and not world.tailnet_devices("ghost")
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()


async def test_the_sweeper_schedule_is_created_once(temporal: WorkflowEnvironment) -> None:
    await ensure_sweeper_schedule(temporal.client, "nowhere")
    await ensure_sweeper_schedule(temporal.client, "nowhere")  # a second worker starting
    handle = temporal.client.get_schedule_handle(SWEEPER_SCHEDULE_ID)
    try:
        desc = await handle.describe()
        assert desc.schedule.spec.intervals[0].every == timedelta(minutes=15)
    finally:
        await handle.delete()


async def test_a_node_workflow_terminated_by_hand_leaves_nothing_after_a_sweep(temporal: WorkflowEnvironment) -> None:
    """The sweeper removes the instance and the tailnet device, deletes the Node object and
    gives the class its budget back (the class's own resync would too, a minute later)."""
    from tests.test_entities_heal import start_class

    async with running_world(temporal) as (world, _, queue):
        klass = f"sweep-{uuid.uuid4().hex[:6]}"
        ledger = await start_class(temporal, queue, klass)
        req = request(node_class=klass, class_workflow_id=class_workflow_id(klass))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        assert req.workflow_id in (await ledger.query(GPUNodeClassWorkflow.budget)).reservations
        await handle.terminate("by hand")

        removed: list[Orphan] = await temporal.client.execute_workflow(
            SweeperWorkflow.run, SweepRequest(sweep=SweepInput(tags=[NODE_TAG]), grace=timedelta(seconds=1)), id=f"sweep-{uuid.uuid4().hex[:6]}", task_queue=queue
        )

        assert {o.kind for o in removed} == {"instance", "device"}
        assert world.cloud.live_instances() == []
        assert not await node_exists(world, req.node_name), "the Node object the workflow left is deleted"
        assert req.workflow_id not in (await ledger.query(GPUNodeClassWorkflow.budget)).reservations, "the budget is given back"
        await ledger.terminate("test finished")


async def test_an_instance_named_after_a_running_node_but_not_its_own_is_ended_and_the_recorded_one_kept(temporal: WorkflowEnvironment) -> None:
    """A twin a late create bought under a running node's name bills like any orphan: once
    older than the consistency window (the simulated cloud's is 0), the sweeper ends it,
    verified, and keeps the instance the node recorded (issue 17, item 4)."""
    async with running_world(temporal) as (world, _, queue):
        req = request()
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)
        [stray] = await buy(world, instance_name(req.node_name, 1))
        world.cloud.model.next_terminates("lie")  # the first terminate answers 200 and does nothing

        removed: list[Orphan] = await temporal.client.execute_workflow(
            SweeperWorkflow.run, SweepRequest(sweep=SweepInput(tags=[NODE_TAG]), grace=timedelta(seconds=1)), id=f"sweep-{uuid.uuid4().hex[:6]}", task_queue=queue
        )
        assert [(o.kind, o.id) for o in removed] == [("stray", stray["id"])]
        assert world.cloud.instances[stray["id"]].status == "terminated", "a terminate that lied was verified and sent again"
        assert world.cloud.instances[ready.instance_id or ""].status == "running", "the recorded instance is kept"
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()
        assert world.cloud.live_instances() == []
