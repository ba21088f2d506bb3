"""The pool's consolidation look (issue 21 item 4): on the dev server with the simulated world and
a pool that looks each second, the test sends what the bridge would (pods pending, the free GPUs
of Ready nodes and the GPU requests of the pods bound to them) and reads the savings the pool's
status shows. (On the time-skipping server these whole lives met its bug: a workflow task that
cancels a timer which fired meanwhile is refused, and the run is stranded, sdk-java#2606.)"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from crd_bridge.bridge import Bridge
from tests.conftest import eventually, running_world
from tests.test_pool_accounting import CLASS, LOOK, end_entities, passes, pool_spec, start_pool
from tests.test_pool_demand import CATALOG
from tgp.crds import GPUNodePoolStatus
from tgp.messages import Demand, PoolUpdate
from workflows.pool import GPUNodePoolWorkflow


def demand(pods: dict[str, int], free: dict[str, int], bound: dict[str, list[int]], held: list[str] | None = None) -> Demand:
    return Demand(
        pods=sorted(pods),
        observed_at=datetime.now(timezone.utc),
        max_gpus=max(pods.values(), default=1),
        pod_gpus={k: v for k, v in pods.items() if v != 1},
        free_gpus=free,
        bound_gpus=bound,
        held_nodes=held or [],
    )


async def found(pool: WorkflowHandle, savings: str, candidates: int) -> GPUNodePoolStatus:
    """The pool's status once looks made after now (four passes: twice its 2 s `after`) found
    `savings` $/h in `candidates` node(s)."""
    since = await passes(pool)

    async def shown() -> GPUNodePoolStatus | None:
        if await passes(pool) < since + 4:
            return None
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        c = status.consolidation
        return status if c is not None and c.savings_found_hourly == Decimal(savings) and c.candidates == candidates else None

    return await eventually(shown, timeout=60, what=f"${savings}/h found in {candidates} node(s) in status.consolidation")


async def ready_nodes(pool: WorkflowHandle, count: int) -> list[str]:
    async def ready() -> list[str] | None:
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        names = sorted(n.name for n in status.nodes if n.phase == "Ready")
        return names if len(names) == count else None

    return await eventually(ready, timeout=60, what=f"{count} Ready node(s)")


async def test_the_pool_removes_a_node_whose_pods_fit_on_the_other_and_shows_the_savings(temporal: WorkflowEnvironment) -> None:
    """Two 2-GPU nodes ($0.95/h each) bought for two 2-GPU pods; then each runs a 1-GPU pod
    only. While do-not-disrupt holds both, nothing is found. Once only one is held, the other's
    pod fits on the held one's free GPU: the pool tells the other to end (Underutilized), it
    drains and terminates, and status.consolidation shows $0.95/h made."""
    async with running_world(temporal, catalog=CATALOG) as (world, _, queue):
        class_name = f"cons-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(class_name, disruption={"consolidation": {"after": "2s"}, "idleTimeout": "1h"})
        pool = await start_pool(temporal, queue, spec, resync_interval=LOOK)
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/a": 2, "ml/b": 2}, {}, {}))
        a, b = await ready_nodes(pool, 2)

        # A do-not-disrupt pod on each: nothing to find, nothing done.
        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, {a: 1, b: 1}, {a: [1], b: [1]}, held=[a, b]))
        status = await found(pool, "0", 0)
        assert status.consolidation is not None and status.consolidation.savings_made_hourly == 0
        assert len(status.nodes) == 2 and len(world.cloud.live_instances()) == 2

        # Only a held: b goes, its pod fits on a.
        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, {a: 1, b: 1}, {a: [1], b: [1]}, held=[a]))

        async def removed() -> GPUNodePoolStatus | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            c = status.consolidation
            return status if c is not None and c.savings_made_hourly == Decimal("0.95") else None

        status = await eventually(removed, timeout=60, what="$0.95/h made in status.consolidation")
        assert status.consolidation is not None and b in status.consolidation.last_action
        alive = [i.name for i in world.cloud.live_instances()]
        assert alive == [f"tgp-{a}-1"], f"only {a}'s instance runs: {alive}"
        assert [n.name for n in status.nodes if n.phase == "Ready"] == [a]

        # Turned off: nothing found any more.
        off = spec.model_copy(update={"disruption": spec.disruption.model_copy(update={"consolidation": None})})
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=off, generation=2, node_class=CLASS))

        async def cleared() -> bool:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return status.consolidation is not None and status.consolidation.savings_found_hourly == 0 and status.consolidation.candidates == 0

        await eventually(cleared, timeout=60, what="no savings found once consolidation is off")
        await end_entities(temporal, pool, class_name)


async def test_a_free_gpu_a_pending_pod_is_nominated_to_is_no_room_for_consolidation(temporal: WorkflowEnvironment) -> None:
    """Two 2-GPU nodes, each running a 1-GPU pod, and a pending 1-GPU pod the pool nominates to
    one of their free GPUs (it binds there): neither node's pod has room on the other, so neither
    node is removed. (Counting that GPU free, the look removed a node, and a pod was left without
    one.) Re-shopping is kept out of it (cheaperBy 99%)."""
    async with running_world(temporal, catalog=CATALOG) as (world, _, queue):
        class_name = f"cons-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(class_name, disruption={"consolidation": {"after": "2s", "cheaperBy": "99%"}, "idleTimeout": "1h"})
        pool = await start_pool(temporal, queue, spec, resync_interval=LOOK, bind_grace=timedelta(minutes=1))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/a": 2, "ml/b": 2}, {}, {}))
        a, b = await ready_nodes(pool, 2)

        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/c": 1}, {a: 1, b: 1}, {a: [1], b: [1]}))
        # Looks past `after`, within the pod's bind grace (a minute here: then its nomination
        # lapses and it gets a node of its own).
        status = await found(pool, "0", 0)
        assert status.consolidation is not None and status.consolidation.savings_made_hourly == 0, status.consolidation
        assert sorted(n.name for n in status.nodes if n.phase == "Ready") == [a, b] and len(world.cloud.live_instances()) == 2, (
            "a node was removed though a pending pod takes the room its pods were planned onto"
        )
        await end_entities(temporal, pool, class_name)


async def test_the_bridge_reports_the_gpus_bound_to_each_ready_node_of_a_pool_and_which_are_held() -> None:
    """What the pool's look reads (Demand.bound_gpus, held_nodes), from Nodes and pods as the API
    serves them: only Ready, schedulable nodes of the pool with GPUs registered; finished pods
    free theirs; a do-not-disrupt pod or Node holds its node."""
    bridge = Bridge(None, None)  # type: ignore[arg-type]  # no client needed to track what the informers see

    dnd = {"karpenter.sh/do-not-disrupt": "true"}

    def gpu_node(name: str, gpus: int, *, ready: bool = True, pool: str = "rtx", annotations: dict[str, str] | None = None) -> dict[str, Any]:
        labels = {"tgp.io/pool": pool, "tgp.io/pool-namespace": "ml", "tgp.io/managed": "true"}
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        meta = {"name": name, "labels": labels, "annotations": annotations or {}}
        return {"metadata": meta, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "conditions": conditions}}

    def gpu_pod(name: str, node: str, gpus: int, phase: str = "Running", annotations: dict[str, str] | None = None) -> dict[str, Any]:
        container = {"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}
        meta = {"name": name, "namespace": "ml", "annotations": annotations or {}}
        return {"metadata": meta, "spec": {"nodeName": node, "containers": [container]}, "status": {"phase": phase}}

    for node in (gpu_node("a", 4), gpu_node("b", 2), gpu_node("c", 1, annotations=dnd), gpu_node("booting", 2, ready=False), gpu_node("other", 2, pool="x")):
        await bridge.on_node("ADDED", node)
    for pod in (gpu_pod("p1", "a", 1), gpu_pod("p2", "a", 2), gpu_pod("p3", "b", 1, annotations=dnd), gpu_pod("done", "b", 1, "Succeeded", dnd),
                gpu_pod("p4", "booting", 1), gpu_pod("p5", "other", 1)):
        await bridge.on_pod("ADDED", pod)
    assert bridge.free_gpus("ml/rtx") == {"a": 1, "b": 1, "c": 1}
    assert bridge.bound_gpus("ml/rtx") == {"a": [2, 1], "b": [1]}
    assert bridge.held_nodes("ml/rtx") == ["b", "c"], "a do-not-disrupt pod holds b, the Node's annotation c"
    bridge._batch_changed.clear()
    await bridge.on_pod("MODIFIED", gpu_pod("p1", "a", 1, annotations=dnd))  # annotated while it runs: its GPUs are the same
    assert bridge.held_nodes("ml/rtx") == ["a", "b", "c"]
    assert bridge._batch_changed.is_set(), "a change of what holds a node sends the demand again"
    bridge._batch_changed.clear()
    await bridge.on_node("MODIFIED", gpu_node("c", 1))  # the Node's annotation removed
    assert bridge.held_nodes("ml/rtx") == ["a", "b"] and bridge._batch_changed.is_set()
