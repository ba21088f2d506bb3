"""Offer failover across providers. A worker killed in the middle of buying an instance is the
fault matrix's cell launch x worker-kill (tests/test_fault_matrix.py: the create held at the
cloud, the worker SIGKILLed, exactly one instance bought per launch attempt)."""

from __future__ import annotations

import dataclasses
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta
from decimal import Decimal

from pydantic import SecretStr
from temporalio.testing import WorkflowEnvironment

from activities.node import NodeActivities
from activities.clouds.simulated import SimulatedProvider
from tests.conftest import running_world
from tests.test_node_lifecycle import assert_nothing_left, request, start, wait_phase
from sim.cloud import SimOffer
from sim.world import sim_world
from tgp.types import NodePhase, OfferRequirements
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow


async def test_capacity_error_on_the_cheapest_provider_fails_over_and_the_next_node_skips_it(temporal: WorkflowEnvironment) -> None:
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        cheap = await world.add_cloud((SimOffer("rtx4090-cheap", "RTX4090", "us-east", Decimal("0.35")),))
        pricier = await world.add_cloud((SimOffer("rtx4090-dear", "RTX4090", "us-east", Decimal("0.52")),))
        cheap.set_capacity("rtx4090-cheap", False)
        adapters = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        providers = {
            "alpha": SimulatedProvider(cheap.url, name="alpha", api_key=SecretStr(world.cloud_api_key)),
            "beta": SimulatedProvider(pricier.url, name="beta", api_key=SecretStr(world.cloud_api_key)),
        }
        for p in providers.values():
            stack.push_async_callback(p.aclose)
        activities = NodeActivities(providers=providers, tailnets=adapters.node.tailnets, cluster=adapters.node.cluster, poll_interval=timedelta(seconds=0.1))
        queue = f"failover-{uuid.uuid4().hex[:6]}"
        await stack.enter_async_context(
            make_worker(temporal.client, dataclasses.replace(adapters, node=activities), task_queue=queue)
        )
        requirements = OfferRequirements(gpu_types=["RTX4090"], providers=["alpha", "beta"])

        first = await start(temporal, queue, request(requirements=requirements, unavailable_offer_ttl=timedelta(minutes=10)))
        ready = await wait_phase(first, NodePhase.READY)
        assert [a.offer.provider for a in ready.attempts] == ["alpha", "beta"]
        assert ready.provider == "beta" and ready.hourly_price == Decimal("0.52")

        second = await start(temporal, queue, request(requirements=requirements))
        ready2 = await wait_phase(second, NodePhase.READY)
        assert [a.offer.provider for a in ready2.attempts] == ["beta"], "the failed offer is skipped while cached"
        assert cheap.create_requests == 1, "the sold-out provider was asked once, not per node"

        for handle in (first, second):
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            await handle.result()
        assert cheap.live_instances() == [] and pricier.live_instances() == []


async def test_a_refused_offer_fails_over_and_is_skipped_by_the_next_node(temporal: WorkflowEnvironment) -> None:
    """A provider refusing one offer (withdrawn, not sold in that region) is not a broken class:
    the node moves to the next offer, and the refused one is out of rotation for a while."""
    async with running_world(temporal) as (world, _, queue):
        world.cloud.refuse_offer("rtx4090-us-east")
        first = await start(temporal, queue, request(unavailable_offer_ttl=timedelta(minutes=10)))
        ready = await wait_phase(first, NodePhase.READY)
        assert [a.offer.offer_id for a in ready.attempts] == ["rtx4090-us-east", "rtx4090-eu-west"]
        assert "OfferRefused" in (ready.attempts[0].outcome or "")

        second = await start(temporal, queue, request())
        ready2 = await wait_phase(second, NodePhase.READY)
        assert [a.offer.offer_id for a in ready2.attempts] == ["rtx4090-eu-west"], "the refused offer is skipped while cached"
        for handle in (first, second):
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            assert (await handle.result()).phase is NodePhase.TERMINATED
        assert world.cloud.live_instances() == []
