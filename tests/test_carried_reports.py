"""A node's launch, drain and terminate carry the report of the phase they begin (patch
`reports-carried-by-activities`, workflows.node): the pool learns Launching, Draining and
Terminating from the activity that begins the phase, which signals it while it works. Before,
each report was a local activity in the workflow task that scheduled the activity, and the task,
so the launch, the drain or the terminate, waited until the pool's signal was accepted (with 100
nodes idle at once, ~1 s more to their terminate calls: bench/results/findings.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import structlog.testing

from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.common import RetryPolicy
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from activities.node import REPORT_ATTEMPTS, REPORT_TRIES, ReportBatcher, _reports_in_flight, carrying, typed
from sim.world import sim_world
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_bridge import apply, bind, gpu_class, gpu_pool, pending_pod, ready_nodes, running_stack
from tests.test_watch_events import SignalsSent, local_activity, signals_received
from tgp.messages import NodeReport, NodeReports, PoolReport, pool_workflow_id
from tgp.types import DrainInput, InstanceRef, LaunchInput, LaunchResult, NodePhase, NodeStatus
from workers.main import WorkerConfig, build_activities
from workers.temporal import DATA_CONVERTER

# The activity that begins each phase a pool hears about.
# (a `life-v4` life terminates in `release_attempt`, which carries the report as `terminate_instance` does).
CARRIERS = {"launch_instance": NodePhase.LAUNCHING, "drain_node": NodePhase.DRAINING, "release_attempt": NodePhase.TERMINATING}


async def carried(handle: WorkflowHandle) -> tuple[dict[str, list[PoolReport | None]], list[str]]:
    """Per carrying activity scheduled in the node's history, the report each schedule carried
    (None: none); and the summaries of its local-activity markers."""
    reports: dict[str, list[PoolReport | None]] = {name: [] for name in CARRIERS}
    markers: list[str] = []
    async for event in handle.fetch_history_events():
        if (summary := local_activity(event)) is not None:
            markers.append(summary)
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name in CARRIERS:
                payloads = attrs.input.payloads
                report = (await DATA_CONVERTER.decode(payloads[1:2], [PoolReport | None]))[0] if len(payloads) > 1 else None  # type: ignore[list-item]
                reports[attrs.activity_type.name].append(report)
    return reports, markers


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

        reports, markers = await carried(handle)
        for name, phase in CARRIERS.items():
            assert reports[name], f"no {name} in the node's life"
            report = reports[name][0]
            assert report is not None, f"{name} carried no report"
            assert report.pool_workflow_id == pool_workflow_id("ml", "rtx") and report.report.phase is phase
            assert report.report.node_name == node["name"]
        told = [m for m in markers if m.startswith("report ")]
        assert not {f"report {phase.value}" for phase in CARRIERS.values()} & set(told), f"still reported by local activities: {told}"

        async def heard() -> list[NodePhase] | None:
            pool = s.env.client.get_workflow_handle(pool_workflow_id("ml", "rtx"))
            # Alone as `node_phase`, or with others made meanwhile as `node_phases`, in order.
            alone = await signals_received(pool, "node_phase", NodeReport)
            together = [r for batch in await signals_received(pool, "node_phases", NodeReports) for r in batch.reports]
            phases = [r.phase for r in sorted([*alone, *together], key=lambda r: r.at) if r.node_name == node["name"]]
            return phases if NodePhase.TERMINATED in phases else None

        phases = await eventually(heard, what="the node's reports in the pool's history")
        assert [p for p in phases if p in CARRIERS.values()] == [NodePhase.LAUNCHING, NodePhase.DRAINING, NodePhase.TERMINATING], phases


def test_a_task_scheduled_by_older_code_is_read_as_its_input() -> None:
    """Older code scheduled these activities with one argument, and Temporal's SDK decodes
    arguments by type only when their count matches the signature: that input comes as plain
    JSON values, and the activity reads it as its model."""
    ref = InstanceRef(provider="sim", instance_name="tgp-n-1", instance_id="i-1")
    assert typed(InstanceRef, ref.model_dump(mode="json")) == ref
    assert typed(InstanceRef, ref) is ref
    drain: dict[str, Any] = {"node_name": "n", "timeout": "PT5M"}
    assert typed(DrainInput, drain).node_name == "n"


@workflow.defn(name="OlderCodeSchedules", sandboxed=False)
class OlderCodeSchedules:
    """Schedules the carrying activities as code before the patch did: one argument each."""

    @workflow.run
    async def run(self, launch: LaunchInput) -> list[Any]:
        once = {"start_to_close_timeout": timedelta(seconds=20), "retry_policy": RetryPolicy(maximum_attempts=1)}
        bought = await workflow.execute_activity("launch_instance", launch, result_type=LaunchResult, **once)  # type: ignore[arg-type]
        drained = await workflow.execute_activity("drain_node", DrainInput(node_name=launch.node_name, timeout=timedelta(seconds=5)), **once)  # type: ignore[arg-type]
        ref = InstanceRef(provider=launch.offer.provider, instance_name=bought.instance.name, instance_id=bought.instance.instance_id)
        terminated = await workflow.execute_activity("terminate_instance", ref, **once)  # type: ignore[arg-type]
        return [bought.instance.instance_id, drained, terminated]


async def test_an_activity_scheduled_by_older_code_still_runs(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.05, kube_url=kube_api.url if not kube_api.real else None))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        queue = f"older-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(Worker(temporal.client, task_queue=queue, workflows=[OlderCodeSchedules], activities=activities.node.all()))
        offer = (await activities.node.providers["simulated"].list_offers())[0]
        launch = LaunchInput(node_name="older-1", attempt=1, offer=offer, tailnet_tags=["tag:tgp-node"])
        bought, drained, terminated = await temporal.client.execute_workflow(OlderCodeSchedules.run, launch, id=queue, task_queue=queue)
        assert world.cloud.instances[bought].status == "terminated" and terminated is True
    assert drained["remaining"] == [] and drained["terminating"] == []  # no Node: nothing to drain


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
    monkeypatch.setattr("activities.node.REPORT_WAIT", timedelta(milliseconds=50))
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


# --- reports to one pool go together ------------------------------------------------------------


async def test_reports_made_together_reach_the_pool_together_and_each_is_taken(temporal: WorkflowEnvironment) -> None:
    """40 nodes of one pool report at once from one worker (as 100 idle nodes report Draining
    together): one signal is in flight at a time and the reports made meanwhile go with it or
    as the next, `node_phases`; the pool takes each as its own `node_phase` (all 40 Ready in its status). A
    report alone still goes as `node_phase`, which pools of earlier releases understand."""
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
    monkeypatch.setattr("activities.node.REPORT_PAUSE", 0.01)
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
