"""Runs that release 31e9066 started finish in its frozen code, then continue in today's
(workflows/legacy/r31e9066, docs/workflow-versioning.md "Frozen releases").

tests/test_replay.py replays 31e9066's recorded histories through it; here: the input's shape
tells 31e9066's runs from every later release's, the handover gives today's code an input it
takes for its own, the activities 31e9066 schedules still exist and understand each other, and
on the dev server a pool, class and node started as 31e9066 started them hand over and work."""

from __future__ import annotations

import functools
import gzip
import inspect
import json
import typing
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from sim.world import sim_world
from tests.conftest import eventually, running_world
from tests.test_node_lifecycle import request
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.messages import ClassInput, ClassUpdate, Demand, Grant, PoolUpdate, Reservation, class_workflow_id, pool_workflow_id
from tgp.node import NodeWorkflowInput
from tgp.types import EvictRequest, NodePhase, NodeStatus, TimeoutsUpdate
from workers.main import Activities, WorkerConfig, build_activities, make_worker
from workers.temporal import DATA_CONVERTER
from workflows.legacy.r31e9066 import activities as legacy_activities
from workflows.legacy.r31e9066 import frozen, handover
from workflows.legacy.r31e9066 import messages as legacy_messages
from workflows.legacy.r31e9066 import node_class as legacy_class
from workflows.legacy.r31e9066 import node as legacy_node
from workflows.legacy.r31e9066 import pool as legacy_pool
from workflows.legacy.r31e9066 import types as legacy_types
from workflows.node import GPUNodeWorkflow
from workflows.pool import GPUNodePoolWorkflow, PoolInput

HISTORIES = Path(__file__).parent / "histories"
RELEASES = ("31e9066", "d9d0b88", "e9a7c55")
INPUTS: dict[str, type[BaseModel]] = {"GPUNodePoolWorkflow": PoolInput, "GPUNodeClassWorkflow": ClassInput, "GPUNodeWorkflow": NodeWorkflowInput}
FROZEN = {"GPUNodePoolWorkflow": frozen.frozen_pool, "GPUNodeClassWorkflow": frozen.frozen_class, "GPUNodeWorkflow": frozen.frozen_node}
CONVERT = {"GPUNodePoolWorkflow": handover.pool_input, "GPUNodeClassWorkflow": handover.class_input, "GPUNodeWorkflow": handover.node_input}


@functools.cache
def _recorded(release: str) -> list[WorkflowHistory]:
    return [WorkflowHistory.from_json(p.name, gzip.decompress(p.read_bytes()).decode()) for p in sorted((HISTORIES / release).glob("*.json.gz"))]


def histories(*releases: str) -> Iterator[tuple[str, WorkflowHistory]]:
    for release in releases:
        for history in _recorded(release):
            yield release, history


def start_input(history: WorkflowHistory) -> tuple[str, Any]:
    """The workflow type and its input as today's worker decodes it."""
    attrs = history.events[0].workflow_execution_started_event_attributes
    kind = attrs.workflow_type.name
    [inp] = DATA_CONVERTER.payload_converter.from_payloads(attrs.input.payloads, [INPUTS[kind]])
    return kind, inp


def round_trip(value: Any, kind: str) -> Any:
    """What the next run decodes from an input this run continues as new with."""
    payloads = DATA_CONVERTER.payload_converter.to_payloads([value])
    [decoded] = DATA_CONVERTER.payload_converter.from_payloads(payloads, [INPUTS[kind]])
    return decoded


def starts(*releases: str) -> Iterator[tuple[str, WorkflowHistory]]:
    """Each recorded history's first event only (parsing whole histories costs seconds)."""
    for release in releases:
        for p in sorted((HISTORIES / release).glob("*.json.gz")):
            first = json.loads(gzip.decompress(p.read_bytes()))["events"][0]
            yield release, WorkflowHistory.from_json(p.name, {"events": [first]})


def test_only_runs_31e9066_started_are_taken_for_its_runs() -> None:
    seen: set[tuple[str, str]] = set()
    for release, history in starts(*RELEASES):
        kind, inp = start_input(history)
        assert (FROZEN[kind](inp) is not None) == (release == "31e9066"), f"{release} {history.workflow_id}"
        seen.add((release, kind))
    assert len(seen) == len(RELEASES) * len(INPUTS), "every release recorded every workflow type"


def test_the_handover_input_is_todays_and_keeps_the_state() -> None:
    for _, history in histories("31e9066"):
        kind, inp = start_input(history)
        run = FROZEN[kind](inp)
        assert run is not None
        nxt = round_trip(CONVERT[kind](run.wf), kind)
        assert FROZEN[kind](nxt) is None, "the next run would be taken for 31e9066's again: a handover loop"
        if kind == "GPUNodePoolWorkflow":
            assert (nxt.namespace, nxt.name, nxt.watch_interval) == (inp.namespace, inp.name, inp.watch_interval)
            assert nxt.state.nodes.keys() == inp.state.nodes.keys() and nxt.state.update == inp.state.update
        elif kind == "GPUNodeClassWorkflow":
            assert (nxt.name, nxt.spec, nxt.ledger) == (inp.name, inp.spec, inp.ledger)
        else:
            assert nxt.request.model_dump(exclude={"demand_since", "tailnet_ref"}) == inp.request.model_dump(exclude={"demand_since", "tailnet_ref"})
            assert nxt.state == (inp.state or nxt.state)


def test_the_handover_takes_the_latest_messages_as_sent_and_the_unwritten_events() -> None:
    """A pool's latest update and demand (the bridge does not send an unchanged demand again)
    and a node's new timeouts reach today's run with the fields 31e9066 did not know."""
    klass = CLASS
    spec = pool_spec("c", minNodes=2)
    inp = round_trip(legacy_pool.PoolInput(namespace="ml", name="p"), "GPUNodePoolWorkflow")
    run = frozen.frozen_pool(inp)
    assert run is not None
    update = PoolUpdate(spec=spec, generation=3, node_class=klass)
    demand = {"pods": ["ml/a", "ml/b"], "observed_at": "2026-11-24T06:00:00Z", "max_gpus": 2, "pod_gpus": {"ml/a": 2}, "free_gpus": {"n1": 1}}
    run.handle("update", update)
    run.handle("demand", Demand.model_validate(demand))
    run.wf.events.append(legacy_activities.EventSpec(ref=legacy_messages.ObjectRef(kind="GPUNodePool", name="p", namespace="ml"), reason="NodeReady", message="m"))
    nxt = round_trip(handover.pool_input(run.wf), "GPUNodePoolWorkflow")
    assert nxt.state.update == update
    assert nxt.state.demand == ["ml/a", "ml/b"] and nxt.state.demand_gpus == 2
    assert nxt.state.pod_gpus == {"ml/a": 2} and nxt.state.free_gpus == {"n1": 1} and set(nxt.state.pending_since) == {"ml/a", "ml/b"}
    assert [e.reason for e in nxt.state.events] == ["NodeReady"]

    node_inp = round_trip(legacy_node.NodeWorkflowInput(request=legacy_types.NodeRequest.model_validate(request().model_dump(mode="json"))), "GPUNodeWorkflow")
    node_run = frozen.frozen_node(node_inp)
    assert node_run is not None
    node_run.handle("update_timeouts", TimeoutsUpdate(idle=timedelta(minutes=7), drain=timedelta(minutes=3), expire_after=None))
    assert round_trip(handover.node_input(node_run.wf), "GPUNodeWorkflow").request.timeouts.idle == timedelta(minutes=7)


def _scheduled(history: WorkflowHistory) -> Iterator[tuple[str, Any, Any]]:
    """(activity name, arguments, result or None) of each activity in the history."""
    names: dict[int, tuple[str, Any]] = {}
    for e in history.events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            a = e.activity_task_scheduled_event_attributes
            names[e.event_id] = (a.activity_type.name, DATA_CONVERTER.payload_converter.from_payloads(a.input.payloads))
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            c = e.activity_task_completed_event_attributes
            name, args = names.pop(c.scheduled_event_id)
            yield name, args, DATA_CONVERTER.payload_converter.from_payloads(c.result.payloads)
    for name, args in names.values():
        yield name, args, None


def _activities(*classes: type) -> dict[str, Any]:
    return {n: f for cls in classes for n, f in inspect.getmembers(cls, inspect.isfunction) if hasattr(f, "__temporal_activity_definition")}


def _concrete(hint: Any) -> type:
    """The class of an optional field's hint (`X | None` -> X)."""
    return next((a for a in typing.get_args(hint) if a is not type(None)), hint)


def _params(fn: Any, given: int) -> list[Any]:
    """The types of `fn`'s first `given` parameters; the ones after must have defaults (an
    activity that took an argument more since, such as the report a launch carries, reads an
    older schedule's first argument as its model: activities.node.typed)."""
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    assert len(params) >= given and all(p.default is not inspect.Parameter.empty for p in params[given:]), f"{fn.__name__} cannot take {given} argument(s)"
    return [hints[p.name] for p in params[:given]]


def test_the_activities_31e9066_schedules_still_run_and_answer_in_its_types() -> None:
    """Every activity a 31e9066 run may still schedule after the upgrade has a worker activity of
    that name that accepts the arguments 31e9066 recorded; and what today's activities return
    (recorded by today's code and the last release) reads into 31e9066's declared result types."""
    # What the worker registers (workers.main.Activities.all()), from instances without adapters.
    bare = {name: object.__new__(_concrete(cls)) for name, cls in typing.get_type_hints(Activities).items()}
    today = {fn.__name__: getattr(type(fn.__self__), fn.__name__) for fn in Activities(**bare).all()}  # type: ignore[attr-defined]
    declared = _activities(legacy_activities.FleetActivities, legacy_activities.NodeActivities)
    assert declared.keys() <= today.keys(), "an activity 31e9066 can schedule is not on the worker: register an alias of its name"
    used = set()
    for _, history in histories("31e9066"):
        for name, args, _result in _scheduled(history):
            used.add(name)
            assert name in today, f"31e9066 schedules {name}, which no worker activity is named: register an alias"
            for t, arg in zip(_params(today[name], len(args)), args, strict=True):
                TypeAdapter(t).validate_python(arg)
    assert used <= declared.keys()
    answered = set()
    newest = [p for p in HISTORIES.glob("*.json")]
    recorded = [WorkflowHistory.from_json(p.name, p.read_text()) for p in newest] + [h for _, h in histories("e9a7c55")]
    for history in recorded:
        for name, _args, result in _scheduled(history):
            if name in declared and result:
                returns = typing.get_type_hints(declared[name])["return"]
                TypeAdapter(returns).validate_python(result[0])
                answered.add(name)
    assert {"check_offers", "select_offer", "observe_node", "launch_instance"} <= answered


# --- on the dev server: started as 31e9066 started them, they hand over and work ------------------


def scheduled(history: WorkflowHistory) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events if e.HasField("activity_task_scheduled_event_attributes")]


async def handed_over(env: WorkflowEnvironment, workflow_id: str, first_run: str, mark: str) -> WorkflowHistory:
    """The first run continued as new, and the next run's input is today's (it has `mark`)."""

    async def moved() -> bool:
        return (await env.client.get_workflow_handle(workflow_id).describe()).run_id != first_run

    await eventually(moved, timeout=60, what=f"{workflow_id} to continue as new")
    first = await env.client.get_workflow_handle(workflow_id, run_id=first_run).fetch_history()
    assert first.events[-1].event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW
    now = await env.client.get_workflow_handle(workflow_id).fetch_history()
    started = json.loads(now.events[0].workflow_execution_started_event_attributes.input.payloads[0].data)
    assert mark in json.dumps(started), f"the run after the handover has a 31e9066-shaped input: {started}"
    return first


async def test_a_pool_and_class_started_by_31e9066_hand_over_and_launch_a_node(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (_, _, queue):
        klass, name = f"old-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        # The inputs exactly as 31e9066's bridge wrote them; the messages as today's bridge sends them.
        klass_handle: WorkflowHandle = await temporal.client.start_workflow(
            "GPUNodeClassWorkflow",
            legacy_messages.ClassInput(name=klass),
            id=class_workflow_id(klass),
            task_queue=queue,
            start_signal="update_class",
            start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
        )
        pool: WorkflowHandle = await temporal.client.start_workflow(
            "GPUNodePoolWorkflow",
            legacy_pool.PoolInput(namespace="ml", name=name),
            id=pool_workflow_id("ml", name),
            task_queue=queue,
            start_signal="update",
            start_signal_args=[PoolUpdate(spec=pool_spec(klass, minNodes=1, maxNodes=1), generation=1, node_class=CLASS)],
        )
        for handle in (klass_handle, pool):
            first = await handed_over(temporal, handle.id, handle.result_run_id or "", '"resync_interval"')
            assert scheduled(first) == [], "31e9066's code handed over before its first pass"

        # Today's pool launches the floor node: the class (today's too) granted its reservation.
        async def ready() -> Any:
            status = await temporal.client.get_workflow_handle(pool.id).query(GPUNodePoolWorkflow.status)
            return status if status.ready_nodes == 1 else None

        status = await eventually(ready, timeout=90, what="the floor node Ready")
        [node] = status.nodes
        ledger = await temporal.client.get_workflow_handle(klass_handle.id).query("budget")
        assert node.workflow_id in ledger["reservations"]


async def test_a_node_started_by_31e9066_comes_up_in_its_code_and_hands_over_when_watching(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        req = request()
        old = legacy_node.NodeWorkflowInput(request=legacy_types.NodeRequest.model_validate(req.model_dump(mode="json")))
        handle: WorkflowHandle = await temporal.client.start_workflow("GPUNodeWorkflow", old, id=req.workflow_id, task_queue=queue)
        first = await handed_over(temporal, req.workflow_id, handle.result_run_id or "", '"demand_since"')
        kinds = scheduled(first)
        assert kinds[:2] == ["select_offer", "launch_instance"] and kinds[-1] == "label_and_taint_node", "31e9066's code brought it up"
        assert not any(e.HasField("marker_recorded_event_attributes") for e in first.events), "today's code records its patches"

        now = temporal.client.get_workflow_handle(req.workflow_id)
        assert (await now.query(GPUNodeWorkflow.status)).phase is NodePhase.READY
        await now.signal(GPUNodeWorkflow.evict, EvictRequest(reason="manual"))
        final = NodeStatus.model_validate(await now.result())
        assert final.phase is NodePhase.TERMINATED and final.end_reason == "evicted: manual"
        assert world.cloud.live_instances() == [], "today's code terminated what 31e9066's bought"



async def test_an_upgrade_from_31e9066_hands_its_running_pool_class_and_node_over(temporal: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    """The upgrade itself: a worker running 31e9066's code (the frozen classes, their handover
    switched off) starts a class, a pool and a node of that pool, which comes up; that worker
    stops. Today's worker picks the three up: each replays through the frozen code, hands over
    at its next step, and today's code carries on with what they held (the pool's node, the
    class's reservation) to the node's end."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        queue = f"test-{uuid.uuid4().hex[:8]}"
        klass, name = f"old-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        client = temporal.client

        async def noop(*_: object) -> None:
            return None

        with monkeypatch.context() as old_release:
            old_release.setattr(legacy_pool, "hand_over", lambda *_: None)
            old_release.setattr(legacy_class, "hand_over", lambda *_: None)
            old_release.setattr(legacy_node, "hand_over_node", noop)
            workflows = [legacy_pool.GPUNodePoolWorkflow, legacy_class.GPUNodeClassWorkflow, legacy_node.GPUNodeWorkflow]
            # Stopped as a deployment stops it: the activities under way finish (a cancelled one
            # would be retried only after its start-to-close timeout, a minute or two).
            old_worker = Worker(
                client,
                task_queue=queue,
                workflows=workflows,
                activities=activities.all(),
                workflow_runner=UnsandboxedWorkflowRunner(),
                graceful_shutdown_timeout=timedelta(seconds=30),
            )
            async with old_worker:
                class_handle: WorkflowHandle = await client.start_workflow(
                    "GPUNodeClassWorkflow",
                    legacy_messages.ClassInput(name=klass),
                    id=class_workflow_id(klass),
                    task_queue=queue,
                    start_signal="update_class",
                    start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
                )
                pool: WorkflowHandle = await client.start_workflow(
                    "GPUNodePoolWorkflow",
                    legacy_pool.PoolInput(namespace="ml", name=name),
                    id=pool_workflow_id("ml", name),
                    task_queue=queue,
                    start_signal="update",
                    start_signal_args=[PoolUpdate(spec=pool_spec(klass, maxNodes=1), generation=1, node_class=CLASS)],
                )
                req = request(pool=name, pool_workflow_id=pool.id, class_workflow_id=class_handle.id)
                granted = await class_handle.execute_update("reserve", Reservation(node_id=req.workflow_id, pool=f"ml/{name}"), result_type=Grant)
                assert granted.granted
                old = legacy_node.NodeWorkflowInput(request=legacy_types.NodeRequest.model_validate(req.model_dump(mode="json")))
                node: WorkflowHandle = await client.start_workflow("GPUNodeWorkflow", old, id=req.workflow_id, task_queue=queue)

                async def pool_sees_it_ready() -> bool:
                    return bool((await pool.query("status"))["readyNodes"] == 1)

                await eventually(pool_sees_it_ready, timeout=60, what="31e9066's pool to see its node Ready")

        # Today's worker. The node's watch timer wakes it; the pool and class get news.
        await stack.enter_async_context(make_worker(client, activities, task_queue=queue))
        await pool.signal("demand", Demand(pods=[], observed_at=datetime.now(UTC)))
        await class_handle.signal("update_class", ClassUpdate(spec=CLASS, generation=2))
        for handle, mark in ((node, '"demand_since"'), (pool, '"resync_interval"'), (class_handle, '"resync_interval"')):
            first = await handed_over(temporal, handle.id, handle.first_execution_run_id or handle.result_run_id or "", mark)
            assert scheduled(first), "the first run is 31e9066's, replayed: it had done work"
            assert len(first.events) < legacy_node.HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW, "it handed over, not continued as new for its length"

        status = await eventually(lambda: ready_in(client.get_workflow_handle(pool.id)), timeout=60, what="today's pool to adopt the node")
        assert [n.workflow_id for n in status.nodes] == [req.workflow_id]
        assert req.workflow_id in (await client.get_workflow_handle(class_handle.id).query("budget"))["reservations"]

        await client.get_workflow_handle(node.id).signal(GPUNodeWorkflow.evict, EvictRequest(reason="manual"))
        final = NodeStatus.model_validate(await client.get_workflow_handle(node.id).result())
        assert final.phase is NodePhase.TERMINATED and world.cloud.live_instances() == []

        async def released() -> bool:
            return not (await client.get_workflow_handle(class_handle.id).query("budget"))["reservations"]

        await eventually(released, timeout=60, what="the node's reservation released on today's class")


async def ready_in(pool: WorkflowHandle) -> Any:
    status = await pool.query(GPUNodePoolWorkflow.status)
    return status if status.ready_nodes == 1 else None
