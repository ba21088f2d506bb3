"""The node-side rules of disruption (issue 21): do-not-disrupt holds voluntary ends, the pool's
terminationGracePeriod bounds the drain, and a node whose GPUs are gone is repaired.

Against the simulated world over HTTP (cloud, Kubernetes emulator), the real bridge (which
tells each node its facts) and the time-skipping Temporal server (the dev server where a node asks
its pool: an update); nothing of tgp is mocked."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.world import SimWorld
from tests.conftest import eventually, running_world, skip_time
from tests.test_node_lifecycle import assert_nothing_left, replay, request, start, wait_phase
from tests.test_watch_events import AT_REST, bridge_running, told
from tgp.types import NodePhase, Stage
from workflows.node import GPUNodeWorkflow

pytestmark = pytest.mark.timeout(600)

MERGE_PATCH = {"Content-Type": "application/merge-patch+json"}


async def put_held_pod(world: SimWorld, node: str, name: str, annotation: str = "tgp.io/do-not-disrupt") -> None:
    """A Running pod bound to `node` that asks not to be disrupted."""
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        await put_held_pod_through(kube, node, name, annotation)


async def put_held_pod_through(kube: httpx.AsyncClient, node: str, name: str, annotation: str = "tgp.io/do-not-disrupt") -> None:
    """`put_held_pod` through a given client (a real cluster's, with its TLS)."""
    meta = {"name": name, "namespace": "default", "annotations": {annotation: "true"}}
    spec = {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}], "terminationGracePeriodSeconds": 1}
    (await kube.post("/api/v1/namespaces/default/pods", json={"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec})).raise_for_status()
    (await kube.patch(f"/api/v1/namespaces/default/pods/{name}/status", json={"status": {"phase": "Running"}}, headers=MERGE_PATCH)).raise_for_status()


async def annotate_node(world: SimWorld, node: str, value: str | None) -> None:
    """Set (or, with None, remove) the Node's tgp.io/do-not-disrupt annotation."""
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        patch = {"metadata": {"annotations": {"tgp.io/do-not-disrupt": value}}}
        (await kube.patch(f"/api/v1/nodes/{node}", json=patch, headers=MERGE_PATCH)).raise_for_status()


async def test_a_do_not_disrupt_pod_holds_expiry_and_a_manual_evict_still_wins(time_skipping: WorkflowEnvironment) -> None:
    """A node past its expireAfter with a running `karpenter.sh/do-not-disrupt` pod stays, for
    hours, and says why (a DisruptionHeld record naming the pod); `evict` ends it at once."""
    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        req = request(timeouts=AT_REST.model_copy(update={"expire_after": timedelta(hours=1)}))
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_held_pod(world, req.node_name, "train", annotation="karpenter.sh/do-not-disrupt")
        await told(handle, holding=1, holders=["default/train"])

        await skip_time(time_skipping, timedelta(hours=3), step=timedelta(minutes=30))
        status = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, "expiry did not wait for the do-not-disrupt pod"
        held = [r for r in status.stages if r.stage is Stage.DISRUPTION_HELD]
        assert held and "past its expireAfter" in held[-1].reason and "default/train" in held[-1].reason, status.stages

        await handle.signal("evict", {"reason": "manual"})
        final = await handle.result()
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("evicted"), final
        assert_nothing_left(world, req.node_name)
        await replay(handle, "do_not_disrupt_pod_held_then_evicted")


@pytest.mark.parametrize("pool", [None, "gpunodepool/ml/no-such-pool"], ids=["no-pool", "pool-asked-in-the-drain"])
async def test_termination_grace_ends_a_do_not_disrupt_hold_of_an_expired_node(time_skipping: WorkflowEnvironment, pool: str | None) -> None:
    """expireAfter 1h, terminationGracePeriod 30m and a do-not-disrupt pod that never ends: the
    node waits past its expiry, and at expireAfter + terminationGracePeriod
    (Karpenter's longest node life) it ends expired, its drain cut at once (the grace is spent),
    and everything it bought is released. A node of a pool (its drain asks the budgets, then
    looks for do-not-disrupt after its cordon) does not look for it then: once, not in a loop."""
    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        timeouts = AT_REST.model_copy(update={"expire_after": timedelta(hours=1), "termination_grace": timedelta(minutes=30)})
        req = request(timeouts=timeouts, pool_workflow_id=pool)
        handle = await start(time_skipping, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)
        await put_held_pod(world, req.node_name, "train")
        await told(handle, holding=1, holders=["default/train"])

        await skip_time(time_skipping, timedelta(hours=1, minutes=10), step=timedelta(minutes=10))
        status = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, "the hold did not wait"
        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("expired"), final
        assert "terminationGracePeriod (30m00s)" in (final.end_reason or "") and "default/train" in (final.end_reason or ""), final.end_reason
        ready_at = next(r.at for r in ready.stages if r.stage is Stage.READY)
        draining = next(r for r in final.stages if r.stage is Stage.DRAINING)
        assert draining.at >= ready_at + timedelta(hours=1, minutes=30), "the hold ended before expireAfter + terminationGracePeriod"
        terminating = next(r for r in final.stages if r.stage is Stage.TERMINATING)
        assert terminating.at - draining.at < timedelta(minutes=5), "the drain took another grace period"
        assert_nothing_left(world, req.node_name)
        drains = [e async for e in handle.fetch_history_events() if e.activity_task_scheduled_event_attributes.activity_type.name == "drain_node"]
        assert len(drains) == 1, f"{len(drains)} drains"
        await replay(handle, "termination_grace_ends_expired_hold" if pool is None else "termination_grace_ends_expired_hold_of_a_pools_node")


async def test_a_do_not_disrupt_node_holds_idle_until_the_annotation_is_removed(time_skipping: WorkflowEnvironment) -> None:
    """The Node itself annotated `tgp.io/do-not-disrupt: "true"`: idle for an hour past its idle
    timeout, it stays (DisruptionHeld names the Node); once the annotation is removed it ends
    idle."""
    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        req = request(timeouts=AT_REST.model_copy(update={"idle": timedelta(minutes=10)}))
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await annotate_node(world, req.node_name, "true")
        await told(handle, do_not_disrupt=True)

        await skip_time(time_skipping, timedelta(hours=1), step=timedelta(minutes=20))
        status = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, "idle did not wait for the Node's do-not-disrupt"
        held = [r for r in status.stages if r.stage is Stage.DISRUPTION_HELD]
        assert held and "is idle" in held[-1].reason and f"Node {req.node_name}" in held[-1].reason, status.stages

        await annotate_node(world, req.node_name, None)
        final = await handle.result()
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("idle"), final
        assert_nothing_left(world, req.node_name)
        await replay(handle, "do_not_disrupt_node_held_then_idle")


# --- terminationGracePeriod -------------------------------------------------------------------


def test_the_pools_termination_grace_period_reaches_its_nodes() -> None:
    from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
    from tgp.pools import node_request

    klass = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}]})
    pool = GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}, "disruption": {"terminationGracePeriod": "90s"}})
    req = node_request(namespace="ml", pool_name="rtx", class_name="c", node_name="n", pool=pool, klass=klass)
    assert req.timeouts.termination_grace == timedelta(seconds=90)
    without = GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}})
    assert node_request(namespace="ml", pool_name="rtx", class_name="c", node_name="n", pool=without, klass=klass).timeouts.termination_grace is None
    # A request from before the field (a running node's input) reads as no bound.
    from tgp.types import NodeRequest

    old = req.model_dump(mode="json")
    del old["timeouts"]["termination_grace"]
    assert NodeRequest.model_validate(old).timeouts.termination_grace is None


async def test_termination_grace_period_terminates_a_node_whose_pdb_blocks_the_drain(temporal: WorkflowEnvironment) -> None:
    """A pod whose PodDisruptionBudget refuses every eviction, a drain timeout of 10 minutes and
    a terminationGracePeriod of 3 s: the instance is terminated after about 3 s of drain, and the
    node's DrainTimedOut record (the pool's Warning Event) and the pod's Event name
    terminationGracePeriod as what ended the wait."""
    from activities.drain import EVENT_DRAIN_TIMED_OUT
    from tests.test_node_drain import bind_pod, kube_get, refuse_evictions

    async with running_world(temporal) as (world, _, queue):
        timeouts = AT_REST.model_copy(update={"drain": timedelta(minutes=10), "termination_grace": timedelta(seconds=3)})
        req = request(timeouts=timeouts)
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await bind_pod(world, req.node_name, "db", labels={"app": "db"})
        await refuse_evictions(world, "db")

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED
        [timed_out] = [s for s in final.stages if s.stage is Stage.DRAIN_TIMED_OUT]
        assert "terminationGracePeriod (3s) ended the drain" in timed_out.reason and "ml/db" in timed_out.reason, timed_out
        draining = next(s for s in final.stages if s.stage is Stage.DRAINING)
        assert timed_out.at - draining.at < timedelta(minutes=1), "the drain was not cut at the grace period"
        events = (await kube_get(world, "/api/v1/namespaces/ml/events") or {}).get("items") or []
        [warning] = [e for e in events if e["involvedObject"]["name"] == "db" and e["reason"] == EVENT_DRAIN_TIMED_OUT]
        assert "terminationGracePeriod (3s) ended the drain" in warning["message"], warning["message"]
        assert_nothing_left(world, req.node_name)
        await replay(handle, "termination_grace_cuts_pdb_blocked_drain")


async def test_termination_grace_period_deletes_a_pdb_blocked_pod_its_own_grace_before_the_deadline(temporal: WorkflowEnvironment) -> None:
    """terminationGracePeriod 8 s, a pod whose PodDisruptionBudget refuses every eviction and
    whose terminationGracePeriodSeconds is 4: tgp deletes the pod (over the PDB) no earlier than
    the deadline minus its grace, with at most that grace (what is left to the deadline, as
    Karpenter clamps it), while the instance still runs (the pod gets its grace before the
    machine goes); the pod's Event and the node's DrainTimedOut record say so; everything is
    released."""
    from activities.drain import EVENT_DELETED_AT_GRACE
    from tests.test_node_drain import bind_pod, kube_get, refuse_evictions

    async with running_world(temporal) as (world, _, queue):
        assert world.kube is not None
        timeouts = AT_REST.model_copy(update={"drain": timedelta(minutes=10), "termination_grace": timedelta(seconds=8)})
        req = request(timeouts=timeouts)
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await bind_pod(world, req.node_name, "db", labels={"app": "db"}, grace=4)
        await refuse_evictions(world, "db")
        deletions: list[tuple[Any, Any, int]] = []  # (when, its body, live instances then), by tgp

        async def seen(request: Any) -> None:
            if not request.headers.get("User-Agent", "").startswith("python-httpx"):  # not the kubelet's
                from datetime import datetime, timezone

                deletions.append((datetime.now(timezone.utc), request.data, len(world.cloud.live_instances())))

        world.kube["delete /api/v1/namespaces/ml/pods/db"] << seen
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED
        assert deletions, "the PDB-blocked pod was never deleted: the instance went with it still running"
        at, body, live = deletions[0]
        draining = next(s for s in final.stages if s.stage is Stage.DRAINING)
        assert at >= draining.at + timedelta(seconds=8 - 4) - timedelta(milliseconds=500), "deleted before the deadline minus its grace"
        grace = body.get("gracePeriodSeconds")
        assert isinstance(grace, int) and 0 <= grace <= 4, body
        assert live == 1, "the instance was terminated before the pod was deleted"
        [record] = [s for s in final.stages if s.stage is Stage.DRAIN_TIMED_OUT]
        assert "terminationGracePeriod (8s) ended the drain" in record.reason and "minus their terminationGracePeriodSeconds: ml/db" in record.reason, record
        events = (await kube_get(world, "/api/v1/namespaces/ml/events") or {}).get("items") or []
        [said] = [e for e in events if e["involvedObject"]["name"] == "db" and e["reason"] == EVENT_DELETED_AT_GRACE]
        assert f"grace period of {grace}s" in said["message"] and "PodDisruptionBudgets" in said["message"], said["message"]
        assert_nothing_left(world, req.node_name)
        await replay(handle, "termination_grace_deletes_pdb_blocked_pod")


# --- node repair ------------------------------------------------------------------------------


async def test_a_node_whose_gpus_drop_to_zero_is_repaired_even_when_held(time_skipping: WorkflowEnvironment) -> None:
    """The machine's GPUs fall off (the kubelet advertises `nvidia.com/gpu: 0`) on a Ready node
    running a do-not-disrupt pod: after the named grace the node ends with reason repair, saying
    why; it is drained (not held) and everything it bought is released."""
    from tgp.lifecycle import GPUS_LOST_AFTER

    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        req = request(timeouts=AT_REST)
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_held_pod(world, req.node_name, "train")
        await told(handle, holding=1, gpus=1)

        world.kubelets[req.node_name].gpus = 0  # what it reports from now on
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            zero = {"status": {"capacity": {"nvidia.com/gpu": "0"}, "allocatable": {"nvidia.com/gpu": "0"}}}
            (await kube.patch(f"/api/v1/nodes/{req.node_name}/status", json=zero, headers=MERGE_PATCH)).raise_for_status()
        lost = await told(handle, gpus=0, ready=True)

        final = await asyncio.wait_for(handle.result(), 120)  # a node never repaired would sit for ever
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("repair"), final
        assert "no allocatable nvidia.com/gpu" in (final.end_reason or ""), final.end_reason
        draining = next(r for r in final.stages if r.stage is Stage.DRAINING)
        assert draining.at >= lost.at + GPUS_LOST_AFTER, "repaired before the grace"
        assert not [r for r in final.stages if r.stage is Stage.DISRUPTION_HELD], "a repair is never held"
        assert_nothing_left(world, req.node_name)
        await replay(handle, "repair_gpus_gone")


async def test_a_node_notready_past_the_threshold_is_repaired_without_a_drain_even_when_held(time_skipping: WorkflowEnvironment) -> None:
    """The machine's kubelet hangs while the provider still runs the instance (the cluster marks
    the Node NotReady), on a node with a do-not-disrupt pod: it is not given up as lost at 5
    minutes; at NODE_NOT_READY_REPAIR_AFTER it is repaired: a NodeRepair record (the pool's
    Warning Event) says it was NotReady for 10 minutes, the instance is terminated without a
    drain (its pods could not leave) and everything it bought is released."""
    from sim.kube_kubelet import set_node_ready
    from tgp.lifecycle import NODE_LOST_AFTER, NODE_NOT_READY_REPAIR_AFTER

    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        req = request(timeouts=AT_REST)
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_held_pod(world, req.node_name, "train")
        await told(handle, holding=1, ready=True)

        world.kubelets[req.node_name].silent = True
        await set_node_ready(world.kube_url, req.node_name, False)
        down = await told(handle, ready=False)

        await skip_time(time_skipping, NODE_LOST_AFTER + timedelta(minutes=1), step=timedelta(minutes=1))
        status = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, f"a NotReady node with a running instance was ended at 5 minutes: {status.end_reason}"

        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("not-ready"), final
        [repair] = [r for r in final.stages if r.stage is Stage.NODE_REPAIR]
        assert "NotReady for 10m" in repair.reason and "without a drain" in repair.reason, repair
        assert repair.at >= down.at + NODE_NOT_READY_REPAIR_AFTER, "repaired before the threshold"
        assert not [r for r in final.stages if r.stage in (Stage.DRAINING, Stage.DISRUPTION_HELD)], "drained or held"
        assert_nothing_left(world, req.node_name)
        await replay(handle, "repair_not_ready")


async def test_a_zero_budget_holds_a_notready_repair_and_an_evict_still_wins(temporal: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool whose only budget is `nodes: "0"` (no reasons: it covers repairs too) and a node
    NotReady past NODE_NOT_READY_REPAIR_AFTER while its instance runs: the repair asks the pool,
    is refused, and the node stays (a DisruptionBlocked record naming the Repair and the budget)
    rather than ending lost at 5 minutes as before; a manual evict ends it.

    On the dev server, with the threshold cut to seconds: the ask is an update to the pool, and
    the time-skipping test server at times fails a workflow task that accepts an update under
    load ("invalid history builder state for action", then "Already accepted update"). The pool
    then never answered, and after POOL_ANSWER_TIMEOUT the node went ahead, as it should when a
    pool does not answer (CI failed so)."""
    from sim.kube_kubelet import set_node_ready
    from tests.test_pool_races import gated_world, pool_spec, start_pool
    from tgp import lifecycle
    from tgp.messages import pool_workflow_id

    monkeypatch.setattr(lifecycle, "NODE_NOT_READY_REPAIR_AFTER", timedelta(seconds=2))
    monkeypatch.setattr("workflows.node.watch.BUDGET_ASK_AGAIN", timedelta(seconds=1))
    async with gated_world(temporal) as s, bridge_running(temporal, s.world, s.queue) as bridge:
        name, _ = await start_pool(s, pool_spec("cls-unused", disruption={"budgets": [{"nodes": "0"}]}))
        req = request(namespace="ml", pool=name, timeouts=AT_REST, pool_workflow_id=pool_workflow_id("ml", name))
        handle = await start(temporal, s.queue, req)
        s.workflow_ids.add(handle.id)
        await wait_phase(handle, NodePhase.READY)
        # The bridge follows it Ready (told, or known to its workflow from the launch's look).
        await eventually(lambda: asyncio.sleep(0, (f := bridge.facts.sent.get(req.node_name)) is not None and f.ready), what="the bridge following it Ready")
        s.world.kubelets[req.node_name].silent = True
        await set_node_ready(s.world.kube_url, req.node_name, False)
        await told(handle, ready=False)

        async def refused(times: int) -> Any:
            """The node's stage records once the pool has refused it `times` times (asked again
            each BUDGET_ASK_AGAIN), the node Ready throughout."""
            status = await handle.query(GPUNodeWorkflow.status)
            assert status.phase is NodePhase.READY, f"the budget did not hold the repair: {status.end_reason}"
            asked = len([e async for e in handle.fetch_history_events() if e.activity_task_scheduled_event_attributes.activity_type.name == "ask_pool_to_disrupt"])
            return status.stages if asked >= times else None

        stages = await eventually(lambda: refused(3), what="the repair refused by the budget, asked three times")
        blocked = [r for r in stages if r.stage is Stage.DISRUPTION_BLOCKED]
        assert blocked and "Repair disruption blocked by budgets[0]" in blocked[-1].reason, stages

        await handle.signal("evict", {"reason": "manual"})
        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("evicted"), final
        assert_nothing_left(s.world, req.node_name)


async def test_the_pool_warns_when_one_of_its_nodes_is_repaired(temporal: WorkflowEnvironment) -> None:
    """A node reports a NodeRepair record with its last phase: the pool writes a Warning
    `NodeRepair` Event with the node's reason."""
    from datetime import datetime, timezone

    from tests.test_pool_races import Reports, about, gated_world, pool_events, pool_spec, start_pool
    from tgp.types import StageRecord
    from workflows.pool import GPUNodePoolWorkflow

    async with gated_world(temporal) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        report = Reports(name).of
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.READY, 0))
        message = "node repair: the Node has been NotReady for 10m00s while its instance runs"
        ending = report("a", NodePhase.TERMINATING, 5).model_copy(
            update={"stages": [StageRecord(stage=Stage.NODE_REPAIR, at=datetime.now(timezone.utc), reason=message)]}
        )
        await pool.signal(GPUNodePoolWorkflow.node_phase, ending)

        async def said() -> list[tuple[str, str]] | None:
            events = await pool_events(s, name)
            return events if about(events, "NodeRepair", "a") else None

        events = await eventually(said, what="the pool's NodeRepair Event")
        [text] = [m for r, m in events if r == "NodeRepair"]
        assert "NotReady for 10m00s" in text, text


async def test_the_pool_says_when_do_not_disrupt_holds_one_of_its_nodes(temporal: WorkflowEnvironment) -> None:
    """A node reports a DisruptionHeld record while Ready (no phase change): the pool writes a
    Normal `DisruptionHeld` Event with the node's message, once per record."""
    from datetime import datetime, timezone

    from tests.test_pool_races import Reports, about, gated_world, pool_events, pool_spec, start_pool
    from tgp.types import StageRecord
    from workflows.pool import GPUNodePoolWorkflow

    async with gated_world(temporal) as s:
        name, pool = await start_pool(s, pool_spec("cls-unused"))
        report = Reports(name).of
        await pool.signal(GPUNodePoolWorkflow.node_phase, report("a", NodePhase.READY, 0))
        message = "node is past its expireAfter but do-not-disrupt holds it: ml/train; it waits until they finish or the annotation is removed (a manual evict does not wait)"
        held = report("a", NodePhase.READY, 5).model_copy(
            update={"stages": [StageRecord(stage=Stage.DISRUPTION_HELD, at=datetime.now(timezone.utc), reason=message)]}
        )
        await pool.signal(GPUNodePoolWorkflow.node_phase, held)

        async def said() -> list[tuple[str, str]] | None:
            events = await pool_events(s, name)
            return events if about(events, "DisruptionHeld", "a") else None

        events = await eventually(said, what="the pool's DisruptionHeld Event")
        [text] = [m for r, m in events if r == "DisruptionHeld"]
        assert "ml/train" in text and "past its expireAfter" in text, text


def test_the_settings_a_node_was_sent_read_as_before_without_a_grace_period() -> None:
    """The pool compares the settings it last sent a node by their JSON: a pool without a
    terminationGracePeriod must write them as releases before the field did (or every node
    would get a settings signal on replay); with one, the grace is in them."""
    from tgp.types import TimeoutsUpdate
    from workflows.pool import _fingerprint

    plain = TimeoutsUpdate(idle=timedelta(minutes=10), drain=timedelta(minutes=5), expire_after=None)
    assert "termination_grace" not in _fingerprint(plain) and "hold" not in _fingerprint(plain)
    graced = plain.model_copy(update={"termination_grace": timedelta(hours=1)})
    assert "termination_grace" in _fingerprint(graced)
    # A message from a pool before the field leaves the node's grace as it was.
    assert "termination_grace" not in TimeoutsUpdate.model_validate({"idle": None, "drain": 60, "expire_after": None}).model_fields_set


# --- disruption budgets -----------------------------------------------------------------------


@pytest.mark.parametrize("inside", [True, False], ids=["zero-budget-window-blocks", "outside-the-window-proceeds"])
async def test_a_zero_budget_in_its_window_holds_an_idle_node_and_outside_it_the_node_goes(temporal: WorkflowEnvironment, inside: bool) -> None:
    """The pool's budget `nodes: "0"` on a daily schedule for 3 hours. Inside its window an
    idle node asks its pool, is refused and stays Ready (a DisruptionBlocked record on the node,
    a DisruptionBlocked Event on the pool naming the budget and the counts); with the window
    twelve hours away the same node ends idle at its timeout."""
    from datetime import datetime, timezone

    from tests.test_pool_races import gated_world, pool_events, pool_spec, start_pool
    from tgp.messages import pool_workflow_id

    hour = datetime.now(timezone.utc).hour if inside else (datetime.now(timezone.utc).hour + 12) % 24
    budget = {"nodes": "0", "schedule": f"0 {hour} * * *", "duration": "3h"}
    async with gated_world(temporal) as s:
        spec = pool_spec("cls-unused", disruption={"idleTimeout": "2s", "budgets": [budget]})
        name, _ = await start_pool(s, spec)
        req = request(namespace="ml", pool=name, timeouts=AT_REST.model_copy(update={"idle": timedelta(seconds=2)}), pool_workflow_id=pool_workflow_id("ml", name))
        handle = await start(temporal, s.queue, req)
        s.workflow_ids.add(handle.id)
        if not inside:
            final = await asyncio.wait_for(handle.result(), 60)
            assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("idle"), final
            assert not [r for r in final.stages if r.stage is Stage.DISRUPTION_BLOCKED]
            return

        async def blocked() -> list[tuple[str, str]] | None:
            events = await pool_events(s, name)
            return events if any(r == "DisruptionBlocked" for r, _ in events) else None

        events = await eventually(blocked, timeout=60, what="the pool's DisruptionBlocked Event")
        [text] = [m for r, m in events if r == "DisruptionBlocked"]
        assert f"node {req.node_name}" in text and "Empty disruption blocked by budgets[0]" in text, text
        assert "allows 0 at once and 0 are disrupting" in text, text
        status = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, "a zero budget let the idle node go"
        assert [r for r in status.stages if r.stage is Stage.DISRUPTION_BLOCKED], status.stages

        await handle.signal("evict", {"reason": "manual"})  # never limited
        final = await asyncio.wait_for(handle.result(), 60)
        assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("evicted"), final
        assert_nothing_left(s.world, req.node_name)
        await replay(handle, "budget_blocks_idle_then_evicted")


async def test_a_budget_of_one_lets_idle_nodes_go_one_at_a_time(temporal: WorkflowEnvironment) -> None:
    """Two nodes of a pool with `budgets: [{nodes: "1"}]` go idle together: one drains, the
    other waits (DisruptionBlocked) and goes as soon as the first has left Draining (the pool
    tells it, it does not wait for its next ask). Never are both draining at once."""
    from tests.test_pool_races import gated_world, pool_events, pool_spec, start_pool
    from tgp.messages import pool_workflow_id

    async with gated_world(temporal) as s:
        spec = pool_spec("cls-unused", disruption={"idleTimeout": "2s", "budgets": [{"nodes": "1"}]})
        name, _ = await start_pool(s, spec)
        reqs = [
            request(namespace="ml", pool=name, timeouts=AT_REST.model_copy(update={"idle": timedelta(seconds=2)}), pool_workflow_id=pool_workflow_id("ml", name))
            for _ in range(2)
        ]
        # The first drain is held until the other node has asked and been refused: the two idle
        # together however fast a drain of an empty node is (the test does not race them).
        first = True

        def hold_first(_: Any) -> bool:
            nonlocal first
            held, first = first, False
            return held

        s.gates.drain_node.hold = hold_first
        handles = [await start(temporal, s.queue, req) for req in reqs]
        s.workflow_ids.update(h.id for h in handles)
        draining = await s.gates.drain_node.next("the first node's drain")
        other = next(h for h, r in zip(handles, reqs, strict=True) if r.node_name != draining.arg.node_name)

        async def refused() -> bool:
            status = await other.query(GPUNodeWorkflow.status)
            return any(r.stage is Stage.DISRUPTION_BLOCKED for r in status.stages)

        await eventually(refused, timeout=60, what="the other node to be refused by the budget while the first drains")
        draining.go()
        finals = [await asyncio.wait_for(h.result(), 90) for h in handles]
        assert all(f.phase is NodePhase.TERMINATED and (f.end_reason or "").startswith("idle") for f in finals), finals

        def span(final: Any) -> tuple[Any, Any]:
            draining = next(r.at for r in final.stages if r.stage is Stage.DRAINING)
            left = next(r.at for r in final.stages if r.stage is Stage.TERMINATING)
            return draining, left

        (a_start, a_end), (b_start, b_end) = sorted(span(f) for f in finals)
        assert b_start >= a_end, f"both drained at once: {a_start}..{a_end} and {b_start}..{b_end}"
        held = [f for f in finals if any(r.stage is Stage.DISRUPTION_BLOCKED for r in f.stages)]
        assert len(held) == 1, "exactly one waited for the budget"
        assert b_start - a_end < timedelta(seconds=30), "the held node waited for its next ask, not for the pool's word"
        events = await pool_events(s, name)
        assert any(r == "DisruptionBlocked" and "allows 1 at once and 1 is disrupting" in m for r, m in events), events
