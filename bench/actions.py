"""Temporal Cloud actions in a workflow's history, counted as Temporal Cloud meters them
(docs.temporal.io/cloud/actions): what a node's life costs a user of Temporal Cloud, and, for one
who runs Temporal, the operations each life asks of it. Pure: events in, counts out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# The Python SDK records a local activity's result, and a patch, as markers of these names.
LOCAL_ACTIVITY_MARKER = "core_local_activity"

# The rule, printed on the page beside the figures.
RULE = (
    "1 action each: a run started (WorkflowExecutionStarted: a client's start, a continue-as-new, a child's start), "
    "an activity attempt (ActivityTaskScheduled, plus attempt − 1 retries on its ActivityTaskStarted), a timer started, "
    "a search-attribute upsert, a signal received (WorkflowExecutionSignaled) or sent (SignalExternalWorkflowExecutionInitiated; "
    "billed once, at its sender, so counting the life's own of each counts every signal once), an update accepted, "
    "a child workflow started (StartChildWorkflowExecutionInitiated); local activities: 1 per workflow task that recorded any "
    "(their markers); not counted: workflow tasks, patches (markers of their own), memo upserts, queries and heartbeats "
    "(not in a history)"
)

# History event type (without EVENT_TYPE_) -> the action it is billed as.
ONE_EACH = {
    "WORKFLOW_EXECUTION_STARTED": "workflow started",
    "ACTIVITY_TASK_SCHEDULED": "activity",
    "TIMER_STARTED": "timer started",
    "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES": "search attribute upsert",
    "WORKFLOW_EXECUTION_SIGNALED": "signal received",
    "SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED": "signal sent",
    "WORKFLOW_EXECUTION_UPDATE_ACCEPTED": "update",
    "START_CHILD_WORKFLOW_EXECUTION_INITIATED": "child workflow started",
}


def actions(events: Iterable[tuple[str, str | int]]) -> Counter[str]:
    """Actions by kind in a history given as (event type, detail) in order: the detail is a
    marker's name for MARKER_RECORDED, an ActivityTaskStarted's attempt, else anything."""
    out: Counter[str] = Counter()
    task = 0  # workflow tasks completed so far: the markers after one are its commands
    with_local: set[int] = set()
    for kind, detail in events:
        if kind in ONE_EACH:
            out[ONE_EACH[kind]] += 1
        elif kind == "ACTIVITY_TASK_STARTED" and int(detail) > 1:
            out["activity retry"] += int(detail) - 1
        elif kind == "WORKFLOW_TASK_COMPLETED":
            task += 1
        elif kind == "MARKER_RECORDED" and detail == LOCAL_ACTIVITY_MARKER:
            with_local.add(task)
    if with_local:
        out["local activities (per workflow task)"] = len(with_local)
    return out
