"""activities.visibility lists workflows as the SDK's `Client.list_workflows` does, decoding only
the search attributes asked for: checked against the SDK on the same Temporal server (the dev
server), with every kind of attribute tgp upserts, across pages and with a limit."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.testing import WorkflowEnvironment

import activities.visibility as visibility
from activities.visibility import SIGHTING_KEYS, running_node_workflows
from activities.fleet import LEARN_KEYS
from activities.search_attributes import SA_CLASS, SA_HOURLY_PRICE, SA_INSTANCE_ID, SA_NODE_NAME, SA_PHASE, SA_POOL, SA_PROVIDER, SA_READY_SINCE
from tests.conftest import eventually


async def test_a_lean_listing_is_the_sdks_listing_with_only_the_keys_asked_for(temporal: WorkflowEnvironment, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    queue = f"visibility-{uuid.uuid4().hex[:8]}"  # no worker polls it: the workflows stay Running
    since = datetime(2026, 11, 25, 12, 0, 1, 250000, tzinfo=UTC)
    handles = []
    for i in range(5):
        pairs = [
            SearchAttributePair(SA_PHASE, "Ready"),
            SearchAttributePair(SA_POOL, "ml/rtx"),
            SearchAttributePair(SA_NODE_NAME, f"rtx-{i}"),
            SearchAttributePair(SA_CLASS, "sim"),
        ]
        if i % 2:  # some have a price, an instance and a Ready time, some not yet
            pairs += [
                SearchAttributePair(SA_HOURLY_PRICE, 0.5 + i),
                SearchAttributePair(SA_PROVIDER, "sim"),
                SearchAttributePair(SA_INSTANCE_ID, f"i-{i}"),
                SearchAttributePair(SA_READY_SINCE, since),
            ]
        handles.append(
            await temporal.client.start_workflow(
                "GPUNodeWorkflow", id=f"gpunode/ml/rtx/{queue}-{i}", task_queue=queue, search_attributes=TypedSearchAttributes(pairs)
            )
        )
    query = f"WorkflowType = 'GPUNodeWorkflow' AND TaskQueue = '{queue}'"
    try:
        async def all_listed() -> bool:
            return len([wf async for wf in temporal.client.list_workflows(query)]) == 5

        await eventually(all_listed, timeout=30, what="the five workflows in visibility")
        monkeypatch.setattr(visibility, "PAGE_SIZE", 2)  # three pages
        sdk = {wf.id: wf async for wf in temporal.client.list_workflows(query)}
        lean = [wf async for wf in visibility.list_workflows(temporal.client, query)]
        assert sorted(wf.id for wf in lean) == sorted(sdk) and len(lean) == 5
        keys = {*SIGHTING_KEYS, *LEARN_KEYS}
        for wf in lean:
            theirs = sdk[wf.id]
            assert (wf.run_id, wf.start_time) == (theirs.run_id, theirs.start_time)
            assert wf.attributes(keys) == {k: v for k, v in theirs.search_attributes.items() if k in keys}
            assert wf.attributes(["TgpPhase"]) == {"TgpPhase": ["Ready"]}
        odd = next(wf for wf in lean if wf.id.endswith("-1"))
        assert odd.attributes(["TgpReadySince"]) == {"TgpReadySince": [since]} and odd.attributes(["TgpHourlyPrice"]) == {"TgpHourlyPrice": [1.5]}
        for limit in (0, 2, 3, 5, 9):  # within a page, at a page's end, past the listing
            assert len([wf async for wf in visibility.list_workflows(temporal.client, query, limit=limit)]) == min(limit, 5)
        sightings = await running_node_workflows(temporal.client, f"TaskQueue = '{queue}'")
        assert sorted((s.node_name, s.hourly_price is not None) for s in sightings) == [(f"rtx-{i}", bool(i % 2)) for i in range(5)]
    finally:
        for handle in handles:
            await handle.terminate("test over")
