"""Launches' look-ups by name, coalesced per provider account (activities/name_lists.py).

The promise: a coalesced look-up never answers with a view older than the caller's own call
would have (its listing started after the caller asked), and a burst of launches costs a
listing per round trip, not three per launch. The property runs against a provider account
modelled as real ones behave: lists lag behind creates and terminates, requests are answered
whenever the test says (so every interleaving of asks, answers, failures and cancellations is
reachable), and each answer is the account's list view at the moment it is served. The counts
run against the simulated cloud over HTTP (sim/), with whole launches (NodeActivities).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Collection
from typing import Any
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from activities.clouds.simulated import SimulatedProvider
from activities.node.launch import LOOK_FRESH_FOR
from activities.tailnets.tailscale import TailscaleTailnet
from activities.name_lists import LookupsByAccount
from sim.cloud import SimulatedCloud
from sim.lambdalabs import FakeLambda
from sim.provider_model import ManualClock, ProviderModel
from tests.money_env import OFFER, money_env
from tests.test_provider_lambdalabs import A10_EAST, API_KEY, BOOT, Clock, make_provider
from tgp.errors import TransientError
from tgp.types import BootPayload, Instance, InstanceRef, InstanceState, LaunchResult, TwinWatchInput, instance_name

NAMES = [f"tgp-burst-{i:03d}-1" for i in range(4)]


@dataclass
class _Record:
    name: str
    created: int
    ended: int | None = None


@dataclass(eq=False)
class LaggingAccount:
    """One provider account: lists show an instance `lag` ticks after its create and drop it
    `lag` ticks after its end; each request waits until the test serves (or fails) it, and
    answers with the view at that moment."""

    lag: int
    now: int = 0
    records: dict[str, _Record] = field(default_factory=dict)
    held: list[tuple[str, str, asyncio.Future[list[Instance]]]] = field(default_factory=list)
    requests: int = 0
    most_in_flight: int = 0
    name = "lagging"

    def view(self, at: int, name: str | None = None, prefix: str = "") -> list[Instance]:
        return [
            Instance(provider=self.name, instance_id=i, name=r.name, state=InstanceState.RUNNING)
            for i, r in sorted(self.records.items())
            if r.created + self.lag <= at and (r.ended is None or at < r.ended + self.lag)
            and (r.name == name if name is not None else r.name.startswith(prefix))
        ]  # fmt: skip

    async def _request(self, kind: str, arg: str) -> list[Instance]:
        self.requests += 1
        future: asyncio.Future[list[Instance]] = asyncio.get_running_loop().create_future()
        self.held.append((kind, arg, future))
        self.most_in_flight = max(self.most_in_flight, len(self.held))
        return await future

    async def find_all_by_name(self, name: str) -> list[Instance]:
        return await self._request("name", name)

    async def list_instances(self, prefix: str, names: Collection[str] | None = None) -> list[Instance]:
        listed = await self._request("prefix", prefix)
        return [i for i in listed if names is None or i.name in names]

    def serve(self, fail: bool = False) -> None:
        if not self.held:
            return
        kind, arg, future = self.held.pop(0)
        if fail:
            future.set_exception(TransientError("429 from the provider"))
        else:
            future.set_result(self.view(self.now, name=arg) if kind == "name" else self.view(self.now, prefix=arg))


step = st.one_of(
    st.tuples(st.just("create"), st.integers(0, len(NAMES) - 1)),
    st.tuples(st.just("end"), st.integers(0, 20)),
    st.tuples(st.just("tick"), st.integers(1, 3)),
    st.tuples(st.just("ask"), st.integers(0, len(NAMES) - 1)),
    st.tuples(st.just("serve"), st.just(0)),
    st.tuples(st.just("fail"), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
)


async def _settle() -> None:
    for _ in range(6):
        await asyncio.sleep(0)


async def _scenario(lag: int, steps: list[tuple[str, int]]) -> None:
    account = LaggingAccount(lag=lag)
    lookups = LookupsByAccount()
    ids = iter(range(1_000_000))
    # Each caller: (name, tick it asked at, task, tick it was answered at).
    callers: list[tuple[str, int, asyncio.Task[list[Instance]], list[int]]] = []

    def ask(name: str) -> None:
        answered: list[int] = []

        async def call() -> list[Instance]:
            try:
                return await lookups.find_all_by_name(account, name)  # type: ignore[arg-type]
            finally:
                answered.append(account.now)

        callers.append((name, account.now, asyncio.ensure_future(call()), answered))

    for kind, n in steps:
        if kind == "create":
            account.records[f"i-{next(ids):06d}"] = _Record(NAMES[n], account.now)
        elif kind == "end":
            live = [r for r in account.records.values() if r.ended is None]
            if live:
                live[n % len(live)].ended = account.now
        elif kind == "tick":
            account.now += n
        elif kind == "ask":
            ask(NAMES[n])
        elif kind in ("serve", "fail"):
            account.serve(fail=kind == "fail")
        elif kind == "cancel" and callers:
            callers[n % len(callers)][2].cancel()
        await _settle()
        assert len(account.held) <= 1, "two listings of one account in flight at once"
    for _ in range(len(callers) + 2):  # every look-up is answered in the end
        account.serve()
        await _settle()
    assert all(task.done() for _, _, task, _ in callers), "a look-up was left waiting"

    for name, asked, task, answered in callers:
        if task.cancelled():
            continue
        if task.exception() is not None:
            assert isinstance(task.exception(), TransientError)
            continue
        got = sorted(i.instance_id for i in task.result())
        # Never older than the caller's own call: the view of some moment between its ask and
        # its answer (the listing went out after it asked).
        fresh = [t for t in range(asked, answered[0] + 1) if sorted(i.instance_id for i in account.view(t, name=name)) == got]
        assert fresh, f"{name} asked at {asked}, answered at {answered[0]} with {got}: the view of no moment in between"
    assert account.requests <= max(1, len(callers)), "more listings than look-ups"


@settings(max_examples=150)
@given(lag=st.integers(0, 3), steps=st.lists(step, max_size=40))
def test_a_coalesced_look_up_never_answers_with_a_view_older_than_its_own_call(lag: int, steps: list[tuple[str, int]]) -> None:
    asyncio.run(_scenario(lag, steps))


async def test_a_burst_of_look_ups_shares_one_listing_and_those_during_it_the_next() -> None:
    account = LaggingAccount(lag=0)
    lookups = LookupsByAccount()
    first = [asyncio.ensure_future(lookups.find_all_by_name(account, f"tgp-a-{i}-1")) for i in range(50)]  # type: ignore[arg-type]
    await _settle()
    assert account.requests == 1 and account.held[0][:2] == ("prefix", "tgp-a-")
    later = [asyncio.ensure_future(lookups.find_all_by_name(account, f"tgp-b-{i}-1")) for i in range(50)]  # type: ignore[arg-type]
    await _settle()
    assert account.requests == 1, "a look-up joined a listing that started before it asked, or went out beside it"
    account.serve()
    await _settle()
    assert all(t.done() for t in first) and account.requests == 2
    account.serve()
    await _settle()
    assert all(t.done() for t in later) and account.requests == 2


async def test_one_look_up_alone_is_the_adapters_own_by_name() -> None:
    account = LaggingAccount(lag=0)
    account.records["i-1"] = _Record("tgp-x-1", 0)
    task = asyncio.ensure_future(LookupsByAccount().find_all_by_name(account, "tgp-x-1"))  # type: ignore[arg-type]
    await _settle()
    assert account.held[0][:2] == ("name", "tgp-x-1")
    account.serve()
    assert [i.instance_id for i in await task] == ["i-1"]


@pytest.mark.parametrize("lag", [0.0, 20.0])
async def test_a_burst_of_launches_lists_the_account_per_round_trip_not_three_times_per_launch(lag: float) -> None:
    """40 launches at once through NodeActivities against the simulated cloud (over HTTP, lists
    lagging `lag` seconds of its clock): each adopts nothing, buys exactly one instance, and the
    account is listed a handful of times (it was 3 look-ups per launch: 120)."""
    n = 40
    async with money_env(list_lag=lag) as env:
        results = await asyncio.gather(*(env.launch(f"burst-{i:03d}") for i in range(n)))
        assert not any(r.adopted for r in results)
        assert env.cloud.create_requests == n
        assert all(len(env.billing(f"burst-{i:03d}")) == 1 for i in range(n))
        looked = env.cloud.name_lookups + env.cloud.instance_lists
        assert looked <= n, f"{looked} listings for {n} launches (each launch looks up to three times)"


async def test_a_coalesced_listing_finds_what_an_earlier_launch_bought_under_each_name() -> None:
    """A launch after a reset (its name already bought) adopts, while its neighbours in the same
    listing buy: each caller gets the instances under its own name only."""
    key = "sim-" + secrets.token_hex(8)
    model = ProviderModel(clock=ManualClock())
    async with SimulatedCloud(api_key=key, boot_delay=60, model=model) as cloud, SimulatedProvider(cloud.url, api_key=SecretStr(key)) as provider:
        boot = BootPayload(kind="env", content="", hostname="x")
        bought = await provider.launch(OFFER, name="tgp-r-1-1", boot=boot)
        await provider.launch(OFFER, name="tgp-other-1", boot=boot)  # another prefix: not ours to return
        lookups = LookupsByAccount()
        found = await asyncio.gather(*(lookups.find_all_by_name(provider, f"tgp-r-{i}-1") for i in range(1, 6)))
        assert [[i.instance_id for i in f] for f in found] == [[bought.instance_id], [], [], [], []]
        assert cloud.instance_lists + cloud.name_lookups <= 2


async def test_lambda_names_too_long_for_its_api_are_found_in_a_shared_listing() -> None:
    """Lambda keeps 64 characters of a name (the adapter sends a hashed short form): a listing
    shared by launches matches each by the name it was sent under. One request serves them all
    (Lambda paces requests at about one a second per account: it was three per launch)."""
    clock = Clock()
    async with FakeLambda(api_key=API_KEY, clock=clock.monotonic) as lam:
        provider = make_provider(lam, clock, launch_interval=0)
        try:
            names = [f"tgp-{'n' * 70}-{i}-1" for i in range(4)]
            bought = await provider.launch(A10_EAST, name=names[2], boot=BOOT)
            before = len(lam.requests)
            lookups = LookupsByAccount()
            found = await asyncio.gather(*(lookups.find_all_by_name(provider, n) for n in names))
            assert [[i.instance_id for i in f] for f in found] == [[], [], [bought.instance_id], []]
            assert len(lam.requests) - before == 1
        finally:
            await provider.aclose()


async def test_the_twin_watches_after_a_burst_share_listings_too() -> None:
    """After each launch the node watches its name for twins (a create that landed late):
    30 watches at once look the account up a few times, not once each."""
    n = 30
    async with money_env() as env:
        results = await asyncio.gather(*(env.launch(f"burst-{i:03d}") for i in range(n)))
        before = env.cloud.name_lookups + env.cloud.instance_lists

        async def watch(i: int, result: LaunchResult) -> list[InstanceRef]:
            ref = InstanceRef(provider="simulated", instance_name=instance_name(f"burst-{i:03d}", 1), instance_id=result.instance.instance_id)
            return await env.env().run(env.activities.watch_for_twins, TwinWatchInput(instances=[ref], keep=result.instance.instance_id))

        watched = await asyncio.gather(*(watch(i, r) for i, r in enumerate(results)))
        assert [w[0].known_ids for w in watched] == [[r.instance.instance_id] for r in results]
        looked = env.cloud.name_lookups + env.cloud.instance_lists - before
        assert looked <= n // 2, f"{looked} listings for {n} twin watches"
        assert all(len(env.billing(f"burst-{i:03d}")) == 1 for i in range(n))



async def test_a_first_attempt_looks_by_name_before_it_mints_and_after_its_create_only() -> None:
    """A retried launch also looks right before its create (an earlier attempt's create may
    have landed while it minted: tests/test_money_properties.py); a first attempt has no
    earlier one, and its look before minting is moments old."""
    async with money_env() as env:
        result = await env.launch("looks")
        assert not result.adopted and env.cloud.create_requests == 1
        assert env.cloud.name_lookups + env.cloud.instance_lists == 2


async def test_a_first_attempt_whose_mint_outlived_its_look_looks_again_and_adopts_what_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow mint: meanwhile another attempt of the name (one Temporal started while this one,
    cut off from it, went on) bought. The look before minting is no longer fresh, so the launch
    looks again before its create and adopts that instance instead of buying a twin."""
    async with money_env() as env:
        name, mint = instance_name("slow-mint", 1), TailscaleTailnet.mint_auth_key

        async def slow_mint(self: TailscaleTailnet, **kwargs: Any) -> Any:
            env.clock.advance(LOOK_FRESH_FOR.total_seconds() + 1)
            await env.provider.launch(OFFER, name=name, boot=BootPayload(kind="env", content="", hostname="slow-mint"))
            return await mint(self, **kwargs)

        monkeypatch.setattr(TailscaleTailnet, "mint_auth_key", slow_mint)
        result = await env.launch("slow-mint")
        assert result.adopted and env.cloud.create_requests == 1, "a twin was bought beside what landed during the mint"
        assert len(env.billing("slow-mint")) == 1
