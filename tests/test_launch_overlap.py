"""A launch never overlaps itself: a slow or unanswered create buys exactly one instance, the
workflow records the one that joins, and termination ends every instance of the name.

The simulated cloud behaves like real ones here: names are not unique (two creates buy two
instances), a create can take longer than the caller's API-call timeout, and a create can
answer 503 after it bought the instance.
"""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from pydantic import SecretStr
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.node import NodeActivities
from activities.clouds.simulated import SimulatedProvider
from tests.conftest import running_world
from tests.test_node_lifecycle import FAST, assert_nothing_left, request, start, wait_phase
from sim.cloud import SimulatedCloud
from sim.fakeserver import GATEWAY_404_HTML, GATEWAY_404_TEXT
from sim.world import SimWorld, sim_world
from tgp.errors import ConfigError
from tgp.types import BootPayload, InstanceRef, NodePhase, NodeStatus, Offer, instance_name
from workflows.node import GPUNodeWorkflow


async def _live_one_node(world: SimWorld, temporal: WorkflowEnvironment, task_queue: str, api_call: timedelta) -> None:
    req = request(timeouts=FAST.model_copy(update={"api_call": api_call, "launch": timedelta(seconds=40)}))
    handle = await start(temporal, task_queue, req)
    ready = await wait_phase(handle, NodePhase.READY, timeout=60)
    name = instance_name(req.node_name, 1)
    bought = [i.id for i in world.cloud.instances.values() if i.name == name]
    assert bought == [ready.instance_id], f"bought {bought} under one name; the workflow recorded {ready.instance_id}"
    await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
    final: NodeStatus = await handle.result()
    assert final.phase is NodePhase.TERMINATED
    assert world.cloud.max_live_per_name.get(name) == 1, "two instances with the same name were alive at once"
    assert_nothing_left(world, req.node_name)


async def test_a_create_slower_than_the_api_call_timeout_buys_one_instance(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, task_queue):
        world.cloud.slow_creates(6.0)  # twice the API-call timeout below
        await _live_one_node(world, temporal, task_queue, api_call=timedelta(seconds=3))
        assert world.cloud.create_requests == 1, "the slow create was retried beside itself"


async def test_a_create_answering_503_after_buying_is_adopted_not_bought_again(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, task_queue):
        world.cloud.fail_creates_after_buying(3)
        await _live_one_node(world, temporal, task_queue, api_call=timedelta(seconds=10))
        assert world.cloud.create_requests == 1, "a create that had bought was sent again"


async def test_terminate_ends_every_live_instance_carrying_the_attempt_name() -> None:
    async with sim_world(boot_delay=60) as world:
        provider = SimulatedProvider(world.cloud.url, api_key=SecretStr(world.cloud_api_key))
        offer = Offer(provider="simulated", offer_id="rtx4090-us-east", gpu_type="RTX4090", region="us-east", hourly_price=Decimal("0.44"))
        name = instance_name("gpu-twins", 1)
        boot = BootPayload(kind="env", content="", hostname="gpu-twins")
        first = await provider.launch(offer, name=name, boot=boot)
        await provider.launch(offer, name=name, boot=boot)  # a twin, as an overlapping create buys
        assert len(world.cloud.live_named(name)) == 2
        activities = NodeActivities(providers={"simulated": provider}, tailnets={}, cluster=None)  # type: ignore[arg-type]
        ref = InstanceRef(provider="simulated", instance_name=name, instance_id=first.instance_id)
        assert await ActivityEnvironment().run(activities.terminate_instance, ref) is True
        assert world.cloud.live_named(name) == []
        await provider.aclose()


SIM_KEY = "sim-key-0123456789"
SIM_OFFER = Offer(provider="simulated", offer_id="rtx4090-us-east", gpu_type="RTX4090", region="us-east", hourly_price=Decimal("0.44"))


async def test_a_404_in_the_simulated_clouds_own_words_is_gone() -> None:
    async with SimulatedCloud(api_key=SIM_KEY, boot_delay=60) as cloud:
        async with SimulatedProvider(cloud.url, api_key=SecretStr(SIM_KEY)) as provider:
            assert await provider.describe("no-such-instance") is None  # 404 {"error": {"code": "not-found"}}
            await provider.terminate("no-such-instance")  # already gone counts as done


@pytest.mark.parametrize("page", [GATEWAY_404_TEXT, GATEWAY_404_HTML, {"message": "Not Found"}], ids=["text", "nginx", "gateway-json"])
async def test_a_404_that_is_not_the_simulated_clouds_is_not_read_as_gone(page: object) -> None:
    async with SimulatedCloud(api_key=SIM_KEY, boot_delay=60) as cloud:
        async with SimulatedProvider(cloud.url, api_key=SecretStr(SIM_KEY)) as provider:
            boot = BootPayload(kind="env", content="", hostname="gpu-gw")
            instance = await provider.launch(SIM_OFFER, name=instance_name("gpu-gw", 1), boot=boot)
            cloud.fail("/v1/instances/*", 404, method="GET", body=page)
            with pytest.raises(ConfigError) as described:
                await provider.describe(instance.instance_id)  # "gone": a billing instance taken for ended
            cloud.fail("/v1/instances/*", 404, method="DELETE", body=page)
            with pytest.raises(ConfigError) as terminated:
                await provider.terminate(instance.instance_id)  # "already gone": a leak
            assert f"GET /v1/instances/{instance.instance_id} was not found" in str(described.value)
            assert "check the base URL" in str(terminated.value)
            assert [i.id for i in cloud.live_instances()] == [instance.instance_id]
