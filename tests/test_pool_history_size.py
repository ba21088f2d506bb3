"""Issue 20: a pool's and a class's history grow with what changed, not with their fleet. A pool
of 500 nodes recorded a ~130 KB node listing each minute and a ~110 KB status on each change; a
class of 1,000 nodes a ~1 MB listing each minute.

A pool of a few hundred running node workflows, as Temporal's visibility lists them: node
workflow executions with the pool's search attributes, on a task queue no worker polls (no node
life is needed to be counted). The pool (class) adopts them; then its resync looks and one status change
are measured in its history's payload bytes."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timezone

from temporalio.api.history.v1 import HistoryEvent
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually, running_world
from tests.test_entities_heal import start_class, start_pool
from tests.test_pool_accounting import pool_spec
from tgp.crds import GPUNodePoolStatus
from tgp.messages import Ledger, NodeReport
from tgp.types import NodePhase, node_workflow_id
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow

# 100 nodes tell a look that grows with the fleet (~300 bytes a node: 30 kB) from one that does
# not (~15 bytes a name the pool knows, under the 4.5 kB bound); 200 cost twice the CPU for the
# same verdict. TGP_HISTORY_NODES=2000 for a closer look.
NODES = int(os.environ.get("TGP_HISTORY_NODES", "100"))
LISTINGS = {"running_nodes", "running_nodes_changed"}
STATUS_WRITES = {"write_status", "write_pool_status"}


def _bytes(payloads: object) -> int:
    return sum(len(p.data) + sum(len(v) for v in p.metadata.values()) for p in getattr(payloads, "payloads", []))


def activity_bytes(events: list[HistoryEvent], types: set[str]) -> list[int]:
    """Input plus result bytes of each completed activity of `types`, in order."""
    scheduled: dict[int, tuple[str, int]] = {}
    sizes = []
    for e in events:
        if e.HasField("activity_task_scheduled_event_attributes"):
            a = e.activity_task_scheduled_event_attributes
            scheduled[e.event_id] = (a.activity_type.name, _bytes(a.input))
        elif e.HasField("activity_task_completed_event_attributes"):
            a = e.activity_task_completed_event_attributes
            name, size = scheduled[a.scheduled_event_id]
            if name in types:
                sizes.append(size + _bytes(a.result))
    return sizes


@asynccontextmanager
async def running_nodes(temporal: WorkflowEnvironment, pool: str, klass: str = "") -> AsyncIterator[list[str]]:
    """NODES running node workflows of `pool` (and `klass`), as visibility lists them: with
    tgp's search attributes, on a task queue no worker polls. Terminated on the way out."""
    idle = f"nobody-{uuid.uuid4().hex[:8]}"
    gate = asyncio.Semaphore(20)
    ids = [node_workflow_id("ml", pool, f"{pool}-{i:05x}") for i in range(NODES)]

    async def node(i: int, wid: str) -> None:
        pairs = [
            SearchAttributePair(SearchAttributeKey.for_keyword("TgpPool"), f"ml/{pool}"),
            SearchAttributePair(SearchAttributeKey.for_keyword("TgpPhase"), NodePhase.READY.value),
            SearchAttributePair(SearchAttributeKey.for_keyword("TgpNodeName"), f"{pool}-{i:05x}"),
            SearchAttributePair(SearchAttributeKey.for_keyword("TgpProvider"), "simulated"),
            SearchAttributePair(SearchAttributeKey.for_keyword("TgpGpuType"), "RTX4090"),
        ]
        if klass:
            pairs.append(SearchAttributePair(SearchAttributeKey.for_keyword("TgpClass"), klass))
        async with gate:
            await temporal.client.start_workflow("GPUNodeWorkflow", id=wid, task_queue=idle, search_attributes=TypedSearchAttributes(pairs))

    try:
        await asyncio.gather(*(node(i, wid) for i, wid in enumerate(ids)))
        yield ids
    finally:
        for wid in ids:
            try:
                await temporal.client.get_workflow_handle(wid).terminate("test finished")
            except RPCError:
                pass


async def looks(handle: WorkflowHandle, more: int) -> list[int]:
    """The history bytes of `more` looks at the running nodes after the ones made so far."""

    async def looked(times: int) -> list[int] | None:
        sizes = activity_bytes((await handle.fetch_history()).events, LISTINGS)
        return sizes if len(sizes) >= times else None

    first = len(await eventually(lambda: looked(1), timeout=60, what="a first look"))
    return (await eventually(lambda: looked(first + more), timeout=120, what=f"{more} more looks at the running nodes"))[first:]


async def test_a_pools_history_grows_with_what_changed_not_with_its_fleet(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (_, _, queue):
        name = f"big-{uuid.uuid4().hex[:6]}"
        async with running_nodes(temporal, name) as ids:
            pool = await start_pool(temporal, queue, name, pool_spec("sim"))

            async def adopted() -> bool:
                status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
                return status.desired_nodes == NODES

            await eventually(adopted, timeout=120, what=f"the pool to adopt its {NODES} running node workflows")
            listings = await looks(pool, 3)
            # One node changes: one status write.
            writes = len(activity_bytes((await pool.fetch_history()).events, STATUS_WRITES))
            await pool.signal(
                GPUNodePoolWorkflow.node_phase,
                NodeReport(workflow_id=ids[0], node_name=f"{name}-00000", phase=NodePhase.DRAINING, reason="a change", at=pool_now()),
            )

            async def written() -> list[int] | None:
                sizes = activity_bytes((await pool.fetch_history()).events, STATUS_WRITES)
                return sizes if len(sizes) > writes else None

            status_writes = await eventually(written, timeout=60, what="the status write after one node changed")
            print(f"history bytes, pool of {NODES} nodes: per look at the running nodes {listings}, per status write {status_writes[writes:]}")
            # What changed is one node; the fleet is NODES nodes of ~300 bytes each in a listing
            # or a status. A look sends the names the pool knows (~15 bytes each), no listing.
            # Both parts are judged, each on its own.
            found = []
            if max(listings) >= 2_000 + 25 * NODES:
                found.append(f"a look at {NODES} unchanged nodes recorded {listings} bytes")
            if max(status_writes[writes:]) >= 2_000:
                found.append(f"a status write recorded {status_writes[writes:]} bytes for one changed node")
            assert not found, "; ".join(found)


async def test_a_classs_history_grows_with_what_changed_not_with_its_fleet(temporal: WorkflowEnvironment) -> None:
    """The class ledger's look at its running nodes, once a resync: at 1,000 nodes a full listing
    was ~1 MB of history a minute (make bench's hold), and seconds of replay per workflow task."""
    async with running_world(temporal) as (_, _, queue):
        name = f"big-{uuid.uuid4().hex[:6]}"
        async with running_nodes(temporal, name, klass=name):
            klass = await start_class(temporal, queue, name)

            async def adopted() -> bool:
                ledger: Ledger = await klass.query(GPUNodeClassWorkflow.budget)
                return len(ledger.reservations) == NODES

            await eventually(adopted, timeout=120, what=f"the class to count its {NODES} running node workflows")
            listings = await looks(klass, 3)
            print(f"history bytes, class of {NODES} nodes: per look at the running nodes {listings}")
            # A look sends the ids the ledger holds (~30 bytes each: namespace/pool/name), no listing.
            assert max(listings) < 2_000 + 40 * NODES, f"a look at {NODES} unchanged nodes recorded {listings} bytes"


def pool_now() -> datetime:
    return datetime.now(timezone.utc)
