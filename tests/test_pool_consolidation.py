"""The pool's consolidation look (issue 21 item 4): on the time-skipping server with the
simulated world, the test sends what the bridge would (pods pending, the free GPUs of Ready nodes
and the GPU requests of the pods bound to them) and reads the savings the pool's status shows."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world, skip_time
from tests.test_pool_accounting import end_entities, pool_spec, start_pool
from tests.test_pool_demand import CATALOG, time_skipping  # noqa: F401 - the fixture
from tgp.crds import GPUNodePoolStatus
from tgp.messages import Demand
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
        await end_entities(time_skipping, pool, class_name)
