"""Failover by cause, like SkyPilot (issue 35 item 11), and the failed-offer cache keyed by what
failed: a capacity error or refusal blocks the offer, a quota its GPU type in every region of the
provider, rejected credentials the provider account, each only for the account that failed (the
class's CredentialsRef for the provider, None: the worker's own key). A node never spends two
attempts on one cause; an oversized boot payload (413) is the class's problem, not the offer's."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.accounts import ProviderRegistry
from activities.node import NodeActivities
from activities.offer_cache import OfferCache
from sim.cloud import SimulatedCloud
from tests.conftest import running_world
from tests.kube_env import KubeApi
from tests.test_credentials import new_key, put_secret
from tests.test_node_lifecycle import request, start, wait_phase
from tests.test_offer_cache import Clock
from tests.test_template_failures import CLASS, StubTailnet, world  # noqa: F401 - `world` is a fixture
from tgp.offers import UnavailableOffers, block_for, choose_offer
from workflows.node import GPUNodeWorkflow
from tgp.types import (
    BlockScope,
    CredentialsRef,
    LaunchInput,
    MarkUnavailableInput,
    NodePhase,
    Offer,
    OfferBlock,
    OfferRequirements,
    SelectOfferInput,
)

TTL = timedelta(minutes=3)
REF_A = CredentialsRef(name="cloud-a", key="apiKey")
REF_B = CredentialsRef(name="cloud-b", key="apiKey")


def offer(provider: str, gpu: str, region: str, price: str = "1.00") -> Offer:
    return Offer(provider=provider, offer_id=f"{gpu}-{region}", gpu_type=gpu, region=region, hourly_price=Decimal(price))


# --- the blocks, pure ------------------------------------------------------------------------


def test_each_cause_blocks_its_scope_for_its_account_only() -> None:
    h100_east, h100_west, a100_east = offer("p", "H100", "east"), offer("p", "H100", "west"), offer("p", "A100", "east")
    other_provider = offer("q", "H100", "east")
    for cause in ("CapacityError", "OfferRefused", "LaunchFailed", ""):
        block = block_for(cause, h100_east, REF_A)
        assert block.scope is BlockScope.OFFER
        assert block.covers(h100_east, REF_A) and not block.covers(h100_west, REF_A)
    quota = block_for("QuotaExceeded", h100_east, REF_A)
    assert quota.scope is BlockScope.GPU_TYPE
    assert quota.covers(h100_west, REF_A) and not quota.covers(a100_east, REF_A) and not quota.covers(other_provider, REF_A)
    for cause in ("AuthError", "PermissionDenied"):
        account = block_for(cause, h100_east, REF_A)
        assert account.scope is BlockScope.ACCOUNT
        assert account.covers(a100_east, REF_A) and not account.covers(other_provider, REF_A)
    for block in (block_for(c, h100_east, REF_A) for c in ("CapacityError", "QuotaExceeded", "AuthError")):
        assert not block.covers(h100_east, REF_B) and not block.covers(h100_east, None), "another account is not blocked"


def test_one_classs_failure_hides_nothing_from_a_class_on_another_account() -> None:
    """Before, the cache was keyed by offer only: class A's refusal hid the offer from every class."""
    cheap, dear = offer("p", "H100", "east", "1.00"), offer("p", "H100", "west", "2.00")
    cache = UnavailableOffers(clock=lambda: 0.0)
    cache.mark(block_for("AuthError", cheap, REF_A), TTL)
    a = OfferRequirements(credentials={"p": REF_A})
    b = OfferRequirements(credentials={"p": REF_B})
    own = OfferRequirements()
    assert choose_offer([cheap, dear], a, blocks=cache.blocks()).offer is None
    assert choose_offer([cheap, dear], b, blocks=cache.blocks()).offer == cheap
    assert choose_offer([cheap, dear], own, blocks=cache.blocks()).offer == cheap


# --- the property ----------------------------------------------------------------------------

PROVIDERS, GPUS, REGIONS = ("p", "q"), ("H100", "A100"), ("east", "west", "south")
CATALOG = [
    offer(p, g, r, f"{1 + i * 0.1:.2f}")
    for i, (p, g, r) in enumerate((p, g, r) for p in PROVIDERS for g in GPUS for r in REGIONS)
]
CAUSES = ("CapacityError", "OfferRefused", "LaunchFailed", "QuotaExceeded", "AuthError", "PermissionDenied")
ACCOUNTS = (None, REF_A, REF_B)


@st.composite
def two_classes(draw: st.DrawFn) -> tuple[dict[str, CredentialsRef], dict[str, CredentialsRef]]:
    """Class A's and class B's credentials, B on another account for every provider."""
    a: dict[str, CredentialsRef] = {}
    b: dict[str, CredentialsRef] = {}
    for p in PROVIDERS:
        mine = draw(st.sampled_from(ACCOUNTS))
        theirs = draw(st.sampled_from([x for x in ACCOUNTS if x != mine]))
        if mine is not None:
            a[p] = mine
        if theirs is not None:
            b[p] = theirs
    return a, b


@settings(max_examples=300, deadline=None)
@given(
    classes=two_classes(),
    failures=st.lists(st.tuples(st.sampled_from(CAUSES), st.sampled_from([0, 60, 200, 3600])), min_size=1, max_size=12),
)
def test_no_two_attempts_fail_on_one_cause_and_no_class_hides_anothers_offers(
    classes: tuple[dict[str, CredentialsRef], dict[str, CredentialsRef]], failures: list[tuple[str, int]]
) -> None:
    """A node of class A meets `failures` one after another (with time passing between them, past
    the cache's TTL too): each offer it is given is covered by no block of its earlier failures,
    and a class B on other accounts chooses exactly as if A had never failed. The same functions
    the workflow and the activities use: `block_for` (launch.bring_up), the node's own blocks
    and the worker's cache into `choose_offer` (NodeActivities.select_offer)."""
    creds_a, creds_b = classes
    now = [0.0]
    cache = UnavailableOffers(clock=lambda: now[0])
    req_a, req_b = OfferRequirements(credentials=creds_a), OfferRequirements(credentials=creds_b)
    tried: list[str] = []
    node_blocked: list[OfferBlock] = []
    for cause, later in failures:
        choice = choose_offer(CATALOG, req_a, exclude=tried, blocks=[*node_blocked, *cache.blocks()])
        assert choose_offer(CATALOG, req_b, blocks=cache.blocks()) == choose_offer(CATALOG, req_b), "A's failures hide nothing from B"
        if choice.offer is None:
            break
        chosen = choice.offer
        account = creds_a.get(chosen.provider)
        covering = [b for b in node_blocked if b.covers(chosen, account)]
        assert not covering, f"{chosen.key} was chosen again under an earlier cause: {covering}"
        tried.append(chosen.key)
        block = block_for(cause, chosen, account)
        cache.mark(block, TTL)
        if block not in node_blocked:
            node_blocked.append(block)
        now[0] += later


# --- the activities --------------------------------------------------------------------------


async def test_a_capacity_failure_of_one_account_leaves_the_offer_to_another(kube_api: KubeApi) -> None:
    """Two classes on two accounts of one provider: A's capacity failure (marked by the launch
    itself) hides the offer from A's next selection only; B still gets it. Before, the cache
    was keyed by offer alone and B skipped it too."""
    key_a, key_b = new_key("a"), new_key("b")
    await put_secret(kube_api.http, REF_A.name, {REF_A.key: key_a})
    await put_secret(kube_api.http, REF_B.name, {REF_B.key: key_b})
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key_a, "team-a")
        cloud.add_key(key_b, "team-b")
        registry = ProviderRegistry(cluster=kube_api.cluster, env={"TGP_SIMULATED_CLOUD_URL": cloud.url}, offers=OfferCache(clock=Clock()))
        node = NodeActivities(providers={}, tailnets={"stub": StubTailnet()}, cluster=kube_api.cluster, registry=registry,  # type: ignore[dict-item]
                              poll_interval=timedelta(seconds=0.01), create_settle=timedelta(0))  # fmt: skip

        def req(ref: CredentialsRef) -> SelectOfferInput:
            return SelectOfferInput(requirements=OfferRequirements(gpu_types=["RTX4090"], providers=["simulated"], credentials={"simulated": ref}))

        try:
            first = (await node.select_offer(req(REF_A))).offer
            assert first is not None
            cloud.set_capacity(first.offer_id, False)
            launch = LaunchInput(node_name="gpu-a", attempt=1, offer=first, credentials=REF_A, tailnet_tags=["tag:tgp-node"], tailnet="stub")
            with pytest.raises(ApplicationError) as failed:
                await ActivityEnvironment().run(node.launch_instance, launch)
            assert failed.value.type == "CapacityError"
            again = await node.select_offer(req(REF_A))
            assert again.offer is not None and again.offer.key != first.key and again.unavailable == 1
            other = await node.select_offer(req(REF_B))
            assert other.offer == first and other.unavailable == 0, "another account's capacity failure hides nothing"
        finally:
            await registry.aclose()


async def test_a_blocked_account_is_told_to_the_class(world: tuple[NodeActivities, httpx.AsyncClient]) -> None:  # noqa: F811
    acts, http = world
    sold = Offer(provider="simulated", offer_id="rtx4090-us-east", gpu_type="RTX4090", region="us-east", hourly_price=Decimal("0.44"))
    block = block_for("PermissionDenied", sold, None)
    await acts.mark_offer_unavailable(
        MarkUnavailableInput(offer_key="simulated/", ttl=TTL, block=block, node_class=CLASS, node_name="gpu-1", error="simulated refused POST /v1/instances (403)")
    )
    choice = await acts.select_offer(SelectOfferInput(requirements=OfferRequirements(providers=["simulated"])))
    assert choice.offer is None and choice.matching > 0, "every offer of the account is blocked"
    events: list[dict[str, Any]] = (await http.get("/api/v1/events")).json()["items"]
    [event] = [e for e in events if e["involvedObject"]["kind"] == "GPUNodeClass"]
    assert event["reason"] == "ProviderAccountBlocked" and event["type"] == "Warning"
    assert "simulated with the worker's own account" in event["message"] and "PermissionDenied" in event["message"], event["message"]


# --- the node workflow -----------------------------------------------------------------------


async def test_a_permission_error_blocks_the_account_and_spends_one_attempt(temporal: WorkflowEnvironment) -> None:
    """Every create is refused with 403: the account may not buy. Before, the node spent all its
    attempts on one offer after another of that account; now the first blocks the account and
    the node ends Failed saying so."""
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail("/v1/instances", 403, times=10, method="POST")
        handle = await start(temporal, queue, request(max_launch_attempts=3))
        failed = await wait_phase(handle, NodePhase.FAILED)
        assert len(failed.attempts) == 1, [a.outcome for a in failed.attempts]
        assert "PermissionDenied" in (failed.attempts[0].outcome or "")
        assert "blocked: simulated with the worker's own account" in (failed.last_error or ""), failed.last_error
        assert world.cloud.live_instances() == []


async def test_an_oversized_boot_payload_ends_the_node_and_blocks_no_offer(temporal: WorkflowEnvironment) -> None:
    """A 413 on create is the class's payload, too large for every offer: the node ends at once,
    naming the size, as a bad template does. Before, it was the offer's refusal: the node
    failed over, and the offer was hidden from every class for minutes."""
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail("/v1/instances", 413, times=1, method="POST", message="request entity too large")
        handle = await start(temporal, queue, request())
        failed = await wait_phase(handle, NodePhase.FAILED)
        assert len(failed.attempts) == 1
        assert "ConfigError" in (failed.last_error or "") and "bytes" in (failed.last_error or ""), failed.last_error
        assert failed.attempts[0].offer.offer_id == "rtx4090-us-east"
        second = await start(temporal, queue, request())
        ready = await wait_phase(second, NodePhase.READY)
        assert [a.offer.offer_id for a in ready.attempts] == ["rtx4090-us-east"], "the offer is not blocked"
        await second.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await second.result()).phase is NodePhase.TERMINATED
