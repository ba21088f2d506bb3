"""Review #5: Temporal admits 10 updates in flight per workflow. When more of a pool's nodes ask
it at once (`may_disrupt`, through the real `ask_pool_to_disrupt` activity), the server refuses
the others (RESOURCE_EXHAUSTED); those asks must not come back as refusals (each would be a
DisruptionBlocked and a minute's wait, every held node again in lockstep): they are asked
again after a jittered pause and get the pool's own answer."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from typing import Any

from temporalio.client import Client, Interceptor, OutboundInterceptor, StartWorkflowUpdateInput, WorkflowUpdateHandle
from temporalio.service import RPCError, RPCStatusCode
from tests.conftest import eventually
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from sim.world import sim_world
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.messages import DisruptionAnswer, DisruptionAsk, PoolAsk, PoolUpdate, pool_workflow_id
from workers.main import WorkerConfig, build_activities
from workflows.pool import GPUNodePoolWorkflow, PoolInput

ASKING = 25  # nodes of one pool asking at once: more than Temporal's 10 in flight


class Refusals(Interceptor):
    """Counts the updates the server refused for its in-flight limit (observes, changes nothing)."""

    def __init__(self) -> None:
        self.exhausted = 0

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        counter = self

        class Counting(OutboundInterceptor):
            async def start_workflow_update(self, input: StartWorkflowUpdateInput) -> WorkflowUpdateHandle[Any]:
                try:
                    return await super().start_workflow_update(input)
                except RPCError as exc:
                    if exc.status is RPCStatusCode.RESOURCE_EXHAUSTED:
                        counter.exhausted += 1
                    raise

        return Counting(next)


async def test_many_nodes_asking_their_pool_at_once_get_its_answer_not_a_refusal(temporal: WorkflowEnvironment) -> None:
    refusals = Refusals()
    client = Client(**{**temporal.client.config(), "interceptors": [refusals]})
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.05))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        queue, name = f"asks-{uuid.uuid4().hex[:8]}", f"p-{uuid.uuid4().hex[:6]}"
        # The pool's worker is not up yet: the first asks wait in flight, the rest are refused.
        spec = pool_spec("cls", disruption={"idleTimeout": "1h", "budgets": []})  # no limit: every answer is yes
        pool = await temporal.client.start_workflow(
            GPUNodePoolWorkflow.run,
            PoolInput(namespace="ml", name=name),
            id=pool_workflow_id("ml", name),
            task_queue=queue,
            start_signal="update",
            start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=CLASS)],
        )
        stack.push_async_callback(pool.terminate, "test over")

        async def ask(i: int) -> DisruptionAnswer:
            call = PoolAsk(pool_workflow_id=pool.id, ask=DisruptionAsk(workflow_id=f"gpunode/ml/{name}/n{i}", node_name=f"n{i}", reason="Empty"))
            answer: DisruptionAnswer = await ActivityEnvironment(client=client).run(activities.node.ask_pool_to_disrupt, call)
            return answer

        asks = [asyncio.create_task(ask(i)) for i in range(ASKING)]
        await eventually(lambda: _true(refusals.exhausted > 0), timeout=30, what="the server to refuse asks past its in-flight limit")
        async with Worker(temporal.client, task_queue=queue, workflows=[GPUNodePoolWorkflow], activities=activities.all()):
            answers = await asyncio.gather(*asks)
    # The pool allows every ask; an ask the server kept out past POOL_ANSWER_TIMEOUT comes back
    # `unasked` (the node asks again within seconds, jittered), never as a refusal.
    refused = [a for a in answers if not a.allowed and not a.unasked]
    assert not refused, f"{len(refused)} of {ASKING} asks came back refused by the server's limit, not by the pool: {refused[0].message}"
    assert sum(a.allowed for a in answers) >= 10, [a.message for a in answers]


async def _true(value: bool) -> bool:
    return value
