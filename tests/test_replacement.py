"""Make-before-break replacement (issue 21 items 3 and 4): a drifted node (its class changed what
made it) and a node a cheaper offer fits (re-shop) are replaced: the replacement is bought and
Ready before the old node is cordoned or drained, one at a time, within the budget.

End to end through the CRD bridge, the simulated cloud and the Kubernetes emulator over HTTP;
the order is read from the cloud's log (what it sold, ran and terminated) and from a watch on
the Nodes (when each became Ready, when each was cordoned). Nothing of tgp is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import eventually
from tests.test_pool_accounting import passes
from tests.kube_env import KubeApi
from tests.test_bridge import CLASSES, POOLS, apply, gpu_class, gpu_pool, ready_nodes, running_stack
from tgp.drift import DRIFT_HASH_VERSION
from tgp.messages import pool_workflow_id

pytestmark = pytest.mark.timeout(300)

MERGE = {"Content-Type": "application/merge-patch+json"}
KEEP = {"idleTimeout": "1h", "drainTimeout": "10s"}


@dataclass
class NodeLog:
    """The Nodes as a watch sees them, in order: (event type, name, Ready, cordoned)."""

    seen: list[tuple[str, str, bool, bool]] = field(default_factory=list)

    def first(self, name: str, *, ready: bool | None = None, cordoned: bool | None = None) -> int | None:
        for i, (_, n, r, c) in enumerate(self.seen):
            if n == name and (ready is None or r == ready) and (cordoned is None or c == cordoned):
                return i
        return None


@contextlib.asynccontextmanager
async def watching_nodes(kube: httpx.AsyncClient) -> AsyncIterator[NodeLog]:
    log = NodeLog()

    async def watch() -> None:
        version = (await kube.get("/api/v1/nodes")).json()["metadata"].get("resourceVersion", "")
        while True:
            params = {"watch": "true", "resourceVersion": version, "allowWatchBookmarks": "false"}
            async with kube.stream("GET", "/api/v1/nodes", params=params, timeout=None) as r:
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event["object"]
                    version = obj["metadata"].get("resourceVersion", version)
                    conditions = (obj.get("status") or {}).get("conditions") or []
                    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
                    cordoned = bool((obj.get("spec") or {}).get("unschedulable"))
                    log.seen.append((event["type"], obj["metadata"]["name"], ready, cordoned))

    task = asyncio.create_task(watch())
    try:
        yield log
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def pool_events(kube: httpx.AsyncClient, pool: str) -> list[tuple[str, str]]:
    items = (await kube.get("/api/v1/namespaces/ml/events")).json()["items"]
    return [(e["reason"], e["message"]) for e in items if e["involvedObject"]["name"] == pool]


def node_of(instance_name: str) -> str:
    """tgp-<node>-<attempt> -> <node>"""
    return instance_name.removeprefix("tgp-").rsplit("-", 1)[0]


async def test_a_drifted_node_is_replaced_make_before_break(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """The class's kubelet version changes under a Ready node: the pool marks it Drifted (status and a
    NodeDrifted Event), buys one replacement, and only once the replacement's Node is Ready is the
    old Node cordoned and its instance terminated; the pool ends with the replacement alone, the
    new hash in its status."""
    async with running_stack(temporal, kube_api) as s, watching_nodes(s.kube) as nodes:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx", minNodes=1, disruption=KEEP))
        [old] = await ready_nodes(s, "ml", "rtx", 1)
        assert old.get("driftHash", "").startswith(f"{DRIFT_HASH_VERSION}-") and not old.get("drifted"), old

        patch = {"spec": {"kubernetesVersion": "1.34.2"}}
        (await s.kube.patch(f"{CLASSES}/sim", json=patch, headers=MERGE)).raise_for_status()

        async def replaced() -> list[dict[str, Any]] | None:
            status = await s.pool_status("ml", "rtx")
            listed = status.get("nodes") or []
            return listed if [n["name"] for n in listed] != [old["name"]] and len(listed) == 1 and listed[0]["phase"] == "Ready" else None

        [new] = await eventually(replaced, timeout=120, what="the drifted node to be replaced")
        assert new["driftHash"] != old["driftHash"] and not new.get("drifted"), new

        # The cloud: one replacement bought; it ran before the old instance was terminated.
        log = s.world.cloud.log
        bought = [node_of(name) for event, name, _ in log if event == "bought"]
        assert bought == [old["name"], new["name"]], f"not exactly one replacement: {log}"
        running_new = log.index(next(e for e in log if e[0] == "running" and node_of(e[1]) == new["name"]))
        deleted_old = log.index(next(e for e in log if e[0] == "deleted" and node_of(e[1]) == old["name"]))
        assert running_new < deleted_old, f"the old instance was terminated before the replacement ran: {log}"

        # Kubernetes: the replacement's Node was Ready before the old Node was cordoned.
        new_ready = nodes.first(new["name"], ready=True)
        [old_cordoned] = await eventually(lambda: _found(nodes.first(old["name"], cordoned=True)), what="the old Node's cordon in the watch")
        assert new_ready is not None and new_ready < old_cordoned, f"cordoned before the replacement was Ready: {nodes.seen}"

        events = await eventually(lambda: _events_with(s.kube, "NodeReplaced"), what="the NodeReplaced Event")
        reasons = [r for r, _ in events]
        assert reasons.count("NodeDrifted") == 1 and reasons.count("NodeReplacing") == 1, events
        drifted_text = next(m for r, m in events if r == "NodeDrifted")
        assert old["name"] in drifted_text and "make-before-break" in drifted_text, drifted_text


async def _found(index: int | None) -> tuple[int] | None:
    return (index,) if index is not None else None


async def _events_with(kube: httpx.AsyncClient, reason: str) -> list[tuple[str, str]] | None:
    events = await pool_events(kube, "rtx")
    return events if any(r == reason for r, _ in events) else None


async def test_a_budget_holds_a_drifted_node_until_it_allows_the_replacement(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """A budget `nodes: "0"` for Drifted: the drifted node is marked but nothing is bought
    (DisruptionBlocked names the budget); once the budget is lifted the replacement comes."""
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        budgets = [{"nodes": "0", "reasons": ["Drifted"]}]
        await apply(s.kube, gpu_pool("rtx", minNodes=1, disruption={**KEEP, "budgets": budgets}))
        [old] = await ready_nodes(s, "ml", "rtx", 1)
        (await s.kube.patch(f"{CLASSES}/sim", json={"spec": {"kubernetesVersion": "1.34.2"}}, headers=MERGE)).raise_for_status()

        events = await eventually(lambda: _events_with(s.kube, "DisruptionBlocked"), timeout=60, what="the DisruptionBlocked Event")
        text = next(m for r, m in events if r == "DisruptionBlocked")
        assert f"node {old['name']}" in text and "Drifted disruption blocked by budgets[0]" in text, text
        status = await s.pool_status("ml", "rtx")
        assert [(n["name"], n.get("drifted")) for n in status["nodes"]] == [(old["name"], True)], status["nodes"]
        assert [e for e, _, _ in s.world.cloud.log].count("bought") == 1, s.world.cloud.log

        (await s.kube.patch(f"{POOLS.format(ns='ml')}/rtx", json={"spec": {"disruption": {"budgets": []}}}, headers=MERGE)).raise_for_status()

        async def replaced() -> list[dict[str, Any]] | None:
            listed = (await s.pool_status("ml", "rtx")).get("nodes") or []
            return listed if len(listed) == 1 and listed[0]["name"] != old["name"] and listed[0]["phase"] == "Ready" else None

        await eventually(replaced, timeout=120, what="the replacement once the budget allows it")


async def _blocked(kube: httpx.AsyncClient, node: str) -> str | None:
    """The DisruptionBlocked Event about `node` (a real cluster keeps earlier tests' Events)."""
    return next((m for r, m in await pool_events(kube, "rtx") if r == "DisruptionBlocked" and f"node {node}:" in m), None)


async def pool_heard_held(s: Any, pool: str, node: str) -> bool:
    """The pool's history holds a `demand` signal from the bridge that names `node` held by
    do-not-disrupt (what the pool goes by)."""
    history = await s.env.client.get_workflow_handle(pool_workflow_id("ml", pool)).fetch_history()
    for e in history.events:
        if e.HasField("workflow_execution_signaled_event_attributes"):
            signal = e.workflow_execution_signaled_event_attributes
            if signal.signal_name == "demand" and any(node in json.loads(p.data).get("held_nodes", []) for p in signal.input.payloads):
                return True
    return False


async def test_no_replacement_is_bought_for_a_drifted_node_do_not_disrupt_holds(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """A drifted node running a `tgp.io/do-not-disrupt` pod: nothing is bought (a replacement
    would bill beside a node that cannot go) and DisruptionBlocked says why; once the pod ends,
    the replacement comes, make-before-break."""
    from tests.test_node_disruption import put_held_pod_through

    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx", minNodes=1, disruption=KEEP))
        [old] = await ready_nodes(s, "ml", "rtx", 1)
        await put_held_pod_through(s.kube, old["name"], "train")
        await eventually(lambda: pool_heard_held(s, "rtx", old["name"]), timeout=60, what="the bridge to tell the pool of the hold")
        (await s.kube.patch(f"{CLASSES}/sim", json={"spec": {"kubernetesVersion": "1.34.2"}}, headers=MERGE)).raise_for_status()

        text = await eventually(lambda: _blocked(s.kube, old["name"]), timeout=60, what="the DisruptionBlocked Event")
        assert f"node {old['name']}: Drifted: do-not-disrupt holds it" in text, text
        status = await s.pool_status("ml", "rtx")
        assert [(n["name"], n.get("drifted")) for n in status["nodes"]] == [(old["name"], True)], status["nodes"]
        assert [e for e, _, _ in s.world.cloud.log].count("bought") == 1, f"a replacement was bought for a held node: {s.world.cloud.log}"

        (await s.kube.delete("/api/v1/namespaces/default/pods/train")).raise_for_status()

        async def replaced() -> list[dict[str, Any]] | None:
            listed = (await s.pool_status("ml", "rtx")).get("nodes") or []
            return listed if len(listed) == 1 and listed[0]["name"] != old["name"] and listed[0]["phase"] == "Ready" else None

        await eventually(replaced, timeout=120, what="the replacement once nothing holds the node")


async def test_no_replacement_is_bought_past_the_pools_max_nodes(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """A pool at spec.maxNodes with a drifted node: the replacement (bought before the old node
    goes) would be one node too many, so none is bought and DisruptionBlocked says to raise
    maxNodes; raised by one, the replacement comes."""
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx", minNodes=1, maxNodes=1, disruption=KEEP))
        [old] = await ready_nodes(s, "ml", "rtx", 1)
        (await s.kube.patch(f"{CLASSES}/sim", json={"spec": {"kubernetesVersion": "1.34.2"}}, headers=MERGE)).raise_for_status()

        text = await eventually(lambda: _blocked(s.kube, old["name"]), timeout=60, what="the DisruptionBlocked Event")
        assert f"node {old['name']}: Drifted: its replacement would be node 2 of spec.maxNodes 1" in text and "raise maxNodes" in text, text
        assert [e for e, _, _ in s.world.cloud.log].count("bought") == 1, f"a replacement was bought past maxNodes: {s.world.cloud.log}"

        (await s.kube.patch(f"{POOLS.format(ns='ml')}/rtx", json={"spec": {"maxNodes": 2}}, headers=MERGE)).raise_for_status()

        async def replaced() -> list[dict[str, Any]] | None:
            listed = (await s.pool_status("ml", "rtx")).get("nodes") or []
            return listed if len(listed) == 1 and listed[0]["name"] != old["name"] and listed[0]["phase"] == "Ready" else None

        await eventually(replaced, timeout=120, what="the replacement once maxNodes allows it")
        blocked = [m for r, m in await pool_events(s.kube, "rtx") if r == "DisruptionBlocked" and f"node {old['name']}:" in m]
        assert len(blocked) == 1, f"the Event was written more than once: {blocked}"


async def test_a_replacement_that_fails_leaves_the_old_node_in_place(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """The class's new tailnet tag is one the tailnet refuses to mint keys for: the replacement
    fails before buying anything; the old node is never cordoned or terminated, and the pool
    says so (ReplacementFailed, a Warning naming both nodes)."""
    async with running_stack(temporal, kube_api) as s, watching_nodes(s.kube) as nodes:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx", minNodes=1, disruption=KEEP))
        [old] = await ready_nodes(s, "ml", "rtx", 1)

        patch = {"spec": {"tailscaleConfig": {"tags": ["tag:tgp-node", "tag:not-owned"]}}}
        (await s.kube.patch(f"{CLASSES}/sim", json=patch, headers=MERGE)).raise_for_status()

        events = await eventually(lambda: _events_with(s.kube, "ReplacementFailed"), timeout=120, what="the ReplacementFailed Event")
        failed = next(m for r, m in events if r == "ReplacementFailed")
        assert f"of node {old['name']}" in failed and f"{old['name']} stays" in failed, failed
        status = await s.pool_status("ml", "rtx")
        assert [(n["name"], n["phase"], n.get("drifted")) for n in status["nodes"]] == [(old["name"], "Ready", True)], status["nodes"]
        assert nodes.first(old["name"], cordoned=True) is None, "the old Node was cordoned though its replacement failed"
        assert [e for e in s.world.cloud.log if e[0] == "deleted"] == [], s.world.cloud.log
        assert len(s.world.cloud.live_instances()) == 1


async def test_a_node_is_re_shopped_when_the_market_drops_and_not_within_the_threshold(temporal: WorkflowEnvironment) -> None:
    """Consolidation `cheaperBy: 30%, after: 2s`. The node's offer ($0.44/h) drops to $0.35/h
    (20% less: within the threshold): the pool sees the new price and passes on, replacing
    nothing. It drops to $0.20/h: the node is replaced (make-before-break) by one bought at
    $0.20/h, the old instance terminated after the replacement ran."""
    from tests.test_pool_races import pool_spec, start_class, start_pool
    from tests.test_pool_races import pool_events as events_of
    from tests.test_pool_races import status as pool_status

    async with market_world(temporal) as s:
        klass = "reshop"
        await start_class(s, klass)
        spec = pool_spec(klass, minNodes=1, disruption={**KEEP, "consolidation": {"cheaperBy": "30%", "after": "2s"}})
        name, pool = await start_pool(s, spec, resync_interval=timedelta(seconds=1), offer_check_ttl=timedelta(seconds=1))

        async def nodes(count: int) -> list[Any] | None:
            listed = (await pool_status(pool)).nodes
            return listed if len(listed) == count and all(n.phase == "Ready" for n in listed) else None

        [old] = await eventually(lambda: nodes(1), timeout=60, what="the floor node Ready")
        s.workflow_ids.add(old.workflow_id)
        assert old.hourly_price == Decimal("0.44"), old

        s.world.cloud.set_price("rtx4090-us-east", Decimal("0.35"))

        async def offers_at(price: str) -> int | None:
            conditions = {c.type: c for c in (await pool_status(pool)).conditions}
            offers = conditions.get("OffersAvailable")
            return await passes(pool) if offers is not None and f"from ${price}/h" in offers.message else None

        seen_at = await eventually(lambda: offers_at("0.35"), timeout=60, what="the pool to see the $0.35/h offer")
        # Passes go by (the pool wakes each second), past `after`: nothing is replaced.
        await eventually(lambda: _passed(pool, seen_at + 4), timeout=60, what="four more passes (twice `after`)")
        assert [n.name for n in (await pool_status(pool)).nodes] == [old.name], "re-shopped within the threshold"
        assert [e for e, _, _ in s.world.cloud.log].count("bought") == 1, s.world.cloud.log

        # The market drops past the threshold for a 1-GPU node, but the bridge reports this Node
        # with 2 GPUs (the pool knows it only by its 1-GPU request): no 1-GPU offer holds its
        # pods, nothing is replaced (review: sized by its request, it would have been).
        from tests.test_pool_consolidation import demand
        from workflows.pool import GPUNodePoolWorkflow

        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, {old.name: 1}, {old.name: [1]}))
        s.world.cloud.set_price("rtx4090-us-east", Decimal("0.20"))
        seen_at = await eventually(lambda: offers_at("0.20"), timeout=60, what="the pool to see the $0.20/h offer")
        await eventually(lambda: _passed(pool, seen_at + 4), timeout=60, what="four more passes (twice `after`)")
        assert [n.name for n in (await pool_status(pool)).nodes] == [old.name], "a 2-GPU node re-shopped to a 1-GPU offer"
        assert [e for e, _, _ in s.world.cloud.log].count("bought") == 1, s.world.cloud.log

        # Reported as it is, 1 GPU: replaced.
        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, {old.name: 1}, {}))

        async def replaced() -> list[Any] | None:
            listed = (await pool_status(pool)).nodes
            return listed if len(listed) == 1 and listed[0].name != old.name and listed[0].phase == "Ready" else None

        [new] = await eventually(replaced, timeout=120, what="the re-shopped node's replacement alone")
        s.workflow_ids.add(new.workflow_id)
        assert new.hourly_price == Decimal("0.20"), new
        log = s.world.cloud.log
        assert [node_of(n) for e, n, _ in log if e == "bought"] == [old.name, new.name], log
        running_new = next(i for i, e in enumerate(log) if e[0] == "running" and node_of(e[1]) == new.name)
        deleted_old = next(i for i, e in enumerate(log) if e[0] == "deleted" and node_of(e[1]) == old.name)
        assert running_new < deleted_old, log

        # The pass that told the old node to go wrote its Events and status after the new node's
        # Ready shows: a later activity (on a loaded machine, seconds later).
        async def consolidated() -> list[Any] | None:
            events = await events_of(s, name)
            return events if any(r == "Consolidated" for r, _ in events) else None

        events = await eventually(consolidated, timeout=60, what="the Consolidated Event")
        found = [m for r, m in events if r == "CheaperOfferFound"]
        assert len(found) == 1 and "$0.20/h" in found[0], events
        made = [m for r, m in events if r == "Consolidated"]
        assert made == [f"node {old.name}: Cheaper, saving $0.24/h"], events

        async def saved() -> Decimal | None:
            savings = (await pool_status(pool)).consolidation.savings_made_hourly
            return savings if savings else None

        assert await eventually(saved, timeout=60, what="savingsMadeHourly in the status") == Decimal("0.24")


@contextlib.asynccontextmanager
async def market_world(env: WorkflowEnvironment) -> AsyncIterator[Any]:
    """The simulated world and a worker whose pricing cache keeps a listing for 0.5 s (the
    worker's is 60 s: a market move is seen within a minute), for pools started by the test."""
    import uuid

    from sim.world import sim_world
    from tests.test_pool_races import Gates, Setup
    from workers.main import WorkerConfig, build_activities, make_worker

    async with contextlib.AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        activities.pool.registry.offers.ttl = 0.5
        queue = f"reshop-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(env.client, activities, task_queue=queue))
        setup = Setup(env, world, queue, Gates())
        stack.push_async_callback(setup.end_workflows)
        yield setup


async def test_a_re_shop_is_called_off_while_a_do_not_disrupt_pod_holds_the_node(temporal: WorkflowEnvironment) -> None:
    """A cheaper offer appears for a node running a `tgp.io/do-not-disrupt` pod: the node is
    never drained; the re-shop is called off (ReshopHeld, naming the pod), its replacement let go
    (terminated), and the node stays, Ready, on its old offer."""
    from tests.test_node_disruption import put_held_pod
    from tests.test_pool_races import pool_spec, start_class, start_pool
    from tests.test_pool_races import pool_events as events_of
    from tests.test_pool_races import status as pool_status

    async with market_world(temporal) as s:
        await start_class(s, "held")
        spec = pool_spec("held", minNodes=1, disruption={**KEEP, "consolidation": {"cheaperBy": "30%", "after": "1s"}})
        name, pool = await start_pool(s, spec, resync_interval=timedelta(seconds=1), offer_check_ttl=timedelta(seconds=1), watch_interval=timedelta(seconds=1))

        async def one_ready() -> Any:
            listed = (await pool_status(pool)).nodes
            return listed[0] if len(listed) == 1 and listed[0].phase == "Ready" else None

        old = await eventually(one_ready, timeout=60, what="the floor node Ready")
        s.workflow_ids.add(old.workflow_id)
        await put_held_pod(s.world, old.name, "train")
        looks = s.world.cloud.describe_requests
        await eventually(lambda: _true(s.world.cloud.describe_requests >= looks + 2), timeout=60, what="the node to look at itself twice")
        from tests.test_pool_consolidation import demand
        from workflows.pool import GPUNodePoolWorkflow

        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, {old.name: 1}, {}))  # the Node's size, as the bridge reports it

        s.world.cloud.set_price("rtx4090-us-east", Decimal("0.20"))
        events = await eventually(lambda: _reason(events_of(s, name), "ReshopHeld"), timeout=90, what="the ReshopHeld Event")
        text = next(m for r, m in events if r == "ReshopHeld")
        assert f"node {old.name}" in text and "default/train" in text, text

        bought = [node_of(n) for e, n, _ in s.world.cloud.log if e == "bought"]
        assert len(bought) == 2 and bought[0] == old.name, s.world.cloud.log
        s.workflow_ids.add(old.workflow_id.rsplit("/", 1)[0] + "/" + bought[1])

        async def let_go() -> bool:
            return any(e == "deleted" and node_of(n) == bought[1] for e, n, _ in s.world.cloud.log)

        await eventually(let_go, timeout=60, what="the called-off replacement to be terminated")
        assert not [e for e in s.world.cloud.log if e[0] == "deleted" and node_of(e[1]) == old.name], s.world.cloud.log
        node = s.env.client.get_workflow_handle(old.workflow_id)
        from tgp.types import NodeStatus

        status = await node.query("status", result_type=NodeStatus)
        assert status.phase.value == "Ready" and not [r for r in status.stages if r.stage.value == "Draining"], status.stages


async def _true(value: bool) -> bool:
    return value


async def _reason(events: Any, reason: str) -> list[tuple[str, str]] | None:
    listed = await events
    return listed if any(r == reason for r, _ in listed) else None


async def test_a_node_told_to_end_for_drift_waits_for_its_do_not_disrupt_pod(time_skipping: WorkflowEnvironment) -> None:
    """The node side of `disrupt`: a Ready node running a do-not-disrupt pod, told that its
    replacement is Ready (reason Drifted), stays for hours and says why (DisruptionHeld naming
    the pod); once the pod is gone it drains and ends `drifted: replaced by <new>`, everything
    released. A `disrupt` with an unknown reason is ignored."""
    from tests.conftest import running_world, skip_time
    from tests.test_node_disruption import put_held_pod
    from tests.test_node_lifecycle import assert_nothing_left, request, start, wait_phase
    from tests.test_watch_events import AT_REST, bridge_running, told
    from tgp.types import DisruptRequest, NodePhase, NodeStatus, Stage
    from workflows.node import GPUNodeWorkflow

    async with running_world(time_skipping) as (world, _, queue), bridge_running(time_skipping, world, queue):
        req = request(timeouts=AT_REST)
        handle = await start(time_skipping, queue, req)
        await wait_phase(handle, NodePhase.READY)
        await put_held_pod(world, req.node_name, "train")
        await told(handle, holding=1, holders=["default/train"])

        await handle.signal(GPUNodeWorkflow.disrupt, DisruptRequest(reason="Sideways", replacement="x"))
        await handle.signal(GPUNodeWorkflow.disrupt, DisruptRequest(reason="Drifted", replacement="rtx-rabcde", detail="rtx-rabcde is Ready"))
        await skip_time(time_skipping, timedelta(hours=2), step=timedelta(minutes=30))
        status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
        assert status.phase is NodePhase.READY, "drained while a do-not-disrupt pod ran"
        held = [r for r in status.stages if r.stage is Stage.DISRUPTION_HELD]
        assert held and "has drifted" in held[-1].reason and "default/train" in held[-1].reason, status.stages

        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            (await kube.delete("/api/v1/namespaces/default/pods/train", params={"gracePeriodSeconds": "0"})).raise_for_status()
        final = await asyncio.wait_for(handle.result(), 120)
        assert final.phase is NodePhase.TERMINATED and final.end_reason == "drifted: replaced by rtx-rabcde (make-before-break): rtx-rabcde is Ready", final
        assert_nothing_left(world, req.node_name)


async def _passed(pool: Any, count: int) -> bool:
    return await passes(pool) >= count
