"""Pool bookkeeping races (issue 9, item 5), each made deterministic by holding one of the
pool's activities until the test has delivered the signal that races it:

* Events a node report adds while the pool writes Events (the `emit_events` activity in flight)
  are written, also when the pool continues as new or is deleted right after that write.
* A node whose first phase report reaches the pool before the activity that started it
  returns still counts as the floor node it was bought as: a pool with minNodes: 1 buys one
  floor node, and the nodes bought for pods idle out.

The pool, class and node workflows run for real against the simulated world, on a worker
where the held activity is the real one behind a gate (the worker takes any set of activities,
as in tests/test_failover_and_crash.py). The node reports of the Event tests are the
`node_phase` signals a node workflow sends, sent by the test (tests/test_pool_accounting.py
does the same), so that each arrives exactly while the write it races is in flight. Nothing
waits on a clock: each step waits for the held call, or polls for what a user would see."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import httpx
import pytest
from temporalio import activity
from temporalio.client import WorkflowContinuedAsNewError, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tgp.events import EventSpec
from activities.node import DrainRelease
from tests.conftest import binary, eventually
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec, GPUNodePoolStatus
from tgp.messages import (
    EvictNodesInput,
    ClassInput,
    ClassUpdate,
    Demand,
    NodeReport,
    PoolReport,
    PoolUpdate,
    Reservation,
    StartNodeInput,
    StartNodeResult,
    StartNodesInput,
    StartNodesResult,
    class_workflow_id,
    pool_workflow_id,
)
from sim.world import SimWorld, sim_world
from tgp.pools import request_for
from workers.temporal import DATA_CONVERTER, search_attribute_keys
from tgp.types import DrainInput, DrainResult, NodePhase
from tgp.node import NodeWorkflowInput
from workers.main import Activities, WorkerConfig, build_activities, make_worker
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow, PoolInput

CLASS = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}})
# Temporal suggests continue-as-new past this many history events (its default is 4,096; the
# pool's own limit is 2,000). Above a pool's first passes; the Event test pushes past it.
SUGGEST_CONTINUE_AS_NEW_AT = 150
# Seconds any one held call or visible outcome may take on a busy machine (the first
# Kubernetes call of a process imports the client: seconds of a loaded CPU).
WAIT = 60.0


def pool_spec(class_name: str, **fields: object) -> GPUNodePoolSpec:
    return GPUNodePoolSpec.model_validate(
        {
            "nodeClassRef": {"name": class_name},
            "template": {"spec": {"requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}]}},
            **fields,
        }
    )


# --- holding an activity ---------------------------------------------------------------------


@dataclass
class Held:
    """One call of a held activity, waiting for `go()`."""

    arg: Any
    _go: asyncio.Event = field(default_factory=asyncio.Event)

    def go(self) -> None:
        self._go.set()


class Gate:
    """While `hold(arg)` says so, a call waits here until the test lets it go; `next()` gives
    the test the calls in the order they arrived."""

    def __init__(self) -> None:
        self.hold: Callable[[Any], bool] = lambda arg: False
        self._arrived: asyncio.Queue[Held] = asyncio.Queue()
        self._waiting: list[Held] = []

    async def passing(self, arg: Any) -> None:
        if not self.hold(arg):
            return
        held = Held(arg)
        self._waiting.append(held)
        self._arrived.put_nowait(held)
        await held._go.wait()

    async def next(self, what: str) -> Held:
        try:
            return await asyncio.wait_for(self._arrived.get(), WAIT)
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}") from None

    def open(self) -> None:
        """Hold nothing more and let every waiting call go (the end of a test included)."""
        self.hold = lambda arg: False
        for held in self._waiting:
            held.go()


@dataclass
class Gates:
    emit_events: Gate = field(default_factory=Gate)
    evict_nodes: Gate = field(default_factory=Gate)
    reserve_and_start_node: Gate = field(default_factory=Gate)  # held after the node workflow started (one pass per node of a batch)
    drain_node: Gate = field(default_factory=Gate)  # held before the drain begins, after a v5 drain's ask (heartbeating meanwhile)

    def open(self) -> None:
        for gate in (self.emit_events, self.evict_nodes, self.reserve_and_start_node, self.drain_node):
            gate.open()


class Gated:
    """Real activities (`inner.all()`), some replaced by gated versions of the same name."""

    def __init__(self, inner: Any, gated: list[Callable[..., Any]]) -> None:
        self.inner, self.gated = inner, {f.__name__: f for f in gated}

    def all(self) -> list[object]:
        return [self.gated.get(getattr(f, "__name__", ""), f) for f in self.inner.all()]


def gate_activities(activities: Activities, gates: Gates) -> Activities:
    """The worker's activities with emit_events, evict_nodes and reserve_and_start_node behind
    the test's gates (each calls the real one)."""
    pool, entity = activities.pool, activities.entity

    @activity.defn(name="emit_events")
    async def emit_events(events: list[EventSpec]) -> None:
        await gates.emit_events.passing(events)
        await entity.emit_events(events)

    @activity.defn(name="evict_nodes")
    async def evict_nodes(inp: EvictNodesInput) -> list[str]:
        await gates.evict_nodes.passing([*inp.workflow_ids, *(r.workflow_id for r in inp.may_start)])
        return await pool.evict_nodes(inp)

    @activity.defn(name="reserve_and_start_node")
    async def reserve_and_start_node(inp: StartNodeInput) -> StartNodeResult:
        result = await pool.reserve_and_start_node(inp)
        await gates.reserve_and_start_node.passing(inp)
        return result

    @activity.defn(name="reserve_and_start_nodes")
    async def reserve_and_start_nodes(inp: StartNodesInput) -> StartNodesResult:
        """A pool's batch (batched launches): each started node passes the same gate."""
        result = await pool.reserve_and_start_nodes(inp)
        for start, started in zip(inp.starts, result.results, strict=True):
            if started.started:
                req = request_for(inp.template, start)
                one = StartNodeInput(class_name=inp.class_name, reservation=Reservation(node_id=req.workflow_id, pool=inp.pool), request=req)
                await gates.reserve_and_start_node.passing(one)
        return result

    node = activities.node

    @activity.defn(name="drain_node")
    async def drain_node(inp: DrainInput, report: PoolReport | None = None, then: DrainRelease | None = None) -> DrainResult:
        if inp.ask is not None:  # a v5 drain asks the budgets first: held once allowed, as before
            answer = await node._ask_pool(inp.ask)
            if not answer.allowed:
                return DrainResult(evicted=0, answer=answer)
            inp = inp.model_copy(update={"ask": None})
        waiting = asyncio.ensure_future(gates.drain_node.passing(inp))
        while not waiting.done():
            activity.heartbeat()  # a held drain is alive: no heartbeat timeout retries it
            await asyncio.wait([waiting], timeout=1)
        return await node.drain_node(inp, report, then)

    return dataclasses.replace(
        activities,
        node=Gated(node, [drain_node]),  # type: ignore[arg-type]
        pool=Gated(pool, [evict_nodes, reserve_and_start_node, reserve_and_start_nodes]),  # type: ignore[arg-type]
        entity=Gated(entity, [emit_events]),  # type: ignore[arg-type]
    )


@dataclass
class Setup:
    env: WorkflowEnvironment
    world: SimWorld
    queue: str
    gates: Gates
    workflow_ids: set[str] = field(default_factory=set)

    async def end_workflows(self) -> None:
        for wid in sorted(self.workflow_ids):
            try:
                await self.env.client.get_workflow_handle(wid).terminate("test finished")
            except RPCError:
                pass  # it ended already


@asynccontextmanager
async def gated_world(env: WorkflowEnvironment) -> AsyncIterator[Setup]:
    """The simulated world and a worker on a fresh task queue whose pool and entity activities are gated."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        gates = Gates()
        queue = f"races-{uuid.uuid4().hex[:8]}"
        gated = gate_activities(activities, gates)
        await stack.enter_async_context(make_worker(env.client, gated, task_queue=queue))
        stack.callback(gates.open)  # runs before the worker stops: no call stays held
        setup = Setup(env, world, queue, gates)
        stack.push_async_callback(setup.end_workflows)  # a failed test leaves nothing running
        yield setup


# --- the pool, its signals and what a user sees -----------------------------------------------


async def start_pool(s: Setup, spec: GPUNodePoolSpec, **inp: Any) -> tuple[str, WorkflowHandle]:
    name = f"pool-{uuid.uuid4().hex[:6]}"
    handle = await s.env.client.start_workflow(
        GPUNodePoolWorkflow.run,
        PoolInput(namespace="ml", name=name, **inp),
        id=pool_workflow_id("ml", name),
        task_queue=s.queue,
        start_signal="update",
        start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=CLASS)],
    )
    s.workflow_ids.add(handle.id)
    return name, handle


async def start_class(s: Setup, name: str) -> WorkflowHandle:
    s.workflow_ids.add(class_workflow_id(name))
    return await s.env.client.start_workflow(
        GPUNodeClassWorkflow.run,
        ClassInput(name=name),
        id=class_workflow_id(name),
        task_queue=s.queue,
        start_signal="update_class",
        start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
    )


class Reports:
    """The `node_phase` signals node workflows of pool `pool` send, `second`s after `t0`."""

    def __init__(self, pool: str) -> None:
        self.pool, self.t0 = pool, datetime.now(timezone.utc)

    def of(self, node: str, phase: NodePhase, second: float, reason: str | None = None) -> NodeReport:
        return NodeReport(
            workflow_id=f"gpunode/ml/{self.pool}/{node}",
            node_name=node,
            phase=phase,
            provider="simulated",
            gpu_type="RTX4090",
            hourly_price=Decimal("0.35"),
            reason=reason,
            at=self.t0 + timedelta(seconds=second),
        )


async def pool_events(s: Setup, pool: str) -> list[tuple[str, str]]:
    """(reason, message) of the Kubernetes Events about the pool, as `kubectl describe` lists them."""
    async with httpx.AsyncClient(verify=default_tls(), base_url=s.world.kube_url) as kube:
        items = (await kube.get("/api/v1/namespaces/ml/events")).json()["items"]
    return [(e["reason"], e["message"]) for e in items if e["involvedObject"]["name"] == pool]


def about(events: list[tuple[str, str]], reason: str, node: str) -> bool:
    return any(r == reason and f"node {node} " in m for r, m in events)


def written(batch: list[EventSpec]) -> list[tuple[str, str]]:
    """(reason, message) of the Events one held `emit_events` call writes."""
    return [(e.reason, e.message) for e in batch]


async def status(handle: WorkflowHandle) -> GPUNodePoolStatus:
    return await handle.query(GPUNodePoolWorkflow.status)  # type: ignore[no-any-return]


def for_pool(name: str) -> Callable[[Any], bool]:
    """Hold the pool's own Event writes (not those of its class)."""
    return lambda events: any(e.ref.kind == "GPUNodePool" and e.ref.name == name for e in events)


# --- (a) Events written while more arrive ---------------------------------------------------


@pytest.fixture(scope="module")
async def suggests_early() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server that suggests continue-as-new after SUGGEST_CONTINUE_AS_NEW_AT events. The
    pool's own limit (2,000 events) is a constant of workflows/pool/state.py, which the workflow
    sandbox imports afresh: Temporal's suggestion is what a test can move."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        search_attributes=search_attribute_keys(),
        data_converter=DATA_CONVERTER,
        dev_server_log_level="error",
        dev_server_extra_args=["--dynamic-config-value", f"limit.historyCount.suggestContinueAsNew={SUGGEST_CONTINUE_AS_NEW_AT}"],
    )
    async with env:
        yield env


async def test_an_event_reported_during_the_last_write_before_continue_as_new_is_written(suggests_early: WorkflowEnvironment) -> None:
    async with gated_world(suggests_early) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        report = Reports(name).of
        first_run = pool.result_run_id

        s.gates.emit_events.hold = for_pool(name)
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.READY, 1))
        write = await s.gates.emit_events.next("the pool to write a's NodeReady Event")
        assert len(write.arg) == 1 and about(written(write.arg), "NodeReady", "a")
        assert (await pool.describe()).history_length < SUGGEST_CONTINUE_AS_NEW_AT / 2, "raise SUGGEST_CONTINUE_AS_NEW_AT"
        # While that write is in flight: the history grows past Temporal's suggestion (the
        # pool continues as new after this pass), and node b turns Ready.
        await _grow_history_past(pool, SUGGEST_CONTINUE_AS_NEW_AT)
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("b", NodePhase.READY, 2))
        write.go()

        last = await s.gates.emit_events.next("the pool to write b's NodeReady Event before it continues as new")
        assert len(last.arg) == 1 and about(written(last.arg), "NodeReady", "b")
        # While the last write before continue-as-new is in flight, node c turns Ready.
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("c", NodePhase.READY, 3))
        s.gates.open()  # that write goes on; nothing more is held

        with pytest.raises(WorkflowContinuedAsNewError):
            await s.env.client.get_workflow_handle(pool.id, run_id=first_run).result(follow_runs=False)
        # The new run hears of node d and writes its Event: every Event before it is written by then.
        latest = s.env.client.get_workflow_handle(pool.id)
        await latest.signal(GPUNodePoolWorkflow.node_phase, report("d", NodePhase.READY, 4))

        async def d_written() -> list[tuple[str, str]] | None:
            events = await pool_events(s, name)
            return events if about(events, "NodeReady", "d") else None

        events = await eventually(d_written, timeout=WAIT, what="node d's NodeReady Event from the new run")
        assert [n for n in "abcd" if about(events, "NodeReady", n)] == list("abcd"), (
            f"an Event reported while the last write before continue-as-new was in flight was lost: {events}"
        )
        assert {n.name for n in (await status(latest)).nodes} == set("abcd")


async def test_an_event_reported_during_the_last_write_of_a_deleted_pool_is_written(temporal: WorkflowEnvironment) -> None:
    async with gated_world(temporal) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        report = Reports(name).of
        for i, node in enumerate("ab"):
            await pool.signal(GPUNodePoolWorkflow.node_phase, report(node, NodePhase.READY, i))

        async def both_announced() -> bool:
            events = await pool_events(s, name)
            return about(events, "NodeReady", "a") and about(events, "NodeReady", "b")

        await eventually(both_announced, timeout=WAIT, what="the NodeReady Events of a and b")

        # The pool is deleted. While it evicts its nodes, a reports that it drained and ended.
        s.gates.evict_nodes.hold = lambda ids: True
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=pool_spec("cls-unused"), generation=1, node_class=CLASS, deleting=True))
        evict = await s.gates.evict_nodes.next("the pool to evict its nodes")
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.TERMINATED, 10, reason="pool deleted"))
        s.gates.emit_events.hold = for_pool(name)
        evict.go()  # no workflow of a or b runs (the test sent their reports): both count as ended

        last = await s.gates.emit_events.next("the pool's last Event write")
        assert len(last.arg) == 1 and about(written(last.arg), "NodeTerminated", "a")
        # While that write is in flight, b's last report arrives: its instance was lost.
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("b", NodePhase.INTERRUPTED, 11, reason="instance lost"))
        s.gates.open()  # that write goes on; nothing more is held

        await asyncio.wait_for(pool.result(), WAIT)  # the pool is gone; nothing is written after this
        events = await pool_events(s, name)
        assert about(events, "NodeTerminated", "a")
        assert about(events, "NodeInterrupted", "b"), f"the Event reported during the deleted pool's last write was lost: {events}"


async def test_a_deleted_pool_evicts_its_nodes_before_writing_the_events_reported_meanwhile(temporal: WorkflowEnvironment) -> None:
    """A pass writes the Events it has once: reports that arrive during the write wait for the
    next pass, which sees the deletion first. Before, a pass wrote until none was left, and a
    100-node pool's reports kept it writing while its nodes billed (15 s, 4 minutes loaded)."""
    async with gated_world(temporal) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        report = Reports(name).of
        s.gates.emit_events.hold = for_pool(name)
        s.gates.evict_nodes.hold = lambda ids: True
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.READY, 1))
        write = await s.gates.emit_events.next("the pool to write a's NodeReady Event")

        # While that write is in flight: the pool is deleted and node b turns Ready (one more Event).
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=pool_spec("cls-unused"), generation=1, node_class=CLASS, deleting=True))
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("b", NodePhase.READY, 2))
        write.go()

        # b's Event would be the next write of the same pass (held: the pass would stop there).
        evict = await s.gates.evict_nodes.next("the pool to evict its nodes before writing b's Event")
        assert set(evict.arg) == {f"gpunode/ml/{name}/a", f"gpunode/ml/{name}/b"}
        s.gates.open()
        await asyncio.wait_for(pool.result(), WAIT)
        events = await pool_events(s, name)
        assert about(events, "NodeReady", "b"), f"b's Event was not written before the pool went: {events}"


async def test_new_settings_reach_every_node_of_a_large_pool(temporal: WorkflowEnvironment) -> None:
    """A pool with 40 Ready nodes whose idle timeout changes tells each of them once more, and
    its history grows by a few events per node told (one workflow task per node, as a pool
    adopting 1,000 nodes once did, is ~5 per node). The nodes here are reports only (no
    workflow runs): each signal fails, which the pool takes as a node that ended."""
    async with gated_world(temporal) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused", disruption={"idleTimeout": "1h"}))
        report = Reports(name).of
        nodes = [f"n{i:02d}" for i in range(40)]
        await asyncio.gather(*(pool.signal(GPUNodePoolWorkflow.node_phase, report(n, NodePhase.READY, 1)) for n in nodes))

        async def all_ready() -> bool:
            return len([n for n in (await status(pool)).nodes if n.phase == "Ready"]) == 40

        await eventually(all_ready, timeout=WAIT, what="the pool to record 40 Ready nodes")
        await eventually(lambda: _quiet(pool), timeout=WAIT, what="the pool to finish telling its nodes their first settings")
        before = (await pool.describe()).history_length

        changed = pool_spec("cls-unused", disruption={"idleTimeout": "2h"})
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=changed, generation=2, node_class=CLASS))
        await eventually(lambda: _signals_sent(pool, "update_timeouts", 80), timeout=WAIT, what="40 more update_timeouts signals")
        await eventually(lambda: _quiet(pool), timeout=WAIT, what="the pool to finish")
        grown = (await pool.describe()).history_length - before
        assert grown < 4 * len(nodes), f"{grown} history events to tell {len(nodes)} nodes their new settings"


async def _signals_sent(pool: WorkflowHandle, name: str, count: int) -> bool:
    events = (await pool.fetch_history()).events
    sent = [e for e in events if e.HasField("signal_external_workflow_execution_initiated_event_attributes")]
    return sum(1 for e in sent if e.signal_external_workflow_execution_initiated_event_attributes.signal_name == name) >= count


async def _quiet(pool: WorkflowHandle) -> bool:
    """No workflow task, activity or signal of the pool's is in flight."""
    d = (await pool.describe()).raw_description
    last = (await pool.fetch_history()).events[-1]
    return not d.pending_activities and not d.HasField("pending_workflow_task") and last.HasField("timer_started_event_attributes")


async def _grow_history_past(pool: WorkflowHandle, events: int) -> None:
    """Signals that change nothing (the pool as it is) until the run's history is past `events`."""
    same = PoolUpdate(spec=pool_spec("cls-unused"), generation=1, node_class=CLASS)
    while (await pool.describe()).history_length <= events:
        await asyncio.gather(*(pool.signal(GPUNodePoolWorkflow.update, same) for _ in range(25)))


# --- (b) the floor node's first report ---------------------------------------------------------


async def test_a_floor_node_reporting_before_its_start_returns_stays_the_only_floor_node(temporal: WorkflowEnvironment) -> None:
    async with gated_world(temporal) as s:
        klass = f"floor-{uuid.uuid4().hex[:6]}"
        await start_class(s, klass)
        spec = pool_spec(klass, minNodes=1, disruption={"idleTimeout": "1s", "drainTimeout": "10s"})
        s.gates.reserve_and_start_node.hold = lambda inp: True
        name, pool = await start_pool(s, spec, watch_interval=timedelta(seconds=0.2))

        # The floor node's workflow runs and reports Pending; the start activity has not returned.
        start = await s.gates.reserve_and_start_node.next("the floor node's start")
        floor_id = start.arg.reservation.node_id
        s.workflow_ids.add(floor_id)

        async def reported() -> bool:
            return any(n.workflow_id == floor_id for n in (await status(pool)).nodes)

        await eventually(reported, timeout=WAIT, what="the floor node's first report to reach the pool")
        s.gates.open()  # now the start returns, and later starts are not held

        await eventually(lambda: _ready(pool, 1), timeout=WAIT, what="the floor node to be Ready")
        # Two pods wait: nodes are bought for them; they leave before binding.
        await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=["ml/train-0", "ml/train-1"], observed_at=datetime.now(timezone.utc)))
        bought = await eventually(lambda: _more_than(pool, 1), timeout=WAIT, what="nodes bought for the pods")
        s.workflow_ids.update(bought)
        await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=[], observed_at=datetime.now(timezone.utc)))

        floors = [wid for wid in bought if await _never_idles(s, wid)]
        assert floors == [floor_id], f"minNodes: 1 bought {len(floors)} floor nodes (no idle timeout): {floors}; the floor node is {floor_id}"

        async def only_the_floor_node_left() -> bool:
            nodes = (await status(pool)).nodes
            return [n.workflow_id for n in nodes] == [floor_id] and len(s.world.cloud.live_instances()) == 1

        await eventually(only_the_floor_node_left, timeout=WAIT, what="the nodes bought for the pods to idle out")


async def _ready(pool: WorkflowHandle, count: int) -> bool:
    return (await status(pool)).ready_nodes == count


async def _more_than(pool: WorkflowHandle, count: int) -> list[str] | None:
    nodes = (await status(pool)).nodes
    return [n.workflow_id for n in nodes if n.workflow_id] if len(nodes) > count else None


async def _never_idles(s: Setup, workflow_id: str) -> bool:
    """Whether the node workflow was started as a floor node: no idle timeout."""
    history = await s.env.client.get_workflow_handle(workflow_id).fetch_history()
    started = history.events[0].workflow_execution_started_event_attributes
    [inp] = await DATA_CONVERTER.decode(started.input.payloads, [NodeWorkflowInput])
    return inp.request.timeouts.idle is None  # type: ignore[no-any-return]
