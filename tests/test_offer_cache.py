"""The pricing cache (issue 20): each provider account's offers are listed once per TTL for the
whole worker, shared by node selections and pool checks, against the simulated cloud over HTTP
(whose keys belong to accounts, and which counts its offer listings per account).

Time is the cache's injected clock, moved by hand: no sleeps. Concurrency is real: listings are
held in flight at the fake until every lookup has arrived."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from decimal import Decimal

import pytest
from pydantic import SecretStr
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.accounts import ProviderRegistry
from activities.clouds.simulated import SimulatedProvider
from activities.node import NodeActivities
from activities.offer_cache import KEEP_WARM_FOR, OFFER_CACHE_TTL, REFRESH_AHEAD, RETRY_FAILED_AFTER, SERVE_STALE_FOR, OfferCache
from activities.pool import PoolActivities
from sim.cloud import SimOffer, SimulatedCloud
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import request, start
from tests.kube_env import KubeApi
from tests.test_credentials import NS, new_key, put_secret
from tests.test_template_failures import StubTailnet
from tgp.types import CredentialsRef, LaunchInput, NodePhase, NodeStatus, OfferRequirements, SelectOfferInput
from workflows.node import GPUNodeWorkflow

TTL = OFFER_CACHE_TTL.total_seconds()


class Clock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def select(requirements: OfferRequirements, exclude: list[str] | None = None) -> SelectOfferInput:
    return SelectOfferInput(requirements=requirements, exclude=exclude or [])


async def test_a_burst_of_node_starts_lists_each_account_once_per_ttl(kube_api: KubeApi) -> None:
    """20 nodes of two classes (two accounts) choose their offers at once, beside their pools'
    offer checks: one listing per account reaches the cloud; after the TTL, one more each."""
    key_a, key_b = new_key("a"), new_key("b")
    ref_a, ref_b = CredentialsRef(name="cloud-a", key="apiKey"), CredentialsRef(name="cloud-b", key="apiKey")
    if kube_api.real:
        await kube_api.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await put_secret(kube_api.http, ref_a.name, {ref_a.key: key_a})
    await put_secret(kube_api.http, ref_b.name, {ref_b.key: key_b})
    clock = Clock()
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key_a, "team-a")
        cloud.add_key(key_b, "team-b")
        cache = OfferCache(clock=clock)
        registry = ProviderRegistry(cluster=kube_api.cluster, env={"TGP_SIMULATED_CLOUD_URL": cloud.url}, offers=cache)
        node = NodeActivities(providers={}, tailnets={}, cluster=kube_api.cluster, registry=registry)
        pool = PoolActivities(cluster=kube_api.cluster, providers={}, registry=registry)
        try:
            for round_ in (1, 2):
                cloud.hold_offer_lists()
                looked_up = cache.lookups
                picks = [
                    asyncio.ensure_future(
                        ActivityEnvironment().run(
                            node.select_offer,
                            select(OfferRequirements(gpu_types=["RTX4090"], providers=["simulated"], credentials={"simulated": ref})),
                        )
                    )
                    for ref in [ref_a, ref_b] * 10
                ]
                checks = [
                    asyncio.ensure_future(
                        ActivityEnvironment().run(pool.check_offers, OfferRequirements(providers=["simulated"], credentials={"simulated": ref}))
                    )
                    for ref in (ref_a, ref_b)
                ]

                async def all_arrived() -> bool:
                    return cache.lookups - looked_up == 22

                await eventually(all_arrived, what="every selection reached the cache")  # 20 wait on 2 listings
                cloud.release_offer_lists()
                choices = await asyncio.gather(*picks)
                assert all(c.offer is not None and c.offer.offer_id == "rtx4090-us-east-spot" for c in choices)
                assert all(c.matching for c in await asyncio.gather(*checks))
                assert cloud.offer_lists == {"team-a": round_, "team-b": round_}, "one listing per account per TTL"
                clock.advance(TTL)
        finally:
            await registry.aclose()


async def test_twenty_node_workflows_started_at_once_list_offers_once(temporal: WorkflowEnvironment) -> None:
    """The same through the worker as `tgp worker` wires it (build_activities: one registry, one
    cache, the scheduled refresh) and 20 GPUNodeWorkflows started together: one listing per TTL
    reaches the cloud (the schedule may add one per TTL less REFRESH_AHEAD on a slow machine)."""
    async with running_world(temporal) as (world, _, queue):
        loop = asyncio.get_running_loop()
        began = loop.time()
        handles = await asyncio.gather(*(start(temporal, queue, request()) for _ in range(20)))

        async def all_chose() -> bool:
            statuses: list[NodeStatus] = await asyncio.gather(*(h.query(GPUNodeWorkflow.status) for h in handles))
            return all(s.attempts for s in statuses)

        await eventually(all_chose, timeout=120, what="every node to choose an offer")
        elapsed = loop.time() - began
        listings = sum(world.cloud.offer_lists.values())
        assert 1 <= listings <= 1 + int(elapsed // (TTL - REFRESH_AHEAD.total_seconds())), f"{listings} listings in {elapsed:.0f} s"
        for h in handles:
            await h.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        finals: list[NodeStatus] = await asyncio.gather(*(h.result() for h in handles))
        assert {f.phase for f in finals} == {NodePhase.TERMINATED}
        assert world.cloud.live_instances() == []


async def test_a_stale_entry_is_listed_again_and_the_schedule_keeps_it_warm() -> None:
    clock = Clock()
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        provider = SimulatedProvider(cloud.url)
        cache = OfferCache(clock=clock)
        node = NodeActivities(providers={"simulated": provider}, tailnets={}, cluster=None, registry=ProviderRegistry(cluster=None, fallback={"simulated": provider}, offers=cache))  # type: ignore[arg-type]
        req = select(OfferRequirements(gpu_types=["L40S"]))
        try:
            assert (await node.select_offer(req)).offer.hourly_price == Decimal("0.89")  # type: ignore[union-attr]
            cloud.catalog["l40s-us-east"] = dataclasses.replace(cloud.catalog["l40s-us-east"], price_per_hour=Decimal("0.79"))
            clock.advance(TTL - 1)
            assert (await node.select_offer(req)).offer.hourly_price == Decimal("0.89"), "fresh: served from the cache"  # type: ignore[union-attr]
            assert cloud.offer_lists[""] == 1
            clock.advance(1)
            assert (await node.select_offer(req)).offer.hourly_price == Decimal("0.79"), "stale: listed again"  # type: ignore[union-attr]
            assert cloud.offer_lists[""] == 2

            # The schedule lists an account in use shortly before its TTL ends, so no lookup waits.
            clock.advance(TTL / 2)
            assert await cache.refresh_due() == 0
            clock.advance(TTL / 2 - 5)
            assert await cache.refresh_due() == 1
            assert cloud.offer_lists[""] == 3
            clock.advance(10)
            await node.select_offer(req)
            assert cloud.offer_lists[""] == 3, "kept warm: a hit"

            # An account nobody looks up is not polled, and is forgotten after KEEP_WARM_FOR.
            clock.advance(KEEP_WARM_FOR.total_seconds())
            assert await cache.refresh_due() == 0 and list(cache.ages()) == []
            assert cloud.offer_lists[""] == 3
        finally:
            await provider.aclose()


async def test_a_capacity_failure_marks_the_offer_unavailable_and_the_next_selection_skips_it() -> None:
    clock = Clock()
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        provider = SimulatedProvider(cloud.url)
        cache = OfferCache(clock=clock)
        registry = ProviderRegistry(cluster=None, fallback={"simulated": provider}, offers=cache)  # type: ignore[arg-type]
        node = NodeActivities(
            providers={"simulated": provider}, tailnets={"stub": StubTailnet()}, cluster=None, registry=registry,  # type: ignore[dict-item, arg-type]
            poll_interval=timedelta(seconds=0.01), create_settle=timedelta(0),
        )  # fmt: skip
        req = select(OfferRequirements(gpu_types=["RTX4090"]))
        try:
            first = (await node.select_offer(req)).offer
            assert first is not None and first.offer_id == "rtx4090-us-east-spot"
            cloud.set_capacity(first.offer_id, False)
            launch = LaunchInput(node_name="gpu-1", attempt=1, offer=first, tailnet_tags=["tag:tgp-node"], tailnet="stub")
            with pytest.raises(ApplicationError) as failed:
                await ActivityEnvironment().run(node.launch_instance, launch)
            assert failed.value.type == "CapacityError"

            second = await node.select_offer(req)
            assert second.offer is not None and second.offer.offer_id == "rtx4090-us-east", "the sold-out offer is skipped"
            assert second.unavailable == 1 and cloud.offer_lists[""] == 1, "from the cached listing"
            clock.advance(TTL)
            third = await node.select_offer(req)
            assert third.offer is not None and third.offer.offer_id == "rtx4090-us-east", "a new listing does not bring it back"
            assert cloud.offer_lists[""] == 2
        finally:
            await provider.aclose()


async def test_a_failing_provider_hides_no_other_and_serves_its_last_offers_for_a_bounded_time() -> None:
    clock = Clock()
    async with (
        SimulatedCloud(catalog=(SimOffer("cheap", "RTX4090", "us-east", Decimal("0.30")),)) as alpha_cloud,
        SimulatedCloud(catalog=(SimOffer("dear", "RTX4090", "us-east", Decimal("0.50")),)) as beta_cloud,
    ):
        providers = {"alpha": SimulatedProvider(alpha_cloud.url, name="alpha"), "beta": SimulatedProvider(beta_cloud.url, name="beta")}
        cache = OfferCache(clock=clock)
        node = NodeActivities(providers=providers, tailnets={}, cluster=None, registry=ProviderRegistry(cluster=None, fallback=providers, offers=cache))  # type: ignore[arg-type]
        req = select(OfferRequirements(gpu_types=["RTX4090"]))
        try:
            # alpha answers 503 from the start: beta's offer is chosen, alpha's failure named in the logs.
            alpha_cloud.fail("/v1/offers", 503, times=1000)
            choice = await node.select_offer(req)
            assert choice.offer is not None and choice.offer.provider == "beta" and choice.seen == 1

            # Within RETRY_FAILED_AFTER alpha is not asked again, by any node.
            def alpha_asked() -> int:  # listings that reached alpha, answered 503 or not
                return alpha_cloud.offer_lists[""] + sum(1000 - f.remaining for f in alpha_cloud._faults)

            asked = alpha_asked()  # one listing: the adapter's own in-call retries of a 503
            clock.advance(RETRY_FAILED_AFTER.total_seconds() - 1)
            for _ in range(5):
                assert (await node.select_offer(req)).offer.provider == "beta"  # type: ignore[union-attr]
            assert alpha_asked() == asked

            # alpha recovers and is listed; then fails again past its TTL: its last offers are
            # served, marked stale, until SERVE_STALE_FOR past the TTL; then they are gone.
            alpha_cloud._faults.clear()
            clock.advance(RETRY_FAILED_AFTER.total_seconds())
            assert (await node.select_offer(req)).offer.provider == "alpha"  # type: ignore[union-attr]
            alpha_cloud.fail("/v1/offers", 503, times=1000)
            clock.advance(TTL)
            stale = await node.select_offer(req)
            assert stale.offer is not None and stale.offer.provider == "alpha"
            assert "listing them again failed" in stale.stale["alpha"] and "503" in stale.stale["alpha"]
            clock.advance(SERVE_STALE_FOR.total_seconds() - 1)
            assert (await node.select_offer(req)).offer.provider == "alpha"  # type: ignore[union-attr]
            clock.advance(1)
            gone = await node.select_offer(req)
            assert gone.offer is not None and gone.offer.provider == "beta" and gone.stale == {}, "stale offers are bounded"
            assert beta_cloud.offer_lists[""] <= 1 + 1 + (TTL + SERVE_STALE_FOR.total_seconds()) // TTL
        finally:
            for p in providers.values():
                await p.aclose()


async def test_a_cancelled_lookup_leaves_the_listing_to_the_others() -> None:
    gate, calls = asyncio.Event(), []

    async def list_offers() -> list:  # the provider port's call, held in flight
        calls.append(1)
        await gate.wait()
        return []

    cache = OfferCache(clock=Clock())
    first = asyncio.ensure_future(cache.offers("p", None, list_offers))
    second = asyncio.ensure_future(cache.offers("p", None, list_offers))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert (await second).offers == [] and len(calls) == 1


async def test_a_refused_key_serves_no_stale_offers() -> None:
    """Stale while error rides out outages only: offers of a key the provider now refuses (401)
    would fail the launch the same way, so the other provider's offer is chosen at once."""
    clock = Clock()
    async with (
        SimulatedCloud(catalog=(SimOffer("cheap", "RTX4090", "us-east", Decimal("0.30")),), api_key="alpha-key") as alpha_cloud,
        SimulatedCloud(catalog=(SimOffer("dear", "RTX4090", "us-east", Decimal("0.50")),)) as beta_cloud,
    ):
        providers = {
            "alpha": SimulatedProvider(alpha_cloud.url, name="alpha", api_key=SecretStr("alpha-key")),
            "beta": SimulatedProvider(beta_cloud.url, name="beta"),
        }
        cache = OfferCache(clock=clock)
        node = NodeActivities(providers=providers, tailnets={}, cluster=None, registry=ProviderRegistry(cluster=None, fallback=providers, offers=cache))  # type: ignore[arg-type]
        req = select(OfferRequirements(gpu_types=["RTX4090"]))
        try:
            assert (await node.select_offer(req)).offer.provider == "alpha"  # type: ignore[union-attr]
            alpha_cloud._api_key = "rotated"  # the worker's key now answers 401
            clock.advance(TTL)
            choice = await node.select_offer(req)
            assert choice.offer is not None and choice.offer.provider == "beta" and choice.stale == {}
        finally:
            for p in providers.values():
                await p.aclose()


# --- the cache's promises over generated histories ---------------------------------------

from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tgp.errors import AuthError, TransientError  # noqa: E402

STALE_FOR = SERVE_STALE_FOR.total_seconds()
RETRY = RETRY_FAILED_AFTER.total_seconds()

Step = st.one_of(
    st.tuples(st.just("advance"), st.sampled_from([1.0, 9.0, 10.0, 30.0, 59.0, 60.0, 61.0, 300.0, 599.0, 700.0])),
    st.tuples(st.just("burst"), st.integers(1, 6)),
    st.tuples(st.just("provider"), st.sampled_from(["up", "outage", "revoked"])),
)


async def cache_history(steps: list[tuple[str, object]]) -> None:
    clock = Clock()
    cache = OfferCache(clock=clock)
    state = {"mode": "up"}
    calls: list[float] = []  # when each listing reached the provider
    good: list[float] = []  # when each listing succeeded
    failed: list[tuple[float, str]] = []

    async def list_offers() -> list:  # the provider: answers after a few turns of the loop, like HTTP
        calls.append(clock.now)
        for _ in range(3):
            await asyncio.sleep(0)
        if state["mode"] == "outage":
            failed.append((clock.now, "outage"))
            raise TransientError("provider answered 503")
        if state["mode"] == "revoked":
            failed.append((clock.now, "revoked"))
            raise AuthError("provider answered 401")
        good.append(clock.now)
        return [clock.now]  # the "offers" say when they were listed

    for kind, arg in steps:
        if kind == "advance":
            clock.advance(arg)  # type: ignore[arg-type]
            continue
        if kind == "provider":
            state["mode"] = arg  # type: ignore[assignment]
            continue
        before = len(calls)
        results = await asyncio.gather(*(cache.offers("p", None, list_offers) for _ in range(arg)), return_exceptions=True)  # type: ignore[call-overload]
        assert len(calls) - before <= 1, "single flight: one listing per burst at one instant"
        for r in results:
            if isinstance(r, BaseException):
                assert isinstance(r, (TransientError, AuthError))
                # An error only when no good listing is young enough, or the provider refuses the key.
                young = good and clock.now - good[-1] < TTL + STALE_FOR
                assert not young or (failed and failed[-1][1] == "revoked")
                continue
            listed_at = r.offers[0]
            assert r.age == clock.now - listed_at and listed_at == good[-1], "the latest good listing"
            assert r.age < TTL + STALE_FOR, "stale offers are bounded"
            assert r.stale == (r.age >= TTL), "served past the TTL only as stale, and then it says so"
            if r.stale:
                assert failed and failed[-1][1] == "outage" and "503" in r.error
    # The provider is asked only when the entry is stale, and not again soon after a failure.
    for at in calls:
        earlier_good = [g for g in good if g < at]
        assert not earlier_good or at - earlier_good[-1] >= TTL or any(g == at for g in good), "listed while fresh"
        earlier_fail = [f for f, _ in failed if f < at]
        assert not earlier_fail or at - earlier_fail[-1] >= RETRY or (earlier_good and earlier_good[-1] > earlier_fail[-1]), "retried too soon"


@settings(max_examples=150, deadline=None)
@given(st.lists(Step, max_size=25))
@example([("burst", 2), ("provider", "outage"), ("advance", 61.0), ("burst", 2), ("advance", 599.0), ("burst", 1), ("advance", 10.0), ("burst", 1)])
def test_the_cache_lists_only_when_stale_once_per_burst_and_bounds_stale_offers(steps: list[tuple[str, object]]) -> None:
    asyncio.run(cache_history(steps))
