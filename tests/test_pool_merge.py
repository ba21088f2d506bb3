"""Several nodes into one (issue 35 item 9), with a real pool (looking each second) on the dev
server and the simulated world: three 1-GPU nodes whose pods fit one cheaper 4-GPU node are replaced by it,
make-before-break: no old node is told to go before the new one is Ready, and the three old
instances are terminated."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from decimal import Decimal

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from sim.cloud import SimOffer
from tests.conftest import eventually, running_world
from tests.test_pool_accounting import LOOK, end_entities, pool_spec, start_pool
from tests.test_pool_consolidation import demand, ready_nodes
from tgp.crds import GPUNodePoolStatus
from tgp.types import node_workflow_id
from workflows.pool import GPUNodePoolWorkflow

# Three 1-GPU nodes cost $1.32/h; one 4-GPU node $1.10/h (16% less).
CATALOG = (
    SimOffer("rtx4090-1x", "RTX4090", "us-east", Decimal("0.44")),
    SimOffer("rtx4090-4x", "RTX4090", "us-east", Decimal("1.10"), gpu_count=4),
)


async def entered(env: WorkflowEnvironment, workflow_id: str, phase: str) -> datetime:
    """When node workflow `workflow_id` entered `phase` (its TgpPhase search attribute)."""
    async for event in env.client.get_workflow_handle(workflow_id).fetch_history_events():
        fields = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
        if "TgpPhase" in fields and json.loads(fields["TgpPhase"].data) == phase:
            return event.event_time.ToDatetime()
    raise AssertionError(f"{workflow_id} never entered {phase}")


async def told_to_go_at(env: WorkflowEnvironment, workflow_id: str) -> list[datetime]:
    """When node workflow `workflow_id` was told to end (its `disrupt` signals)."""
    return [
        event.event_time.ToDatetime()
        async for event in env.client.get_workflow_handle(workflow_id).fetch_history_events()
        if event.workflow_execution_signaled_event_attributes.signal_name == "disrupt"
    ]


async def status_of(pool: WorkflowHandle) -> GPUNodePoolStatus:
    status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
    return status


async def test_three_one_gpu_nodes_are_merged_into_one_cheaper_four_gpu_node_make_before_break(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal, catalog=CATALOG) as (world, _, queue):
        class_name = f"merge-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(class_name, disruption={"consolidation": {"after": "2s", "cheaperBy": "10%"}, "idleTimeout": "1h", "budgets": [{"nodes": "3"}]})
        pool = await start_pool(temporal, queue, spec, resync_interval=LOOK)
        # The pods come one at a time (together they would be packed onto one 4-GPU node):
        # each buys a 1-GPU node and runs there.
        old: list[str] = []
        for pod in ("ml/a", "ml/b", "ml/c"):
            await pool.signal(GPUNodePoolWorkflow.demand, demand({pod: 1}, dict.fromkeys(old, 0), {n: [1] for n in old}))
            old = await ready_nodes(pool, len(old) + 1)
        assert sorted(i.offer.id for i in world.cloud.live_instances()) == ["rtx4090-1x"] * 3
        # The new node's instance stays booting until released: meanwhile the pool says what it
        # does, and nothing of the three is touched.
        world.cloud.hold_boots()
        await pool.signal(GPUNodePoolWorkflow.demand, demand({}, dict.fromkeys(old, 0), {n: [1] for n in old}))

        async def merging() -> GPUNodePoolStatus | None:
            status = await status_of(pool)
            c = status.consolidation
            bought = [i.offer.id for i in world.cloud.live_instances()]
            return status if c is not None and c.consolidating.startswith("Consolidating 3 nodes into 1, saving $0.22/h") and "rtx4090-4x" in bought else None

        status = await eventually(merging, timeout=90, what="status.consolidation.consolidating names the merge of 3 nodes, its new node bought")
        assert sorted(n.name for n in status.nodes if n.phase == "Ready") == sorted(old), "the three stay Ready while the new node boots"
        assert sorted(i.offer.id for i in world.cloud.live_instances()) == ["rtx4090-1x"] * 3 + ["rtx4090-4x"]
        pool_name = pool.id.rsplit("/", 1)[-1]
        for name in old:
            assert not await told_to_go_at(temporal, node_workflow_id("ml", pool_name, name)), f"{name} was told to go before the new node was Ready"
        world.cloud.release_boots()

        async def merged() -> list[str] | None:
            status = await status_of(pool)
            alive = world.cloud.live_instances()
            ready = [n.name for n in status.nodes if n.phase == "Ready"]
            return ready if [i.offer.id for i in alive] == ["rtx4090-4x"] and len(ready) == 1 else None

        (new,) = await eventually(merged, timeout=120, what="only the 4-GPU node left, Ready, and the three 1-GPU instances terminated")
        assert new not in old
        became_ready = await entered(temporal, node_workflow_id("ml", pool_name, new), "Ready")
        for name in old:
            drained = await entered(temporal, node_workflow_id("ml", pool_name, name), "Draining")
            assert drained > became_ready, f"{name} began draining at {drained}, before the new node {new} was Ready at {became_ready}"

        async def over() -> GPUNodePoolStatus | None:
            status = await status_of(pool)
            return status if status.consolidation is not None and status.consolidation.consolidating == "" else None

        status = await eventually(over, timeout=30, what="the merge over in status.consolidation (the pool's next pass)")
        assert status.consolidation is not None and status.consolidation.savings_made_hourly == Decimal("0.22")
        await end_entities(temporal, pool, class_name)
