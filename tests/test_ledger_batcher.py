"""Issue 20: node workflows' ledger calls to one class are gathered per worker. Temporal admits at
most 10 updates in flight per workflow; a burst of nodes each settling its price with its own
update timed out (`reserve_and_start_node` timed out at 20–30 pods). Here many nodes settle at
once against the real class workflow on the dev server: every one gets its answer, the class's
budget holds, and the class sees a handful of updates, not one per node."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest

from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.ledger import LedgerBatcher
from activities.node_class import LedgerCall, NodeClassActivities
from tests.conftest import eventually, running_world
from tests.test_entities_heal import start_class
from tests.test_pool_accounting import CLASS
from tgp.crds import GPUNodeClassSpec
from tgp.messages import ClassInput, Ledger, Reservation, class_workflow_id
from workflows.node_class import GPUNodeClassWorkflow

NODES = 60
ALLOWED = 40


async def test_a_burst_of_settlements_reaches_the_class_in_a_few_updates_and_holds_its_budget(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (_, _, queue):
        name = f"burst-{uuid.uuid4().hex[:6]}"
        spec = GPUNodeClassSpec.model_validate({**CLASS.model_dump(mode="json", by_alias=True), "limits": {"maxNodes": ALLOWED}})
        klass = await start_class(temporal, queue, name, spec)

        async def listed() -> bool:
            return (await klass.describe()).raw_description.pending_activities == [] and len((await klass.fetch_history()).events) > 5

        await eventually(listed, what="the class's first pass")
        acts = NodeClassActivities(cluster=None, providers={})  # type: ignore[arg-type]  # the ledger calls read no cluster
        env = ActivityEnvironment(client=temporal.client)
        calls = [
            LedgerCall(class_workflow_id=class_workflow_id(name), reservation=Reservation(node_id=f"gpunode/ml/p/n{i}", pool="ml/p", hourly_price=Decimal("0.44")))
            for i in range(NODES)
        ]
        grants = await asyncio.gather(*(env.run(acts.settle_reservation, c) for c in calls))
        assert sum(g.granted for g in grants) == ALLOWED, "the class granted more (or fewer) than its maxNodes"
        assert all(g.granted or "limits.maxNodes" in g.reason for g in grants)
        ledger: Ledger = await klass.query(GPUNodeClassWorkflow.budget)
        assert len(ledger.reservations) == ALLOWED
        updates = sum(1 for e in (await klass.fetch_history()).events if e.HasField("workflow_execution_update_accepted_event_attributes"))
        assert updates <= 10, f"{updates} updates for {NODES} settlements"
        # Releases are gathered the same way.
        await asyncio.gather(*(env.run(acts.release_reservation, c) for c in calls))
        ledger = await klass.query(GPUNodeClassWorkflow.budget)
        assert not ledger.reservations


async def test_a_class_that_never_answers_holds_no_later_call(temporal: WorkflowEnvironment) -> None:
    """A class ledger whose worker never comes (nobody polls its queue): a settle hears an
    error after the batcher's timeout (1 s here; the SDK's own wait would be longer), and the
    update is given up, so a later call is not queued behind it."""
    queue = f"silent-{uuid.uuid4().hex[:8]}"
    name = f"silent-{uuid.uuid4().hex[:6]}"
    klass = await temporal.client.start_workflow(
        GPUNodeClassWorkflow.run, ClassInput(name=name, spec=CLASS), id=class_workflow_id(name), task_queue=queue
    )
    try:
        acts = NodeClassActivities(cluster=None, providers={}, ledger=LedgerBatcher(timeout=timedelta(seconds=1)))  # type: ignore[arg-type]
        env = ActivityEnvironment(client=temporal.client)
        call = LedgerCall(class_workflow_id=klass.id, reservation=Reservation(node_id="gpunode/ml/p/n0", pool="ml/p", hourly_price=Decimal("0.44")))
        loop = asyncio.get_running_loop()
        for _ in range(2):  # the second is not queued behind the first
            began = loop.time()
            with pytest.raises(Exception) as raised:
                await asyncio.wait_for(env.run(acts.settle_reservation, call), 8)
            assert loop.time() - began < 5, f"the settle waited {loop.time() - began:.1f} s ({raised.value!r})"
    finally:
        await klass.terminate("test over")


async def test_an_update_that_answers_short_fails_its_callers_instead_of_leaving_them_waiting(temporal: WorkflowEnvironment) -> None:
    """A batch whose update answers fewer items than it carried (a workflow of another shape):
    every caller of it hears an error, and the next batch still goes."""
    from typing import Any

    from activities.batching import UpdateBatcher

    class Short(UpdateBatcher):
        async def _update(self, client: Any, workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
            return items[1:] if len(items) > 1 else items

    batcher = Short(10)

    async def callers() -> list[Any]:
        return await asyncio.wait_for(asyncio.gather(*(batcher.call("wf", "k", i) for i in range(3)), return_exceptions=True), 5)

    answers = await ActivityEnvironment(client=temporal.client).run(callers)
    assert all(isinstance(a, RuntimeError) and "2 answers to 3 calls" in str(a) for a in answers), answers

    async def one() -> Any:
        return await asyncio.wait_for(batcher.call("wf", "k", 7), 5)

    assert await ActivityEnvironment(client=temporal.client).run(one) == 7
