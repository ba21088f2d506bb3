"""Two edges of a node's life that only the deadline and the drain reach (commit e9dba0c):

* the join's last look at the tailnet stage's deadline asks for the instance and its device
  only: a device that joined while the Node was still coming up keeps the node (no failover,
  the offer stays in rotation), and the Node is the next stage's wait;
* a drain whose release left the tailnet cleanup to the workflow shows Terminating (search
  attribute, what listings and `tgp status NODE` find) while the workflow's release retries it.

GPUNodeWorkflow on the real dev server against the simulated world over HTTP. Every wait is on
an event (a history event, a request log, a phase), never on the clock."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio.testing import WorkflowEnvironment

from activities.search_attributes import SA_PHASE
from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import FAST, assert_nothing_left, node_exists, request, start, wait_phase
from tgp.types import NodePhase, NodeStatus, Stage
from workflows.node import GPUNodeWorkflow

DEVICE_DELETES = "/api/v2/device/*"
# Fails "for a while": until the test clears the faults.
UNTIL_CLEARED = 1_000_000


def hold_kubelets(world: SimWorld) -> asyncio.Event:
    """Machines booted from now on join the tailnet at once but start their kubelet (register
    their Node) only once the returned event is set: a kubelet or GPU driver still coming up.
    The simulated cloud has no knob for it: its boot calls `_node_register` after the tailnet
    join, and this wraps it."""
    kubelets_may_start = asyncio.Event()
    register = world.cloud._node_register
    assert register is not None

    async def late_kubelet(name: str, labels: dict[str, str], gpus: int, taints: list[dict[str, str]]) -> object:
        await kubelets_may_start.wait()
        return await register(name, labels, gpus, taints)

    world.cloud._node_register = late_kubelet
    return kubelets_may_start


async def test_a_device_joined_by_the_deadline_keeps_the_node_while_its_node_registers_later(temporal: WorkflowEnvironment) -> None:
    """The tailnet stage is the instance and its device: at its deadline a device that is there
    keeps the node even though its Node is not registered yet (its kubelet comes up later, well
    within node_ready). Looking for the Node too failed this node over: its instance released,
    its offer out of rotation, a second instance bought."""
    async with running_world(temporal) as (world, _, queue):
        kubelets_may_start = hold_kubelets(world)
        world.cloud.hold_boots()
        # The tailnet stage's deadline is launch + tailnet_join from the join's start.
        req = request(timeouts=FAST.model_copy(update={"launch": timedelta(seconds=8), "tailnet_join": timedelta(seconds=1)}))
        handle = await start(temporal, queue, req)
        try:
            await eventually(lambda: asyncio.sleep(0, world.cloud.create_requests == 1), what="the instance bought")
            # The join's wait sees no device before its deadline: its next device listing (made
            # before the machine boots) hangs past it; the last look's answers at once.
            world.tailscale.slow_device_lists(3600, count=1)
            world.cloud.release_boots()
            await eventually(lambda: asyncio.sleep(0, world.tailnet_devices(req.node_name)), what="the device to join the tailnet")
            assert not await node_exists(world, req.node_name), "the Node is not registered at the deadline"

            async def past_the_tailnet_stage() -> NodeStatus | None:
                status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
                return status if Stage.TAILNET_JOINED.value in status.stage_times or len(status.attempts) > 1 else None

            joined = await eventually(past_the_tailnet_stage, what="the tailnet stage kept or failed over")
            assert [(a.offer.offer_id, a.outcome) for a in joined.attempts] == [("rtx4090-us-east", "launched")], (
                f"a node whose device had joined was failed over: {joined.last_error}"
            )
            assert joined.phase is NodePhase.JOINING and Stage.NODE_READY.value not in joined.stage_times

            kubelets_may_start.set()  # the kubelet comes up, within node_ready
            ready = await wait_phase(handle, NodePhase.READY, timeout=60)
            assert [(a.offer.offer_id, a.outcome) for a in ready.attempts] == [("rtx4090-us-east", "launched")]
            assert ready.last_error is None, ready.last_error
            assert world.cloud.create_requests == 1, "a second instance was bought"
            assert [i.id for i in world.cloud.live_instances()] == [ready.instance_id]
            assert [entry for entry in world.cloud.log if entry[0] == "deleted"] == [], "the joined instance was terminated"
        finally:
            kubelets_may_start.set()
            world.tailscale.slow_device_lists(0)

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED, final
        assert_nothing_left(world, req.node_name)


def failed_device_deletes(world: SimWorld) -> int:
    return sum(1 for r in world.tailscale.requests if r.method == "DELETE" and r.path.startswith("/api/v2/device/") and r.status >= 500)


async def test_a_drain_that_left_the_tailnet_cleanup_to_the_release_shows_terminating_while_it_retries(temporal: WorkflowEnvironment) -> None:
    """The drain releases the instance, but the tailnet's device delete fails: the workflow's
    release retries it, and the node's phase says Terminating meanwhile (not Draining, its last
    upsert before the fix), then nothing is left."""
    async with running_world(temporal) as (world, _, queue):
        req = request()
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        world.tailscale.fail(DEVICE_DELETES, 500, times=UNTIL_CLEARED, method="DELETE", message="device delete failing")
        try:
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            listed = f"WorkflowId = '{req.workflow_id}' AND TgpPhase = '{NodePhase.TERMINATING.value}'"

            shown: list[str | None] = []

            async def shown_terminating() -> bool:
                shown.append((await handle.describe()).typed_search_attributes.get(SA_PHASE))
                if shown[-1] != NodePhase.TERMINATING.value or failed_device_deletes(world) == 0:
                    return False
                return await anext(aiter(temporal.client.list_workflows(listed)), None) is not None

            try:
                await eventually(shown_terminating, timeout=60, what="the node listed Terminating while its device delete fails")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: its TgpPhase said {shown[-1]!r} after {failed_device_deletes(world)} failed device deletes") from None
            # Its drain is over (the instance released), its release waits on the tailnet. (No
            # status query here: it waits for the workflow task that the retries hold open.)
            assert world.cloud.live_instances() == [], "the drain released the instance"
            assert world.tailnet_devices(req.node_name), "the device is still there"
        finally:
            world.tailscale._faults.clear()  # the tailnet answers again: the release's next try deletes the device

        final: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert final.phase is NodePhase.TERMINATED, final
        assert (await handle.describe()).typed_search_attributes.get(SA_PHASE) == NodePhase.TERMINATED.value
        assert Stage.RELEASED.value in final.stage_times
        assert world.cloud.delete_requests == 1, "the drain's terminate was the only one"
        deleted = [r for r in world.tailscale.requests if r.method == "DELETE" and r.path.startswith("/api/v2/device/") and r.status == 200]
        assert len(deleted) == 1, "the release's retry deleted the device"
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)
