"""The class ledger never stops (issue 17, item 13).

* A `reserve` that waits for the ledger's first listing of running nodes while the run's history
  grows long is answered, and the run then continues as new: the main loop never waits for a
  handler that waits for the main loop.
* A deleted class whose nodes still hold reservations continues as new too.
* Everything a run knows (conditions, the status written, when it listed and validated) is
  carried into the next run.

The class workflow runs for real against the simulated world on a dev server that suggests
continue-as-new early (the class's own limit, 2,000 events, is a constant the workflow sandbox
imports afresh). The listing is the real `running_nodes_changed` activity behind a gate: the test holds
its first call, grows the history while it is held, then lets it fail. Nothing waits on a clock."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowContinuedAsNewError, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateStage
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from sim.world import sim_world
from tests.conftest import binary
from tgp.crds import GPUNodeClassSpec
from tgp.messages import ClassInput, ClassUpdate, Reservation, RunningNodesChanges, RunningNodesQuery, class_workflow_id
from workers.main import Activities, WorkerConfig, build_activities, make_worker
from workers.temporal import DATA_CONVERTER, search_attribute_keys
from workflows.node_class import GPUNodeClassWorkflow

CLASS = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}})
SUGGEST_CONTINUE_AS_NEW_AT = 150
# Seconds any one held call or visible outcome may take on a busy machine.
WAIT = 60.0


@pytest.fixture(scope="module")
async def suggests_early() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        search_attributes=search_attribute_keys(),
        data_converter=DATA_CONVERTER,
        dev_server_log_level="error",
        dev_server_extra_args=["--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGEST_CONTINUE_AS_NEW_AT}"],
    )
    async with env:
        yield env


class Listing:
    """The real `running_nodes_changed`; while `holding`, each call waits until `fail()` and
    then fails for good (a visibility outage as the class sees it)."""

    def __init__(self, activities: Activities) -> None:
        self.real = activities.entity.running_nodes_changed
        self.holding = False
        self.arrived = asyncio.Event()
        self._failed = asyncio.Event()

    def fail(self) -> None:
        self.holding = False
        self._failed.set()

    async def __call__(self, query: RunningNodesQuery) -> RunningNodesChanges:
        if self.holding:
            self.arrived.set()
            await self._failed.wait()
            raise ApplicationError("visibility is down (test)", non_retryable=True)
        return await self.real(query)


class Gated:
    def __init__(self, inner: Any, replacement: Any) -> None:
        self.inner, self.replacement = inner, replacement

    def all(self) -> list[object]:
        return [self.replacement if getattr(f, "__name__", "") == "running_nodes_changed" else f for f in self.inner.all()]


async def start_class(env: WorkflowEnvironment, queue: str, **inp: Any) -> WorkflowHandle:
    name = f"ledger-{uuid.uuid4().hex[:6]}"
    return await env.client.start_workflow(
        GPUNodeClassWorkflow.run,
        ClassInput(name=name, **inp),
        id=class_workflow_id(name),
        task_queue=queue,
        start_signal="update_class",
        start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
    )


async def grow_history_past(env: WorkflowEnvironment, handle: WorkflowHandle, run_id: str | None, events: int) -> None:
    """Releases of nodes the class never heard of (they change nothing it counts) until run
    `run_id` has ended or its history is past `events` (an update that reaches the next run is
    as harmless)."""
    run = env.client.get_workflow_handle(handle.id, run_id=run_id)
    while (desc := await run.describe()).status is WorkflowExecutionStatus.RUNNING and desc.history_length <= events:
        ghosts = [f"ghost-{uuid.uuid4().hex[:6]}" for _ in range(10)]
        await asyncio.gather(*(handle.execute_update(GPUNodeClassWorkflow.release, g) for g in ghosts), return_exceptions=True)


async def next_run_input(env: WorkflowEnvironment, handle: WorkflowHandle, first_run: str | None) -> ClassInput:
    """Wait (bounded) for the first run to continue as new; the input it gave the next run."""
    with pytest.raises(WorkflowContinuedAsNewError):
        await asyncio.wait_for(env.client.get_workflow_handle(handle.id, run_id=first_run).result(follow_runs=False), WAIT)
    history = await env.client.get_workflow_handle(handle.id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    (carried,) = await DATA_CONVERTER.decode([started.input.payloads[0]], [ClassInput])
    return carried  # type: ignore[no-any-return]


async def test_a_reserve_waiting_for_the_first_listing_does_not_stop_the_ledger(suggests_early: WorkflowEnvironment) -> None:
    env = suggests_early
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        listing = Listing(activities)

        @activity.defn(name="running_nodes_changed")
        async def listed(query: RunningNodesQuery) -> RunningNodesChanges:
            return await listing(query)

        queue = f"ledger-{uuid.uuid4().hex[:8]}"
        gated = dataclasses.replace(activities, entity=Gated(activities.entity, listed))  # type: ignore[arg-type]
        await stack.enter_async_context(make_worker(env.client, gated, task_queue=queue))
        stack.callback(listing.fail)  # nothing stays held when the worker stops

        listing.holding = True
        # The resync interval is the workflow's own timer: after a failed listing the ledger
        # lists again this soon.
        handle = await start_class(env, queue, resync_interval=timedelta(seconds=1))
        stack.push_async_callback(handle.terminate, "test finished")
        first_run = handle.result_run_id
        await asyncio.wait_for(listing.arrived.wait(), WAIT)

        # A pool reserves while the ledger's first listing is in flight: the reserve waits.
        reserve = await handle.start_update(
            GPUNodeClassWorkflow.reserve,
            Reservation(node_id="gpunode/ml/pool/n1", pool="ml/pool"),
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
        )
        # The history grows past the suggestion to continue as new, then the listing fails.
        await grow_history_past(env, handle, first_run, SUGGEST_CONTINUE_AS_NEW_AT)
        listing.fail()

        grant = await asyncio.wait_for(reserve.result(), WAIT)
        assert grant.granted, grant.reason
        carried = await next_run_input(env, handle, first_run)
        assert "gpunode/ml/pool/n1" in carried.ledger.reservations
        # The next run knows what this one had done: it neither lists nor validates again at
        # once, and writes no status it already wrote.
        assert carried.seen_at is not None and carried.validated_at is not None
        assert [c.type for c in carried.conditions] == ["Ready", "CredentialsAvailable", "ProviderAccountsAvailable"]
        assert all(c.status == "True" for c in carried.conditions)
        assert carried.written and carried.problems == []


async def test_a_deleted_class_holding_reservations_continues_as_new(suggests_early: WorkflowEnvironment) -> None:
    env = suggests_early
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        queue = f"ledger-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(env.client, activities, task_queue=queue))
        # A node of this class that is still running holds its reservation for as long as it
        # lives (no node workflow runs here, so the grace keeps it from being taken for an orphan).
        handle = await start_class(env, queue, reservation_grace=timedelta(days=30))
        stack.push_async_callback(handle.terminate, "test finished")
        first_run = handle.result_run_id
        grant = await asyncio.wait_for(handle.execute_update(GPUNodeClassWorkflow.reserve, Reservation(node_id="gpunode/ml/pool/n1", pool="ml/pool")), WAIT)
        assert grant.granted, grant.reason

        await handle.signal(GPUNodeClassWorkflow.update_class, ClassUpdate(spec=None))
        # Past the suggestion, each pass (one per update) may continue as new: grow until the
        # run does, or to well past the point where it should have.
        await grow_history_past(env, handle, first_run, 4 * SUGGEST_CONTINUE_AS_NEW_AT)

        carried = await next_run_input(env, handle, first_run)
        assert carried.spec is None and "gpunode/ml/pool/n1" in carried.ledger.reservations
