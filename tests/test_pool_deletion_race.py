"""A deleted pool never lets its finalizer go while a node start it made may still happen
(issue 35 item 2). Under load a start's RPC can time out after the server took it, or the
batch's activity outlive the pool's wait: the node workflow then appears after the pool looked.
Its evict, sent as a signal, found no workflow and counted the node closed; the late start then
bought an instance for a pool that was gone (`sim-0056` live after the pool object was gone).
Now such a start is taken by the evict itself (signal-with-start, the same id): the node ends at
once, buying nothing, and the late start is refused."""

from __future__ import annotations

import dataclasses

from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.pool import PoolActivities, _start_node_workflow
from tests.conftest import running_world
from tests.test_node_lifecycle import request
from tgp.messages import EvictNodesInput
from tgp.types import NodePhase
from workflows.node import GPUNodeWorkflow


async def test_a_start_that_may_still_happen_is_taken_by_the_pools_evict(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        req = request()
        env = ActivityEnvironment(client=temporal.client)
        env.info = dataclasses.replace(env.info, task_queue=queue)
        acts = PoolActivities(cluster=None, providers={})  # type: ignore[arg-type]  # evicting reads no cloud

        closed = await env.run(acts.evict_nodes, EvictNodesInput(may_start=[req]))
        assert closed == [], "a node not yet started is not closed: it may still start"
        handle = temporal.client.get_workflow_handle_for(GPUNodeWorkflow.run, req.workflow_id)
        ended = await handle.result()
        assert ended.phase is NodePhase.TERMINATED and not ended.attempts, ended

        await env.run(_start_node_workflow, temporal.client, req)  # the late start
        assert (await handle.describe()).status is WorkflowExecutionStatus.COMPLETED
        assert world.cloud.create_requests == 0, "the late start bought an instance"
        assert await env.run(acts.evict_nodes, EvictNodesInput(may_start=[req])) == [req.workflow_id], "closed now"
