"""Watch-stage honesty (issue 9, item 4): a wait stage (instance running, tailnet device, Node
Ready) fails over only when its own deadline has passed and one more look finds the node not
up. A slow look is not a dead worker, and a dead worker is not a broken instance."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta

from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from tests.conftest import binary, eventually, running_world
from tests.test_watch_events import bridge_running, local_activity
from tests.test_node_lifecycle import FAST, assert_nothing_left, request, start, wait_phase
from sim.world import sim_world
from activities.node import NodeActivities
from activities.node.base import heartbeating
from tgp.types import DeviceQuery, InstanceRef, LaunchInput, NodePhase, NodeStatus, Offer, StageCheck, instance_name
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow


async def activity_attempts(handle: WorkflowHandle) -> dict[str, list[int]]:
    """For each activity type, the attempt number of every attempt that reported back: a wait
    retried after a heartbeat timeout completes on attempt 2 or later."""
    scheduled: dict[int, str] = {}
    attempts: dict[str, list[int]] = {}
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            scheduled[event.event_id] = event.activity_task_scheduled_event_attributes.activity_type.name
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            attrs = event.activity_task_started_event_attributes
            attempts.setdefault(scheduled[attrs.scheduled_event_id], []).append(attrs.attempt)
    return attempts


TAGS = ["tag:tgp-node"]
OFFER = Offer(provider="simulated", offer_id="rtx4090-us-east", gpu_type="RTX4090", region="us-east", hourly_price="0.44")


async def launched(acts: NodeActivities, node_name: str) -> StageCheck:
    """Buy an instance for `node_name` as the workflow does (a minted key in its boot payload,
    so it joins the tailnet once it runs): what `wait_for_join` is then given."""
    result = await ActivityEnvironment().run(acts.launch_instance, LaunchInput(node_name=node_name, attempt=1, offer=OFFER, tailnet_tags=TAGS))
    ref = InstanceRef(provider="simulated", instance_name=instance_name(node_name, 1), instance_id=result.instance.instance_id)
    return StageCheck(instance=ref, device=DeviceQuery(hostname=node_name, tags=TAGS))


async def test_a_device_that_joins_within_a_poll_interval_costs_no_read_of_the_provider() -> None:
    """The create's answer is the join's first read of the instance: a device in the tailnet
    before the next poll interval (a fast boot) leaves the provider unasked."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=5)
        check = await launched(activities.node, "fast-boot")
        before = world.cloud.describe_requests
        joined = await ActivityEnvironment().run(activities.node.wait_for_join, check)
        assert joined.device is not None and joined.device.hostname == "fast-boot"
        assert world.cloud.describe_requests == before, "the join read the instance it had just bought"


async def test_heartbeats_keep_one_rhythm_across_an_activitys_blocks_and_none_comes_at_once() -> None:
    """A heartbeating block that follows another beats one interval after the last beat, not
    one interval after it began (which let two blocks go two intervals without a beat); and no
    block beats the moment it begins (an empty beat held back the launch's record of its create)."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=3))  # a beat a second
    beats: list[float] = []
    env.on_heartbeat = lambda *_: beats.append(time.monotonic())

    async def two_blocks() -> None:
        with heartbeating():
            await asyncio.sleep(1.9)
        with heartbeating():
            await asyncio.sleep(1.4)

    started = time.monotonic()
    await env.run(two_blocks)
    marks = [started, *beats]
    gaps = [b - a for a, b in zip(marks, marks[1:])]
    assert beats and gaps[0] >= 0.8, f"a beat at once: {gaps}"
    assert max(gaps) < 1.5, f"{max(gaps):.1f} s without a beat across the blocks (a beat a second): {gaps}"


async def test_the_join_heartbeats_while_one_look_is_slow() -> None:
    """Each look goes with heartbeats, so a look slower than the heartbeat timeout (in-call
    HTTP retries, a provider's pacer) is never mistaken for a dead worker."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        world.cloud.hold_boots()  # pending while the join's first look at the provider hangs
        check = await launched(activities.node, "slow-look")
        world.cloud.slow_describes(3.0, count=1)
        activities.node.poll_interval = timedelta(seconds=0.2)  # the join's first look at the provider: 0.2 s after the buy
        asyncio.get_running_loop().call_later(0.5, world.cloud.release_boots)

        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=1))
        beats: list[float] = []
        env.on_heartbeat = lambda *_: beats.append(time.monotonic())
        started = time.monotonic()
        joined = await env.run(activities.node.wait_for_join, check)
        ended = time.monotonic()

        assert joined.device.hostname == "slow-look"
        assert ended - started >= 3.0, "the look was slow"
        marks = [started, *beats, ended]
        gaps = [b - a for a, b in zip(marks, marks[1:])]
        assert max(gaps) < 1.0, f"no heartbeat for {max(gaps):.1f}s during a look (heartbeat timeout 1s)"


async def test_the_join_looks_until_a_held_boot_is_released() -> None:
    """However long an instance stays pending (the simulated cloud holds its boot, as the fault
    matrix does to strike while a node waits for it), the wait keeps looking, and returns once it
    runs and its device has joined."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.05)
        world.cloud.hold_boots()
        check = await launched(activities.node, "held-boot")
        assert check.instance is not None and check.instance.instance_id is not None
        wait = asyncio.ensure_future(ActivityEnvironment().run(activities.node.wait_for_join, check))
        looks = world.cloud.describe_requests
        await eventually(lambda: _true(world.cloud.describe_requests >= looks + 5), what="five looks at the held instance")
        assert not wait.done() and world.cloud.instances[check.instance.instance_id].status == "pending"
        world.cloud.release_boots()
        joined = await asyncio.wait_for(wait, 30)
        assert joined.device.hostname == "held-boot"
        assert world.cloud.instances[check.instance.instance_id].status == "running"


async def test_looks_slower_than_the_heartbeat_timeout_do_not_fail_the_stages(temporal: WorkflowEnvironment) -> None:
    """Describes and device listings answer in 4 s against a 2 s heartbeat timeout: the node
    comes up on its first offer (the bridge tells it Ready), the join's wait done by its first
    activity attempt."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        world.cloud.slow_describes(4.0)
        world.tailscale.slow_device_lists(4.0)
        req = request(timeouts=FAST.model_copy(update={"api_call": timedelta(seconds=2)}))
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)
        world.cloud.slow_describes(0)
        world.tailscale.slow_device_lists(0)

        assert len(ready.attempts) == 1, f"the stage was failed over: {ready.attempts}"
        assert world.cloud.create_requests == 1
        attempts = await activity_attempts(handle)
        assert attempts["launch_instance"] == [1], f"the join was retried after a missed heartbeat: attempts {attempts['launch_instance']}"
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await handle.result()).phase is NodePhase.TERMINATED
        assert_nothing_left(world, req.node_name)


async def test_an_instance_up_when_the_stage_deadline_passes_is_kept(temporal: WorkflowEnvironment) -> None:
    """The instance runs within a second, but the look at it takes longer than the whole stage
    budget: at the deadline one more look finds it running, and it is kept, not blamed."""
    async with running_world(temporal) as (world, _, queue):
        # The first look outlasts the stage: its deadline is the launch's and the tailnet join's together (8 s).
        world.cloud.slow_describes(12.0, count=1)
        timeouts = {"launch": timedelta(seconds=5), "tailnet_join": timedelta(seconds=3), "api_call": timedelta(seconds=3)}
        req = request(timeouts=FAST.model_copy(update=timeouts))
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)

        assert [a.outcome for a in ready.attempts] == ["launched"], f"a running instance was failed over: {ready.attempts}"
        assert world.cloud.create_requests == 1
        history = await handle.fetch_history()
        # Looked at again: by a backstop or deadline look, or by the join's wait, which looks at the Node itself once the device joined.
        waits = [p.data.replace(b" ", b"") for e in history.events for p in e.activity_task_completed_event_attributes.result.payloads]
        looked = any(local_activity(e) == "look at the stage" for e in history.events) or any(b'"node":{"up":true' in w for w in waits)
        assert looked, "the stage was looked at again"
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await handle.result()).phase is NodePhase.TERMINATED
        assert_nothing_left(world, req.node_name)


async def test_a_node_not_up_at_the_deadline_still_fails_over(temporal: WorkflowEnvironment) -> None:
    """The last look is honest both ways: no tailnet device at the deadline is a join timeout,
    and it says what the look saw."""
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail_boot("rtx4090-us-east", "never_joins")
        timeouts = {"launch": timedelta(seconds=4), "tailnet_join": timedelta(seconds=4), "api_call": timedelta(seconds=3)}
        req = request(timeouts=FAST.model_copy(update=timeouts))
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)

        first = ready.attempts[0].outcome or ""
        assert [a.offer.offer_id for a in ready.attempts] == ["rtx4090-us-east", "rtx4090-eu-west"]
        assert first.startswith("join timeout: no tailnet device within 8s of the launch") and "at the deadline no tailnet device" in first, first
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()
        assert_nothing_left(world, req.node_name)


async def test_a_worker_dead_past_the_stage_deadline_does_not_get_the_instance_blamed(temporal: WorkflowEnvironment) -> None:
    """The only worker dies while waiting for the instance to run, and stays dead past the
    stage's deadline; the instance boots meanwhile. The worker that comes back looks once
    more and keeps it."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        queue = f"watch-crash-{uuid.uuid4().hex[:6]}"
        env = {
            **os.environ,
            **world.worker_env(),
            "TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host,
            "TGP_TASK_QUEUE": queue,
        }
        doomed = subprocess.Popen([binary("tgp"), "worker"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        stack.callback(lambda: doomed.poll() is None and doomed.kill())

        world.cloud.hold_boots()  # the instance pends, its device cannot join ...
        world.cloud.slow_describes(60.0)  # ... and the wait's first look at it (a poll interval in) hangs ...
        # The wait's deadline is the launch's and the tailnet join's together (11 s).
        timeouts = {"launch": timedelta(seconds=8), "tailnet_join": timedelta(seconds=3), "api_call": timedelta(seconds=3)}
        req = request(timeouts=FAST.model_copy(update=timeouts))
        handle = await start(temporal, queue, req)
        await eventually(lambda: _true(world.cloud.describe_requests > 0), timeout=60, what="the wait's first look")
        doomed.send_signal(signal.SIGKILL)  # ... and the worker dies in it
        doomed.wait(10)
        world.cloud.slow_describes(0)
        world.cloud.release_boots()

        async def deadline_passed() -> bool:
            return EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT in [e.event_type async for e in handle.fetch_history_events()]

        await eventually(deadline_passed, timeout=60, what="the launch stage's deadline")
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)

        assert [a.outcome for a in ready.attempts] == ["launched"], f"the instance was blamed for the dead worker: {ready.attempts}"
        assert world.cloud.create_requests == 1 and list(world.cloud.instances) == [ready.instance_id]
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED
        assert_nothing_left(world, req.node_name)


async def _true(value: bool) -> bool:
    return value
