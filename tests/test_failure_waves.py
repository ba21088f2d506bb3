"""Issue 20: the nodes of one batch failing together count as one launch failure. The pool's
launch back-off doubled per failed node (30 s, 1 m, 2 m, 4 m, 8 m...): a few nodes of a burst
failing at once under load held the pool for minutes with Ready True (LaunchBackoff) while pods
stayed pending. A node started after the last failure counts again."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world
from tests.test_entities_heal import start_pool
from tests.test_pool_accounting import pool_spec
from tgp.crds import GPUNodePoolStatus
from tgp.messages import NodeReport
from tgp.types import NodePhase
from workflows.pool import GPUNodePoolWorkflow


async def report(pool: WorkflowHandle, name: str, node: str, phase: NodePhase, at: datetime) -> None:
    await pool.signal(
        GPUNodePoolWorkflow.node_phase, NodeReport(workflow_id=f"gpunode/ml/{name}/{node}", node_name=node, phase=phase, at=at, reason="join timeout")
    )


async def ready_message(pool: WorkflowHandle, failures: int) -> str:
    async def check() -> str | None:
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        ready = {c.type: c for c in status.conditions}.get("Ready")
        return ready.message if ready is not None and f"{failures} launch failure(s)" in ready.message else None

    return await eventually(check, timeout=60, what=f"Ready to count {failures} launch failure(s)")


async def test_a_batch_failing_together_is_one_failure_and_a_later_node_counts_again(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (_, _, queue):
        name = f"wave-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(temporal, queue, name, pool_spec("sim"))
        t0 = datetime.now(timezone.utc)
        batch = [f"{name}-{i}" for i in range(5)]
        for node in batch:
            await report(pool, name, node, NodePhase.PENDING, t0)
        for i, node in enumerate(batch):
            await report(pool, name, node, NodePhase.FAILED, t0 + timedelta(seconds=1 + i))
        message = await ready_message(pool, 1)
        first = t0 + timedelta(seconds=1) + timedelta(seconds=30)
        assert f"next launch after {first:%H:%M:%S}" in message, message
        # A node started after those failures fails: that is news, the back-off doubles.
        later = t0 + timedelta(seconds=10)
        await report(pool, name, f"{name}-later", NodePhase.PENDING, later)
        await report(pool, name, f"{name}-later", NodePhase.FAILED, later + timedelta(seconds=1))
        message = await ready_message(pool, 2)
        assert f"next launch after {later + timedelta(seconds=1) + timedelta(minutes=1):%H:%M:%S}" in message, message
