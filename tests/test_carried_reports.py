"""A node's launch, drain and terminate carry the report of the phase they begin: the activity
that begins the phase signals the pool while it works, so the launch, the drain or the terminate
never waits for the pool's signal to be accepted (with 100 nodes idle at once, a report made in
the workflow task cost their terminate calls ~1 s: bench/results/findings.md). Reports made
together by one worker reach the pool together."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import structlog.testing

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.http_wire import default_tls
from activities.node import REPORT_ATTEMPTS, REPORT_TRIES, ReportBatcher, _reports_in_flight, carrying, signal_report
from activities.node.reports import REPORT_GAP
from sim.world import sim_world
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_bridge import apply, bind, gpu_class, gpu_pool, pending_pod, ready_nodes, running_stack
from tests.test_launch_settles import quick_world
from tests.test_node_lifecycle import FAST, request, start, wait_phase
from tests.test_watch_events import SignalsSent, signals_received
from tgp.messages import NodeReport, NodeReports, PoolReport, pool_workflow_id
from tgp.types import LabelInput, NodePhase, NodeStatus
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow

# The phases a pool hears about from the activity that begins each (the end: from the drain
# whose release did every step).
CARRIED = [NodePhase.LAUNCHING, NodePhase.DRAINING, NodePhase.TERMINATING, NodePhase.TERMINATED]


async def test_the_pool_learns_each_phase_from_the_activity_that_begins_it(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx"))
        await pending_pod(s.kube, "train")
        [node] = await ready_nodes(s, "ml", "rtx", 1)
        await bind(s.kube, "train", node["name"], real=s.world.kube is None)
        (await s.kube.delete("/api/v1/namespaces/ml/pods/train")).raise_for_status()
        handle = s.env.client.get_workflow_handle(node["workflowId"], result_type=NodeStatus)
        assert (await handle.result()).phase is NodePhase.TERMINATED

        async def heard() -> list[NodePhase] | None:
            pool = s.env.client.get_workflow_handle(pool_workflow_id("ml", "rtx"))
            # Alone as `node_phase`, or with others made meanwhile as `node_phases`, in order.
            alone = await signals_received(pool, "node_phase", NodeReport)
            together = [r for batch in await signals_received(pool, "node_phases", NodeReports) for r in batch.reports]
            phases = [r.phase for r in sorted([*alone, *together], key=lambda r: r.at) if r.node_name == node["name"]]
            return phases if NodePhase.TERMINATED in phases else None

        phases = await eventually(heard, what="the node's reports in the pool's history")
        assert [p for p in phases if p in CARRIED] == CARRIED, phases
        # The end was told once, by the drain's activity: no local activity after it.
        events = [e async for e in handle.fetch_history_events()]
        drained = max(i for i, e in enumerate(events) if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)
        assert not [e for e in events[drained:] if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED], "the end was reported again"
        # Ready was told by the launch's activity, which found the Node up and labelled it.
        local = [e.user_metadata.summary.data.decode() for e in events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
        assert not [x for x in local if "label" in x], local


# --- `carrying` itself: who sends, how long the activity waits, what never reaches it ----------


REPORT = PoolReport(
    pool_workflow_id="gpupool/ml/no-such-pool",
    report=NodeReport(workflow_id="gpunode/ml/no-such-pool/n", node_name="n", phase=NodePhase.TERMINATING, at=datetime(2026, 1, 1, tzinfo=timezone.utc)),
)


def signals(sent: SignalsSent) -> list[str]:
    return [name for _, name, _ in sent.sent]


async def carried_by(temporal: WorkflowEnvironment, signalling: SignalsSent, *, attempt: int = 1) -> str:
    """Run a block under `carrying(REPORT)` in an activity of attempt `attempt`; its result."""
    env = ActivityEnvironment(client=Client(**{**temporal.client.config(), "interceptors": [signalling]}))
    env.info = dataclasses.replace(env.info, attempt=attempt)

    async def work() -> str:
        async with carrying(REPORT, ReportBatcher()):
            return "done"

    return await env.run(work)


async def test_the_first_attempts_send_the_report_and_a_retry_past_them_does_not(temporal: WorkflowEnvironment) -> None:
    for attempt, sends in ((1, 1), (REPORT_ATTEMPTS, 1), (REPORT_ATTEMPTS + 1, 0), (30, 0)):
        signalling = SignalsSent()
        assert await carried_by(temporal, signalling, attempt=attempt) == "done"
        assert signals(signalling) == ["node_phase"] * sends, (attempt, signalling.sent)


async def test_a_report_that_does_not_go_through_never_holds_or_fails_its_activity(temporal: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("activities.node.reports.REPORT_WAIT", timedelta(milliseconds=50))
    hanging = SignalsSent(gate=asyncio.Event())  # never set: the pool never answers
    assert await asyncio.wait_for(carried_by(temporal, hanging), 5) == "done"  # not held by a pool that does not answer
    assert signals(hanging) == ["node_phase"]
    for task in list(_reports_in_flight):  # the hanging send, left to finish on its own: end it
        task.cancel()
    broken = SignalsSent(fail=RuntimeError("not an RPC error"))
    with structlog.testing.capture_logs() as logs:
        assert await carried_by(temporal, broken) == "done"
        await asyncio.wait_for(asyncio.gather(*_reports_in_flight, return_exceptions=True), 10)
    assert signals(broken) == ["node_phase"]  # not tried again: only RPC errors are
    assert [(e["event"], e["status"]) for e in logs if e["event"] == "report_not_sent"] == [("report_not_sent", "RuntimeError")]  # logged, not raised


async def test_a_drain_that_goes_terminates_its_node_without_waiting_for_its_draining_report(
    temporal: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Draining report a drain carries is waited for at the activity's end, not before the
    release it goes on to: a pool slow to take the report does not hold the node's terminate (100
    nodes idle at once: 0.3-1 s of each terminate call, the pool's reports queued behind each
    other). Here the pool never takes it while the test looks, and the wait could last a minute."""
    monkeypatch.setattr("activities.node.reports.REPORT_WAIT", timedelta(seconds=60))
    signalling = SignalsSent()
    async with AsyncExitStack() as stack:
        world, activities = await quick_world(stack)
        activities.node.reports.gap = 0  # the Draining report goes as soon as it is made, not at the end of the Ready one's gap
        client = Client(**{**temporal.client.config(), "interceptors": [signalling]})
        queue = f"test-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(client, activities, task_queue=queue))
        req = request(timeouts=FAST, pool_workflow_id=pool_workflow_id("ml", "no-such-pool"))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)

        def reported(phase: NodePhase) -> bool:
            sent = [r for _, name, arg in signalling.sent for r in (arg.reports if name == "node_phases" else [arg])]
            return any(r.phase is phase for r in sent)

        async def ready_reported() -> bool | None:
            return reported(NodePhase.READY) or None

        await eventually(ready_reported, what="the Ready report")
        signalling.gate = asyncio.Event()  # from now on no report goes through
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await asyncio.wait_for(world.cloud.delete_arrived.wait(), 30)
        assert reported(NodePhase.DRAINING), "the drain's report was sent (and is still waiting for the pool)"
        signalling.gate.set()
        final: NodeStatus = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED, final


# --- reports to one pool go together ------------------------------------------------------------


async def test_reports_made_together_reach_the_pool_together_and_each_is_taken(temporal: WorkflowEnvironment) -> None:
    """40 nodes of one pool report at once from one worker (as 100 idle nodes report Draining
    together): one signal is in flight at a time and the reports made meanwhile go with it or
    as the next, `node_phases`; the pool takes each as its own `node_phase` (all 40 Ready in its status). A
    report alone goes as `node_phase`."""
    from tests.test_pool_accounting import CLASS, pool_spec
    from tgp.messages import PoolUpdate
    from workflows.pool import GPUNodePoolWorkflow, PoolInput

    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.05))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        queue, name = f"reports-{uuid.uuid4().hex[:8]}", f"p-{uuid.uuid4().hex[:6]}"
        from workers.main import make_worker

        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        pool = await temporal.client.start_workflow(
            GPUNodePoolWorkflow.run,
            # A long visibility lag: the pool keeps the reported nodes, whose workflows do not run.
            PoolInput(namespace="ml", name=name, visibility_lag=timedelta(minutes=10)),
            id=pool_workflow_id("ml", name),
            task_queue=queue,
            start_signal="update",
            start_signal_args=[PoolUpdate(spec=pool_spec("cls"), generation=1, node_class=CLASS)],
        )
        stack.push_async_callback(pool.terminate, "test over")
        at = datetime.now(timezone.utc)

        def report(i: int) -> PoolReport:
            node = f"{name}-n{i:02}"
            return PoolReport(
                pool_workflow_id=pool.id,
                report=NodeReport(workflow_id=f"gpunode/ml/{name}/{node}", node_name=node, phase=NodePhase.READY, at=at),
            )

        signalling = SignalsSent()
        env = ActivityEnvironment(client=Client(**{**temporal.client.config(), "interceptors": [signalling]}))
        batcher = ReportBatcher()
        from activities.node import signal_report

        async def together() -> list[bool]:
            return list(await asyncio.gather(*(signal_report(report(i), batcher) for i in range(40))))

        sent = await env.run(together)
        assert sent == [True] * 40
        names = signals(signalling)
        assert set(names) == {"node_phases"} and len(names) <= 2, names
        carried = [r.workflow_id for _, _, batch in signalling.sent for r in batch.reports]
        assert carried == [report(i).report.workflow_id for i in range(40)], "every report once, in the order made"

        async def all_ready() -> bool:
            status = await pool.query(GPUNodePoolWorkflow.status)
            return status.ready_nodes == 40

        await eventually(all_ready, timeout=30, what="the pool to take all 40 reports")
        assert await env.run(signal_report, report(40), batcher) is True
        assert signals(signalling)[-1] == "node_phase"


async def test_a_report_whose_signal_hangs_is_tried_again(temporal: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's signal that outlasts the batcher's timeout (the client's own retries included)
    is given up, and the report is tried again, as one the server refused: each try a signal."""
    monkeypatch.setattr("activities.node.reports.REPORT_PAUSE", 0.01)
    hanging = SignalsSent(gate=asyncio.Event())  # never set: the pool never answers
    env = ActivityEnvironment(client=Client(**{**temporal.client.config(), "interceptors": [hanging]}))
    batcher = ReportBatcher()
    batcher.timeout = 0.05

    async def work() -> None:
        async with carrying(REPORT, batcher):
            pass
        await asyncio.wait_for(asyncio.gather(*_reports_in_flight, return_exceptions=True), 10)

    with structlog.testing.capture_logs() as logs:
        await env.run(work)
    assert signals(hanging) == ["node_phase"] * REPORT_TRIES
    assert [e["status"] for e in logs if e["event"] == "report_not_sent"] == ["TimeoutError"]


async def test_a_launch_past_the_reporting_attempts_leaves_the_labels_and_ready_to_the_workflow() -> None:
    """An attempt past REPORT_ATTEMPTS sends no report: the launch's retry does not label the Node
    either (its `label_on_join` says no), so the workflow labels it and tells the pool Ready."""
    async with AsyncExitStack() as stack:
        world, activities = await quick_world(stack)
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            (await kube.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": "late"}})).raise_for_status()
            labels = LabelInput(node_name="late", labels={"tgp.io/pool": "rtx"}, taints=[])
            env = ActivityEnvironment()
            env.info = dataclasses.replace(env.info, attempt=REPORT_ATTEMPTS + 1)
            assert not await env.run(activities.node.label_on_join, labels, REPORT)
            assert "tgp.io/pool" not in (await kube.get("/api/v1/nodes/late")).json()["metadata"].get("labels", {})
            env.info = dataclasses.replace(env.info, attempt=1)
            assert await env.run(activities.node.label_on_join, labels, REPORT)
            assert (await kube.get("/api/v1/nodes/late")).json()["metadata"]["labels"]["tgp.io/pool"] == "rtx"



async def test_reports_made_within_the_gap_after_a_signal_wait_for_it_and_go_together(temporal: WorkflowEnvironment) -> None:
    """A pool's nodes coming Ready one after another (a burst): a report goes at once, those made
    within REPORT_GAP after its signal wait for the gap's end and go as one signal. Each signal
    is a workflow task of the pool's, a pass over all its nodes (issue 37)."""
    signalling = SignalsSent()
    env = ActivityEnvironment(client=Client(**{**temporal.client.config(), "interceptors": [signalling]}))
    batcher = ReportBatcher()
    assert batcher.gap == REPORT_GAP.total_seconds() > 0
    batcher.gap = 2.0  # wide: a loaded machine stays well within it
    pool = await temporal.client.start_workflow("NobodyListens", id=f"pool-{uuid.uuid4().hex[:8]}", task_queue=f"none-{uuid.uuid4().hex[:8]}")

    def report(i: int) -> PoolReport:
        return PoolReport(pool_workflow_id=pool.id, report=NodeReport(workflow_id=f"n{i}", node_name=f"n{i}", phase=NodePhase.READY, at=datetime.now(timezone.utc)))

    async def one_then_three() -> float:
        assert await signal_report(report(0), batcher) is True
        loop = asyncio.get_running_loop()
        began = loop.time()
        first = asyncio.ensure_future(signal_report(report(1), batcher))
        await asyncio.sleep(0.1)  # the next nodes come Ready a little later, well within the gap
        assert await asyncio.gather(first, *(signal_report(report(i), batcher) for i in (2, 3))) == [True] * 3
        return loop.time() - began

    try:
        waited = await env.run(one_then_three)
    finally:
        await pool.terminate("test over")
    assert signals(signalling) == ["node_phase", "node_phases"], "the three made within the gap went together"
    assert [r.workflow_id for r in signalling.sent[-1][2].reports] == ["n1", "n2", "n3"]
    assert waited >= batcher.gap - 0.05, waited
