"""PaperspaceProvider against FakePaperspace over real HTTP on loopback.

Expected shapes and failures come from reference/providers.md section 4 (Paperspace, the
DigitalOcean-era API). Retry waits are recorded, never slept.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import date, timedelta
from decimal import Decimal

import pytest

from activities.http import OutcomeUnknown
from pydantic import SecretStr

from activities.ports import CloudProvider
from activities.clouds.paperspace import CATALOG_PATH, CatalogEntry, PaperspaceCatalog, PaperspaceProvider, load_catalog
from tgp.errors import AuthError, CapacityError, ConfigError, OfferRefused, PermissionDenied, TransientError
from sim.fakeserver import GATEWAY_404_HTML, GATEWAY_404_TEXT
from sim.paperspace import SOLD_IN, FakePaperspace
from tgp.types import BootPayload, InstanceState, Offer

API_KEY = "ps-key-0123456789abcdef-never-logged"
BOOT = BootPayload(kind="startup-script", content="#!/bin/bash\ncurl -fsSL https://example.invalid/join | sh\n", hostname="gpu-a")
NAME = "tgp-gpu-a-1"
NY2 = "East Coast (NY2)"


class Sleeps(list[float]):
    """Records retry waits instead of sleeping."""

    async def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture
def sleeps() -> Sleeps:
    return Sleeps()


@pytest.fixture
async def ps() -> AsyncIterator[FakePaperspace]:
    async with FakePaperspace(api_key=API_KEY) as fake:
        yield fake


def make(ps: FakePaperspace, sleeps: Sleeps, *, key: str = API_KEY, **kwargs: object) -> PaperspaceProvider:
    kwargs.setdefault("template_id", ps.template_id)
    return PaperspaceProvider(SecretStr(key), base_url=ps.url, sleep=sleeps, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
async def provider(ps: FakePaperspace, sleeps: Sleeps) -> AsyncIterator[PaperspaceProvider]:
    async with make(ps, sleeps) as p:
        yield p


def a4000(region: str = "ny2") -> Offer:
    return Offer(provider="paperspace", offer_id="A4000", gpu_type="A4000", region=region, hourly_price=Decimal("0.76"))


# --- catalog and offers ----------------------------------------------------------------


def test_catalog_is_dated_sourced_and_covers_the_machine_types() -> None:
    catalog = load_catalog()
    assert catalog.as_of <= date.today() and catalog.currency == "USD"
    assert "stale" in catalog.note and catalog.source
    types = {e.machine_type for e in catalog.machine_types}
    assert {"H100", "H100x8", "A100-80G", "A6000", "A5000", "A4000", "RTX4000", "P4000", "V100-32G"} <= types
    assert CATALOG_PATH.name == "paperspace_catalog.json"


async def test_offers_come_from_the_catalog_with_dollar_prices_and_normalised_labels(provider: PaperspaceProvider) -> None:
    offers = await provider.list_offers()
    by_key = {(o.offer_id, o.region): o for o in offers}
    a = by_key[("A4000", "ams1")]
    assert (a.gpu_type, a.gpu_count, a.hourly_price, a.spot) == ("A4000", 1, Decimal("0.76"), False)
    h = by_key[("H100x8", "ny2")]
    assert (h.gpu_type, h.gpu_count, h.hourly_price) == ("H100-SXM", 8, Decimal("47.60"))
    assert by_key[("A100-80G", "ny2")].gpu_type == "A100-80GB"
    assert by_key[("V100-32G", "ny2")].gpu_type == "V100-32GB"
    assert by_key[("RTX4000", "ca1")].hourly_price == Decimal("0.56")
    assert ("H100", "ams1") not in by_key  # NY2-only
    assert provider.catalog_as_of == load_catalog().as_of


async def test_offers_are_cross_checked_against_the_templates_machine_types(ps: FakePaperspace, sleeps: Sleeps) -> None:
    ps.page_size = 1
    ps.templates.insert(0, {"id": "tother", "availableMachineTypes": []})
    ps.templates[1]["availableMachineTypes"] = [
        {"machineTypeLabel": "A4000", "isAvailable": True},
        {"machineTypeLabel": "A6000", "isAvailable": False},
    ]
    async with make(ps, sleeps) as p:
        assert {o.offer_id for o in await p.list_offers()} == {"A4000"}
    async with make(ps, sleeps, template_id="tmissing") as p:
        with pytest.raises(ConfigError, match="tmissing"):
            await p.list_offers()


async def test_catalog_lists_each_machine_type_only_where_paperspace_sells_it(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    # A5000 and A6000 are sold in NY2 and CA1 only (DigitalOcean's Machines availability table).
    for entry in load_catalog().machine_types:
        assert set(entry.regions) <= set(SOLD_IN[entry.machine_type]), entry.machine_type
    offers = await provider.list_offers()
    keys = {(o.offer_id, o.region) for o in offers}
    assert ("A6000", "ams1") not in keys and ("A5000", "ams1") not in keys
    assert {("A6000", "ny2"), ("A6000", "ca1"), ("A5000", "ny2"), ("A5000", "ca1")} <= keys
    # Every offer the catalog makes is one the API accepts.
    for n, offer in enumerate(offers):
        await provider.launch(offer, name=f"tgp-gpu-{n}", boot=BOOT)
    assert len(ps.live_machines()) == len(offers)


def test_stale_catalog_is_detected() -> None:
    old = PaperspaceCatalog(
        as_of=date(2025, 1, 1),
        source="test",
        machine_types=[CatalogEntry(machine_type="A4000", gpu="A4000", hourly_price=Decimal("0.76"), regions=[NY2])],
    )
    p = PaperspaceProvider(SecretStr(API_KEY), catalog=old)
    assert p.catalog_is_stale(date(2025, 1, 1) + timedelta(days=365))
    assert not p.catalog_is_stale(date(2025, 1, 2))


def test_capabilities_and_protocol() -> None:
    p: CloudProvider = PaperspaceProvider(SecretStr(API_KEY))
    assert p.name == "paperspace"
    caps = p.capabilities
    assert (caps.machine, caps.boot_payload, caps.joins_as_node, caps.spot) == ("vm", "startup-script", True, False)


# --- lifecycle -------------------------------------------------------------------------


async def test_launch_describe_terminate(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    instance = await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert instance.state is InstanceState.PENDING and instance.name == NAME and instance.offer_id == "A4000"
    assert instance.hourly_price == Decimal("0.76")
    machine = ps.machines[instance.instance_id]
    assert (machine.machine_type, machine.region, machine.template_id, machine.disk_size) == ("A4000", NY2, ps.template_id, 100)
    assert machine.body["startOnCreate"] is True
    assert ps.scripts[machine.startup_script_id or ""]["script"] == BOOT.content  # type: ignore[index]
    assert ps.scripts[machine.startup_script_id or ""]["isRunOnce"] is True  # type: ignore[index]

    for state in ("provisioning", "starting", "serviceready"):
        ps.set_state(instance.instance_id, state)
        seen = await provider.describe(instance.instance_id)
        assert seen is not None and seen.state is InstanceState.PENDING
    ps.make_ready(instance.instance_id)
    running = await provider.describe(instance.instance_id)
    assert running is not None and running.state is InstanceState.RUNNING
    ps.set_state(instance.instance_id, "off")
    assert (await provider.describe(instance.instance_id)).state is InstanceState.STOPPED  # type: ignore[union-attr]

    await provider.terminate(instance.instance_id)
    assert await provider.describe(instance.instance_id) is None  # 404
    assert ps.scripts == {}  # the script held the auth key: deleted with the machine
    await provider.terminate(instance.instance_id)  # 404: already gone counts as done
    assert ps.creates == 1


async def test_deleted_machine_with_dt_deleted_is_gone(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    ps.deleted_visible = True
    instance = await provider.launch(a4000(), name=NAME, boot=BOOT)
    await provider.terminate(instance.instance_id)
    assert await provider.describe(instance.instance_id) is None


async def test_a_404_in_paperspaces_own_words_is_gone(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    assert await provider.describe("psnosuchmachine") is None  # 404 {"code": "NOT_FOUND", "message": ...}
    await provider.terminate("psnosuchmachine")  # already gone counts as done


# A 404 a proxy or gateway answers with its own page, or JSON that is not Paperspace's envelope.
NOT_PAPERSPACES_404 = [GATEWAY_404_TEXT, GATEWAY_404_HTML, {"message": "no Route matched with those values"}]


@pytest.mark.parametrize("page", NOT_PAPERSPACES_404, ids=["text", "nginx", "gateway-json"])
async def test_a_404_that_is_not_paperspaces_is_not_read_as_gone(
    provider: PaperspaceProvider, ps: FakePaperspace, page: object
) -> None:
    instance = await provider.launch(a4000(), name=NAME, boot=BOOT)
    ps.fail("/v1/machines/*", 404, method="GET", body=page)
    with pytest.raises(ConfigError) as described:
        await provider.describe(instance.instance_id)  # "gone" here: the workflow thinks a billing machine ended
    ps.fail("/v1/machines/*", 404, method="DELETE", body=page)
    with pytest.raises(ConfigError) as terminated:
        await provider.terminate(instance.instance_id)  # "already gone" here would leak it
    assert f"GET /v1/machines/{instance.instance_id} was not found" in str(described.value)
    assert f"DELETE /v1/machines/{instance.instance_id} was not found" in str(terminated.value)
    assert "check the base URL" in str(terminated.value)
    assert ps.live_machines() != []  # still running: nothing may count it as ended


async def test_a_404_from_the_wrong_url_is_not_read_as_gone(ps: FakePaperspace, sleeps: Sleeps) -> None:
    async with PaperspaceProvider(SecretStr(API_KEY), base_url=ps.root + "/v9", template_id=ps.template_id, sleep=sleeps) as p:
        with pytest.raises(ConfigError) as exc:
            await p.terminate("psabc")
        with pytest.raises(ConfigError):
            await p.describe("psabc")
    assert "/v9" in str(exc.value)


async def test_find_by_name_follows_pages(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    await provider.launch(a4000(), name="other-1", boot=BOOT)
    await provider.launch(a4000("ca1"), name="other-2", boot=BOOT)
    mine = await provider.launch(a4000("ams1"), name=NAME, boot=BOOT)
    found = await provider.find_by_name(NAME)
    assert found is not None and found.instance_id == mine.instance_id and found.name == NAME
    assert [r.query["name"] for r in ps.requests if r.path == "/v1/machines" and r.method == "GET"] == [NAME]
    # Should the name filter be ignored, the adapter still pages and checks names itself.
    ps.honour_name_filter, ps.page_size = False, 1
    ps.requests.clear()
    found = await provider.find_by_name(NAME)
    assert found is not None and found.instance_id == mine.instance_id
    pages = [r.query for r in ps.requests if r.path == "/v1/machines"]
    assert [q.get("after") for q in pages] == [None, "1", "2"]
    assert await provider.find_by_name("tgp-nobody-1") is None
    await provider.terminate(mine.instance_id)
    assert await provider.find_by_name(NAME) is None


async def test_template_list_pages_are_followed(ps: FakePaperspace, sleeps: Sleeps) -> None:
    ps.page_size = 1
    ps.templates[:0] = [{"id": f"t{i}", "availableMachineTypes": []} for i in range(3)]
    async with make(ps, sleeps) as p:
        assert await p.list_offers()
    pages = [r.query for r in ps.requests if r.path == "/v1/os-templates"]
    assert [q.get("after") for q in pages] == [None, "1", "2", "3"]


async def test_terminate_of_a_machine_that_must_be_off_first_stops_it_and_asks_for_a_retry(
    provider: PaperspaceProvider, ps: FakePaperspace
) -> None:
    ps.delete_requires_off = True
    instance = await provider.launch(a4000(), name=NAME, boot=BOOT)
    with pytest.raises(TransientError, match="asked it to stop"):
        await provider.terminate(instance.instance_id)
    assert ps.machines[instance.instance_id].state == "stopping"
    ps.set_state(instance.instance_id, "off")
    await provider.terminate(instance.instance_id)
    assert ps.live_machines() == []


# --- errors ----------------------------------------------------------------------------


async def test_no_capacity_is_a_capacity_error_and_leaves_no_script(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    ps.set_capacity("A4000", NY2, 0)
    with pytest.raises(CapacityError, match="capacity"):
        await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert ps.live_machines() == [] and ps.scripts == {}
    ps.set_capacity("A4000", NY2, 1)
    await provider.launch(a4000(), name=NAME, boot=BOOT)
    with pytest.raises(CapacityError):
        await provider.launch(a4000(), name="tgp-gpu-b-1", boot=BOOT)


async def test_machine_type_not_sold_in_the_region_refuses_the_offer_and_leaves_no_script(ps: FakePaperspace, sleeps: Sleeps) -> None:
    # A catalog that still lists A6000 in AMS1: Paperspace refuses that one offer, not the class.
    stale = PaperspaceCatalog(
        as_of=date(2026, 1, 1),
        source="test",
        machine_types=[CatalogEntry(machine_type="A6000", gpu="A6000", hourly_price=Decimal("1.89"), regions=[NY2, "Europe (AMS1)"])],
    )
    offer = Offer(provider="paperspace", offer_id="A6000", gpu_type="A6000", region="ams1", hourly_price=Decimal("1.89"))
    async with make(ps, sleeps, catalog=stale) as p:
        with pytest.raises(OfferRefused) as err:
            await p.launch(offer, name=NAME, boot=BOOT)
    message = str(err.value)
    assert not err.value.retryable
    assert "A6000" in message and "Europe (AMS1)" in message and "not offered" not in message, "Paperspace's words are not quoted"
    assert API_KEY not in message and "example.invalid" not in message
    assert ps.live_machines() == [] and ps.scripts == {}


async def test_a_template_the_server_does_not_know_is_still_a_config_error(ps: FakePaperspace, sleeps: Sleeps) -> None:
    async with make(ps, sleeps, template_id="tgone", check_templates=False) as p:
        with pytest.raises(ConfigError, match="tgone"):
            await p.launch(a4000(), name=NAME, boot=BOOT)
    assert ps.scripts == {}


async def test_bad_key_is_a_non_retryable_auth_error_naming_the_credential(ps: FakePaperspace, sleeps: Sleeps) -> None:
    wrong = "ps-wrong-key-5555"
    async with make(ps, sleeps, key=wrong) as p:
        for call in (p.list_offers(), p.describe("ps000001"), p.launch(a4000(), name=NAME, boot=BOOT), p.find_by_name(NAME)):
            with pytest.raises(AuthError) as err:
                await call
            assert not err.value.retryable
            assert "Paperspace API key" in str(err.value) and "Secret" in str(err.value)
            assert wrong not in str(err.value) and API_KEY not in str(err.value)
    assert sleeps == []


@pytest.mark.parametrize("retry_after", [None, "2"])
async def test_429_is_retried_then_succeeds(provider: PaperspaceProvider, ps: FakePaperspace, sleeps: Sleeps, retry_after: str | None) -> None:
    ps.fail("/v1/machines", 429, times=2, retry_after=retry_after, method="GET")
    assert await provider.find_by_name(NAME) is None
    assert len(sleeps) == 2
    if retry_after:
        assert sleeps == [2.0, 2.0]


async def test_429_on_create_is_an_unknown_outcome_never_retried_blind(provider: PaperspaceProvider, ps: FakePaperspace, sleeps: Sleeps) -> None:
    # A gateway may throttle after the backend bought (issue 17, item 2): look, never resend.
    ps.fail("/v1/machines", 429, method="POST")
    with pytest.raises(OutcomeUnknown):
        await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert [r.method for r in ps.requests if r.path == "/v1/machines"] == ["POST"] and sleeps == []


async def test_5xx_is_retried_then_succeeds(provider: PaperspaceProvider, ps: FakePaperspace, sleeps: Sleeps) -> None:
    instance = await provider.launch(a4000(), name=NAME, boot=BOOT)
    ps.fail("/v1/machines/*", 503, times=2, method="GET")
    assert await provider.describe(instance.instance_id) is not None
    assert len(sleeps) == 2


async def test_persistent_5xx_is_a_transient_error(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    ps.fail("/v1/os-templates", 500, times=10)
    with pytest.raises(TransientError) as err:
        await provider.list_offers()
    assert err.value.retryable


async def test_5xx_on_create_is_not_retried_and_the_machine_can_be_adopted(
    provider: PaperspaceProvider, ps: FakePaperspace, sleeps: Sleeps
) -> None:
    ps.fail("/v1/machines", 502, method="POST", after_handling=True)
    with pytest.raises(TransientError, match="look it up by name"):
        await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert ps.creates == 1 and sleeps == []  # never bought twice
    adopted = await provider.find_by_name(NAME)
    assert adopted is not None and adopted.instance_id == ps.live_machines()[0].id
    assert len(ps.scripts) == 1  # the machine may still need its script


async def test_account_not_in_good_standing_is_non_retryable_and_buys_nothing(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    ps.standing = {"isInGoodStanding": False, "hasPaymentMethod": False, "isAdminLocked": False, "messages": ["Add a payment method"]}
    with pytest.raises(PermissionDenied, match="payment method") as err:
        await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert not err.value.retryable and "billing" in str(err.value)
    assert ps.creates == 0 and ps.scripts == {}


async def test_billing_error_on_create_is_non_retryable(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    ps.fail("/v1/machines", 402, method="POST", body={"code": "PAYMENT_REQUIRED", "message": "Your account has an outstanding balance."})
    with pytest.raises(PermissionDenied) as err:
        await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert not err.value.retryable and ps.scripts == {}


async def test_launch_needs_a_template_and_a_startup_script(ps: FakePaperspace, sleeps: Sleeps) -> None:
    async with make(ps, sleeps, template_id=None) as p:
        with pytest.raises(ConfigError, match="template"):
            await p.launch(a4000(), name=NAME, boot=BOOT)
    async with make(ps, sleeps) as p:
        with pytest.raises(ConfigError, match="startup script"):
            await p.launch(a4000(), name=NAME, boot=BootPayload(kind="env", content="A=1\n", hostname="gpu-a"))
        with pytest.raises(ConfigError, match="not in the catalog"):
            await p.launch(a4000("fra1"), name=NAME, boot=BOOT)
    assert ps.creates == 0


async def test_list_instances_by_name_prefix(provider: PaperspaceProvider, ps: FakePaperspace) -> None:
    ours = await provider.launch(a4000(), name="tgp-gpu-a-1", boot=BOOT)
    await provider.launch(a4000(), name="someone-elses", boot=BOOT)
    assert [i.instance_id for i in await provider.list_instances("tgp-")] == [ours.instance_id]
    assert [i.instance_id for i in await provider.list_instances("tgp-", names={ours.name})] == [ours.instance_id]
    assert await provider.list_instances("tgp-", names={"tgp-gpu-a-2"}) == []  # the names asked for, no other


@pytest.mark.parametrize("path", ["/v1/startup-scripts", "/v1/machines"])
async def test_a_payload_too_large_is_the_classs_config_error_naming_its_size(provider: PaperspaceProvider, ps: FakePaperspace, path: str) -> None:
    """A 413 is the startup script the class's template made, too large for every offer: a
    ConfigError naming its size, not the offer's refusal (before: OfferRefused on /machines,
    so the node failed over and the offer was hidden)."""
    ps.fail(path, 413, method="POST", message="request entity too large")
    with pytest.raises(ConfigError) as err:
        await provider.launch(a4000(), name=NAME, boot=BOOT)
    assert f"{len(BOOT.content.encode())} bytes" in str(err.value) and "413" in str(err.value)
    assert ps.live_machines() == [] and ps.scripts == {}
