"""Listing workflows from Temporal's visibility, decoding only what the caller reads.

The SDK's `Client.list_workflows` turns every listed workflow into a `WorkflowExecution`, which
decodes all of its search attributes twice (the typed and the untyped form): ~0.3 ms of CPU
per node workflow, ~0.3 s per listing of a 1,000-node fleet. The pool's, the class's and the
fleet's looks and the fleet metrics each list the fleet every minute, so at rest that was most
of the worker's CPU (bench/results/findings.md, session 13). Here a listing is the same
`ListWorkflowExecutions` call, page by page, and a workflow's search attributes are decoded by
the SDK's own decoder when asked for, and only the keys asked for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from temporalio.api.common.v1 import SearchAttributes
from temporalio.api.workflowservice.v1 import ListWorkflowExecutionsRequest
from temporalio.client import Client
from temporalio.converter import decode_search_attributes

from tgp.messages import NodeSighting
from tgp.types import NodePhase

# As the SDK's list_workflows pages.
PAGE_SIZE = 1000


@dataclass(frozen=True)
class Listed:
    """One workflow of a listing: its ids, its start, and its search attributes as listed
    (decoded on demand by `attributes`)."""

    id: str
    run_id: str
    start_time: datetime | None
    raw: SearchAttributes

    def attributes(self, keys: Collection[str]) -> dict[str, list[Any]]:
        """The search attributes in `keys` that it has, in the SDK's untyped form
        (`WorkflowExecution.search_attributes`: key -> list of values), by the SDK's decoder."""
        fields = self.raw.indexed_fields
        return dict(decode_search_attributes(SearchAttributes(indexed_fields={key: fields[key] for key in keys if key in fields})))


async def list_workflows(client: Client, query: str, *, limit: int | None = None) -> AsyncIterator[Listed]:
    """The workflows matching `query`, as `Client.list_workflows` lists them (at most `limit`),
    their search attributes left undecoded. RPC errors are raised as there."""
    token = b""
    listed = 0
    while limit is None or listed < limit:
        size = PAGE_SIZE if limit is None else min(PAGE_SIZE, limit - listed)
        page = await client.workflow_service.list_workflow_executions(
            ListWorkflowExecutionsRequest(namespace=client.namespace, page_size=size, next_page_token=token, query=query),
            retry=True,
        )
        for info in page.executions[: None if limit is None else limit - listed]:
            listed += 1
            start = info.start_time.ToDatetime().replace(tzinfo=UTC) if info.HasField("start_time") else None
            yield Listed(id=info.execution.workflow_id, run_id=info.execution.run_id, start_time=start, raw=info.search_attributes)
        token = page.next_page_token
        if not token:
            return


RUNNING_NODES = "WorkflowType = 'GPUNodeWorkflow' AND ExecutionStatus = 'Running'"


# The search attributes a sighting reads.
SIGHTING_KEYS = ("TgpPhase", "TgpHourlyPrice", "TgpNodeName", "TgpProvider", "TgpGpuType", "TgpPool")


def sighting(wf: Listed) -> NodeSighting:
    """A node workflow as its search attributes (set by the node, workflows/node/) show it."""
    sa = wf.attributes(SIGHTING_KEYS)

    def first(key: str) -> Any:
        return (sa.get(key) or [None])[0]

    phase, price = first("TgpPhase"), first("TgpHourlyPrice")
    return NodeSighting(
        workflow_id=wf.id,
        node_name=first("TgpNodeName") or "",
        phase=NodePhase(phase) if phase in NodePhase._value2member_map_ else None,
        provider=first("TgpProvider"),
        gpu_type=first("TgpGpuType"),
        hourly_price=Decimal(str(price)) if price is not None else None,
        pool=first("TgpPool") or "",
        started_at=wf.start_time,
    )


async def running_node_workflows(client: Client, query: str = "", *, limit: int | None = None) -> list[NodeSighting]:
    """The running node workflows (those matching `query`, a visibility filter on tgp's search
    attributes, e.g. `TgpPool = 'ml/rtx'`), as sightings. Visibility lags by a second or so."""
    listing = list_workflows(client, f"{RUNNING_NODES} AND {query}" if query else RUNNING_NODES, limit=limit)
    return [sighting(wf) async for wf in listing]
