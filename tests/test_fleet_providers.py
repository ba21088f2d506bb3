"""The fleet look's listing (activities.listing.list_account) and rule (tgp.fleet.sightings)
through each real adapter against its provider fake (sim/, the provider model behind them):
one list call per look whatever the number of nodes, no describe; an instance ended behind
tgp's back is told to its node only; a lagging list tells a new node nothing; a throttled list
raises after the adapter's own retries, with no provider text, and tells nothing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from activities.listing import INSTANCE_LISTS, list_account
from activities.termination import consistency_window
from sim.provider_model import ManualClock, ProviderModel
from tests.test_provider_model import provider_and_fake
from tgp.errors import TransientError
from tgp.fleet import WatchedNode, sightings
from tgp.types import BootPayload

# Each fake's instance listing (the path its log records) and the fault pattern that hits it.
LISTS = {
    "runpod": ("/v2/pods", "/pods"),
    "lambdalabs": ("/api/v1/instances", "/instances"),
    "paperspace": ("/v1/machines", "/v1/machines"),
    "vastai": ("/api/v1/instances/", "/api/v1/instances/"),
}
NODES = 3
# The Vast fake sells one ask (a host's machine): one node there.
NODES_ON = {"vastai": 1}
AT = datetime(2026, 11, 24, 9, 0, tzinfo=timezone.utc)


async def launch_nodes(target: object, count: int) -> list[WatchedNode]:
    offer = (await target.list_offers())[0]  # type: ignore[attr-defined]
    nodes = []
    for i in range(count):
        boot = BootPayload(kind=target.capabilities.boot_payload, content="#cloud-config\n", hostname=f"gpu-{i}")  # type: ignore[attr-defined]
        inst = await target.launch(offer, name=f"tgp-gpu-{i}-1", boot=boot)  # type: ignore[attr-defined]
        nodes.append(WatchedNode(workflow_id=f"gpunode/ml/rtx/gpu-{i}", node_name=f"gpu-{i}", provider=target.name, instance_id=inst.instance_id, since=AT - timedelta(hours=1)))  # type: ignore[attr-defined]
    return nodes


def calls(fake: object, name: str) -> tuple[int, int]:
    """(instance listings, other reads of one instance) in the fake's request log."""
    path = LISTS[name][0]
    log = [r for r in fake.requests if r.method == "GET"]  # type: ignore[attr-defined]
    listings = sum(1 for r in log if r.path == path)
    describes = sum(1 for r in log if r.path.startswith(path.rstrip("/") + "/") and r.path != path)
    return listings, describes


@pytest.mark.parametrize("name", list(LISTS))
async def test_looks_at_rest_cost_one_listing_each_and_an_ended_instance_is_told(name: str) -> None:
    model = ProviderModel(clock=ManualClock())
    async with provider_and_fake(name, model) as (target, fake):
        nodes = await launch_nodes(target, NODES_ON.get(name, NODES))
        before = calls(fake, name)
        for _ in range(3):
            listed = await list_account(target, "tgp-", account=name)
            assert sightings(listed, nodes, at=AT, window=consistency_window(target)) == {}, "nothing for running instances"
        listings, describes = calls(fake, name)
        assert (listings - before[0], describes - before[1]) == (3, 0), "one listing per look, no request per node"

        await target.terminate(nodes[0].instance_id)  # from the provider's console: tgp did not ask
        told = sightings(await list_account(target, "tgp-", account=name), nodes, at=AT, window=consistency_window(target))
        assert set(told) == {nodes[0].workflow_id}, "its node only"


@pytest.mark.parametrize("name", list(LISTS))
async def test_a_lagging_list_tells_a_new_node_nothing(name: str) -> None:
    clock = ManualClock()
    model = ProviderModel(clock=clock, list_lag=90)  # lists lag 90 s behind creates, as seen on real clouds
    async with provider_and_fake(name, model) as (target, _):
        nodes = [n.model_copy(update={"since": AT}) for n in await launch_nodes(target, 1)]
        assert await list_account(target, "tgp-", account=name) == []
        assert sightings([], nodes, at=AT + timedelta(seconds=60), window=consistency_window(target)) == {}, "within the window"
        clock.advance(90)
        listed = await list_account(target, "tgp-", account=name)
        assert sightings(listed, nodes, at=AT + timedelta(seconds=90), window=consistency_window(target)) == {}


@pytest.mark.parametrize("name", list(LISTS))
async def test_a_throttled_list_raises_without_provider_text_and_is_counted(name: str) -> None:
    model = ProviderModel(clock=ManualClock())
    async with provider_and_fake(name, model) as (target, fake):
        await launch_nodes(target, 1)
        fake.fail(LISTS[name][1], 429, times=50, method="GET", message="slow down sk-live-abc", retry_after=7)
        before = INSTANCE_LISTS.labels(target.name, name, "TransientError")._value.get()
        with pytest.raises(TransientError) as raised:
            await list_account(target, "tgp-", account=name)
        assert "sk-live-abc" not in str(raised.value) and "slow down" not in str(raised.value)
        assert INSTANCE_LISTS.labels(target.name, name, "TransientError")._value.get() == before + 1
