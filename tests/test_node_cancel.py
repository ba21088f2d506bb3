"""`temporal workflow cancel` of a node, at any moment of its life, ends it `Cancelled` with
everything it bought released (issue 17 item 17). Against the simulated world over HTTP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import FAST, assert_nothing_left, node_exists, replay, request, start, wait_phase
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
        await replay(handle, "cancel_while_observing")


async def test_a_cancel_during_the_last_look_of_a_join_ends_cancelled_and_buys_nothing_more(temporal: WorkflowEnvironment) -> None:
    # The cancelled look came back as a failed look: the attempt failed over, the next offer
    # was bought, and the node went on to Ready as if nobody had cancelled it.
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail_boot("rtx4090-us-east", "never_joins")
        req = request(timeouts=FAST.model_copy(update={"tailnet_join": timedelta(seconds=2)}))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.LAUNCHING)  # the join waits inside the launch activity
        looked = world.cloud.describe_requests
        world.cloud.slow_describes(3600, count=1)  # the look at the join deadline hangs
        await eventually(lambda: asyncio.sleep(0, world.cloud.describe_requests > looked), what="the last look in flight")

        await handle.cancel()
        world.cloud.slow_describes(0)

        status = await ends_cancelled(handle)
        assert len(status.attempts) == 1, "a cancel is not a failed attempt: nothing else is bought"
        assert world.cloud.create_requests == 1
        # The cancelled launch answered what it bought: released by its id, not looked for by name.
        assert status.attempts[0].instance_id == list(world.cloud.instances)[0], status.attempts
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
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        (await kube.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()
        running = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        path = "/api/v1/namespaces/ml/pods/trainer/status"
        (await kube.patch(path, json=running, headers={"Content-Type": "application/merge-patch+json"})).raise_for_status()


# --- the property: a cancel or an evict at any moment of a life releases everything ----------

# Where in a life to strike: once the node is seen in this phase (TERMINATING: during the
# cleanup after an evict), and then this much later, so the strike lands at the phase's start,
# in the middle of one of its activities, or between them.
STRIKE_PHASES = (NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING, NodePhase.READY, NodePhase.TERMINATING)
STRIKE_DELAYS = (0.0, 0.05, 0.2, 0.6)


@pytest.fixture(scope="module")
async def shared_world(temporal: WorkflowEnvironment) -> AsyncIterator[tuple[WorkflowEnvironment, SimWorld, str]]:
    """One simulated world and worker for every generated life (each has its own node name).

    On the dev server, not the time-skipping one: no timer of these lives needs skipping (no
    idle timeout, a 1 s watch), and the Java test server answers a workflow task that cancels an
    activity scheduled but not yet started with ACTIVITY_UNKNOWN, forever (a fault of that
    server: the dev server, a real Temporal, accepts it), which would hang such an example."""
    async with running_world(temporal, boot_delay=0.05) as (world, _, queue):
        yield temporal, world, queue


LIFE_ORDER = (NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING, NodePhase.READY, NodePhase.DRAINING, NodePhase.TERMINATING)


async def reached(handle: WorkflowHandle, phase: NodePhase) -> NodeStatus:
    """The node's status once it is in `phase` or past it (a short phase may be over before a
    look sees it; the strike then lands a little later, which is just another moment)."""

    async def check() -> NodeStatus | None:
        status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
        past = status.phase.is_final or status.phase is NodePhase.TERMINATION_STUCK or LIFE_ORDER.index(status.phase) >= LIFE_ORDER.index(phase)
        return status if past else None

    return await eventually(check, timeout=60, what=f"phase {phase.value} or later")


@settings(max_examples=15)
@given(
    strike=st.sampled_from(["cancel", "evict"]),
    phase=st.sampled_from(STRIKE_PHASES),
    delay=st.sampled_from(STRIKE_DELAYS),
    slow_look=st.booleans(),
)
async def test_a_cancel_or_evict_at_any_moment_releases_everything(
    shared_world: tuple[WorkflowEnvironment, SimWorld, str], strike: str, phase: NodePhase, delay: float, slow_look: bool
) -> None:
    env, world, queue = shared_world
    req = request(timeouts=FAST.model_copy(update={"idle": None, "watch_interval": timedelta(seconds=1)}))
    handle = await start(env, queue, req)
    if phase is NodePhase.TERMINATING:  # strike during the cleanup of an evicted node
        await reached(handle, NodePhase.READY)
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "first"})
    await reached(handle, phase)
    if slow_look:
        world.cloud.slow_describes(0.5, count=1)  # the next look at the instance is in flight longer
    await asyncio.sleep(delay)
    first_evicted = phase is NodePhase.TERMINATING
    ended_before = (await handle.describe()).status is not WorkflowExecutionStatus.RUNNING
    try:
        if strike == "cancel":
            await handle.cancel()
        elif not ended_before:
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "generated"})
    except RPCError:
        # The evicted node's cleanup may finish between the look above and the strike: a
        # cancel or signal to a closed workflow is refused. Only an evicted node ends alone.
        if not first_evicted:
            raise
        ended_before = True
    try:
        final: NodeStatus | None = await asyncio.wait_for(handle.result(), 120)
    except WorkflowFailureError:
        final = None
    world.cloud.slow_describes(0)

    status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
    if strike == "cancel" and first_evicted and final is not None:
        # The cleanup of the evict finished before the cancel landed (or it landed after).
        assert final.phase is NodePhase.TERMINATED, (final, status)
    elif strike == "cancel" and not ended_before:
        # A cancel during the cleanup of an evict lets the cleanup finish, then ends Cancelled.
        assert status.phase is NodePhase.CANCELLED, status
        assert final is None and (await handle.describe()).status is WorkflowExecutionStatus.CANCELED
    else:
        assert final is not None and final.phase is NodePhase.TERMINATED, (final, status)
        assert first_evicted or final.end_reason in ("evicted: generated", "evicted before Ready: generated"), final
    assert [i.id for i in world.cloud.live_instances() if i.name.startswith(f"tgp-{req.node_name}-")] == [], "an instance is still billing"
    assert world.tailnet_devices(req.node_name) == [], "a tailnet device was left"
    assert not await node_exists(world, req.node_name), "the Node object was left"
    assert world.usable_keys() == [], "an unrevoked tailnet key was left"


async def test_an_evict_during_the_buy_ends_the_node_evicted_not_its_offer_failed(temporal: WorkflowEnvironment) -> None:
    # The evict's cancel cut the launch's create short, and the workflow took the cancelled launch
    # for the offer's failure: a failed attempt, the offer blocked for every node of the worker.
    async with running_world(temporal) as (world, _, queue):
        world.cloud.hold_creates()  # the create reaches the cloud (which buys) and is not answered
        req = request()
        handle = await start(temporal, queue, req)
        await asyncio.wait_for(world.cloud.create_arrived.wait(), 60)
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "not needed after all"})

        async def launch_cancelled() -> bool:
            return "EVENT_TYPE_ACTIVITY_TASK_CANCELED" in [EventType.Name(e.event_type) async for e in handle.fetch_history_events()]

        await eventually(launch_cancelled, what="the launch cancelled in its create")
        world.cloud.release_creates()
        final: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("evicted before Ready"), final
        assert [a.outcome for a in final.attempts] == [""] and not (final.last_error or "").startswith("attempt 1"), final.attempts
        assert world.cloud.create_requests == 1
        assert_nothing_left(world, req.node_name)  # what the cut create bought, found by its name
