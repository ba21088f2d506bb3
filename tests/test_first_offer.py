"""The pool's start chooses a node's first offer (issue 37): the run starts Launching, its
search attributes set by the start, and buys that offer without choosing one itself; each
upsert of a phase carries only what changed. A start whose choice fails leaves it to the node."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.search_attributes import SA_GPU_TYPE, SA_HOURLY_PRICE, SA_INSTANCE_ID, SA_PHASE, SA_PROVIDER, SA_READY_SINCE, start_attributes
from sim.world import SimWorld
from tests.test_launch_settles import quick_world
from tests.test_node_lifecycle import request, wait_phase
from tgp.node import NodeWorkflowInput
from tgp.types import BlockScope, NodePhase, NodeRequest, OfferBlock, OfferRequirements, SelectOfferInput, Stage
from workers.main import Activities, make_worker
from workflows.node import GPUNodeWorkflow


async def world_with_a_worker(stack: AsyncExitStack, temporal: WorkflowEnvironment) -> tuple[SimWorld, Activities, str]:
    """A quick simulated world, its activities and a worker on a task queue of its own."""
    world, activities = await quick_world(stack)
    queue = f"first-offer-{uuid.uuid4().hex[:8]}"
    await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
    return world, activities, queue


async def start_as_the_pool_does(temporal: WorkflowEnvironment, queue: str, req: NodeRequest) -> WorkflowHandle:
    """The node's run started as the pool's start starts it: its request and first attributes."""
    return await temporal.client.start_workflow(
        GPUNodeWorkflow.run, NodeWorkflowInput(request=req), id=req.workflow_id, task_queue=queue, search_attributes=start_attributes(req)
    )


async def test_a_node_started_with_its_offer_starts_launching_and_buys_that_offer(temporal: WorkflowEnvironment) -> None:
    async with AsyncExitStack() as stack:
        world, activities, queue = await world_with_a_worker(stack, temporal)
        req = await activities.pool._offered(request())
        assert req.offer is not None
        assert req.offer == (await activities.node.select_offer(SelectOfferInput(requirements=req.requirements))).offer, "the node's own choice"

        handle = await start_as_the_pool_does(temporal, queue, req)
        at_start = (await handle.describe()).typed_search_attributes
        assert (at_start.get(SA_PHASE), at_start.get(SA_PROVIDER), at_start.get(SA_GPU_TYPE)) == ("Launching", req.offer.provider, req.offer.gpu_type)
        assert at_start.get(SA_HOURLY_PRICE) == float(req.offer.hourly_price)

        status = await wait_phase(handle, NodePhase.READY)
        assert [a.offer for a in status.attempts] == [req.offer]
        assert [i.offer.id for i in world.cloud.live_instances()] == [req.offer.offer_id]
        assert Stage.PENDING not in {s.stage for s in status.stages}, "never Pending: it started with its offer"
        ready = (await handle.describe()).typed_search_attributes
        assert (ready.get(SA_PHASE), ready.get(SA_PROVIDER), ready.get(SA_INSTANCE_ID)) == ("Ready", req.offer.provider, status.instance_id)
        assert ready.get(SA_READY_SINCE) is not None
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test over"})
        await handle.result()


async def test_a_start_that_finds_no_offer_leaves_the_choice_and_its_message_to_the_node(temporal: WorkflowEnvironment) -> None:
    async with AsyncExitStack() as stack:
        _, activities = await quick_world(stack)
        nothing = request(requirements=OfferRequirements(gpu_types=["NoSuchGPU"]))
        assert await activities.pool._offered(nothing) == nothing
        assert start_attributes(nothing).get(SA_PHASE) == "Pending"


async def test_an_offer_blocked_after_the_start_chose_it_is_not_bought_and_the_node_fails_over(temporal: WorkflowEnvironment) -> None:
    """Another node's failure blocks the offer between the pool's start and the node's launch:
    the launch refuses it before settling or buying anything, and the next offer is chosen."""
    async with AsyncExitStack() as stack:
        world, activities, queue = await world_with_a_worker(stack, temporal)
        req = await activities.pool._offered(request())
        assert req.offer is not None
        activities.node.unavailable.mark(OfferBlock(scope=BlockScope.OFFER, provider=req.offer.provider, offer_key=req.offer.key), timedelta(minutes=3))
        handle = await start_as_the_pool_does(temporal, queue, req)
        status = await wait_phase(handle, NodePhase.READY)
        assert [a.offer.key for a in status.attempts][0] == req.offer.key and status.attempts[-1].offer.key != req.offer.key
        assert req.offer.offer_id not in [i.offer.id for i in world.cloud.instances.values()], "the blocked offer was bought"
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test over"})
        await handle.result()


async def test_a_start_whose_choice_takes_too_long_leaves_it_to_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold listing behind a provider's pacer must not hold the pool's starts: past
    FIRST_OFFER_TIMEOUT the request goes without an offer (the node chooses, Pending)."""
    async with AsyncExitStack() as stack:
        _, activities = await quick_world(stack)
        monkeypatch.setattr("activities.pool.FIRST_OFFER_TIMEOUT", timedelta(milliseconds=50))
        hang = asyncio.Event()

        async def slow_listing(adapter: object) -> object:
            await hang.wait()  # never set: a listing that does not answer
            raise AssertionError("unreachable")

        monkeypatch.setattr(activities.pool.registry, "list_offers", slow_listing)
        req = request()
        assert await activities.pool._offered(req) == req
