"""The provider model (sim.provider_model) behaves alike behind every fake: the simulated cloud
and the four provider fakes each speak their own wire format, but lag, late creates, answers
after buying and lying terminates are the model's, seen through each real adapter, and the
model's truth (what bills) stays apart from what the API answers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from decimal import Decimal
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from activities.clouds.lambdalabs import LambdaProvider
from activities.clouds.paperspace import PaperspaceProvider
from activities.clouds.runpod import RunPodProvider
from activities.clouds.simulated import SimulatedProvider
from activities.clouds.vastai import VastProvider
from activities.http import OutcomeUnknown
from sim.cloud import SimulatedCloud
from sim.lambdalabs import FakeLambda
from sim.paperspace import FakePaperspace
from sim.provider_model import CreateOutcome, ManualClock, ProviderModel
from sim.runpod import FakeRunPod
from sim.vastai import FakeAsk, FakeVast
from tgp.types import BootPayload, InstanceState

PROVIDERS = ("simulated", "runpod", "lambdalabs", "paperspace", "vastai")
KEY = "key_0123456789abcdef"
NAME = "tgp-gpu-model-1"


async def no_sleep(_: float) -> None:
    return None


@asynccontextmanager
async def provider(name: str, model: ProviderModel) -> AsyncIterator[Any]:
    async with provider_and_fake(name, model) as (target, _):
        yield target


@asynccontextmanager
async def provider_and_fake(name: str, model: ProviderModel) -> AsyncIterator[tuple[Any, Any]]:
    """The real adapter of `name` and the fake it talks to (for its request log and faults)."""
    async with AsyncExitStack() as stack:
        if name == "runpod":
            fake = await stack.enter_async_context(FakeRunPod(api_key=KEY, model=model))
            target = RunPodProvider(SecretStr(KEY), base_url=fake.url, sleep=no_sleep)
        elif name == "lambdalabs":
            fake = await stack.enter_async_context(FakeLambda(api_key=KEY, launch_interval=0, model=model))
            target = LambdaProvider(SecretStr(KEY), ssh_key_name="tgp", base_url=fake.url, request_interval=0, launch_interval=0, sleep=no_sleep)
        elif name == "paperspace":
            fake = await stack.enter_async_context(FakePaperspace(api_key=KEY, model=model))
            target = PaperspaceProvider(SecretStr(KEY), base_url=fake.url, template_id=fake.template_id, sleep=no_sleep)
        elif name == "vastai":
            ask = FakeAsk(id=101, gpu_name="RTX 4090", geolocation="Helsinki, FI", dph_base=Decimal("0.30"))
            fake = await stack.enter_async_context(FakeVast(api_key=KEY, asks=[ask], min_intervals={}, model=model))
            target = VastProvider(SecretStr(KEY), base_url=fake.url, sleep=no_sleep, min_intervals={}, spot=False)
        else:
            fake = await stack.enter_async_context(SimulatedCloud(api_key=KEY, boot_delay=60, model=model))
            target = SimulatedProvider(fake.url, api_key=SecretStr(KEY))
        stack.push_async_callback(target.aclose)
        yield target, fake


async def launch(target: Any) -> Any:
    offer = (await target.list_offers())[0]
    boot = BootPayload(kind=target.capabilities.boot_payload, content="#cloud-config\n", hostname="gpu-model")
    return await target.launch(offer, name=NAME, boot=boot)


@pytest.mark.parametrize("name", PROVIDERS)
async def test_lists_and_describes_lag_behind_a_create(name: str) -> None:
    clock = ManualClock()
    model = ProviderModel(clock=clock, list_lag=60, describe_lag=30)
    async with provider(name, model) as target:
        inst = await launch(target)
        assert [r.id for r in model.billing()] == [inst.instance_id], "bought, whatever the API shows"
        assert await target.find_all_by_name(inst.name) == [] and await target.describe(inst.instance_id) is None
        clock.advance(30)
        assert await target.describe(inst.instance_id) is not None and await target.find_all_by_name(inst.name) == []
        clock.advance(30)
        assert [i.instance_id for i in await target.find_all_by_name(inst.name)] == [inst.instance_id]


@pytest.mark.parametrize("name", PROVIDERS)
@pytest.mark.parametrize("outcome", [CreateOutcome.THROTTLED_AFTER_BUY, CreateOutcome.FAILED_AFTER_BUY, CreateOutcome.RESET_AFTER_BUY])
async def test_a_create_can_buy_and_answer_an_error(name: str, outcome: CreateOutcome) -> None:
    model = ProviderModel(clock=ManualClock())
    model.next_creates(outcome)
    async with provider(name, model) as target:
        with pytest.raises(OutcomeUnknown):
            await launch(target)
        assert len(model.billing()) == 1, "the backend bought although the answer was an error"
        assert len(await target.find_all_by_name(model.billing()[0].name)) == 1


@pytest.mark.parametrize("name", PROVIDERS)
async def test_a_create_can_complete_after_the_client_gave_up(name: str) -> None:
    clock = ManualClock()
    model = ProviderModel(clock=clock, late_create_after=70)
    model.next_creates(CreateOutcome.LATE)
    async with provider(name, model) as target:
        with pytest.raises(OutcomeUnknown):
            await launch(target)
        assert model.billing() == []
        clock.advance(70)
        assert len(model.billing()) == 1 and len(await target.list_instances("tgp-")) == 1


@pytest.mark.parametrize("name", PROVIDERS)
async def test_a_terminate_can_answer_success_and_do_nothing_or_act_late(name: str) -> None:
    clock = ManualClock()
    model = ProviderModel(clock=clock, late_terminate_after=20)
    async with provider(name, model) as target:
        inst = await launch(target)
        model.next_terminates("lie", "late")
        await target.terminate(inst.instance_id)
        seen = await target.describe(inst.instance_id)
        assert seen is not None and seen.state is not InstanceState.TERMINATED, "a lying terminate changed nothing"
        await target.terminate(inst.instance_id)
        assert len(model.billing()) == 1
        clock.advance(20)
        assert model.billing() == []


async def test_a_create_can_buy_and_answer_nothing_until_the_client_gives_up() -> None:
    """A timeout after buying: the answer is held until the server stops; the client's read
    timeout (short here) ends its wait, and the outcome is unknown, not a failure."""
    model = ProviderModel(clock=ManualClock())
    model.next_creates(CreateOutcome.TIMEOUT_AFTER_BUY)
    async with SimulatedCloud(api_key=KEY, boot_delay=60, model=model) as cloud:
        async with SimulatedProvider(cloud.url, api_key=SecretStr(KEY), timeout=httpx.Timeout(0.5)) as target:
            with pytest.raises(OutcomeUnknown):
                await launch(target)
            assert len(model.billing()) == 1 and cloud.create_requests == 1
