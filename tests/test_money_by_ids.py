"""Money by ids (issue 17, items 1-4): each break reproduced on `e9a7c55`, one test per part
of its fix, at the activity level against the provider model on a fake clock (tests.money_env).
Judged by the model's truth (what really bills), not by what the API answered.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from temporalio.exceptions import ApplicationError

from sim.provider_model import CreateOutcome
from tests.money_env import money_env
from tgp import types
from tgp.types import InstanceRef, instance_name

NODE = "gpu-money"
NAME = instance_name(NODE, 1)


def ref(instance_id: str | None, created_by=None, known: list[str] | None = None) -> InstanceRef:  # type: ignore[no-untyped-def]
    return InstanceRef(provider="simulated", instance_name=NAME, instance_id=instance_id, created_by=created_by, known_ids=known or [])


# --- item 1: a create that completes after its caller gave up ------------------------------


async def test_a_create_bought_after_the_caller_gave_up_is_adopted_not_bought_again() -> None:
    """The connection drops before any answer and the backend buys 70 s later: the launch
    looks by name over the consistency window before buying again (the re-check part)."""
    async with money_env(late_create_after=70) as env:
        env.model.next_creates(CreateOutcome.LATE)
        result = None
        for attempt in (1, 2, 3):  # Temporal's retries of the launch activity
            try:
                result = await env.launch(NODE, attempt=attempt, details=env.last_details())
                break
            except ApplicationError:
                continue
        assert result is not None
        env.clock.advance(600)
        assert env.billing(NODE) == [result.instance.instance_id], "bought twice for one node"
        assert env.cloud.create_requests == 1, "an unknown outcome was resent blind"


async def test_a_worker_killed_during_a_create_leaves_its_successor_looking_before_buying() -> None:
    """A worker dies while its create is in flight; the create lands 70 s later. The next
    attempt reads the dead one's heartbeat (a create was sent) and looks over the window."""
    async with money_env(late_create_after=70) as env:
        env.model.next_creates(CreateOutcome.LATE)
        await env.launch_killed_at_create(NODE, attempt=1)
        result = await env.launch(NODE, attempt=2, details=env.last_details())
        env.clock.advance(600)
        assert env.billing(NODE) == [result.instance.instance_id]
        assert env.cloud.create_requests == 1


async def test_a_first_attempt_adopts_what_an_earlier_run_of_its_name_bought() -> None:
    """A launch's first attempt run again under a name that already bought (the workflow reset
    to before its launch) adopts the instance before it reads, mints or renders anything (so a
    join Secret or template broken meanwhile cannot fail a node whose instance runs), and buys
    no second one."""
    async with money_env() as env:
        first = await env.launch(NODE)
        assert env.tailscale is not None and len(env.tailscale.keys) == 1
        again = await env.launch(NODE)  # attempt 1 again, nothing carried over
        assert again.adopted and again.instance.instance_id == first.instance.instance_id
        assert len(env.tailscale.keys) == 1, "the second run minted a key before it looked"
        env.clock.advance(600)
        assert env.billing(NODE) == [first.instance.instance_id]
        assert env.cloud.create_requests == 1


async def test_a_twin_that_lands_after_the_launch_returned_is_ended_over_the_window() -> None:
    """The dead worker's heartbeat was lost, so the next attempt buys again; the late create
    lands afterwards. The twin watch (the part after buying) ends it and keeps the recorded one."""
    async with money_env(late_create_after=70) as env:
        env.model.next_creates(CreateOutcome.LATE)
        await env.launch_killed_at_create(NODE, attempt=1)
        result = await env.launch(NODE, attempt=2, details=())  # the heartbeat never arrived
        recorded = result.instance.instance_id
        watch = ref(recorded, created_by=env.now(), known=result.seen_ids)
        await env.env().run(env.activities.watch_for_twins, types.TwinWatchInput(instances=[watch], keep=recorded))
        assert env.billing(NODE) == [recorded], "the late twin still bills, or the recorded instance was ended"
        env.clock.advance(600)
        assert env.billing(NODE) == [recorded]


# --- item 2: a 429 answered after the create bought ----------------------------------------


@pytest.mark.parametrize("outcome", [CreateOutcome.THROTTLED_AFTER_BUY, CreateOutcome.FAILED_AFTER_BUY, CreateOutcome.RESET_AFTER_BUY])
async def test_a_create_answered_429_5xx_or_reset_after_buying_is_settled_by_looking(outcome: CreateOutcome) -> None:
    async with money_env() as env:
        env.model.next_creates(outcome)
        result = await env.launch(NODE)
        assert env.cloud.create_requests == 1, f"a create answered {outcome} was resent in-call"
        assert env.billing(NODE) == [result.instance.instance_id]


# --- item 3: lists and describes that lag behind a create -----------------------------------


async def test_a_lagging_list_and_describe_do_not_defeat_the_check_before_buying() -> None:
    """The first attempt's create answered, then its worker died; lists and describes lag
    90 s. The next attempt knows the id from the heartbeat and adopts it."""
    async with money_env(list_lag=90, describe_lag=90) as env:
        env.cloud.hold_creates()
        first = env.launch(NODE)
        task = asyncio.ensure_future(first)
        await env.cloud.create_arrived.wait()
        env.cloud.release_creates()
        result = await task  # the answer came back ...
        details = env.last_details()  # ... and the worker died right after recording it
        again = await env.launch(NODE, attempt=2, details=details)
        assert again.instance.instance_id == result.instance.instance_id
        env.clock.advance(600)
        assert env.billing(NODE) == [result.instance.instance_id]
        assert env.cloud.create_requests == 1


async def test_a_running_instance_read_as_404_inside_the_window_is_not_vanished() -> None:
    """The join's wait (`wait_for_join`) and its looks (`check_stage`) read a 404 for the
    instance right after its create as the provider lagging, never as a vanished instance."""
    async with money_env(describe_lag=60) as env:
        result = await env.launch(NODE)
        running = ref(result.instance.instance_id, created_by=env.now())
        env.activities.poll_interval = timedelta(milliseconds=10)
        check = types.StageCheck(instance=running, device=types.DeviceQuery(hostname=NODE, tags=["tag:tgp-node"]))

        joining = env.env()
        waiting = asyncio.ensure_future(joining.run(env.activities.wait_for_join, check))
        looks = env.cloud.describe_requests
        await asyncio.sleep(0.2)  # several looks, each a 404 while the provider lags
        assert env.cloud.describe_requests > looks + 2, "the wait did not look at the instance"
        assert not waiting.done(), "a 404 inside the consistency window was read as a vanished instance"
        look = await env.env().run(env.activities.check_stage, types.StageCheck(instance=running))
        assert not look.up and "not visible yet" in look.seen, look.seen

        env.clock.advance(61)
        look = await env.env().run(env.activities.check_stage, types.StageCheck(instance=running))
        assert look.up and "is running" in look.seen, look.seen
        await asyncio.sleep(0.2)  # the wait reads it running too: it waits on for the device
        assert not waiting.done()
        joining.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 10)


async def test_terminate_right_after_a_create_survives_a_lagging_list_and_describe() -> None:
    async with money_env(list_lag=60, describe_lag=60) as env:
        result = await env.launch(NODE)
        await env.terminate(ref(result.instance.instance_id, created_by=env.now()))
        assert env.billing(NODE) == [], "terminate by id and by name read the lag as 'gone'"


# --- item 4: a terminate that answers 200 and does nothing ----------------------------------


async def test_a_terminate_that_answers_200_and_does_nothing_is_verified_and_sent_again() -> None:
    async with money_env() as env:
        result = await env.launch(NODE)
        env.model.next_terminates("lie")
        assert await env.env().run(env.activities.terminate_instance, ref(result.instance.instance_id)) is True
        assert env.billing(NODE) == []


async def test_a_terminate_that_never_takes_effect_is_termination_stuck() -> None:
    async with money_env() as env:
        result = await env.launch(NODE)
        env.model.next_terminates(*["lie"] * 1000)
        with pytest.raises(ApplicationError) as stuck:
            await env.env().run(env.activities.terminate_instance, ref(result.instance.instance_id))
        assert stuck.value.type == "TerminationStuck" and not stuck.value.non_retryable
        assert env.billing(NODE) == [result.instance.instance_id]


async def test_the_watch_reads_a_404_inside_the_window_as_an_unknown_not_a_vanished_instance() -> None:
    """observe_node: a 404 for the recorded instance right after its create is an outage-like
    unknown (the watch looks again), never `instance=None`, which ends the node as Interrupted."""
    async with money_env(describe_lag=60) as env:
        result = await env.launch(NODE)
        look = types.ObserveInput(instance=ref(result.instance.instance_id, created_by=env.now()), node_name=NODE)
        with pytest.raises(ApplicationError) as unknown:
            await env.env().run(env.activities.observe_node, look)
        assert not unknown.value.non_retryable and "not visible" in unknown.value.message
