"""A pytest plugin that saves the history of every pool, class and node workflow a test run
started on the dev server, so a release's own tests record what its workflows really do.
tests/test_replay.py replays them through the current code.

Run a release's tests with it from a checkout of that release (docs/workflow-versioning.md):

    TGP_RELEASE_HISTORIES=/path/to/tests/histories/<sha> PYTHONPATH=<checkout> \\
        python -m pytest -p tests.release_histories tests/test_entities_heal.py ...

Only dev servers (DEV_SERVERS) are recorded: the time-skipping server keeps no list of
workflows. A history is saved gzipped, named after its test and workflow type, and only when
its sequence of commands is new to the run: ten nodes of one pool that did the same thing are
one history (replay compares commands, nothing else)."""

from __future__ import annotations

import gzip
import os
import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHistory

# The fixtures that give a dev server (module- or session-scoped, so still up at teardown): the
# suite's own, and the one of tests/test_class_ledger.py that suggests continue-as-new early.
DEV_SERVERS = ("temporal", "suggests_early")
TYPES = ("GPUNodePoolWorkflow", "GPUNodeClassWorkflow", "GPUNodeWorkflow")
# A history longer than this is left out: replaying it would cost CI seconds for no new order.
MAX_EVENTS = 3000
# Histories kept per workflow type and test: more nodes of one pool add time, not coverage.
PER_TEST = 2
# The events a workflow's commands (and its update results) leave: what replay checks.
COMMAND_EVENTS = {
    EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED,
    EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED,
    EventType.EVENT_TYPE_TIMER_STARTED,
    EventType.EVENT_TYPE_TIMER_CANCELED,
    EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED,
    EventType.EVENT_TYPE_REQUEST_CANCEL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED,
    EventType.EVENT_TYPE_START_CHILD_WORKFLOW_EXECUTION_INITIATED,
    EventType.EVENT_TYPE_MARKER_RECORDED,
    EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
    EventType.EVENT_TYPE_WORKFLOW_PROPERTIES_MODIFIED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED,
    EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED,
}
_SEEN: set[tuple[tuple[int, str], ...]] = set()


def commands(history: WorkflowHistory) -> tuple[tuple[int, str], ...]:
    """The history's command events in order, with each scheduled activity's name."""
    return tuple(
        (e.event_type, e.activity_task_scheduled_event_attributes.activity_type.name) for e in history.events if e.event_type in COMMAND_EVENTS
    )


@pytest.fixture(autouse=True)
async def _save_release_histories(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    target = os.environ.get("TGP_RELEASE_HISTORIES")
    servers = [name for name in DEV_SERVERS if name in request.fixturenames]
    if not target or not servers:
        yield
        return
    env = request.getfixturevalue(servers[0])
    started = datetime.now(UTC) - timedelta(seconds=1)
    yield
    out = Path(target)
    out.mkdir(parents=True, exist_ok=True)
    test = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower()).strip("_")[:60]
    types = ", ".join(f"'{t}'" for t in TYPES)
    query = f"WorkflowType IN ({types}) AND StartTime >= '{started.isoformat().replace('+00:00', 'Z')}'"
    counts: dict[str, int] = {}
    async for execution in env.client.list_workflows(query):
        history = await env.client.get_workflow_handle(execution.id, run_id=execution.run_id).fetch_history()
        sequence = commands(history)
        kind = execution.workflow_type.removeprefix("GPUNode").removesuffix("Workflow").lower() or "node"
        if len(history.events) > MAX_EVENTS or sequence in _SEEN or counts.get(kind, 0) >= PER_TEST:
            continue
        _SEEN.add(sequence)
        n = counts[kind] = counts.get(kind, 0) + 1
        (out / f"{test}-{kind}{n}.json.gz").write_bytes(gzip.compress(history.to_json().encode(), mtime=0))
