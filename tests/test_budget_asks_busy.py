"""Review #5: Temporal admits 10 updates in flight per workflow. When more of a pool's nodes ask
it at once (`may_disrupt`, through the real `ask_pool_to_disrupt` activity), the server refuses
the others (RESOURCE_EXHAUSTED); those asks must not come back as refusals (each would be a
DisruptionBlocked and a minute's wait, every held node again in lockstep): they are asked
again after a jittered pause and get the pool's own answer.

Session 9: one worker's asks to a pool go together (`may_disrupt_many`, activities.batching), so
the server refuses none of them: a pool of 100 nodes going idle together had its asks refused
past the tenth and waited out growing pauses (make bench: the last terminate call 20 s after the
idle timeout). The refusal path stays for asks from many workers at once."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import Any

from temporalio.client import Client, Interceptor, OutboundInterceptor, StartWorkflowUpdateInput, WorkflowUpdateHandle
from temporalio.service import RPCError, RPCStatusCode
from tests.conftest import eventually
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio import workflow
from temporalio.worker import Worker

from sim.world import sim_world
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.messages import DisruptionAnswer, DisruptionAsk, PoolAsk, PoolUpdate, pool_workflow_id
from workers.main import WorkerConfig, build_activities
from workflows.pool import GPUNodePoolWorkflow, PoolInput

ASKING = 25  # nodes of one pool asking at once: more than Temporal's 10 in flight


class Refusals(Interceptor):
    """Counts the updates sent, and those the server refused for its in-flight limit (observes,
    changes nothing)."""

    def __init__(self) -> None:
        self.exhausted = 0
        self.sent = 0

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        counter = self

        class Counting(OutboundInterceptor):
            async def start_workflow_update(self, input: StartWorkflowUpdateInput) -> WorkflowUpdateHandle[Any]:
                counter.sent += 1
                try:
                    return await super().start_workflow_update(input)
                except RPCError as exc:
                    if exc.status is RPCStatusCode.RESOURCE_EXHAUSTED:
                        counter.exhausted += 1
                    raise

        return Counting(next)


async def asks_at_once(temporal: WorkflowEnvironment, refusals: Refusals, *, workers: int) -> list[DisruptionAnswer]:
    """ASKING nodes of one pool ask it at once through the real activity, from `workers` worker
    processes (each a client of its own: the activities gather asks per client), before the
    pool's worker is up; then it comes up and answers. A pool without budgets allows every ask."""
    clients = [Client(**{**temporal.client.config(), "interceptors": [refusals]}) for _ in range(workers)]
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.05))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        queue, name = f"asks-{uuid.uuid4().hex[:8]}", f"p-{uuid.uuid4().hex[:6]}"
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
            answer: DisruptionAnswer = await ActivityEnvironment(client=clients[i % workers]).run(activities.node.ask_pool_to_disrupt, call)
            return answer

        asks = [asyncio.create_task(ask(i)) for i in range(ASKING)]
        # The pool's worker is not up yet: the first updates wait in flight.
        await eventually(lambda: _true(refusals.sent >= min(workers, 10)), timeout=30, what="the first asks to be sent")
        if workers > 10:
            await eventually(lambda: _true(refusals.exhausted > 0), timeout=30, what="the server to refuse asks past its in-flight limit")
        async with Worker(temporal.client, task_queue=queue, workflows=[GPUNodePoolWorkflow], activities=activities.all()):
            return await asyncio.gather(*asks)


async def test_one_workers_nodes_asking_their_pool_at_once_go_together_and_none_is_refused(temporal: WorkflowEnvironment) -> None:
    refusals = Refusals()
    answers = await asks_at_once(temporal, refusals, workers=1)
    assert refusals.exhausted == 0, f"the server refused {refusals.exhausted} of {refusals.sent} updates for its in-flight limit"
    assert refusals.sent < ASKING / 2, f"{refusals.sent} updates for {ASKING} asks: not gathered"
    assert all(a.allowed for a in answers), [a.message for a in answers if not a.allowed]


async def test_many_workers_nodes_asking_their_pool_at_once_get_its_answer_not_a_refusal(temporal: WorkflowEnvironment) -> None:
    refusals = Refusals()
    answers = await asks_at_once(temporal, refusals, workers=ASKING)  # an ask per worker: past the limit
    # The pool allows every ask; an ask the server kept out past POOL_ANSWER_TIMEOUT comes back
    # `unasked` (the node asks again within seconds, jittered), never as a refusal.
    refused = [a for a in answers if not a.allowed and not a.unasked]
    assert not refused, f"{len(refused)} of {ASKING} asks came back refused by the server's limit, not by the pool: {refused[0].message}"
    assert sum(a.allowed for a in answers) >= 10, [a.message for a in answers]


@workflow.defn(name="SilentPool", sandboxed=False)
class SilentPool:
    """A pool that never answers: no worker polls its task queue."""

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)


async def _true(value: bool) -> bool:
    return value


async def test_an_ask_a_pool_never_answers_leaves_no_update_open(temporal: WorkflowEnvironment) -> None:
    """A pool whose worker never comes: the ask goes ahead after POOL_ANSWER_TIMEOUT, as before
    the asks went together, and the update that carried it is not left open behind it (where
    every later ask of this worker to the pool would queue, and where a time-skipping test
    server would wait on it)."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.05))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.pool_answer_timeout = timedelta(seconds=1)  # the ask and its update: waited out sooner
        queue = f"silent-{uuid.uuid4().hex[:8]}"
        pool = await temporal.client.start_workflow(SilentPool.run, id=queue, task_queue=queue)  # no worker polls it
        stack.push_async_callback(pool.terminate, "test over")
        call = PoolAsk(pool_workflow_id=pool.id, ask=DisruptionAsk(workflow_id="n0", node_name="n0", reason="Empty"))
        answer = await ActivityEnvironment(client=temporal.client).run(activities.node.ask_pool_to_disrupt, call)
        assert answer.allowed and "did not answer" in answer.message, answer
        batcher = activities.node.pool_asks
        await eventually(lambda: _true(not batcher._sending), timeout=15, what="the unanswered update to be given up")
