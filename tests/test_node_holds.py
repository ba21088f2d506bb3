"""What holds a node, and what ends the hold.

* A node the pool bought for pods holds their place (bind grace) and ends that hold itself at
  its first workload pod (`hold_ends_when_busy`), unless the pool sent it settings since; the
  pool models the same rule and sends nothing when the pods bind on it.
* An idle (or expired) node's drain asks the pool's disruption budgets itself, first (only a
  budget that can refuse), and looks again for do-not-disrupt right after its cordon. A
  refusal touches nothing; the budget tests (tests/test_node_disruption.py) hold for it too.
* The watch keeps a timer that fires early rather than cancel it and start a later one.
* A release the provider holds up shows TerminationStuck, and still gives everything back.

Against the simulated world over HTTP, the real bridge and the Temporal dev server."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from contextlib import AsyncExitStack
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import httpx
import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.http_wire import default_tls
from sim.cloud import SimOffer
from sim.world import sim_world

from tests.conftest import eventually, running_world
from tests.kube_env import KubeApi
from tests.test_bridge import POOLS, Stack, apply, bind, gpu_class, gpu_pool, pending_pod, ready_nodes, running_stack
from tests.test_life_events import SHORT
from tests.test_launch_settles import ledger_of, reserved_node, start_as_the_pool
from tests.test_node_lifecycle import assert_nothing_left, request, wait_phase
from tests.test_node_long_lived import put_pod, remove_pod
from tests.test_watch_events import bridge_running, signals_received, told
from tests.test_entities_heal import start_class, start_pool
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.crds import GPUNodePoolStatus
from tgp.messages import Demand
from tgp.node import NodeWorkflowInput
from tgp.types import DisruptionAsk, DrainInput, DrainResult, NodePhase, NodeStatus, PoolAsk, Stage, TimeoutsUpdate
from workers.main import WorkerConfig, build_activities, make_worker
from workers.temporal import DATA_CONVERTER
from workflows.node import GPUNodeWorkflow
from workflows.pool import GPUNodePoolWorkflow

pytestmark = pytest.mark.timeout(300)

# The pool's bind grace, as the pool starts its nodes with it: far past the test's idle timeout.
HOLD = timedelta(minutes=3)
def held_request(**overrides: Any) -> Any:
    """A pool's node bought for pods: it holds their place for HOLD after Ready, and may end
    that hold itself at its first pod (as the pool's batched starts ask)."""
    return request(
        timeouts=SHORT.model_copy(update={"bind_grace": HOLD}),
        pool_workflow_id="gpupool/ml/no-such-pool",
        hold_ends_when_busy=True,
        **overrides,
    )


async def timers_between(handle: WorkflowHandle, first: int, second: int) -> list[str]:
    """The timer events between the node's `first` and `second` node_facts signals (1-based)."""
    seen, found = 0, []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED and event.workflow_execution_signaled_event_attributes.signal_name == "node_facts":
            seen += 1
        elif first <= seen < second and event.event_type in (EventType.EVENT_TYPE_TIMER_STARTED, EventType.EVENT_TYPE_TIMER_CANCELED):
            found.append(EventType.Name(event.event_type))
    return found


async def drain_inputs(handle: WorkflowHandle) -> list[DrainInput]:
    found = []
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attrs = event.activity_task_scheduled_event_attributes
            if attrs.activity_type.name == "drain_node":
                found.append((await DATA_CONVERTER.decode(attrs.input.payloads[:1], [DrainInput]))[0])
    return found


async def last_timer(handle: WorkflowHandle) -> timedelta:
    """The duration of the last timer the node started."""
    last = None
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            last = event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta()
    assert last is not None, "no timer started"
    return last


async def test_a_node_ends_its_hold_at_its_first_pod_and_asks_its_budget_in_the_drain(temporal: WorkflowEnvironment) -> None:
    """A pool's node bought for pods (hold HOLD) runs one pod: once that pod is gone it idles
    out after its idle timeout, not HOLD after Ready, with no settings from the pool. The pod's
    arrival moves the next deadline later: the timer is kept (no cancel, no new timer). The
    idle end asks the pool's budgets inside the drain."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        req = held_request()
        handle = await start_as_the_pool(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY, timeout=90)
        before = len(await signals_received(handle, "node_facts", object))
        await put_pod(world, req.node_name, "job")
        await told(handle, busy_pods=1)
        await remove_pod(world, "job")
        await told(handle, busy_pods=0)
        # Ends after the idle timeout (2 s), far before the hold (3 minutes) would let it.
        status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status
        assert not await signals_received(handle, "update_timeouts", TimeoutsUpdate)

        busy = before + 1  # the signal that told the node of its pod
        assert await timers_between(handle, busy, busy + 1) == [], "the pod's arrival cancelled the watch's timer"
        [drained] = await drain_inputs(handle)
        assert drained.ask is not None and drained.ask.ask.reason == "Empty" and drained.holds, drained


async def test_a_node_the_pool_sent_settings_keeps_the_pools_hold(temporal: WorkflowEnvironment) -> None:
    """Settings the pool sent after the start (its pods still wait) are the pool's word: the
    node's first pod no longer ends the hold, and once idle it sleeps until the hold's end."""
    async with running_world(temporal) as (world, _, queue), bridge_running(temporal, world, queue):
        req = held_request()
        handle = await start_as_the_pool(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY, timeout=90)
        t = req.timeouts
        await handle.signal(GPUNodeWorkflow.update_timeouts, TimeoutsUpdate(idle=t.idle, drain=t.drain, expire_after=t.expire_after, hold=HOLD))
        await put_pod(world, req.node_name, "job")
        await told(handle, busy_pods=1)
        await remove_pod(world, "job")
        await told(handle, busy_pods=0)

        async def sleeps_for_the_hold() -> bool:
            return await last_timer(handle) > timedelta(minutes=1)

        await eventually(sleeps_for_the_hold, what="the idle node's watch to sleep until the pool's hold ends")
        assert (await handle.query(GPUNodeWorkflow.status)).phase is NodePhase.READY
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await asyncio.wait_for(handle.result(), 90)).phase is NodePhase.TERMINATED


async def a_node_for_a_pod(s: Stack, **disruption: Any) -> tuple[dict[str, Any], WorkflowHandle]:
    """Through the bridge: pool ml/rtx (idle timeout 2 s) buys a node for pending pod "train";
    the node once Ready (as the pool's status has it), and its workflow."""
    await apply(s.kube, gpu_class())
    await apply(s.kube, gpu_pool("rtx", disruption={"idleTimeout": "2s", "drainTimeout": "10s", **disruption}))
    await pending_pod(s.kube, "train")
    [node] = await ready_nodes(s, "ml", "rtx", 1)
    return node, s.env.client.get_workflow_handle(node["workflowId"], result_type=NodeStatus)


async def test_the_pool_sends_no_settings_to_a_node_whose_pod_bound_on_it(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """Through the bridge: a pending pod gets a node, the pool hears it Ready (carried by the
    labels' call), the pod binds on it and runs while the pool looks; the pool then sends the
    node nothing (its nomination ended, and the node ended its hold itself at the pod), and once
    the pod is gone the node idles out after the pool's idle timeout."""
    async with running_stack(temporal, kube_api) as s:
        node, handle = await a_node_for_a_pod(s)
        pool = s.env.client.get_workflow_handle("gpunodepool/ml/rtx")
        await bind(s.kube, "train", node["name"], real=s.world.kube is None)
        await told(handle, busy_pods=1)

        async def pool_saw_it_bound() -> bool:
            # A pool pass (a completed workflow task) after a demand that shows the pod on it.
            shown = False
            async for event in pool.fetch_history_events():
                if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
                    attrs = event.workflow_execution_signaled_event_attributes
                    if attrs.signal_name == "demand":
                        demand = (await DATA_CONVERTER.decode(attrs.input.payloads[:1], [dict]))[0]
                        shown = bool((demand.get("bound_gpus") or {}).get(node["name"]))
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and shown:
                    return True
            return False

        await eventually(pool_saw_it_bound, timeout=60, what="a pool pass that saw the pod bound on the node")
        (await s.kube.delete("/api/v1/namespaces/ml/pods/train")).raise_for_status()
        status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status
        assert not await signals_received(handle, "update_timeouts", TimeoutsUpdate), "the pool sent the node its settings again"


async def test_a_node_the_pool_sent_settings_to_is_released_by_the_pool(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """The pool changes its idle timeout while the node's pod still waits: it sends the node
    its settings (with the hold), and from then on it, not the node's first pod, says when the
    hold ends. Once the pod bound on the node, the pool sends the hold's end; the pod gone, the
    node idles out after the idle timeout, not the bind grace (3 minutes).

    The change comes while the instance still boots (held by the simulated cloud): on a real
    control plane the kube-scheduler binds the pod the moment its node is Ready."""
    async with running_stack(temporal, kube_api) as s:
        s.world.cloud.hold_boots()
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx", disruption={"idleTimeout": "2s", "drainTimeout": "10s"}))
        await pending_pod(s.kube, "train")

        async def bought() -> str | None:
            nodes = (await s.pool_status("ml", "rtx")).get("nodes") or []
            return nodes[0]["workflowId"] if nodes else None

        handle = s.env.client.get_workflow_handle(await eventually(bought, what="the pool's node for the pod"), result_type=NodeStatus)
        patch = {"spec": {"disruption": {"idleTimeout": "3s", "drainTimeout": "10s"}}}
        merge = {"Content-Type": "application/merge-patch+json"}
        (await s.kube.patch(f"{POOLS.format(ns='ml')}/rtx", json=patch, headers=merge)).raise_for_status()

        async def sent_with_the_hold() -> bool:
            return any(u.hold for u in await signals_received(handle, "update_timeouts", TimeoutsUpdate))

        await eventually(sent_with_the_hold, timeout=60, what="the pool's new settings, with the hold, sent to the node")
        s.world.cloud.release_boots()
        [node] = await ready_nodes(s, "ml", "rtx", 1)
        await bind(s.kube, "train", node["name"], real=s.world.kube is None)
        await told(handle, busy_pods=1)

        async def hold_ended() -> bool:
            sent = await signals_received(handle, "update_timeouts", TimeoutsUpdate)
            return bool(sent) and sent[-1].hold == timedelta(0)

        await eventually(hold_ended, timeout=60, what="the pool to end the node's hold once its pod bound")
        (await s.kube.delete("/api/v1/namespaces/ml/pods/train")).raise_for_status()
        status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
        assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status


@pytest.mark.parametrize("attempt", [1, 2])
async def test_a_drain_asks_the_budget_on_its_first_attempt_only(temporal: WorkflowEnvironment, attempt: int) -> None:
    """The drain of a voluntary end asks its pool first. A pool whose budget allows no
    disruption refuses the first attempt, which touches nothing (the Node stays schedulable).
    A retry of the drain holds its first attempt's grant (it may have cordoned and evicted
    already): it does not ask again, and drains."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.05))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        queue, name = f"drain-ask-{uuid.uuid4().hex[:8]}", f"p-{uuid.uuid4().hex[:6]}"
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        pool = await start_pool(temporal, queue, name, pool_spec("cls", disruption={"idleTimeout": "1h", "budgets": [{"nodes": "0"}]}))
        stack.push_async_callback(pool.terminate, "test over")
        node = f"gpu-{uuid.uuid4().hex[:6]}"
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            (await kube.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})).raise_for_status()
            ask = PoolAsk(pool_workflow_id=pool.id, ask=DisruptionAsk(workflow_id=f"gpunode/ml/{name}/{node}", node_name=node, reason="Empty"))
            env = ActivityEnvironment(client=temporal.client)
            env.info = dataclasses.replace(env.info, attempt=attempt, heartbeat_timeout=timedelta(seconds=30))
            inp = DrainInput(node_name=node, timeout=timedelta(seconds=10), revalidate=True, ask=ask, holds=True)
            result: DrainResult = await env.run(activities.node.drain_node, inp)
            cordoned = bool((await kube.get(f"/api/v1/nodes/{node}")).json()["spec"].get("unschedulable"))
        if attempt == 1:
            assert result.answer is not None and not result.answer.allowed and "0" in result.answer.message, result
            assert not cordoned, "a refused drain cordoned the Node"
        else:
            assert result.answer is None and cordoned, result


@pytest.mark.parametrize("pods", [1, 2])
async def test_only_a_node_bought_for_one_pod_ends_its_hold_itself(temporal: WorkflowEnvironment, pods: int) -> None:
    """The pool buys one node for `pods` 1-GPU pods (a 2-GPU offer is the cheapest per GPU, so
    two pods share one node). Bought for one pod, the node ends its hold itself at its first
    pod; bought for two, it keeps it until the pool says: the pool cannot tell which of them
    bound there, and the node must not idle out while the other still waits."""
    catalog = (
        SimOffer("rtx4090-us-east", "RTX4090", "us-east", Decimal("0.44")),
        SimOffer("rtx4090x2-us-east", "RTX4090", "us-east", Decimal("0.60"), gpu_count=2),
    )
    async with running_world(temporal, catalog=catalog) as (_, _, queue):
        klass, name = f"hold-{uuid.uuid4().hex[:6]}", f"pool-{uuid.uuid4().hex[:6]}"
        class_run = await start_class(temporal, queue, klass, CLASS)
        pool = await start_pool(temporal, queue, name, pool_spec(klass, disruption={"idleTimeout": "1h"}))
        try:
            await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=[f"ml/train-{i}" for i in range(pods)], observed_at=datetime.now(timezone.utc)))

            async def started() -> list[str] | None:
                status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
                return [n.workflow_id for n in status.nodes] or None

            [wid] = await eventually(started, timeout=60, what="the pool's node")
            first = (await temporal.client.get_workflow_handle(wid).fetch_history()).events[0]
            [inp] = await DATA_CONVERTER.decode(first.workflow_execution_started_event_attributes.input.payloads, [NodeWorkflowInput])
            assert inp.request.requirements.min_gpu_count == pods, inp.request.requirements
            assert inp.request.timeouts.bind_grace is not None
            assert inp.request.hold_ends_when_busy is (pods == 1), inp.request
            await temporal.client.get_workflow_handle(wid).signal(GPUNodeWorkflow.evict, {"reason": "test over"})
        finally:
            await pool.terminate("test over")
            await class_run.terminate("test over")


async def test_a_stuck_release_shows_termination_stuck_and_gives_the_class_its_place_back_once(temporal: WorkflowEnvironment) -> None:
    """The provider refuses terminates for a while (the threshold is 1 s): the release says it
    is stuck, the node shows TerminationStuck, and its release made again terminates the
    instance, cleans up and gives the class ledger its place back, once."""
    async with running_world(temporal) as (world, _, queue):
        class_run, req = await reserved_node(temporal, queue, None)
        req = req.model_copy(update={"timeouts": req.timeouts.model_copy(update={"termination_stuck": timedelta(seconds=1)})})
        handle = await start_as_the_pool(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY, timeout=90)
        world.cloud.fail_deletes(3 * 3)  # three Temporal attempts (1 s, 2 s apart) fail
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED and any(r.stage is Stage.TERMINATION_STUCK for r in final.stages), final.stages
        assert world.cloud.live_instances() == []
        assert_nothing_left(world, req.node_name)
        assert req.workflow_id not in (await ledger_of(temporal, req.node_class)).reservations
        await class_run.terminate("test finished")


async def idle_drain_of(s: Stack, node: dict[str, Any], handle: WorkflowHandle) -> DrainInput:
    """Pod "train" binds on the node, runs and is deleted: the node idles out; its one drain."""
    await bind(s.kube, "train", node["name"], real=s.world.kube is None)
    await told(handle, busy_pods=1)
    (await s.kube.delete("/api/v1/namespaces/ml/pods/train")).raise_for_status()
    status: NodeStatus = await asyncio.wait_for(handle.result(), 90)
    assert status.phase is NodePhase.TERMINATED and (status.end_reason or "").startswith("idle"), status
    [drained] = await drain_inputs(handle)
    return drained


@pytest.mark.parametrize("budgets", [[{"nodes": "100%"}], None], ids=["budget-100%", "default-budget"])
async def test_a_drain_asks_only_a_budget_that_can_refuse(temporal: WorkflowEnvironment, kube_api: KubeApi, budgets: Any) -> None:
    """Through the bridge: a pool whose one budget allows 100% of its nodes can never refuse an
    idle node (tgp.disruption.unlimited_reasons); the node knows it from its start and its drain
    begins without asking, while still looking for do-not-disrupt after the cordon. The default
    budget (10%) can refuse: the drain asks it."""
    async with running_stack(temporal, kube_api) as s:
        node, handle = await a_node_for_a_pod(s, **({"budgets": budgets} if budgets is not None else {}))
        drained = await idle_drain_of(s, node, handle)
        assert drained.holds, drained
        if budgets is None:
            assert drained.ask is not None and drained.ask.ask.reason == "Empty", drained
        else:
            assert drained.ask is None, f"asked a budget that cannot refuse: {drained}"


async def test_a_node_hears_when_its_budgets_can_refuse_again(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """The pool's budgets change while its node runs, and nothing else: from 100% (its drains
    would not ask) to 10%. The pool sends the node its settings without the unlimited reasons,
    and its idle drain asks again. Budgets changed back to 100% are sent too."""
    async with running_stack(temporal, kube_api) as s:
        node, handle = await a_node_for_a_pod(s, budgets=[{"nodes": "100%"}], idleTimeout="1h")
        merge = {"Content-Type": "application/merge-patch+json"}

        async def set_disruption(**disruption: Any) -> None:
            patch = {"spec": {"disruption": disruption}}
            (await s.kube.patch(f"{POOLS.format(ns='ml')}/rtx", json=patch, headers=merge)).raise_for_status()

        async def sent(count: int) -> TimeoutsUpdate | None:
            received = await signals_received(handle, "update_timeouts", TimeoutsUpdate)
            return received[-1] if len(received) >= count else None

        await set_disruption(budgets=[{"nodes": "10%"}])
        limited = await eventually(lambda: sent(1), timeout=60, what="the 10% budget sent to the node")
        assert limited.unlimited_reasons is None and limited.idle == timedelta(hours=1), limited
        await set_disruption(budgets=[{"nodes": "100%"}])
        freed = await eventually(lambda: sent(2), timeout=60, what="the 100% budget sent to the node")
        assert "Empty" in (freed.unlimited_reasons or []), freed
        await set_disruption(budgets=[{"nodes": "10%"}], idleTimeout="2s")
        await eventually(lambda: sent(3), timeout=60, what="the 10% budget sent again")
        drained = await idle_drain_of(s, node, handle)
        assert drained.ask is not None and drained.holds, f"a budget that can refuse again was not asked: {drained}"
