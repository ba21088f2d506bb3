"""VastProvider against FakeVast over real HTTP on loopback.

Expected shapes and failures come from reference/providers.md section 3 (Vast.ai). Retry waits
and pacing waits are recorded, never slept; the fake and the adapter share one clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from decimal import Decimal

import pytest

from activities.http import OutcomeUnknown
from pydantic import SecretStr

from activities.ports import CloudProvider
from activities.clouds.vastai import VastProvider
from tgp.errors import AuthError, CapacityError, ConfigError, OfferRefused, PermissionDenied, TransientError
from tgp.types import BootPayload, InstanceState, Offer
from sim.fakeserver import GATEWAY_404_HTML, GATEWAY_404_TEXT
from sim.vastai import FakeAsk, FakeVast

API_KEY = "vast-key-0123456789abcdef-never-logged"
BOOT = BootPayload(kind="onstart", content="#!/bin/bash\necho join\n", hostname="gpu-a")
NAME = "tgp-gpu-a-1"


class Clock:
    """Monotonic seconds shared by the adapter's pacing and the fake's rate limiter."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Sleeps(list[float]):
    """Records waits and advances the shared clock instead of sleeping."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)
        self.clock.t += seconds


def asks() -> list[FakeAsk]:
    # storage_cost 0.144 $/GB/month * 50 GB / 720 h = $0.01/h on top of dph_base.
    return [
        FakeAsk(id=101, gpu_name="RTX 4090", geolocation="Helsinki, FI", dph_base=Decimal("0.30"), min_bid=Decimal("0.12")),
        FakeAsk(id=102, gpu_name="RTX_3090", geolocation="Quebec, CA", dph_base=Decimal("0.20"), num_gpus=2, min_bid=Decimal("0.09")),
        FakeAsk(id=103, gpu_name="H100 SXM", geolocation="Texas, US", dph_base=Decimal("2.10"), vms_enabled=True),
        FakeAsk(id=104, gpu_name="RTX 4090", geolocation="Oregon, US", dph_base=Decimal("0.25"), verified=False),
    ]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sleeps(clock: Clock) -> Sleeps:
    return Sleeps(clock)


@pytest.fixture
async def vast(clock: Clock) -> AsyncIterator[FakeVast]:
    async with FakeVast(api_key=API_KEY, asks=asks(), clock=clock) as fake:
        yield fake


def make(vast: FakeVast, sleeps: Sleeps, clock: Clock, *, key: str = API_KEY, **kwargs: object) -> VastProvider:
    kwargs.setdefault("min_intervals", {})
    return VastProvider(SecretStr(key), base_url=vast.url, sleep=sleeps, clock=clock, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
async def provider(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> AsyncIterator[VastProvider]:
    async with make(vast, sleeps, clock) as p:
        yield p


def offer(ask_id: int, price: str, *, spot: bool = False) -> Offer:
    return Offer(provider="vastai", offer_id=str(ask_id), gpu_type="RTX4090", region="fi", hourly_price=Decimal(price), spot=spot)


# --- offers ----------------------------------------------------------------------------


async def test_offers_are_verified_unrented_asks_with_total_price_and_normalised_labels(provider: VastProvider, vast: FakeVast) -> None:
    offers = await provider.list_offers()
    on_demand = {o.offer_id: o for o in offers if not o.spot}
    assert set(on_demand) == {"101", "102", "103"}  # 104 is unverified
    a = on_demand["101"]
    assert (a.gpu_type, a.region, a.gpu_count, a.hourly_price) == ("RTX4090", "fi", 1, Decimal("0.31"))
    b = on_demand["102"]
    assert (b.gpu_type, b.region, b.gpu_count, b.hourly_price) == ("RTX3090", "ca", 2, Decimal("0.21"))
    assert on_demand["103"].gpu_type == "H100-SXM" and on_demand["103"].region == "us"
    search = next(r.json for r in vast.requests if r.path.endswith("/bundles/"))
    assert search["verified"] == {"eq": True} and search["rentable"] == {"eq": True} and search["rented"] == {"eq": False}
    assert search["allocated_storage"] == 50 and search["order"] == [["dph_total", "asc"]]


async def test_spot_offers_bid_the_asks_min_bid(provider: VastProvider, vast: FakeVast) -> None:
    spot = {o.offer_id: o for o in await provider.list_offers() if o.spot}
    assert {k: o.hourly_price for k, o in spot.items()} == {"101": Decimal("0.12"), "102": Decimal("0.09")}
    assert [r.json["type"] for r in vast.requests if r.path.endswith("/bundles/")] == ["ondemand", "bid"]


async def test_vm_class_searches_only_vm_hosts_and_joins_as_node(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> None:
    async with make(vast, sleeps, clock, vm=True, spot=False) as p:
        offers = await p.list_offers()
        assert [o.offer_id for o in offers] == ["103"]
        assert p.capabilities.joins_as_node and p.capabilities.machine == "container-or-vm"
        instance = await p.launch(offers[0], name=NAME, boot=BOOT)
    body = vast.instances[int(instance.instance_id)].body
    assert body["vm"] is True and body["image"].startswith("docker.io/vastai/kvm:") and body["onstart"] == BOOT.content


def test_containers_do_not_join_as_nodes_and_say_why() -> None:
    p = VastProvider(SecretStr(API_KEY))
    assert p.capabilities.boot_payload == "onstart" and p.capabilities.spot
    assert not p.capabilities.joins_as_node
    assert "unprivileged Docker" in p.capabilities.why_not_node and "VM" in p.capabilities.why_not_node
    with pytest.raises(ConfigError, match="vastai/kvm"):
        VastProvider(SecretStr(API_KEY), vm=True, image="ubuntu:22.04")


def test_is_a_cloud_provider() -> None:
    p: CloudProvider = VastProvider(SecretStr(API_KEY))
    assert p.name == "vastai"


# --- lifecycle -------------------------------------------------------------------------


async def test_launch_describe_terminate(provider: VastProvider, vast: FakeVast) -> None:
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    assert instance.state is InstanceState.PENDING and instance.name == NAME and instance.offer_id == "101"
    body = vast.instances[int(instance.instance_id)].body
    assert body["label"] == NAME and body["onstart"] == BOOT.content and body["client_id"] == "me"
    assert "price" not in body and "vm" not in body  # on-demand container

    pending = await provider.describe(instance.instance_id)
    assert pending is not None and pending.state is InstanceState.PENDING  # actual_status null
    vast.set_status(instance.instance_id, "loading")
    assert (await provider.describe(instance.instance_id)).state is InstanceState.PENDING  # type: ignore[union-attr]
    vast.start_instance(instance.instance_id)
    running = await provider.describe(instance.instance_id)
    assert running is not None and running.state is InstanceState.RUNNING and running.hourly_price == Decimal("0.31")

    await provider.terminate(instance.instance_id)
    assert await provider.describe(instance.instance_id) is None  # {"instances": null}
    await provider.terminate(instance.instance_id)  # 404: already gone counts as done
    assert vast.creates == 1


async def test_env_payload_keeps_the_image_entrypoint(provider: VastProvider, vast: FakeVast) -> None:
    boot = BootPayload(kind="env", content="TS_AUTHKEY=tskey-auth-x\nTS_HOSTNAME=gpu-a\n", hostname="gpu-a")
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=boot)
    body = vast.instances[int(instance.instance_id)].body
    assert body["runtype"] == "args" and body["env"] == {"TS_AUTHKEY": "tskey-auth-x", "TS_HOSTNAME": "gpu-a"}


async def test_find_by_name_uses_the_label_filter_and_follows_pages(provider: VastProvider, vast: FakeVast) -> None:
    vast.page_size = 1
    for ask_id in (101, 102):
        await provider.launch(offer(ask_id, "0.3"), name=f"other-{ask_id}", boot=BOOT)
    mine = await provider.launch(offer(103, "2.11"), name=NAME, boot=BOOT)
    found = await provider.find_by_name(NAME)
    assert found is not None and found.instance_id == mine.instance_id and found.name == NAME
    assert await provider.find_by_name("tgp-nobody-1") is None
    lists = [r for r in vast.requests if r.path == "/api/v1/instances/"]
    assert '"label": {"eq": "tgp-gpu-a-1"}' in lists[0].query["select_filters"]
    await provider.terminate(mine.instance_id)
    assert await provider.find_by_name(NAME) is None


async def test_find_by_name_pages_through_unfiltered_answers(provider: VastProvider, vast: FakeVast, monkeypatch: pytest.MonkeyPatch) -> None:
    vast.page_size = 1
    for ask_id in (101, 102):
        await provider.launch(offer(ask_id, "0.3"), name=f"other-{ask_id}", boot=BOOT)
    mine = await provider.launch(offer(103, "2.11"), name=NAME, boot=BOOT)
    # A server that ignores select_filters still pages; the adapter checks the label itself.
    monkeypatch.setattr("sim.vastai._matches", lambda value, cond: True)
    found = await provider.find_by_name(NAME)
    assert found is not None and found.instance_id == mine.instance_id
    assert len([r for r in vast.requests if r.path == "/api/v1/instances/"]) == 3


# --- capacity and spot -----------------------------------------------------------------


@pytest.mark.parametrize("gone", ["rented", "withdrawn"])
async def test_ask_rented_away_is_a_capacity_error(provider: VastProvider, vast: FakeVast, gone: str) -> None:
    vast.rent_away(101) if gone == "rented" else vast.withdraw(101)
    with pytest.raises(CapacityError, match="no longer available"):
        await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    assert vast.live_instances() == []


async def test_host_only_ask_refuses_the_offer_not_the_account(provider: VastProvider, vast: FakeVast) -> None:
    vast.asks[101].host_only = True  # listed by the search, rentable only by its host
    assert "101" in {o.offer_id for o in await provider.list_offers()}
    with pytest.raises(OfferRefused) as err:
        await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    message = str(err.value)
    assert not err.value.retryable
    assert "ask 101" in message and "host-only" in message and "403" in message
    assert API_KEY not in message and "echo join" not in message
    assert vast.live_instances() == []
    # The next offer rents as usual.
    assert (await provider.launch(offer(102, "0.21"), name=NAME, boot=BOOT)).state is InstanceState.PENDING


async def test_vm_without_an_account_ssh_key_is_still_a_config_error(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> None:
    vast.account_ssh_key = False
    async with make(vast, sleeps, clock, vm=True) as p:
        with pytest.raises(ConfigError, match="no_ssh_key_for_vm") as err:
            await p.launch(offer(103, "2.11"), name=NAME, boot=BOOT)
    assert API_KEY not in str(err.value) and vast.live_instances() == []


async def test_bid_launch_sends_the_price(provider: VastProvider, vast: FakeVast) -> None:
    instance = await provider.launch(offer(101, "0.12", spot=True), name=NAME, boot=BOOT)
    assert vast.instances[int(instance.instance_id)].body["price"] == 0.12
    vast.start_instance(instance.instance_id)
    assert (await provider.describe(instance.instance_id)).state is InstanceState.RUNNING  # type: ignore[union-attr]


async def test_bid_below_a_risen_min_bid_is_a_capacity_error(provider: VastProvider, vast: FakeVast) -> None:
    vast.asks[101].min_bid = Decimal("0.15")
    with pytest.raises(CapacityError, match="bid"):
        await provider.launch(offer(101, "0.12", spot=True), name=NAME, boot=BOOT)
    assert vast.live_instances() == []


async def test_low_bid_error_destroys_the_stopped_instance_and_is_a_capacity_error(provider: VastProvider, vast: FakeVast) -> None:
    vast.raise_market(101, Decimal("0.20"))
    with pytest.raises(CapacityError, match="bid"):
        await provider.launch(offer(101, "0.12", spot=True), name=NAME, boot=BOOT)
    assert vast.creates == 1 and vast.live_instances() == []  # destroyed, not left billing storage


async def test_low_bid_instance_that_cannot_be_destroyed_now_is_left_to_cleanup_by_label(provider: VastProvider, vast: FakeVast) -> None:
    vast.raise_market(101, Decimal("0.20"))
    vast.fail("/api/v0/instances/*", 503, times=3, method="DELETE")
    with pytest.raises(CapacityError, match="released by label"):
        await provider.launch(offer(101, "0.12", spot=True), name=NAME, boot=BOOT)
    left = await provider.find_by_name(NAME)
    assert left is not None and left.interrupted  # what the workflow's cleanup terminates


async def test_low_bid_instance_created_stopped_is_interrupted_not_running(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> None:
    vast.low_bid_reply = "success"
    vast.raise_market(101, Decimal("0.20"))
    async with make(vast, sleeps, clock) as p:
        instance = await p.launch(offer(101, "0.12", spot=True), name=NAME, boot=BOOT)
        seen = await p.describe(instance.instance_id)
        assert seen is not None and seen.state is InstanceState.STOPPED and seen.interrupted
        by_name = await p.find_by_name(NAME)
        assert by_name is not None and by_name.interrupted and by_name.state is not InstanceState.RUNNING


async def test_outbid_running_instance_is_interrupted(provider: VastProvider, vast: FakeVast) -> None:
    instance = await provider.launch(offer(101, "0.12", spot=True), name=NAME, boot=BOOT)
    vast.start_instance(instance.instance_id)
    vast.outbid(instance.instance_id)
    seen = await provider.describe(instance.instance_id)
    assert seen is not None and seen.state is InstanceState.STOPPED and seen.interrupted


async def test_instances_null_means_gone(provider: VastProvider, vast: FakeVast) -> None:
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    vast.forget(instance.instance_id)
    assert await provider.describe(instance.instance_id) is None
    assert await provider.describe("99999999") is None


async def test_a_404_in_vasts_own_words_is_gone(provider: VastProvider, vast: FakeVast) -> None:
    await provider.terminate("99999999")  # 404 {"success": false, "error": "not_found"}: already gone
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    vast.fail("/api/v0/instances/*", 404, method="GET", body={"success": False, "error": "no_such_instance", "msg": "No such instance"})
    assert await provider.describe(instance.instance_id) is None


# A 404 a proxy or gateway answers with its own page, or JSON that is not Vast's envelope.
NOT_VASTS_404 = [
    GATEWAY_404_TEXT,
    GATEWAY_404_HTML,
    {"message": "no Route matched with those values"},
    {"error": {"code": 404, "message": "Requested entity was not found.", "status": "NOT_FOUND"}},
]


@pytest.mark.parametrize("page", NOT_VASTS_404, ids=["text", "nginx", "gateway-json", "gateway-error-object"])
async def test_a_404_that_is_not_vasts_is_not_read_as_gone(provider: VastProvider, vast: FakeVast, page: object) -> None:
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    vast.fail("/api/v0/instances/*", 404, method="GET", body=page)
    with pytest.raises(ConfigError) as described:
        await provider.describe(instance.instance_id)  # "gone" here: the workflow thinks a billing instance ended
    vast.fail("/api/v0/instances/*", 404, method="DELETE", body=page)
    with pytest.raises(ConfigError) as terminated:
        await provider.terminate(instance.instance_id)  # "already gone" here would leak it
    assert f"GET /api/v0/instances/{instance.instance_id}/ was not found" in str(described.value)
    assert f"DELETE /api/v0/instances/{instance.instance_id}/ was not found" in str(terminated.value)
    assert "check the base URL" in str(terminated.value)
    assert [i.id for i in vast.live_instances()] == [int(instance.instance_id)]  # still billing


async def test_a_404_from_the_wrong_url_is_not_read_as_gone(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> None:
    async with VastProvider(SecretStr(API_KEY), base_url=vast.origin + "/api/v9", sleep=sleeps, clock=clock, min_intervals={}) as p:
        with pytest.raises(ConfigError) as exc:
            await p.terminate("123")
        with pytest.raises(ConfigError):
            await p.describe("123")
    assert "/api/v9" in str(exc.value)


async def test_container_that_failed_to_start_is_failed(provider: VastProvider, vast: FakeVast) -> None:
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    vast.set_status(instance.instance_id, "created", status_msg="Error response from daemon: OCI runtime create failed: ...")
    assert (await provider.describe(instance.instance_id)).state is InstanceState.FAILED  # type: ignore[union-attr]


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("search_status", [401, 404])
async def test_bad_key_is_a_non_retryable_auth_error_naming_the_credential(
    vast: FakeVast, sleeps: Sleeps, clock: Clock, search_status: int
) -> None:
    vast.bad_key_search_status = search_status
    wrong = "vast-wrong-key-5555"
    async with make(vast, sleeps, clock, key=wrong) as p:
        for call in (p.list_offers(), p.describe("1"), p.launch(offer(101, "0.31"), name=NAME, boot=BOOT)):
            with pytest.raises(AuthError) as err:
                await call
            assert not err.value.retryable
            assert "Vast.ai API key" in str(err.value) and "Secret" in str(err.value)
            assert wrong not in str(err.value) and API_KEY not in str(err.value)
    assert sleeps == []


@pytest.mark.parametrize("retry_after", [None, "1"])
async def test_429_is_retried_then_succeeds(provider: VastProvider, vast: FakeVast, sleeps: Sleeps, retry_after: str | None) -> None:
    vast.fail("/api/v0/bundles/", 429, times=2, retry_after=retry_after)
    assert await provider.list_offers()
    assert len(sleeps) == 2
    if retry_after:
        assert sleeps == [1.0, 1.0]


async def test_429_on_create_is_an_unknown_outcome_never_retried_blind(provider: VastProvider, vast: FakeVast, sleeps: Sleeps) -> None:
    # A gateway may throttle after the backend bought (issue 17, item 2): look, never resend.
    vast.fail("/api/v0/asks/*", 429)
    with pytest.raises(OutcomeUnknown):
        await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    assert [r.method for r in vast.requests if r.path.startswith("/api/v0/asks/")] == ["PUT"] and sleeps == []


async def test_5xx_is_retried_then_succeeds(provider: VastProvider, vast: FakeVast, sleeps: Sleeps) -> None:
    instance = await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    vast.fail("/api/v0/instances/*", 502, times=2)
    assert (await provider.describe(instance.instance_id)) is not None
    assert len(sleeps) == 2


async def test_persistent_5xx_is_a_transient_error(provider: VastProvider, vast: FakeVast) -> None:
    vast.fail("/api/v0/bundles/", 503, times=10)
    with pytest.raises(TransientError) as err:
        await provider.list_offers()
    assert err.value.retryable


async def test_persistent_429_is_a_transient_error(provider: VastProvider, vast: FakeVast) -> None:
    vast.fail("/api/v0/bundles/", 429, times=10)
    with pytest.raises(TransientError, match="429"):
        await provider.list_offers()


async def test_5xx_on_create_is_not_retried_and_the_instance_can_be_adopted(provider: VastProvider, vast: FakeVast, sleeps: Sleeps) -> None:
    vast.fail("/api/v0/asks/*", 500, after_handling=True)
    with pytest.raises(TransientError, match="look it up by label"):
        await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    assert vast.creates == 1 and sleeps == []  # never bought twice
    adopted = await provider.find_by_name(NAME)
    assert adopted is not None and adopted.instance_id == str(vast.live_instances()[0].id)


async def test_billing_problem_is_non_retryable_and_says_so(provider: VastProvider, vast: FakeVast) -> None:
    vast.fail("/api/v0/asks/*", 400, body={"success": False, "error": "insufficient_credit", "msg": "Your account balance is too low."})
    with pytest.raises(PermissionDenied) as err:
        await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    assert not err.value.retryable and "add credit" in str(err.value)


async def test_pacing_keeps_calls_under_vasts_per_endpoint_intervals(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> None:
    vast.min_intervals = {"create": 4.5, "show": 2.0}
    async with make(vast, sleeps, clock, min_intervals={"create": 4.5, "show": 2.0}) as p:
        a = await p.launch(offer(101, "0.31"), name="tgp-a-1", boot=BOOT)
        await p.launch(offer(102, "0.21"), name="tgp-b-1", boot=BOOT)
        await p.describe(a.instance_id)
        await p.describe(a.instance_id)
    assert vast.rate_limited == 0
    assert sleeps == [4.5, 2.0]


async def test_429_without_retry_after_waits_out_the_endpoint_interval(vast: FakeVast, sleeps: Sleeps, clock: Clock) -> None:
    # Another client of the same key used the endpoint just now: the fake's limiter answers 429.
    vast.min_intervals = {"show": 2.0}
    async with make(vast, sleeps, clock, min_intervals={"show": 2.0}) as p:
        a = await p.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
        vast.mark_called("show")
        assert await p.describe(a.instance_id) is not None
    assert vast.rate_limited == 1
    assert sum(sleeps) == pytest.approx(2.0)  # the retry waited out the endpoint's interval


async def test_list_instances_by_label_prefix(provider: VastProvider, vast: FakeVast) -> None:
    ours = await provider.launch(offer(101, "0.31"), name="tgp-gpu-a-1", boot=BOOT)
    await provider.launch(offer(102, "0.21"), name="someone-elses", boot=BOOT)
    assert [i.instance_id for i in await provider.list_instances("tgp-")] == [ours.instance_id]
    assert [i.instance_id for i in await provider.list_instances("tgp-", names={ours.name})] == [ours.instance_id]
    assert await provider.list_instances("tgp-", names={"tgp-gpu-a-2"}) == []  # the names asked for, no other


async def test_a_payload_too_large_is_the_classs_config_error_naming_its_size(provider: VastProvider, vast: FakeVast) -> None:
    """A 413 is the onstart script the class's template made, too large for every ask: a
    ConfigError naming its size, not the ask's refusal (before: OfferRefused, so the node failed
    over and the ask was hidden)."""
    vast.fail("/api/v0/asks/*", 413, method="PUT", message="request entity too large")
    with pytest.raises(ConfigError) as err:
        await provider.launch(offer(101, "0.31"), name=NAME, boot=BOOT)
    assert f"{len(BOOT.content.encode())} bytes" in str(err.value) and "413" in str(err.value)
    assert vast.live_instances() == []
