"""Issue 20: the looks at every node (the fleet look, the sweeper) learn each Ready node's
instance from Temporal's listing, not by asking its workflow. A query to a node workflow the
worker's cache no longer holds replays its whole history: after a worker restart the fleet look
asked every Ready node once, and the sweeper asked every running node every 15 minutes (make
bench's hold: 1,000 nodes on a cache of 300, seconds of CPU each time).

Both run here against real node lives on the dev server, through a client that counts the
queries it sends (the SDK's client interceptor); what they find must still be right."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from temporalio.client import Client, Interceptor, OutboundInterceptor, QueryWorkflowInput
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.clouds.registry import providers_from_env
from activities.sweeper import Orphan, SweepInput, SweeperActivities
from sim.world import NODE_TAG
from tests.conftest import eventually, running_world
from tests.test_fleet_look import fleet_look, look, ready_nodes, until_listed_ready
from tests.test_node_lifecycle import FAST, request, start, wait_phase
from tests.test_sweeper import buy
from tgp.types import NodePhase, Stage, instance_name
from workflows.node import GPUNodeWorkflow


class CountQueries(Interceptor):
    """The workflow ids this client queried."""

    def __init__(self) -> None:
        self.queried: list[str] = []

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _Counting(next, self)


class _Counting(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, counter: CountQueries) -> None:
        super().__init__(next)
        self.counter = counter

    async def query_workflow(self, input: QueryWorkflowInput) -> Any:
        self.counter.queried.append(input.id)
        return await super().query_workflow(input)


def counting_client(env: WorkflowEnvironment, counter: CountQueries) -> Client:
    c = env.client
    return Client(c.service_client, namespace=c.namespace, data_converter=c.data_converter, interceptors=[counter])


async def test_a_fleet_look_learns_ready_nodes_from_the_listing_without_a_query(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        nodes = await ready_nodes(temporal, queue, 3)
        counter = CountQueries()
        client = counting_client(temporal, counter)
        async with fleet_look(world) as fleet:
            result = await until_listed_ready(temporal, fleet, len(nodes), queue=queue, client=client)
            assert counter.queried == [], f"the look queried {len(counter.queried)} node workflows"
            assert [(a.account, a.nodes, a.sent) for a in result.accounts] == [("simulated", 3, 0)]
            # What it learnt is each node's own instance: the one the provider takes away is told.
            victim, victim_status = nodes[0]
            await world.cloud.preempt(victim_status.instance_id or "")
            after = await look(temporal, fleet, queue=queue, client=client)
        assert [(a.account, a.sent) for a in after.accounts] == [("simulated", 1)]
        assert (await victim.result()).phase is NodePhase.INTERRUPTED
        for handle, _ in nodes[1:]:
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            await handle.result()


async def test_a_sweep_reads_a_ready_nodes_instance_from_the_listing_without_a_query(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        req = request()
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)
        [stray] = await buy(world, instance_name(req.node_name, 1))
        # The listing lags the node's own answer: sweep once it shows the node Ready.
        listed = f"WorkflowId = '{req.workflow_id}' AND TgpPhase = 'Ready'"
        await eventually(lambda: anext(aiter(temporal.client.list_workflows(listed)), None), timeout=60, what="the listing to show the node Ready")
        counter = CountQueries()
        client = counting_client(temporal, counter)
        providers = providers_from_env(world.worker_env())
        sweeper = SweeperActivities(providers=providers, tailnets={})
        try:

            async def found() -> list[Orphan] | None:
                orphans: list[Orphan] = await ActivityEnvironment(client=client).run(sweeper.find_orphans, SweepInput(tags=[NODE_TAG]))
                return orphans if orphans else None

            orphans = await eventually(found, timeout=60, what="the sweep to see the Ready node's twin")
        finally:
            for provider in providers.values():
                await provider.aclose()  # type: ignore[attr-defined]
        assert [(o.kind, o.id) for o in orphans] == [("stray", stray["id"])], "the twin is a stray; the recorded instance is kept"
        assert ready.instance_id != stray["id"]
        assert counter.queried == [], f"the sweep queried {counter.queried}"
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()
        assert world.cloud.live_instances() == []


async def test_a_look_after_a_restart_tells_a_long_ready_node_its_vanished_instance_at_once(temporal: WorkflowEnvironment) -> None:
    """The consistency window for an instance missing from a list runs from when the node became
    Ready (TgpReadySince, with its Ready phase), not from when this process learnt the node: a
    worker that just restarted does not hold back a node Ready for longer than the window."""
    window = timedelta(seconds=1)
    async with running_world(temporal) as (world, _, queue):
        [(handle, status)] = await ready_nodes(temporal, queue, 1)
        ready_at = max(r.at for r in status.stages if r.stage is Stage.READY)
        await eventually(lambda: asyncio.sleep(0, datetime.now(timezone.utc) - ready_at >= window), what="the node Ready for longer than the window")
        await world.cloud.preempt(status.instance_id or "")  # the simulated cloud then lists it no more
        async with fleet_look(world, consistency_window=window) as fresh:  # a worker that just started
            result = await until_listed_ready(temporal, fresh, 1, queue=queue)
        assert [(a.account, a.sent) for a in result.accounts] == [("simulated", 1)], "the look held back a node Ready for longer than the window"
        assert (await handle.result()).phase is NodePhase.INTERRUPTED


@pytest.mark.parametrize(
    ("failure", "timeouts", "named_first"),
    [
        ("never_joins", {"launch": timedelta(seconds=6), "tailnet_join": timedelta(seconds=2)}, False),  # the join waits both out
        ("gpus_never_register", {"gpu_registration": timedelta(seconds=2)}, True),  # Joining named it
    ],
)
async def test_a_failovers_next_launch_does_not_name_the_released_instance(
    temporal: WorkflowEnvironment, failure: str, timeouts: dict[str, timedelta], named_first: bool
) -> None:
    """TgpInstanceId names the current attempt's instance: while the next offer launches after
    a join timeout, the listing does not name the released one. A first attempt that failed in
    the launch's own join never named it; one that failed while Joining did, and the next
    Launching upsert unsets it."""
    async with running_world(temporal) as (world, _, queue):
        world.cloud.fail_boot("rtx4090-us-east", failure)  # type: ignore[arg-type]
        req = request(timeouts=FAST.model_copy(update=timeouts))
        handle = await start(temporal, queue, req)
        first, second = (await wait_phase(handle, NodePhase.READY)).attempts
        # What the listing showed after each upsert: the attributes folded in order (an unset is
        # the attribute with an empty value; one absent from an upsert keeps its last value).
        shown: dict[str, object] = {}
        named: list[tuple[object, object]] = []  # (TgpPhase, TgpInstanceId) after each upsert
        for e in (await handle.fetch_history()).events:
            if e.HasField("upsert_workflow_search_attributes_event_attributes"):
                fields = e.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields
                shown.update({k: json.loads(v.data or b"null") for k, v in fields.items()})
                named.append((shown.get("TgpPhase"), shown.get("TgpInstanceId")))
        assert first.instance_id is not None
        assert ((NodePhase.JOINING.value, first.instance_id) in named) is named_first, named
        assert (NodePhase.LAUNCHING.value, first.instance_id) not in named, f"the next launch's listing named the released instance: {named}"
        assert named[-1] == (NodePhase.READY.value, second.instance_id), named
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "test done"})
        await handle.result()
