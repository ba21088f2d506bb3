"""The pool's consolidation look (issue 21 item 4): on the time-skipping server with the
simulated world, the test sends what the bridge would (pods pending, the free GPUs of Ready nodes
and the GPU requests of the pods bound to them) and reads the savings the pool's status shows."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from crd_bridge.bridge import Bridge
from tests.conftest import eventually, running_world, skip_time
from tests.test_pool_accounting import CLASS, end_entities, pool_spec, start_pool
from tests.test_pool_demand import CATALOG, time_skipping  # noqa: F401 - the fixture
from tgp.crds import GPUNodePoolStatus
from tgp.messages import Demand, PoolUpdate
from workflows.pool import GPUNodePoolWorkflow


def demand(pods: dict[str, int], free: dict[str, int], bound: dict[str, list[int]]) -> Demand:
    return Demand(
        pods=sorted(pods),
        observed_at=datetime.now(timezone.utc),
        max_gpus=max(pods.values(), default=1),
        pod_gpus={k: v for k, v in pods.items() if v != 1},
        free_gpus=free,
        bound_gpus=bound,
    )


async def ready_nodes(pool: WorkflowHandle, count: int) -> list[str]:
    async def ready() -> list[str] | None:
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        names = sorted(n.name for n in status.nodes if n.phase == "Ready")
        return names if len(names) == count else None

    return await eventually(ready, timeout=60, what=f"{count} Ready node(s)")


async def test_the_pool_shows_the_savings_of_removing_a_node_whose_pods_fit_on_the_other(time_skipping: WorkflowEnvironment) -> None:
    """Two 2-GPU nodes ($0.95/h each) bought for two 2-GPU pods; then each runs a 1-GPU pod
    only: one node's pod fits on the other's free GPU, and the pool's status says removing it
    saves $0.95/h (nothing is carried out yet: the lead wires the replacement step)."""
    async with running_world(time_skipping, catalog=CATALOG) as (_, _, queue):
        class_name = f"cons-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(class_name, disruption={"consolidation": {"after": "2m"}, "idleTimeout": "1h"})
        pool = await start_pool(time_skipping, queue, spec)
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/a": 2, "ml/b": 2}, {}, {}))
        a, b = await ready_nodes(pool, 2)
        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, {a: 1, b: 1}, {a: [1], b: [1]}))
        await skip_time(time_skipping, timedelta(minutes=3), step=timedelta(minutes=1))

        async def found() -> GPUNodePoolStatus | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            c = status.consolidation
            return status if c is not None and c.savings_found_hourly > 0 else None

        status = await eventually(found, timeout=60, what="the savings in status.consolidation")
        assert status.consolidation is not None
        assert status.consolidation.savings_found_hourly == Decimal("0.95") and status.consolidation.candidates == 1
        assert status.consolidation.savings_made_hourly == 0, "nothing is carried out yet"
        assert len(status.nodes) == 2

        # Turned off: nothing found any more.
        off = spec.model_copy(update={"disruption": spec.disruption.model_copy(update={"consolidation": None})})
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=off, generation=2, node_class=CLASS))

        async def cleared() -> bool:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return status.consolidation is not None and status.consolidation.savings_found_hourly == 0 and status.consolidation.candidates == 0

        await eventually(cleared, timeout=60, what="no savings found once consolidation is off")
        await end_entities(time_skipping, pool, class_name)


def test_the_bridge_reports_the_gpu_requests_bound_to_each_ready_node_of_a_pool() -> None:
    """What the pool's look reads (Demand.bound_gpus), from Nodes and pods as the API serves them:
    only Ready, schedulable nodes of the pool with GPUs registered; finished pods free theirs."""
    bridge = Bridge(None, None)  # type: ignore[arg-type]  # no client needed to track what the informers see

    def gpu_node(name: str, gpus: int, *, ready: bool = True, pool: str = "rtx") -> dict[str, Any]:
        labels = {"tgp.io/pool": pool, "tgp.io/pool-namespace": "ml", "tgp.io/managed": "true"}
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "conditions": conditions}}

    def gpu_pod(node: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
        container = {"name": "c", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}
        return {"spec": {"nodeName": node, "containers": [container]}, "status": {"phase": phase}}

    for node in (gpu_node("a", 4), gpu_node("b", 2), gpu_node("booting", 2, ready=False), gpu_node("other", 2, pool="x")):
        bridge._track_node("ADDED", node)
    for key, pod in {"ml/p1": gpu_pod("a", 1), "ml/p2": gpu_pod("a", 2), "ml/p3": gpu_pod("b", 1), "ml/done": gpu_pod("b", 1, "Succeeded"),
                     "ml/p4": gpu_pod("booting", 1), "ml/p5": gpu_pod("other", 1)}.items():
        bridge._track_bound(key, "ADDED", pod)
    assert bridge.free_gpus("ml/rtx") == {"a": 1, "b": 1}
    assert bridge.bound_gpus("ml/rtx") == {"a": [2, 1], "b": [1]}
