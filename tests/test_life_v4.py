"""A `life-v4` life (workflows/node.py LIFE_V4_PATCH): fewer calls for the same promises.

* The launch settles the price with the class ledger before it mints or buys (no settle
  activity before it); a refusal is tests/test_class_refusal.py's.
* The release terminates, removes the tailnet device, deletes the Node and gives the class its
  place back in one activity (`release_attempt`); a later step it could not make is made by the
  workflow as a call of its own, and nothing is left either way.
* A node the pool starts (with `start_attributes`) makes no search-attribute upsert of its own
  for Pending; one started without them (by hand, as tests/test_life_events.py's) still does.

Against the simulated world over HTTP, the real bridge and the Temporal dev server."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from activities.search_attributes import SA_PHASE, start_attributes
from tests.conftest import eventually, running_world
from tests.test_entities_heal import start_class
from tests.test_life_events import SHORT, event_types
from tests.test_money_workflow import billing, lagging_world
from tests.test_node_lifecycle import assert_nothing_left, node_exists, request, wait_phase
from tests.test_node_long_lived import put_pod, remove_pod
from tests.test_pool_accounting import CLASS
from tests.test_watch_events import bridge_running, local_activity, told
from activities.ledger import LedgerCall
from tgp.messages import Grant, Ledger, Reservation, class_workflow_id
from tgp.node import NodeWorkflowInput
from tgp.types import NodePhase, NodeRequest, NodeStatus, instance_name
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
        klass = f"v4-{uuid.uuid4().hex[:6]}"
        class_run = await start_class(temporal, queue, klass, CLASS)
        req = request(
            timeouts=SHORT,
            pool_workflow_id="gpupool/ml/no-such-pool",
            node_class=klass,
            class_workflow_id=class_workflow_id(klass),
            reserved_price=reserved,
        )
        grant = await class_run.execute_update("reserve", Reservation(node_id=req.workflow_id, pool="ml/rtx", hourly_price=reserved), result_type=Grant)
        assert grant.granted, grant
        handle = await start_as_the_pool(temporal, queue, req)
        status = await wait_phase(handle, NodePhase.READY, timeout=90)
        assert status.hourly_price == OFFER_PRICE, status.hourly_price
        [settle] = await launch_settles(handle)
        assert (settle is not None) is settles, settle
        # Either way the class holds the node at the price it bought at.
        held = (await ledger_of(temporal, klass)).reservations.get(req.workflow_id)
        assert held is not None and held.hourly_price == OFFER_PRICE, held

        await put_pod(world, req.node_name, "job")
        await told(handle, busy_pods=1)
        await remove_pod(world, "job")
        status = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status

        activities, local, phases = await calls(handle)
        assert not {"settle_reservation", "release_reservation", "terminate_instance"} & set(activities), activities
        assert activities.count("release_attempt") == 1 and activities.index("launch_instance") < activities.index("release_attempt"), activities
        assert not {"remove from tailnet", "delete Node", "settle price with the class budget", "release class budget"} & set(local), local
        assert phases[0] == NodePhase.LAUNCHING.value, f"an upsert for what the run started with: {phases}"
        # Everything is given back all the same.
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)
        assert req.workflow_id not in (await ledger_of(temporal, klass)).reservations
        tally, order = await event_types(handle)
        assert not tally["WORKFLOW_TASK_FAILED"], order
        await Replayer(workflows=[GPUNodeWorkflow], data_converter=DATA_CONVERTER).replay_workflow(await handle.fetch_history())
        await class_run.terminate("test finished")


async def test_a_release_step_that_fails_is_made_by_the_workflow_itself(temporal: WorkflowEnvironment) -> None:
    """The Node's deletion fails inside `release_attempt`: the terminate is not made again, the
    workflow deletes the Node with a call of its own, and the class's place still went back."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        klass = f"v4-{uuid.uuid4().hex[:6]}"
        class_run = await start_class(temporal, queue, klass, CLASS)
        req = request(timeouts=SHORT, pool_workflow_id="gpupool/ml/no-such-pool", node_class=klass, class_workflow_id=class_workflow_id(klass))
        handle = await start_as_the_pool(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY, timeout=90)
        refused: Any = world.kube[f"delete /api/v1/nodes/{req.node_name}"][:1] << 500  # the first delete only
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
        status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED, status
        assert len(refused) == 1, "the Node's deletion was not refused once"

        activities, local, _ = await calls(handle)
        assert activities.count("release_attempt") == 1, activities
        assert "delete Node" in local, f"the workflow did not delete the Node itself: {local}"
        assert not {"terminate_instance", "release_reservation"} & set(activities), activities
        assert not await node_exists(world, req.node_name)
        assert_nothing_left(world, req.node_name)
        assert req.workflow_id not in (await ledger_of(temporal, klass)).reservations
        await class_run.terminate("test finished")


@pytest.mark.parametrize("window, with_join", [(timedelta(seconds=1), True), (timedelta(seconds=20), False)], ids=["window-within-the-boot", "window-past-the-join"])
async def test_a_twin_is_ended_by_the_joins_watch_or_after_it(temporal: WorkflowEnvironment, window: timedelta, with_join: bool) -> None:
    """A create under the node's name lands beside its launch (a dead worker's): within a
    consistency window that ends before the instance has booted, the join's own twin watch
    (`wait_for_join`) ends one that lands while it boots; a window that outlasts the join is
    watched on after it (`watch_for_twins`), and one that lands once the node is Ready is ended
    by that. Either way the recorded instance is kept and the release ends all."""
    async with lagging_world(temporal, window=window, boot_delay=3.0) as (world, queue):
        req = request(timeouts=SHORT, pool_workflow_id="gpupool/ml/no-such-pool")
        handle = await start_as_the_pool(temporal, queue, req)
        # While it boots; or, for the window that outlasts the join, once it is Ready.
        await wait_phase(handle, NodePhase.JOINING if with_join else NodePhase.READY, timeout=60)
        async with httpx.AsyncClient(base_url=world.cloud.url, headers={"Authorization": f"Bearer {world.cloud_api_key}"}) as cloud:
            twin = (await cloud.post("/v1/instances", json={"offerId": "rtx4090-us-east", "name": instance_name(req.node_name, 1)})).json()
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)

        async def only_the_recorded_one() -> bool:
            return billing(world, req.node_name) == [ready.instance_id]

        await eventually(only_the_recorded_one, timeout=40, what=f"the twin {twin['id']} ended by the node's twin watch")
        activities, _, _ = await calls(handle)
        assert "wait_for_join" in activities, activities
        assert ("watch_for_twins" not in activities) is with_join, activities
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await handle.result()).phase is NodePhase.TERMINATED
        assert billing(world, req.node_name) == []
