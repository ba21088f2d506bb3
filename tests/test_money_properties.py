"""Money holds for every fault sequence (issue 17, "Prove it" (a)): a Hypothesis state machine
drives a node's launch / twin watch / terminate lifecycle, the way GPUNodeWorkflow calls its
activities, against the provider model (tests.money_env: the simulated cloud over HTTP, a fake
clock) with generated faults:

* create outcomes: ok, late (bought after the client gave up), 429 / 5xx / reset after buying;
  a timeout differs from a reset only in how long the client waits, so reset stands for both;
* list and describe lag, chosen per run;
* worker kills at any step of a launch attempt or a terminate (tests.money_env.Worker): a
  request about to leave or just answered (the key's mint, each look-up by name, the create,
  each read and terminate), each wait (a retry's settle look, a terminate's verification), its
  return; Temporal keeps only the heartbeats the SDK really sent: it throttles them, so a beat
  made within the interval of the last one (the create's `sent_at`, its `bought`) dies with
  the worker;
* terminates that answer 200 and do nothing, or act late; instances that vanish;
* the end (a cancel or an evict) at any point, a launch in flight included.

After every step, judged by the model's truth (what really bills), never by API answers:
no launch attempt's name ever bills twice (a retried launch buys nothing while an earlier
attempt's create may still land: it is adopted or known absent first); no create goes out
while an earlier create of its name may still land unless its own attempt looked the name up
the settle time (max(30 s, window)) after that create or later, whatever the provider does;
once the node's twin watch has run through the consistency window, at most one instance
bills for the node and it is the one recorded; the recorded instance is never ended while
the node lives; after the node ends, nothing of it bills, then or later: every instance
bought was adopted by the node or ended.

The last two (one instance, nothing after the end) are the node's own promises only where the
provider keeps its consistency window (a late create listed within it). Where it does not, a
create can land after the node stopped looking: what then bills must carry a name the sweeper
reads as the node's, and the sweeper ends it (tests/test_sweeper.py), as docs/providers.md
says of a window shorter than the provider's real lag.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test
from temporalio.exceptions import ApplicationError

from activities.sweeper import node_of_instance
from sim.provider_model import CreateOutcome, TerminateOutcome
from tests.money_env import CREATE_ANSWERED, HEARTBEAT_TIMEOUT, Killed, MoneyEnv, money_env
from tgp.types import InstanceRef, TwinWatchInput, instance_name

NODE = "gpu-prop"
WINDOW = timedelta(minutes=3)
# LAUNCH_RETRY's attempts per launch, and the node's launch attempts (max_launch_attempts).
ACTIVITY_ATTEMPTS = 5
NODE_ATTEMPTS = 3
CREATES = st.sampled_from(
    [
        CreateOutcome.OK,
        CreateOutcome.LATE,
        CreateOutcome.THROTTLED_AFTER_BUY,
        CreateOutcome.FAILED_AFTER_BUY,
        CreateOutcome.RESET_AFTER_BUY,
    ]
)

# Where a worker dies: never, at a step of the attempt by number (a first attempt takes about 14,
# a retry's settle look about 40, a terminate about 10), or right after the cloud answered the
# create.
KILLS = st.one_of(st.none(), st.integers(min_value=0, max_value=48), st.just(CREATE_ANSWERED))
RELEASE_KILLS = st.one_of(st.none(), st.integers(min_value=0, max_value=16))


@dataclass
class World:
    """One event loop and one set of servers for every run of the machine (starting them per
    run would cost most of the test's time); each run resets the cloud (MoneyEnv.reset)."""

    loop: asyncio.AbstractEventLoop
    env: MoneyEnv


class NodeMoney(RuleBasedStateMachine):
    def __init__(self, world: World) -> None:
        super().__init__()
        self.world = world
        self.loop = world.loop
        self.env: MoneyEnv | None = None
        self.phase = "launching"  # -> up -> ended
        self.node_attempt = 1
        self.activity_attempts = 0
        self.details: tuple[Any, ...] = ()
        self.refs: dict[str, InstanceRef] = {}  # the workflow's state.seen
        self.recorded: str | None = None
        self.watched = False
        self.vanished = False
        self.consistent = True
        self.release_kill: int | None = None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @property
    def e(self) -> MoneyEnv:
        assert self.env is not None
        return self.env

    # --- the world ---------------------------------------------------------------------

    @initialize(
        list_lag=st.sampled_from([0.0, 30.0, 90.0]),
        describe_lag=st.sampled_from([0.0, 30.0, 90.0]),
        late=st.sampled_from([20.0, 70.0, 150.0]),
    )
    def start(self, list_lag: float, describe_lag: float, late: float) -> None:
        self.world.env.reset(list_lag=list_lag, describe_lag=describe_lag, late_create_after=late)
        self.env = self.world.env
        self.remember(InstanceRef(provider="simulated", instance_name=self.name))
        # The provider keeps its consistency window: a late create is listed within it. Only
        # then can a retried launch know an earlier create absent before buying; past it (a
        # provider breaking its promise) twins are ended by the twin watch instead.
        self.consistent = late + max(list_lag, describe_lag) <= WINDOW.total_seconds()

    @property
    def name(self) -> str:
        return instance_name(NODE, self.node_attempt)

    def remember(self, ref: InstanceRef) -> None:
        """GPUNodeWorkflow._remember: one entry per name, ids merged."""
        known = self.refs.get(ref.instance_name)
        if known is not None:
            ref = ref.model_copy(
                update={
                    "known_ids": sorted(set(known.known_ids) | set(ref.known_ids)),
                    "created_by": ref.created_by or known.created_by,
                    "instance_id": ref.instance_id or known.instance_id,
                }
            )
        self.refs[ref.instance_name] = ref

    def billing(self) -> list[str]:
        names = {instance_name(NODE, n) for n in range(1, NODE_ATTEMPTS + 2)}

        async def billed() -> list[str]:  # in the loop: the model's due late creates buy now
            return sorted(r.id for r in self.e.model.billing() if r.name in names)

        return self.run(billed())

    # --- faults ------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([1.0, 10.0, 45.0, 120.0, 400.0]))
    def advance(self, seconds: float) -> None:
        if self.phase == "up" and not self.watched:
            self.watch_twins()  # the workflow's watch runs in the background all along
        self.e.clock.advance(seconds)

    @rule(outcomes=st.lists(st.sampled_from([TerminateOutcome.LIE, TerminateOutcome.LATE]), min_size=1, max_size=3))
    def terminates_misbehave(self, outcomes: list[TerminateOutcome]) -> None:
        self.e.model.next_terminates(*outcomes)

    @precondition(lambda self: self.phase == "up" and not self.vanished)
    @rule()
    def instance_vanishes(self) -> None:
        assert self.recorded is not None
        self.run(self.e.cloud.preempt(self.recorded))
        self.vanished = True

    # --- the node ----------------------------------------------------------------------

    @precondition(lambda self: self.phase == "launching")
    @rule(outcome=CREATES, kill=KILLS, release_kill=RELEASE_KILLS, beat_first=st.booleans())
    def launch(self, outcome: CreateOutcome, kill: int | str | None, release_kill: int | None, beat_first: bool) -> None:
        """One attempt of the launch activity, its worker killed at step `kill` (None: it
        lives): Temporal's retries are further calls of this. `release_kill`: where the worker
        of the release's first terminate dies, if this attempt is the launch's last.
        `beat_first`: the attempt beat before its create (it waited an interval), so the SDK
        holds the beat that records the create, which a kill then takes with it."""
        e = self.e
        e.model.create_outcomes.clear()
        e.model.next_creates(outcome)
        self.activity_attempts += 1
        self.release_kill = release_kill
        try:
            result = self.run(
                e.launch(NODE, attempt=self.activity_attempts, details=self.details, kill_at=kill, node_attempt=self.node_attempt, beat_first=beat_first)
            )
        except Killed as killed:
            self.details = killed.details
        except ApplicationError:
            self.details = e.attempt_details(self.details)
        else:
            # GPUNodeWorkflow._launched
            self.recorded = result.instance.instance_id
            ids = sorted({*result.seen_ids, self.recorded})
            self.remember(InstanceRef(provider="simulated", instance_name=self.name, instance_id=self.recorded, created_by=e.now(), known_ids=ids))
            self.phase, self.watched = "up", False
            return
        if self.activity_attempts >= ACTIVITY_ATTEMPTS:
            self.fail_over()

    def fail_over(self) -> None:
        """The launch failed for good (GPUNodeWorkflow._launch_failed, _release_attempt): the
        attempt's name is released, and the next offer gets a new name."""
        self.remember(self.refs[self.name].model_copy(update={"created_by": self.e.now()}))
        self.run(self.e.terminate(self.refs[self.name], kill_at=self.release_kill))
        if self.node_attempt >= NODE_ATTEMPTS:
            self.end_node()
            return
        self.node_attempt += 1
        self.activity_attempts, self.details = 0, ()
        self.e.heartbeats.clear()
        self.remember(InstanceRef(provider="simulated", instance_name=self.name))

    @precondition(lambda self: self.phase == "up" and not self.watched)
    @rule()
    def watch_twins(self) -> None:
        refs = self.run(self.e.env().run(self.e.activities.watch_for_twins, TwinWatchInput(instances=list(self.refs.values()), keep=self.recorded)))
        for ref in refs:
            self.remember(ref)
        self.watched = True

    @precondition(lambda self: self.phase != "ended")
    @rule(kill=RELEASE_KILLS)
    def end(self, kill: int | None) -> None:
        """A cancel or an evict, at any point (a launch in flight included), the worker of its
        first terminate killed at step `kill`."""
        self.end_node(kill)

    def end_node(self, kill: int | None = None) -> None:
        """GPUNodeWorkflow._release_all: the current attempt's name (a launch in flight may
        still be buying under it), then every other name."""
        e = self.e
        if self.phase == "launching":
            self.remember(self.refs[self.name].model_copy(update={"created_by": e.now()}))
        for name in [self.name, *(n for n in self.refs if n != self.name)]:
            self.run(e.terminate(self.refs[name], kill_at=kill))
            kill = None
        self.phase = "ended"

    # --- what must hold -----------------------------------------------------------------

    @invariant()
    def no_name_bills_twice(self) -> None:
        if self.env is None or not self.consistent:
            return

        async def billed() -> list[str]:  # in the loop: the model's due late creates buy now
            return [r.name for r in self.e.model.billing() if r.name.startswith(f"tgp-{NODE}-")]

        names: list[str] = self.run(billed())
        twice = sorted({n for n in names if names.count(n) > 1})
        assert not twice, f"{twice} billing twice: a launch bought again while an earlier create could still land"

    @invariant()
    def nothing_bought_unlooked(self) -> None:
        """Whatever the provider does (its promise kept or not): a create goes out while an
        earlier one of its name may land only after its attempt looked the name up for the
        settle time. The record that the earlier create may have gone out is the activity's
        attempt number (Temporal's, recorded before the attempt ran), not a heartbeat."""
        if self.env is None:
            return
        assert not self.e.unlooked_creates, self.e.unlooked_creates

    @invariant()
    def one_instance_once_the_window_has_passed(self) -> None:
        if self.env is None or self.phase != "up" or not self.watched or not self.consistent:
            return
        billing = self.billing()
        expected = [] if self.vanished else [self.recorded]
        assert billing == expected, f"billing {billing} for one node; it recorded {self.recorded}"

    @invariant()
    def the_recorded_instance_is_kept(self) -> None:
        if self.env is None or self.phase != "up" or self.vanished:
            return
        assert self.recorded in self.billing(), f"the recorded instance {self.recorded} was ended while the node lives"

    @invariant()
    def nothing_bills_after_the_end(self) -> None:
        if self.env is None or self.phase != "ended" or not self.consistent:
            return
        assert self.billing() == [], f"{self.billing()} still billing after the node ended"

    def teardown(self) -> None:
        if self.env is not None:
            if self.phase != "ended":
                self.end_node()
            self.e.clock.advance(3600)  # every late create and terminate has happened by now
            if self.consistent:
                assert self.billing() == [], f"{self.billing()} billing an hour after the node ended"
                return
            # A provider that lists a create later than its window: the node stopped looking
            # before it landed, so the sweeper ends it (test_sweeper: an ended node's instance,
            # and a running node's stray). It finds instances by their tgp name only.
            async def billed() -> list[str]:
                return [r.name for r in self.e.model.billing()]

            names = self.run(billed())
            assert all(node_of_instance(n) == NODE for n in names), f"{names}: billing under a name the sweeper cannot read"


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    loop = asyncio.new_event_loop()
    stack = AsyncExitStack()
    try:
        env = loop.run_until_complete(stack.enter_async_context(money_env(window=WINDOW)))
        yield World(loop=loop, env=env)
    finally:
        loop.run_until_complete(stack.aclose())
        loop.close()


def test_money_holds_for_every_fault_sequence(world: World) -> None:
    # About 5 s in the suite's profile. HYPOTHESIS_PROFILE=explore runs its own count, at random
    # (its failures of 2026-11-29, in worlds whose late create and list lag outlast the window,
    # were the node's promises judged where only the sweeper's hold: see the docstring).
    # In the suite's profile a failure is reported as found, unshrunk: shrinking a machine whose
    # runs take 0.1-0.3 s each takes minutes, past the suite's timeout, which would hide it.
    ci = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"
    examples = 40 if ci else settings().max_examples
    phases = [Phase.explicit, Phase.reuse, Phase.generate] if ci else list(Phase)
    run_state_machine_as_test(lambda: NodeMoney(world), settings=settings(max_examples=examples, stateful_step_count=12, phases=phases))


async def test_a_worker_killed_during_a_prompt_create_leaves_its_record() -> None:
    """A launch that creates within its first heartbeat interval sends the beat that records the
    create (`sent_at`) as its first: the SDK sends a first beat at once, so the record outlives a
    worker killed during the create (an empty beat at the attempt's start held it back until the
    throttle interval's end, issue 35 item 1)."""
    async with money_env(list_lag=90, window=WINDOW) as env:
        kept = await env.launch_killed_at_create(NODE, attempt=1)
        assert any(isinstance(d, dict) and d.get("sent_at") for d in kept), kept


async def test_a_worker_killed_after_its_throttled_beat_buys_nothing_twice() -> None:
    """Issue 35 item 1: the beat that records the create comes within the throttle interval of an
    earlier beat (a launch that beat before its create: a pacer's wait, a slow mint), so the SDK
    holds it, and the worker dies with it during the create. The retried attempt hears nothing of
    the create, and the provider's list lags: it must look for the whole settle time, find the
    instance and adopt it, not buy a second."""
    async with money_env(list_lag=90, window=WINDOW) as env:
        kept = await env.launch_killed_at_create(NODE, attempt=1, beat_first=True)
        assert not any(isinstance(d, dict) and d.get("sent_at") for d in kept), "the model lost the throttled beat"
        bought = env.billing(NODE)
        result = await env.launch(NODE, attempt=2, details=kept)
        assert env.billing(NODE) == bought == [result.instance.instance_id], "a retried launch bought again"
        assert env.cloud.create_requests == 1


async def test_a_late_create_whose_reads_lag_is_ended_not_taken_for_gone() -> None:
    """Found by HYPOTHESIS_PROFILE=explore: a create that lands late (150 s after a killed
    attempt sent it) on a provider whose reads lag 90 s behind a create. The node's end looked by
    name, saw it, and once the window after the node's own create time had passed took its 404
    for gone: it billed on. Its 404 counts only a window after it was first listed."""
    async with money_env(late_create_after=150.0, describe_lag=90.0, window=WINDOW) as env:
        env.model.next_creates(CreateOutcome.LATE)
        await env.launch_killed_at_create(NODE, attempt=1)
        assert await env.terminate(InstanceRef(provider="simulated", instance_name=instance_name(NODE, 1), created_by=env.now()))
        env.clock.advance(3600)
        assert env.billing(NODE) == [], "a late create outlived the node's end"


async def test_a_tailnet_refusal_is_a_config_error_not_the_provider_accounts() -> None:
    """Review finding: the tailnet's PermissionDenied (an OAuth client minting a key for a tag it
    does not own) came out of the launch as PermissionDenied, which blocks the provider account
    (tgp.offers.block_for) though the provider refused nothing. It is the tailnet's: a ConfigError
    naming it, and nothing is bought."""
    from temporalio.testing import ActivityEnvironment

    async with money_env(window=WINDOW) as env:
        inp = env.launch_input(NODE).model_copy(update={"tailnet_tags": ["tag:not-owned"]})
        with pytest.raises(ApplicationError) as raised:
            await ActivityEnvironment().run(env.activities.launch_instance, inp)
        assert raised.value.type == "ConfigError" and "the tailnet" in raised.value.message, raised.value
        assert env.cloud.create_requests == 0
