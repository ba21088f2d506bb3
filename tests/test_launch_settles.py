"""A node's launch settles its price with the class ledger, and its release gives everything
back, whatever fails on the way.

* The launch settles the price with the class ledger before it mints or buys, unless the pool
  reserved exactly the offer's price; a settle refused, or a ledger that stops answering, on a
  retried launch still ends what an earlier try bought (a refusal is
  tests/test_class_refusal.py's).
* The release terminates, removes the tailnet device, deletes the Node and gives the class its
  place back; a step that fails is made again, and nothing is left either way.
* A twin bought under the node's name is ended, by the join's watch or after it.

Against the simulated world over HTTP, the real bridge and the Temporal dev server."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.http_wire import default_tls
from activities.search_attributes import SA_PHASE, start_attributes
from tests.conftest import eventually, running_world
from tests.test_entities_heal import start_class
from tests.test_life_events import SHORT, event_types
from tests.test_money_workflow import billing, lagging_world
from tests.test_node_lifecycle import assert_nothing_left, node_exists, request, start, wait_phase
from tests.test_node_long_lived import put_pod, remove_pod
from tests.test_pool_accounting import CLASS
from tests.test_watch_events import bridge_running, local_activity, told
from activities.ledger import LedgerBatcher, LedgerCall
from activities.node import NodeActivities
from tgp.crds import GPUNodeClassSpec
from sim.world import SimWorld, sim_world
from tgp.messages import ClassUpdate, Grant, Ledger, Reservation, class_workflow_id
from workers.main import Activities, WorkerConfig, build_activities, make_worker
from tgp.node import NodeWorkflowInput
from tgp.types import LaunchInput, NodePhase, NodeRequest, NodeStatus, Offer, Stage, instance_name
from workers.temporal import DATA_CONVERTER
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow

pytestmark = pytest.mark.timeout(300)


async def start_as_the_pool(env: WorkflowEnvironment, queue: str, req: NodeRequest) -> WorkflowHandle:
    """Start the node's workflow as the pool's `reserve_and_start_nodes` does: with its first
    search attributes."""
    return await env.client.start_workflow(
        GPUNodeWorkflow.run, NodeWorkflowInput(request=req), id=req.workflow_id, task_queue=queue, search_attributes=start_attributes(req)
    )


async def calls(handle: WorkflowHandle) -> tuple[list[str], list[str], list[str]]:
    """The activities the life scheduled, its local activities' summaries, and the phases its
    search-attribute upserts set, each in order."""
    activities: list[str] = []
    local: list[str] = []
    phases: list[str] = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            activities.append(event.activity_task_scheduled_event_attributes.activity_type.name)
        elif (summary := local_activity(event)) is not None:
            local.append(summary)
        elif event.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
            if SA_PHASE.name in fields:
                phases.append((await DATA_CONVERTER.decode([fields[SA_PHASE.name]], [str]))[0])
    return activities, local, phases


async def ledger_of(env: WorkflowEnvironment, klass: str) -> Ledger:
    ledger: Ledger = await env.client.get_workflow_handle(class_workflow_id(klass)).query(GPUNodeClassWorkflow.budget)
    return ledger


async def launch_settles(handle: WorkflowHandle) -> list[LedgerCall | None]:
    """The settle each `launch_instance` of the life carried (its third argument)."""
    found: list[LedgerCall | None] = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == "launch_instance":
                payloads = attrs.input.payloads
                found.append((await DATA_CONVERTER.decode(payloads[2:3], [LedgerCall | None]))[0] if len(payloads) > 2 else None)  # type: ignore[list-item]
    return found


async def reserved_node(env: WorkflowEnvironment, queue: str, price: Decimal | None) -> tuple[WorkflowHandle, NodeRequest]:
    """A new class, and the request of a pool's node of it whose place the pool reserved (as
    its `reserve_and_start_nodes` does) at `price` $/h."""
    klass = f"settle-{uuid.uuid4().hex[:6]}"
    class_run = await start_class(env, queue, klass, CLASS)
    req = request(
        timeouts=SHORT, pool_workflow_id="gpupool/ml/no-such-pool", node_class=klass, class_workflow_id=class_workflow_id(klass), reserved_price=price
    )
    grant = await class_run.execute_update("reserve", Reservation(node_id=req.workflow_id, pool="ml/rtx", hourly_price=price), result_type=Grant)
    assert grant.granted, grant
    return class_run, req


# A generous bound on this module's short life of a pool's node (bought, joined, a pod ran, idle,
# drained, released): room for a loaded machine; `make bench` measures the exact count.
SHORT_LIFE_EVENTS = 100
# The simulated cloud's cheapest RTX4090 offer (tests.test_node_lifecycle.request asks for one).
OFFER_PRICE = Decimal("0.44")


@pytest.mark.parametrize(
    "reserved, settles",
    [(None, True), (OFFER_PRICE, False), (Decimal("9.99"), True)],
    ids=["price-unknown", "reserved-at-the-offers-price", "reserved-at-another-price"],
)
async def test_a_pool_node_settles_in_its_launch_and_releases_in_one_activity(temporal: WorkflowEnvironment, reserved: Decimal | None, settles: bool) -> None:
    """The pool reserved the node's place, at `reserved` $/h; the launch settles the offer's
    price with the ledger first unless that is the price reserved."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        class_run, req = await reserved_node(temporal, queue, reserved)
        klass = req.node_class
        handle = await start_as_the_pool(temporal, queue, req)
        status = await wait_phase(handle, NodePhase.READY, timeout=90)
        assert status.hourly_price == OFFER_PRICE, status.hourly_price
        [settle] = await launch_settles(handle)
        assert (settle is not None) is settles, settle
        # Started with the price reserved, if known: a ledger that counts its nodes again (a new
        # run) holds the Pending node at it.
        started = (await handle.fetch_history()).events[0].workflow_execution_started_event_attributes.search_attributes.indexed_fields
        assert ("TgpHourlyPrice" in started) is (reserved is not None), list(started)
        # Either way the class holds the node at the price it bought at.
        held = (await ledger_of(temporal, klass)).reservations.get(req.workflow_id)
        assert held is not None and held.hourly_price == OFFER_PRICE, held

        await put_pod(world, req.node_name, "job")
        await told(handle, busy_pods=1)
        await remove_pod(world, "job")
        status = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status

        # Everything is given back.
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)
        assert req.workflow_id not in (await ledger_of(temporal, klass)).reservations
        tally, order = await event_types(handle)
        assert not tally["WORKFLOW_TASK_FAILED"], order
        total = sum(tally.values())
        assert total < SHORT_LIFE_EVENTS, f"{total} events: {dict(tally.most_common())}; in order: {order}"
        await class_run.terminate("test finished")


async def test_a_release_step_that_fails_is_made_by_the_workflow_itself(temporal: WorkflowEnvironment) -> None:
    """The Node's first deletion fails: the release deletes it all the same, terminates the
    instance, and the class's place still goes back."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        class_run, req = await reserved_node(temporal, queue, None)
        klass = req.node_class
        handle = await start_as_the_pool(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY, timeout=90)
        refused: Any = world.kube[f"delete /api/v1/nodes/{req.node_name}"][:1] << 500  # the first delete only
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
        status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED, status
        assert len(refused) == 1, "the Node's deletion was not refused once"

        assert not await node_exists(world, req.node_name)
        assert_nothing_left(world, req.node_name)
        assert req.workflow_id not in (await ledger_of(temporal, klass)).reservations
        await class_run.terminate("test finished")


@pytest.mark.parametrize("window, with_join", [(timedelta(seconds=1), True), (timedelta(seconds=8), False)], ids=["window-within-the-boot", "window-past-the-join"])
async def test_a_twin_is_ended_by_the_joins_watch_or_after_it(temporal: WorkflowEnvironment, window: timedelta, with_join: bool) -> None:
    """A create under the node's name lands beside its launch (a dead worker's): within a
    consistency window that ends before the instance has booted, the join's own twin watch
    (in the launch's activity) ends one that lands while it boots; a window that outlasts the join is
    watched on after it (`watch_for_twins`), and one that lands once the device has joined is
    ended by that. Either way the recorded instance is kept and the release ends all."""
    async with lagging_world(temporal, window=window, boot_delay=3.0) as (world, queue):
        req = request(timeouts=SHORT.model_copy(update={"idle": None}), pool_workflow_id="gpupool/ml/no-such-pool")
        handle = await start_as_the_pool(temporal, queue, req)

        async def joined() -> bool:
            status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
            return any(r.stage is Stage.TAILNET_JOINED for r in status.stages)

        # While it boots; or, for the window that outlasts the join, once the join's wait is over
        # (the Node not Ready yet: a twin the window still covers, whenever Ready comes).
        if with_join:  # bought, and booting: the launch's activity waits for its join
            await eventually(lambda: asyncio.sleep(0, billing(world, req.node_name)), timeout=60, what="the instance bought")
        else:
            await eventually(joined, timeout=60, what="the device joined")
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.cloud.url, headers={"Authorization": f"Bearer {world.cloud_api_key}"}) as cloud:
            twin = (await cloud.post("/v1/instances", json={"offerId": "rtx4090-us-east", "name": instance_name(req.node_name, 1)})).json()
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)

        async def only_the_recorded_one() -> bool:
            return billing(world, req.node_name) == [ready.instance_id]

        await eventually(only_the_recorded_one, timeout=40, what=f"the twin {twin['id']} ended by the node's twin watch")
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await handle.result()).phase is NodePhase.TERMINATED
        assert billing(world, req.node_name) == []


async def test_after_a_failover_that_settled_a_launch_at_the_reserved_price_settles_again(temporal: WorkflowEnvironment) -> None:
    """Reserved at the dearer offer's price: the first launch (the cheaper offer) settles its
    price and finds no capacity; the ledger now holds that price, so the next launch, at the
    price reserved, settles too."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        world.cloud.set_capacity("rtx4090-us-east", False)
        dearer = Decimal("0.49")  # sim/cloud.py: rtx4090-eu-west
        class_run, req = await reserved_node(temporal, queue, dearer)
        klass = req.node_class
        handle = await start(temporal, queue, req)
        status = await wait_phase(handle, NodePhase.READY, timeout=90)
        assert status.hourly_price == dearer and len(status.attempts) == 2, status.attempts
        settles = await launch_settles(handle)
        assert [s.reservation.hourly_price if s else None for s in settles] == [OFFER_PRICE, dearer], settles
        held = (await ledger_of(temporal, klass)).reservations.get(req.workflow_id)
        assert held is not None and held.hourly_price == dearer, held
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await asyncio.wait_for(handle.result(), 90)
        assert_nothing_left(world, req.node_name)
        await class_run.terminate("test finished")


@pytest.mark.parametrize("attempt, kind", [(1, "ClassBudgetRefused"), (2, "ClassBudgetRefusedOnRetry")])
async def test_a_refused_settle_says_whether_an_earlier_try_may_have_bought(temporal: WorkflowEnvironment, attempt: int, kind: str) -> None:
    """The launch's settle, refused by a real class ledger: on the activity's first try nothing
    can have been bought (the settle comes first); on a later try an earlier one may have sent
    a create before it died, and the workflow must keep that attempt to release. The settle's
    heartbeats carry the earlier try's memo through, never an empty one in its place."""
    async with running_world(temporal) as (_, _, queue):
        klass = f"settle-{uuid.uuid4().hex[:6]}"
        spec = GPUNodeClassSpec.model_validate({**CLASS.model_dump(mode="json", by_alias=True), "limits": {"maxHourlyCost": "0.01"}})
        class_run = await start_class(temporal, queue, klass, spec)
        acts = NodeActivities(providers={}, tailnets={}, cluster=None)  # type: ignore[arg-type]  # refused before any provider is asked
        env = ActivityEnvironment(client=temporal.client)
        memo = ["an earlier try's memo"]
        # A beat every millisecond (a third of the timeout): several during the ledger's round trip.
        env.info = dataclasses.replace(env.info, attempt=attempt, heartbeat_details=memo, heartbeat_timeout=timedelta(milliseconds=3))
        beats: list[tuple[Any, ...]] = []
        env.on_heartbeat = lambda *details: beats.append(details)
        offer = Offer(provider="simulated", offer_id="rtx4090-us-east", gpu_type="RTX4090", region="us-east", hourly_price=OFFER_PRICE)
        inp = LaunchInput(node_name="gpu-1", attempt=1, offer=offer, tailnet_tags=["tag:tgp-node"])
        call = LedgerCall(class_workflow_id=class_workflow_id(klass), reservation=Reservation(node_id="gpunode/ml/rtx/gpu-1", pool="ml/rtx", hourly_price=OFFER_PRICE))
        with pytest.raises(ApplicationError) as raised:
            await env.run(acts.launch_instance, inp, None, call)
        assert raised.value.type == kind and raised.value.non_retryable, raised.value
        assert "maxHourlyCost" in raised.value.message
        assert beats and all(list(b) == memo for b in beats), beats
        await class_run.terminate("test finished")


async def quick_world(stack: AsyncExitStack) -> tuple[SimWorld, Activities]:
    """A simulated world whose machines boot at once, and activities that look every 0.1 s."""
    world = await stack.enter_async_context(sim_world(boot_delay=0.2))
    activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
    activities.node.poll_interval = timedelta(seconds=0.1)
    return world, activities


def dies_after_its_first_buy(activities: Activities, then: Callable[[], Awaitable[Any]]) -> None:
    """The launch's first try buys, then `then` happens, then the try dies before it can say so
    (as when its worker is gone); later tries launch as usual."""
    real = activities.node._launch_instance

    async def launch(inp: LaunchInput) -> Any:
        bought = await real(inp)
        if activity.info().attempt == 1:
            await then()
            raise ApplicationError("the worker died after the create", type="TransientError")
        return bought

    activities.node._launch_instance = launch  # type: ignore[method-assign]


async def test_a_settle_refused_on_a_retried_launch_still_ends_what_an_earlier_try_bought(temporal: WorkflowEnvironment) -> None:
    """The launch's first try settles, buys and dies before it can say so (its worker is
    gone); the class's limits are lowered meanwhile, and the retry's settle is refused. The
    node ends Failed saying why, and the instance the first try bought is found by its name and
    terminated: a refusal on a retry is no proof that nothing was bought."""
    async with AsyncExitStack() as stack:
        world, activities = await quick_world(stack)
        klass = f"settle-{uuid.uuid4().hex[:6]}"

        async def lower_the_limits() -> None:
            lowered = GPUNodeClassSpec.model_validate({**CLASS.model_dump(mode="json", by_alias=True), "limits": {"maxHourlyCost": "0.01"}})
            await activity.client().get_workflow_handle(class_workflow_id(klass)).signal("update_class", ClassUpdate(spec=lowered, generation=2))

        dies_after_its_first_buy(activities, lower_the_limits)
        queue = f"test-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        class_run = await start_class(temporal, queue, klass, CLASS)
        stack.push_async_callback(class_run.terminate, "test finished")
        req = request(timeouts=SHORT, pool_workflow_id="gpupool/ml/no-such-pool", node_class=klass, class_workflow_id=class_workflow_id(klass))
        handle = await start_as_the_pool(temporal, queue, req)
        status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.FAILED and "class budget refused" in (status.last_error or ""), status
        assert world.cloud.create_requests == 1
        assert len(status.attempts) == 1, "the attempt whose first try bought was dropped"
        assert_nothing_left(world, req.node_name)


async def test_a_ledger_that_stops_answering_on_a_retried_launch_still_ends_what_an_earlier_try_bought(temporal: WorkflowEnvironment) -> None:
    """The launch's first try settles, buys and dies before it can say so; then the class
    ledger stops answering (its workflow runs, nobody serves it). The retries' settles time out
    until the launch gives up as `LedgerUnavailable`: no proof that nothing was bought, so the
    node keeps the attempt and its cleanup terminates what the first try bought at once; it ends
    Failed, saying why, once the ledger answers again and is told (the release waits for it)."""
    async with AsyncExitStack() as stack:
        world, activities = await quick_world(stack)
        activities.node.ledger = LedgerBatcher(timeout=timedelta(seconds=1))  # the update's own timeout, shortened
        klass = f"settle-{uuid.uuid4().hex[:6]}"
        ledger_queue = f"ledger-{uuid.uuid4().hex[:8]}"
        ledger_worker = make_worker(temporal.client, await build_activities(WorkerConfig.from_env(world.worker_env()), stack), task_queue=ledger_queue)
        ledger_serving = asyncio.ensure_future(ledger_worker.run())
        dies_after_its_first_buy(activities, ledger_worker.shutdown)  # the ledger stops answering
        queue = f"test-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        class_run = await start_class(temporal, ledger_queue, klass, CLASS)
        stack.push_async_callback(class_run.terminate, "test finished")
        req = request(timeouts=SHORT, pool_workflow_id="gpupool/ml/no-such-pool", node_class=klass, class_workflow_id=class_workflow_id(klass))
        handle = await start_as_the_pool(temporal, queue, req)

        async def gave_up() -> bool:
            if (await handle.describe()).status is not WorkflowExecutionStatus.RUNNING:
                return True  # ended without waiting for the ledger: the asserts below say what went wrong
            status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
            return "did not take the launch's settle" in (status.last_error or "")

        await eventually(gave_up, timeout=60, what="the launch given up as LedgerUnavailable")
        await ledger_serving

        async def terminated() -> bool:
            return world.cloud.live_instances() == []

        # Money first: the release terminates before it tells the ledger, which is still away.
        await eventually(terminated, timeout=60, what="the first try's instance terminated while the ledger is away")
        assert (await handle.describe()).status is WorkflowExecutionStatus.RUNNING, "ended without telling the ledger"
        async with make_worker(temporal.client, await build_activities(WorkerConfig.from_env(world.worker_env()), stack), task_queue=ledger_queue):
            status = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.FAILED and "did not take the launch's settle" in (status.last_error or ""), status
        assert world.cloud.create_requests == 1
        assert len(status.attempts) == 1, "the attempt whose first try bought was dropped"
        assert_nothing_left(world, req.node_name)
