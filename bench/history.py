"""What `make bench` reads from Temporal after a phase: workflows and their history lengths, each
node's path by the phases it entered, the pool's and class's histories, event types, and the
Temporal Cloud actions of a life (bench/actions.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections import Counter
from typing import Any

from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client
from temporalio.service import RPCError

from bench.actions import actions
from bench.knobs import RPC_TIMEOUT, summary
from bench.stack import TASK_QUEUE


async def node_workflows(client: Client, extra: str = "") -> list[Any]:
    query = f"WorkflowType = 'GPUNodeWorkflow' AND TaskQueue = '{TASK_QUEUE}'" + (f" AND {extra}" if extra else "")
    return [w async for w in client.list_workflows(query)]


# How often a burst counts its node workflows by phase (the TgpPhase search attribute): where
# the nodes sit while pods wait (Pending, Launching, Joining, Ready).
PHASES_EVERY = 10.0
BURST_PHASES = ("Pending", "Launching", "Joining", "Ready")


async def node_phases(client: Client) -> dict[str, int]:
    try:
        return {p: (await client.count_workflows(f"WorkflowType = 'GPUNodeWorkflow' AND TaskQueue = '{TASK_QUEUE}' AND TgpPhase = '{p}'", rpc_timeout=RPC_TIMEOUT)).count for p in BURST_PHASES}
    except RPCError:
        return {}


async def describe_all(client: Client, ids: list[str], run_ids: dict[str, str] | None = None) -> dict[str, tuple[str, int]]:
    """workflow id -> (run id, history length) for the current run (or the given run)."""
    sem = asyncio.Semaphore(64)
    out: dict[str, tuple[str, int]] = {}

    async def one(wid: str) -> None:
        async with sem:
            try:
                d = await client.get_workflow_handle(wid, run_id=(run_ids or {}).get(wid)).describe()
                out[wid] = (d.run_id, d.history_length)
            except RPCError:
                pass

    await asyncio.gather(*(one(w) for w in ids))
    return out



# A node's path, step by step: (name, from, to) over the moments `launch_durations` reads from its
# history (its start, first workflow task, and the phases it entered). A node the pool starts
# runs `Launching` from its start (the start's search attributes, no upsert), and its first task
# schedules the launch: the buy and the join are one activity to Ready.
NODE_PATH = (
    ("start_to_first_task", "start", "first_task"),
    ("first_task_to_ready", "first_task", "Ready"),
)


# Fewer nodes Ready than this: no rate while they come Ready (too few for its percentiles).
STEADY_AT_LEAST = 50


def steady_window(ready_at: list[float]) -> dict[str, float] | None:
    """The nodes that came Ready between the 10th and the 90th percentile of their Ready times
    and how long that took: the rate while nodes come Ready, without the first and the last."""
    if len(ready_at) < STEADY_AT_LEAST:
        return None
    t = sorted(ready_at)
    lo, hi = round(0.1 * (len(t) - 1)), round(0.9 * (len(t) - 1))
    return {"nodes": hi - lo, "s": t[hi] - t[lo]}


async def launch_durations(client: Client, ids: list[str], bound_at: dict[str, float] | None = None) -> dict[str, Any]:
    """launch_instance per node workflow (first run): scheduled -> started (queue), started ->
    closed (the activity itself, over all its attempts' last), and how many were still open.
    Also each node's path (NODE_PATH): start -> its first workflow task (the worker's backlog) ->
    Ready (its TgpPhase upsert: the launch and its join, labels), and, with
    `bound_at` (workflow id -> when the first pod was bound to its node), Ready -> pod bound
    (the simulated scheduler's share); every activity's scheduled -> closed by type; and the
    worker's backlog: every workflow task's scheduled -> started."""
    queued: list[float] = []
    ran: list[float] = []
    activities: dict[str, list[float]] = {}  # activity type -> scheduled -> closed, every node's first run
    stages: dict[str, list[float]] = {name: [] for name, _, _ in NODE_PATH} | {"ready_to_pod_bound": []}
    task_queued: list[float] = []  # every workflow task: scheduled -> started (the worker's backlog)
    open_ = 0
    ready_at: list[float] = []  # when each node entered Ready
    sem = asyncio.Semaphore(32)

    async def one(wid: str) -> None:
        nonlocal open_
        async with sem:
            scheduled: dict[int, float] = {}
            started: dict[int, float] = {}
            entered: dict[str, float] = {}
            kinds: dict[int, tuple[str, float]] = {}  # every activity: scheduled event id -> (type, when)
            tasks: dict[int, float] = {}  # workflow tasks scheduled, not yet started
            async for event in client.get_workflow_handle(wid).fetch_history_events():
                at = event.event_time.ToDatetime().timestamp()
                entered.setdefault("start", at)
                if event.HasField("upsert_workflow_search_attributes_event_attributes"):
                    phase = event.upsert_workflow_search_attributes_event_attributes.search_attributes.indexed_fields.get("TgpPhase")
                    if phase is not None:
                        entered.setdefault(json.loads(phase.data), at)
                if event.HasField("workflow_task_scheduled_event_attributes"):
                    tasks[event.event_id] = at
                elif event.HasField("workflow_task_started_event_attributes"):
                    entered.setdefault("first_task", at)  # the worker's first look at the new run
                    sid = event.workflow_task_started_event_attributes.scheduled_event_id
                    if sid in tasks:
                        task_queued.append(at - tasks.pop(sid))
                elif event.HasField("activity_task_scheduled_event_attributes"):
                    kinds[event.event_id] = (event.activity_task_scheduled_event_attributes.activity_type.name, at)
                    if event.activity_task_scheduled_event_attributes.activity_type.name == "launch_instance":
                        scheduled[event.event_id] = at
                elif event.HasField("activity_task_started_event_attributes"):
                    sid = event.activity_task_started_event_attributes.scheduled_event_id
                    if sid in scheduled:
                        started[sid] = at
                else:
                    for field in ("activity_task_completed_event_attributes", "activity_task_failed_event_attributes",
                                  "activity_task_timed_out_event_attributes", "activity_task_canceled_event_attributes"):  # fmt: skip
                        if event.HasField(field):
                            sid = getattr(event, field).scheduled_event_id
                            if sid in kinds:
                                name, when = kinds.pop(sid)
                                activities.setdefault(name, []).append(at - when)
                            if sid in started:
                                queued.append(started[sid] - scheduled[sid])
                                ran.append(at - started[sid])
                                del scheduled[sid]
            open_ += len(scheduled)
            for name, a, b in NODE_PATH:
                if a in entered and b in entered:
                    stages[name].append(entered[b] - entered[a])
            if "Ready" in entered:
                ready_at.append(entered["Ready"])
            if bound_at and wid in bound_at and "Ready" in entered:
                stages["ready_to_pod_bound"].append(bound_at[wid] - entered["Ready"])

    await asyncio.gather(*(one(w) for w in dict.fromkeys(ids)))
    return {
        "closed": summary(ran),
        "scheduled_to_started": summary(queued),
        "still_open": open_,
        "ready": len(ready_at),
        "last_ready_at": max(ready_at, default=None),
        "ready_steady": steady_window(ready_at),
        "stages_s": {k: summary(v) for k, v in stages.items()},
        "activities_scheduled_to_closed_s": {k: summary(v) for k, v in sorted(activities.items())},
        "workflow_task_scheduled_to_started": summary(task_queued),
    }



async def entity_histories(client: Client) -> dict[str, dict[str, Any]]:
    """Each pool and class workflow's history (all runs on the bench's queue): events, bytes,
    signals by name and updates by name. Issue 20: the bridge forwarded the workflows' own
    status writes back to them as signals, and a pool's history grows with its fleet."""
    out: dict[str, dict[str, Any]] = {}
    query = f"TaskQueue = '{TASK_QUEUE}' AND WorkflowType IN ('GPUNodePoolWorkflow', 'GPUNodeClassWorkflow')"
    async for wf in client.list_workflows(query):
        e = out.setdefault(wf.id, {"runs": 0, "events": 0, "bytes": 0, "largest_event_bytes": 0, "signals": Counter(), "updates": Counter()})
        e["runs"] += 1
        async for event in client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history_events():
            size = event.ByteSize()
            e["events"] += 1
            e["bytes"] += size
            e["largest_event_bytes"] = max(e["largest_event_bytes"], size)
            if event.HasField("workflow_execution_signaled_event_attributes"):
                e["signals"][event.workflow_execution_signaled_event_attributes.signal_name] += 1
            if event.HasField("workflow_execution_update_accepted_event_attributes"):
                e["updates"][event.workflow_execution_update_accepted_event_attributes.accepted_request.input.name] += 1
    return {k: {**v, "signals": dict(v["signals"]), "updates": dict(v["updates"])} for k, v in out.items()}


async def breakdown(client: Client, wid: str, since: dt.datetime | None, run_id: str | None = None) -> dict[str, int]:
    """Event types of a workflow's history (since `since`), most frequent first."""
    tally: Counter[str] = Counter()
    async for event in client.get_workflow_handle(wid, run_id=run_id).fetch_history_events():
        if since is None or event.event_time.ToDatetime(tzinfo=dt.timezone.utc) >= since:
            tally[event_name(event)] += 1
    return dict(tally.most_common())


async def sequence(client: Client, wid: str) -> list[str]:
    """A workflow's history, one line an event: seconds from its start, the event, and what it
    names (the activity, signal or marker; a timer's duration)."""
    out: list[str] = []
    start: dt.datetime | None = None
    async for event in client.get_workflow_handle(wid).fetch_history_events():
        at = event.event_time.ToDatetime(tzinfo=dt.timezone.utc)
        start = start or at
        name, what = event_name(event), ""
        if name == "ACTIVITY_TASK_SCHEDULED":
            what = event.activity_task_scheduled_event_attributes.activity_type.name
        elif name == "WORKFLOW_EXECUTION_SIGNALED":
            what = event.workflow_execution_signaled_event_attributes.signal_name
        elif name == "MARKER_RECORDED":  # a local activity's: its summary says which
            what = event.user_metadata.summary.data.decode() or event.marker_recorded_event_attributes.marker_name
        elif name == "TIMER_STARTED":
            what = f"{event.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds():g}s"
        out.append(f"{(at - start).total_seconds():7.2f} {name} {what}".rstrip())
    return out


def event_name(event: HistoryEvent) -> str:
    name: str = type(event).DESCRIPTOR.fields_by_name["event_type"].enum_type.values_by_number[event.event_type].name
    return name.removeprefix("EVENT_TYPE_")


async def life_actions(client: Client, wid: str, run_id: str | None = None) -> dict[str, int]:
    """A workflow run's Temporal Cloud actions by kind (bench/actions.py's rule)."""
    events: list[tuple[str, str | int]] = []
    async for event in client.get_workflow_handle(wid, run_id=run_id).fetch_history_events():
        name = event_name(event)
        if name == "MARKER_RECORDED":
            events.append((name, event.marker_recorded_event_attributes.marker_name))
        elif name == "ACTIVITY_TASK_STARTED":
            events.append((name, event.activity_task_started_event_attributes.attempt))
        else:
            events.append((name, ""))
    return dict(actions(events))


async def idle_stages(client: Client, wids: dict[str, str], deleted: dict[str, float], first_delete: dict[str, float], idle_s: float) -> dict[str, Any]:
    """Where an idle reaction's time goes (bench/burst.py), per node (`wids`: node name →
    workflow id), from each node's history once it closed: its pod's deletion (sent) → the bridge's
    facts, dated `at` (facts_dated) → their signal's arrival → the idle timer's firing, due at
    `at` + the idle timeout (timer_late) → its workflow task picked up by the worker → completed,
    the drain scheduled (task_done) → the drain started → the terminate call (the simulated
    cloud's clock: one machine, one clock)."""
    keys = ("facts_dated", "signal_arrived", "timer_late", "task_picked", "task_done", "drain_started", "terminate_called")
    stages: dict[str, list[float]] = {k: [] for k in keys}

    async def one(node: str, wid: str) -> None:
        marks: dict[str, float] = {}  # the first of each, after the deletion, in order
        drain_id = None
        async for event in client.get_workflow_handle(wid).fetch_history_events():
            t, name = event.event_time.ToDatetime(tzinfo=dt.timezone.utc).timestamp(), event_name(event)
            if name == "WORKFLOW_EXECUTION_SIGNALED" and t >= deleted[node] and "at" not in marks:
                attrs = event.workflow_execution_signaled_event_attributes
                if attrs.signal_name == "node_facts":
                    [facts] = await client.data_converter.decode(attrs.input.payloads[:1], [dict])
                    if not facts.get("busy_pods"):
                        marks.update(at=dt.datetime.fromisoformat(facts["at"]).timestamp(), arrived=t)
            elif name == "TIMER_FIRED" and "at" in marks and "fired" not in marks and t >= marks["at"] + idle_s - 0.05:
                marks["fired"] = t
            elif name == "WORKFLOW_TASK_STARTED" and "fired" in marks:
                marks.setdefault("picked", t)
            elif name == "WORKFLOW_TASK_COMPLETED" and "picked" in marks:
                marks.setdefault("done", t)
            elif name == "ACTIVITY_TASK_SCHEDULED" and "done" in marks and drain_id is None:
                if event.activity_task_scheduled_event_attributes.activity_type.name.endswith("drain_node"):
                    drain_id = event.event_id
            elif name == "ACTIVITY_TASK_STARTED" and drain_id is not None and event.activity_task_started_event_attributes.scheduled_event_id == drain_id:
                marks["started"] = t
        if len(marks) < 6 or node not in first_delete:
            return
        points = [deleted[node], marks["at"], marks["arrived"], marks["fired"], marks["picked"], marks["done"], marks["started"], first_delete[node]]
        due = marks["at"] + idle_s
        for key, (a, b) in zip(keys, zip(points, points[1:])):
            stages[key].append(b - (due if key == "timer_late" else a))

    sem = asyncio.Semaphore(20)

    async def bounded(node: str, wid: str) -> None:
        async with sem:
            try:
                await one(node, wid)
            except RPCError:
                pass

    await asyncio.gather(*(bounded(n, w) for n, w in wids.items() if n in deleted))
    return {"nodes": len(stages["facts_dated"]), **{k: summary(v) for k, v in stages.items()}}
