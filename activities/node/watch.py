"""Looks at a Ready node (`observe_node`), and what it asks and tells its pool: may it be
disrupted now (`ask_pool_to_disrupt`, the pool's budgets), its phase (`report_to_pool`)."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.service import RPCError, RPCStatusCode

from activities.batching import UpdateBatcher
from activities.errors import temporal_errors
from activities.node.base import NodeBase
from activities.node.reports import signal_report
from tgp.errors import TransientError
from tgp.lifecycle import holders_of, pod_keeps_node_busy
from tgp.messages import DisruptionAnswer, DisruptionAnswers, DisruptionAsks, PoolAsk, PoolReport
from tgp.types import NodeObservation, ObserveInput

# How long a node waits for its pool's answer to "may I be disrupted now?" (budgets). A pool that
# is deleted, stuck or replaying a long history must not hold its nodes for ever: past this the
# node goes ahead as it would without budgets.
POOL_ANSWER_TIMEOUT = timedelta(seconds=10)
# An ask the server refused for the pool's in-flight update limit is sent again after a
# jittered pause from this, doubling up to the max (seconds).
POOL_BUSY_PAUSE = 0.2
POOL_BUSY_PAUSE_MAX = 2.0
# Asks gathered into one `may_disrupt_many` update; a bigger backlog goes in the next one.
MAX_ASK_BATCH = 500


class PoolAskBatcher(UpdateBatcher):
    """Per worker process: the disruption asks of a pool's nodes go to it together
    (activities.batching): `call(pool_workflow_id, "ask", a DisruptionAsk)`, its answer."""

    def __init__(self) -> None:
        # As each ask was before they went together: a pool that does not answer within
        # POOL_ANSWER_TIMEOUT does not hold its nodes, and its update is not left open.
        super().__init__(MAX_ASK_BATCH, timeout=POOL_ANSWER_TIMEOUT.total_seconds())

    async def _update(self, client: Any, pool_workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
        handle = client.get_workflow_handle(pool_workflow_id)
        batch = await handle.execute_update("may_disrupt_many", DisruptionAsks(asks=items), result_type=DisruptionAnswers)
        return list(batch.answers)


class Watch(NodeBase):
    """The watch's activities: `observe_node`, `ask_pool_to_disrupt`, `report_to_pool`."""

    pool_asks: PoolAskBatcher

    @property
    def pool_answer_timeout(self) -> timedelta:
        """How long an ask waits for the pool (POOL_ANSWER_TIMEOUT; a test shortens it), its update too."""
        return timedelta(seconds=self.pool_asks.timeout or 0)

    @pool_answer_timeout.setter
    def pool_answer_timeout(self, value: timedelta) -> None:
        self.pool_asks.timeout = value.total_seconds()

    @activity.defn
    async def observe_node(self, inp: ObserveInput) -> NodeObservation:
        """One look at a Ready node: is the instance alive, is the Node Ready, is it busy?"""
        with temporal_errors():
            provider = await self._provider_for(inp.instance.provider, inp.instance.credentials, inp.instance.account)
            instance = await provider.describe(inp.instance.instance_id or "")
            if instance is None and self._lagging(inp.instance, provider):
                # A running instance can read 404 while the provider lags behind its create:
                # an unknown, not a vanished instance (the watch looks again).
                raise TransientError(f"instance {inp.instance.instance_id} is not visible on {provider.name} yet")
            node = await self.cluster.get_node(inp.node_name)
            pods = await self.cluster.list_pods_on_node(inp.node_name) if node is not None else []
        holders, holding = holders_of(pods)
        return NodeObservation(instance=instance, node=node, busy_pods=sum(1 for p in pods if pod_keeps_node_busy(p)), holders=holders, holding=holding)

    # --- disruption budgets ----------------------------------------------------------------

    @activity.defn
    async def ask_pool_to_disrupt(self, call: PoolAsk) -> DisruptionAnswer:
        """Ask the node's pool whether it may begin a voluntary disruption now (its budgets).
        A pool that is gone or does not answer within POOL_ANSWER_TIMEOUT does not hold the
        node: it goes ahead as before budgets. Any other failure (the pool's update queue full,
        Temporal unreachable) is a refusal for now: the node asks again later."""
        return await self._ask_pool(call)

    async def _ask_pool(self, call: PoolAsk) -> DisruptionAnswer:
        busy = False
        try:
            async with asyncio.timeout(self.pool_answer_timeout.total_seconds()):
                pause = POOL_BUSY_PAUSE
                while True:
                    try:
                        # With the asks of this worker's other nodes of the pool made meanwhile.
                        answer: DisruptionAnswer = await self.pool_asks.call(call.pool_workflow_id, "ask", call.ask)
                        return answer
                    except RPCError as exc:
                        # Temporal admits 10 updates in flight per workflow: when more workers'
                        # nodes of a pool ask at once, the others are refused by the server, not by
                        # the pool (RESOURCE_EXHAUSTED; an admitted update the server dropped says
                        # UNAVAILABLE, "update was aborted"). Ask again after a jittered, growing
                        # pause: not a refusal.
                        if exc.status not in (RPCStatusCode.RESOURCE_EXHAUSTED, RPCStatusCode.UNAVAILABLE):
                            raise
                        busy = True
                        await asyncio.sleep(random.uniform(pause / 2, pause))
                        pause = min(pause * 2, POOL_BUSY_PAUSE_MAX)
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):
            if busy:
                return DisruptionAnswer(allowed=False, unasked=True, message="the pool's updates stayed at Temporal's in-flight limit: asking again soon")
            # The SDK reports the update's wait cut short by the timeout as its own error type.
            return DisruptionAnswer(allowed=True, message=f"the pool did not answer within {self.pool_answer_timeout.total_seconds():.0f}s: not held")
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return DisruptionAnswer(allowed=True, message="the pool is gone: not held")
            return DisruptionAnswer(allowed=False, message=f"could not ask the pool ({exc.status.name if exc.status else 'RPCError'}): asking again later")
        except WorkflowUpdateFailedError as exc:
            return DisruptionAnswer(allowed=True, message=f"the pool could not answer ({type(exc.cause).__name__}): not held")

    @activity.defn
    async def report_to_pool(self, call: PoolReport) -> bool:
        """Signal the node's report to its pool (`node_phase`) from a local activity: a phase
        that no activity begins (Ready again, TerminationStuck, the final one). Sent again when a
        worker dies around it: the pool keeps the newest report per node (by `at`), so a repeat
        changes nothing. A pool that is gone (deleted, or a node started by hand) has nobody
        listening: False."""
        return await signal_report(call, self.reports)
