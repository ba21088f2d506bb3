"""`make bench`: every target of issue 20, measured on the real stack, written to
bench/results/latest.json and docs/benchmarks.md (bench/report.py).

    PYTHONPATH=. .venv/bin/python bench/run.py          # the full run (under 10 minutes on 2 cores)
    make bench BENCH_QUICK=1                             # a 1-2 minute run for development

Phases, each on a fresh stack (bench/stack.py: Temporal dev server, `tgp worker`, `tgp bridge`,
the simulated world in this process):

* burst N (N = 100 and 500): N pending 1-GPU pods at once through the bridge; per pod, tgp's
  overhead is (pod bound - pod created - the simulated boot); pods never served; pending ->
  node workflow start (pods and node workflows matched in order of time);
* idle reaction (on the first burst's nodes): every pod deleted; per node, its first terminate
  call at the simulated cloud - the deletion of its pod - the pool's idle timeout; then the
  history length of those node workflows, each one short life (pending pod -> bought -> Ready
  -> pod ran -> idle -> drained -> terminated);
* latency: after the bursts, one of 10 pods, too small to saturate the machine: the overhead
  when nothing waits for CPU, stage by stage (the report sets it beside the big bursts');
* hold: node workflows started directly (as the pool's start activity does, for a pool and a
  class the bridge runs) on machines that boot at once and register their Node without a
  kubelet loop; once all are Ready and settled, a measured stretch at rest: CPU and RSS of each
  process, provider and Kubernetes requests per second, history events per node-hour (from the
  dev server: each workflow's history length at the start and the end of the stretch) and
  which events they are;
* offers: ranking 10,000 offers (bench/offer_selection.py), and offer listings per node started
  (bench/offer_cache.py, and the bursts' own count at the simulated cloud);
* floor: the least CPU one workflow per node costs, with nothing of tgp in it: 500 workflows of
  the smallest life (one activity; then three) at once on a dev server of their own
  (bench/temporal_floor.py), set against what the burst targets allow per pod.

Knobs (environment): BENCH_QUICK=1, BENCH_BURSTS (e.g. "100,500"), BENCH_HOLD_NODES,
BENCH_HOLD_SECONDS, BENCH_HOLD_BRINGUP_SECONDS, BENCH_HOLD_SETTLE_SECONDS (the most the settle
waits for a quiet stack), BENCH_QUIET_SECONDS, BENCH_QUIET_WORKER_CPU_PCT, BENCH_BOOT_SECONDS,
BENCH_IDLE_SECONDS, BENCH_PHASES ("offers,burst,hold,floor"), BENCH_FLOOR_WORKFLOWS, BENCH_OUT (the JSON file), BENCH_DOC (the
Markdown page; "-" for none), BENCH_NO_BASELINE=1 (no column from bench/results/baseline.json),
BENCH_SKIP_IDLE=1, BENCH_LATENCY_PODS (the unsaturated burst after the others, default 10; 0 for
none), BENCH_IDLE_BUDGET (the burst pool's disruption budget, default "100%": the idle
reaction measures one node's reaction, not the default 10% pacing); TGP_WORKFLOW_CACHE reaches the worker.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import structlog
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from bench import offer_cache, offer_selection
from bench.report import render
from bench.stack import NS, ROOT, TASK_QUEUE, Stack, Usage, gpu_class, gpu_pod, gpu_pool
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
from tgp.messages import class_workflow_id
from tgp.node import NodeWorkflowInput
from tgp.pools import node_request
from tgp.types import node_workflow_id
from workers.main import workflow_cache

# The simulated scheduler and kubelets log each pod they bind and run; the harness prints its own progress.
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
QUICK = os.environ.get("BENCH_QUICK", "") not in ("", "0")


def knob(name: str, full: str, quick: str) -> str:
    return os.environ.get(name) or (quick if QUICK else full)


BURSTS = [int(n) for n in knob("BENCH_BURSTS", "100,500", "30").split(",") if n]
# A burst small enough not to saturate the machine, after the others: what a pod's overhead is
# when nothing waits for CPU (the batch window, the node's own path, the scheduler). 0: none.
LATENCY_PODS = int(knob("BENCH_LATENCY_PODS", "10", "0"))
HOLD_NODES = int(knob("BENCH_HOLD_NODES", "1000", "100"))
HOLD_SECONDS = float(knob("BENCH_HOLD_SECONDS", "45", "15"))
BOOT = float(knob("BENCH_BOOT_SECONDS", "3", "3"))
IDLE = int(knob("BENCH_IDLE_SECONDS", "5", "5"))
PHASES = set(knob("BENCH_PHASES", "offers,burst,hold,floor", "offers,burst,hold,floor").split(","))
# Workflows of the smallest life started at once on a dev server of their own (bench/temporal_floor.py).
FLOOR_WORKFLOWS = int(knob("BENCH_FLOOR_WORKFLOWS", "500", "100"))
FLOOR_TIMEOUT = 180.0
# How long a burst may take until every pod is bound, and the hold's bring-up until every node
# is Ready; past it the phase reports what it has (pods never served, nodes Ready). They keep a
# full run under 10 minutes on 2 cores even where every target is missed by far.
BURST_DEADLINE = {100: 60.0, 500: 120.0}
HOLD_BRINGUP_DEADLINE = float(knob("BENCH_HOLD_BRINGUP_SECONDS", "180", "60"))
# How long the worker's stacks are sampled after the hold's stretch.
PROFILE_SECONDS = float(knob("BENCH_PROFILE_SECONDS", "10", "5"))
# After the last node is Ready the nodes' last reports, the pool's adoption of the nodes the hold
# started (their settings and labels, signals from the pool) and the twin watches end; the stretch
# at rest starts once the stack is quiet (`settle`): no pool or class history growing and the
# worker under QUIET_WORKER_CPU_PCT of a core, both over QUIET_SECONDS. HOLD_SETTLE bounds the
# wait; a stretch that starts at it is reported as not quiet.
HOLD_SETTLE = float(knob("BENCH_HOLD_SETTLE_SECONDS", "240", "120"))
QUIET_SECONDS = float(knob("BENCH_QUIET_SECONDS", "15", "10"))
QUIET_WORKER_CPU_PCT = float(knob("BENCH_QUIET_WORKER_CPU_PCT", "10", "10"))
# How often the settle reads the entities' history lengths and the worker's CPU.
QUIET_EVERY = 2.5
IDLE_DEADLINE = 75.0
# How long every bound pod has run when the idle reaction deletes them: a job that ran (the
# demo's runs 20 s), not a pod deleted the instant it starts, which its pool never sees bound
# (a node's own end of its bind-grace hold, life-v5, then comes as the pool's settings instead).
RUN_BEFORE_IDLE = float(knob("BENCH_RUN_BEFORE_IDLE_SECONDS", "2", "2"))
# Node workflows whose history lengths the hold reads (spread over all of them).
HISTORY_SAMPLE = 200
# How long the idle nodes' workflows may take to close after their terminate calls.
CLOSE_DEADLINE = 20.0
# A count of workflows by phase on a loaded dev server: the loop around it does not wait longer.
RPC_TIMEOUT = dt.timedelta(seconds=5)
T0 = time.monotonic()


def say(line: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {line}", flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def summary(values: list[float]) -> dict[str, float | None]:
    return {"n": len(values), "p50": pct(values, 50), "p99": pct(values, 99), "max": max(values) if values else None}


def usage_delta(before: dict[str, Usage], after: dict[str, Usage], wall: float) -> dict[str, dict[str, float]]:
    return {
        name: {
            "cpu_s": round(after[name].cpu_s - before[name].cpu_s, 2),
            "cpu_pct_of_core": round(100 * (after[name].cpu_s - before[name].cpu_s) / wall, 1),
            "rss_mb": round(after[name].rss_mb, 1),
            "peak_rss_mb": round(after[name].peak_rss_mb, 1),
        }
        for name in after
    }


# --- pods: created and bound times -------------------------------------------------------------


class PodClock:
    """When each pod was created (by this harness) and first seen bound (a watch on pods)."""

    def __init__(self, kube: httpx.AsyncClient) -> None:
        self.kube = kube
        self.created: dict[str, float] = {}
        self.bound: dict[str, float] = {}
        self.node_of: dict[str, str] = {}
        self.running: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def _see(self, pod: dict[str, Any]) -> None:
        name, node = pod["metadata"]["name"], (pod.get("spec") or {}).get("nodeName")
        if node and name not in self.bound:
            self.bound[name] = time.time()
            self.node_of[name] = node
        if (pod.get("status") or {}).get("phase") == "Running":
            self.running.add(name)

    async def _run(self) -> None:
        path = f"/api/v1/namespaces/{NS}/pods"
        while True:
            try:
                listing = (await self.kube.get(path)).json()
                for pod in listing.get("items") or []:
                    self._see(pod)
                params = {"watch": "true", "resourceVersion": listing["metadata"]["resourceVersion"], "timeoutSeconds": "60"}
                async with self.kube.stream("GET", path, params=params, timeout=httpx.Timeout(10.0, read=90.0)) as r:
                    async for line in r.aiter_lines():
                        if line.strip():
                            event = json.loads(line)
                            if event.get("type") in ("ADDED", "MODIFIED"):
                                self._see(event["object"])
            except (httpx.HTTPError, json.JSONDecodeError, KeyError):
                await asyncio.sleep(0.2)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


async def create_pods(s: Stack, prefix: str, n: int, clock: PodClock) -> None:
    sem = asyncio.Semaphore(50)

    async def one(i: int) -> None:
        name = f"{prefix}-{i:04d}"
        async with sem:
            clock.created[name] = time.time()
            r = await s.kube.post(f"/api/v1/namespaces/{NS}/pods", json=gpu_pod(name))
            r.raise_for_status()

    await asyncio.gather(*(one(i) for i in range(n)))


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


# --- burst and idle reaction ---------------------------------------------------------------------


async def burst(n: int, *, idle: bool) -> dict[str, Any]:
    say(f"burst {n}: starting a fresh stack (boot {BOOT:.0f} s simulated)")
    async with Stack(boot_delay=BOOT, logs=ROOT / "bench" / "results" / "logs" / f"burst{n}") as s:
        await s.apply(gpu_class("sim", max_nodes=min(1000, 2 * n)))
        await s.apply(gpu_pool("burst", "sim", idle_timeout=f"{IDLE}s" if idle else "1h", max_nodes=min(1000, 2 * n)))
        await s.class_ready("sim")
        clock = PodClock(s.kube)
        clock.start()
        u0, w0 = s.usage(), time.monotonic()
        say(f"burst {n}: creating {n} pending GPU pods")
        started = time.time()
        await create_pods(s, "p", n, clock)
        # BENCH_BURST_PROFILE=<seconds>: the worker's busiest functions over the burst's start.
        profile_s = float(os.environ.get("BENCH_BURST_PROFILE") or 0)
        profiling = asyncio.ensure_future(s.profile_worker(profile_s)) if profile_s else None
        sim_profiling = asyncio.ensure_future(profile_here(profile_s, s.logs / "sim-profile.json")) if profile_s else None
        deadline = BURST_DEADLINE.get(n, 60 + n * 0.5)
        last, timeline, looked = 0, [], 0.0
        while len(clock.bound) < n and time.monotonic() - w0 < deadline:
            s.check_alive()
            await asyncio.sleep(1)
            if len(clock.bound) // max(1, n // 5) != last:
                last = len(clock.bound) // max(1, n // 5)
                say(f"burst {n}: {len(clock.bound)}/{n} pods bound")
            if time.monotonic() - looked >= PHASES_EVERY:
                looked = time.monotonic()
                timeline.append({"s": round(looked - w0, 1), "pods_bound": len(clock.bound), **await node_phases(s.client)})
        wall = time.monotonic() - w0
        u1 = s.usage()
        profile = await profiling if profiling is not None else None
        sim_profile = await sim_profiling if sim_profiling is not None else None
        overheads = [clock.bound[p] - clock.created[p] - BOOT for p in clock.bound]
        workflows = await node_workflows(s.client)
        starts = sorted(w.start_time.timestamp() for w in workflows)
        created = sorted(clock.created.values())
        to_start = [st - cr for st, cr in zip(starts, created)]
        listings = sum(s.cloud.offer_lists.values())
        bought = len(s.cloud.instances)
        result: dict[str, Any] = {
            "pods": n,
            "boot_s": BOOT,
            "served": len(clock.bound),
            "never_served": n - len(clock.bound),  # within the deadline
            "deadline_s": deadline,
            "wall_s": round(wall, 1),
            "overhead_s": summary(overheads),
            "pending_to_node_workflow_start_s": summary(to_start),
            "node_workflows": len(workflows),
            "instances_bought": bought,
            "offer_listings": listings,
            "offer_listings_per_node": round(listings / bought, 3) if bought else None,
            "usage": usage_delta(u0, u1, wall),
            "kube_requests": {"/".join(k): v for k, v in sorted(s.emulator.counts.items())},
            "kube_user_agents": dict(s.emulator.user_agents),
            "cloud_requests": dict(s.cloud.requests.most_common()),
            "cloud_requests_per_instance": round(sum(s.cloud.requests.values()) / bought, 2) if bought else None,
            "worker_cpu_s_per_instance": round((u1["worker"].cpu_s - u0["worker"].cpu_s) / bought, 3) if bought else None,
            "timeline": timeline,
        }
        if profile is not None:
            result["worker_profile"] = profile
        if sim_profile is not None:
            result["sim_profile"] = sim_profile  # this process: the simulated world (cloud, tailnet, Kubernetes, kubelets)
        try:
            bound_at: dict[str, float] = {}
            for pod, node in clock.node_of.items():
                wid = node_workflow_id(NS, "burst", node)
                bound_at[wid] = min(bound_at.get(wid, clock.bound[pod]), clock.bound[pod])
            result["launch_instance"] = await launch_durations(s.client, [w.id for w in workflows], bound_at)
        except RPCError as exc:
            result["launch_instance"] = {"error": str(exc)[:200]}
        say(f"burst {n}: launch_instance {result['launch_instance']}; cloud requests per instance {result['cloud_requests_per_instance']}")
        say(f"burst {n}: served {len(clock.bound)}/{n} in {wall:.0f} s; overhead p99 {fmt(result['overhead_s']['p99'])} s, "
            f"pending -> node workflow start p99 {fmt(result['pending_to_node_workflow_start_s']['p99'])} s")  # fmt: skip
        try:
            result["entities"] = await entity_histories(s.client)
        except RPCError as exc:
            result["entities"] = {"error": str(exc)[:200]}
        if idle:
            result["idle"] = await idle_reaction(s, clock)
        clock.stop()
        return result


_SAMPLING: list[Path] = []


async def profile_here(seconds: float, out: Path) -> dict[str, Any] | None:
    """This process's busiest functions over `seconds` (the simulated world's share of the
    machine), sampled as bench/proc.py samples the worker."""
    import signal

    from bench.proc import _sample_on_signals

    if not _SAMPLING:
        _sample_on_signals(out)
        _SAMPLING.append(out)
    target = _SAMPLING[0]
    target.unlink(missing_ok=True)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.sleep(seconds)
    os.kill(os.getpid(), signal.SIGUSR2)
    try:
        return json.loads(target.read_text())  # type: ignore[no-any-return]
    except (OSError, json.JSONDecodeError):
        return None


# A node's path, step by step: (name, from, to) over the moments `launch_durations` reads from its
# history (its start, first workflow task, first marker, and the phases it entered).
NODE_PATH = (
    ("start_to_first_task", "start", "first_task"),
    ("first_task_to_offer", "first_task", "first_local_activity"),
    ("offer_to_launching", "first_local_activity", "Launching"),
    ("start_to_launching", "start", "Launching"),
    ("launching_to_joining", "Launching", "Joining"),
    ("joining_to_ready", "Joining", "Ready"),
)


async def launch_durations(client: Client, ids: list[str], bound_at: dict[str, float] | None = None) -> dict[str, Any]:
    """launch_instance per node workflow (first run): scheduled -> started (queue), started ->
    closed (the activity itself, over all its attempts' last), and how many were still open.
    Also each node's path by the phases it entered (its TgpPhase upserts): start -> Launching
    (offer, the class's reservation), -> Joining (launch), -> Ready (join, labels), and, with
    `bound_at` (workflow id -> when the first pod was bound to its node), Ready -> pod bound
    (the simulated scheduler's share); every activity's scheduled -> closed by type; and the
    worker's backlog: every workflow task's scheduled -> started."""
    queued: list[float] = []
    ran: list[float] = []
    activities: dict[str, list[float]] = {}  # activity type -> scheduled -> closed, every node's first run
    stages: dict[str, list[float]] = {name: [] for name, _, _ in NODE_PATH} | {"ready_to_pod_bound": []}
    task_queued: list[float] = []  # every workflow task: scheduled -> started (the worker's backlog)
    open_ = 0
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
                if event.HasField("marker_recorded_event_attributes"):
                    # The life's patch marker and select_offer's, recorded with the same task.
                    entered.setdefault("first_local_activity", at)
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
            if bound_at and wid in bound_at and "Ready" in entered:
                stages["ready_to_pod_bound"].append(bound_at[wid] - entered["Ready"])

    await asyncio.gather(*(one(w) for w in dict.fromkeys(ids)))
    return {
        "closed": summary(ran),
        "scheduled_to_started": summary(queued),
        "still_open": open_,
        "stages_s": {k: summary(v) for k, v in stages.items()},
        "activities_scheduled_to_closed_s": {k: summary(v) for k, v in sorted(activities.items())},
        "workflow_task_scheduled_to_started": summary(task_queued),
    }


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


async def idle_reaction(s: Stack, clock: PodClock) -> dict[str, Any]:
    """Delete every bound pod once all have run RUN_BEFORE_IDLE; per node: first terminate call -
    pod deletion - idle timeout."""
    try:
        async def running() -> bool:
            return clock.running >= set(clock.bound)

        await s.until(running, "every bound pod Running", 60)
    except TimeoutError:
        pass
    await asyncio.sleep(RUN_BEFORE_IDLE)  # the bench's workload, not a wait for tgp
    say(f"idle: deleting {len(clock.bound)} pods (pool idle timeout {IDLE} s)")
    deleted: dict[str, float] = {}
    sem = asyncio.Semaphore(50)

    async def delete(pod: str) -> None:
        async with sem:
            node = clock.node_of[pod]
            await s.kube.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")
            deleted[node] = max(deleted.get(node, 0.0), time.time())

    u0, w0 = s.usage(), time.monotonic()
    await asyncio.gather(*(delete(p) for p in list(clock.bound)))

    async def all_terminated() -> bool:
        return set(deleted) <= set(s.cloud.first_delete)

    try:
        await s.until(all_terminated, "a terminate call for every idle node", IDLE_DEADLINE)
    except TimeoutError:
        pass
    wall = time.monotonic() - w0
    u1 = s.usage()
    reactions = [s.cloud.first_delete[n] - t - IDLE for n, t in deleted.items() if n in s.cloud.first_delete]
    result: dict[str, Any] = {
        "nodes": len(deleted),
        "idle_timeout_s": IDLE,
        "never_terminated": len(deleted) - len(reactions),
        "reaction_s": summary(reactions),
        "wall_s": round(wall, 1),
        "usage": usage_delta(u0, u1, wall),
    }
    say(f"idle: terminate call after the idle timeout p50 {fmt(result['reaction_s']['p50'])} s, p99 {fmt(result['reaction_s']['p99'])} s")

    async def closed() -> bool:
        return not await node_workflows(s.client, "ExecutionStatus = 'Running'")

    try:
        await s.until(closed, "every node workflow closed", CLOSE_DEADLINE, every=1)
    except TimeoutError:
        pass
    lives = [w for w in await node_workflows(s.client) if w.status == WorkflowExecutionStatus.COMPLETED]
    lengths = await describe_all(s.client, [w.id for w in lives])
    durations = [(w.close_time - w.start_time).total_seconds() for w in lives if w.close_time]
    events = [n for _, n in lengths.values()]
    result["short_life"] = {
        "workflows": len(events),
        "history_events": summary([float(e) for e in events]),
        "life_s": summary(durations),
    }
    if lives:
        result["short_life"]["breakdown"] = await breakdown(s.client, lives[0].id, None)
    say(f"idle: one short life ({fmt(pct(durations, 50))} s) = {fmt(pct([float(e) for e in events], 50))} history events (median of {len(events)})")
    return result


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
            name = type(event).DESCRIPTOR.fields_by_name["event_type"].enum_type.values_by_number[event.event_type].name
            tally[name.removeprefix("EVENT_TYPE_")] += 1
    return dict(tally.most_common())


# --- hold ---------------------------------------------------------------------------------------


async def hold(n: int) -> dict[str, Any]:
    say(f"hold {n}: starting a fresh stack (machines boot at once and register their Node, no kubelet loop)")
    async with Stack(boot_delay=0.0, logs=ROOT / "bench" / "results" / "logs" / "hold", kubelets=False, scheduler=False) as s:
        klass, pool = gpu_class("hold", max_nodes=n), gpu_pool("hold", "hold", idle_timeout="1h", max_nodes=n)
        await s.apply(klass)
        await s.apply(pool)
        await s.class_ready("hold")
        class_spec, pool_spec = GPUNodeClassSpec.model_validate(klass["spec"]), GPUNodePoolSpec.model_validate(pool["spec"])
        say(f"hold {n}: starting {n} node workflows")
        u0, w0 = s.usage(), time.monotonic()
        sem = asyncio.Semaphore(32)

        async def start(i: int) -> None:
            req = node_request(namespace=NS, pool_name="hold", class_name="hold", node_name=f"hold-{i:04d}", pool=pool_spec, klass=class_spec)
            async with sem:
                await s.client.start_workflow(
                    "GPUNodeWorkflow", NodeWorkflowInput(request=req), id=req.workflow_id, task_queue=TASK_QUEUE,
                    static_summary=f"GPU node {req.node_name} (pool {NS}/hold)",
                )  # fmt: skip

        await asyncio.gather(*(start(i) for i in range(n)))
        ready, last = 0, -1
        while time.monotonic() - w0 < HOLD_BRINGUP_DEADLINE:
            s.check_alive()
            try:
                ready = (await s.client.count_workflows(f"WorkflowType = 'GPUNodeWorkflow' AND TgpPhase = 'Ready'", rpc_timeout=RPC_TIMEOUT)).count
            except RPCError:
                pass  # a loaded dev server: counted again next time round
            if ready >= n:
                break
            if ready * 10 // n != last:
                last = ready * 10 // n
                say(f"hold {n}: {ready}/{n} nodes Ready")
            await asyncio.sleep(2)
        bringup = time.monotonic() - w0
        u1 = s.usage()
        say(f"hold {n}: {ready}/{n} Ready after {bringup:.0f} s; settling (quiet for {QUIET_SECONDS:.0f} s, at most {HOLD_SETTLE:.0f} s)")
        settled = await settle(s)
        say(f"hold {n}: {'quiet' if settled['quiet'] else 'NOT quiet'} after {settled['settle_s']:.0f} s ({settled['last_window']})")
        running = [w.id async for w in s.client.list_workflows(f"TaskQueue = '{TASK_QUEUE}' AND ExecutionStatus = 'Running'")]
        # History lengths of a sample of the nodes (every 1,000 describes at a loaded dev server
        # take tens of seconds), and of every pool and class.
        nodes_running = sorted(w for w in running if w.startswith("gpunode/"))
        ids = nodes_running[:: max(1, len(nodes_running) // HISTORY_SAMPLE)] + [w for w in running if not w.startswith("gpunode/")]
        say(f"hold {n}: measuring {HOLD_SECONDS:.0f} s at rest ({len(running)} running workflows)")
        tb = time.monotonic()
        before = await describe_all(s.client, ids)
        tb = (tb + time.monotonic()) / 2  # each history is read between these; its middle stands for all
        since = dt.datetime.now(dt.timezone.utc)
        h0, k0 = time.monotonic(), dict(s.emulator.counts)
        c0 = (sum(s.cloud.requests_by_key.values()), s.cloud.describe_requests, sum(s.cloud.offer_lists.values()))
        a0 = s.usage()
        await asyncio.sleep(HOLD_SECONDS)
        s.check_alive()
        a1 = s.usage()
        stretch = time.monotonic() - h0
        k1 = dict(s.emulator.counts)
        c1 = (sum(s.cloud.requests_by_key.values()), s.cloud.describe_requests, sum(s.cloud.offer_lists.values()))
        ta = time.monotonic()
        after = await describe_all(s.client, ids)
        hours = ((ta + time.monotonic()) / 2 - tb) / 3600
        # A run continued as new meanwhile: its old run's final length plus the new run's.
        moved = {w: before[w][0] for w in after if w in before and after[w][0] != before[w][0]}
        old_runs = await describe_all(s.client, list(moved), moved)
        events: dict[str, int] = {}
        for w, (_, length) in after.items():
            if w in before:
                events[w] = length - before[w][1] if w not in moved else old_runs.get(w, ("", before[w][1]))[1] - before[w][1] + length
        # Where the worker's CPU goes at rest: its stacks sampled after the measured stretch (the
        # sampling costs CPU of its own, so not during it).
        say(f"hold {n}: sampling the worker's stacks for {PROFILE_SECONDS:.0f} s")
        profile = await s.profile_worker(PROFILE_SECONDS)
        node_events = [v for w, v in events.items() if w.startswith("gpunode/")]
        other_events = {w: v for w, v in events.items() if not w.startswith("gpunode/")}
        kube = {"/".join(k): round((k1.get(k, 0) - k0.get(k, 0)) / stretch, 2) for k in k1 if k[0] == "tgp" and k1.get(k, 0) != k0.get(k, 0)}
        polls = sum(v for k, v in kube.items() if k.split("/")[1] in ("get", "list"))
        sample = [w for w in ids if w.startswith("gpunode/")][:1]
        result = {
            "nodes": n,
            "ready": ready,
            "bringup_s": round(bringup, 1),
            "bringup_usage": usage_delta(u0, u1, bringup),
            "settle": settled,
            "how": "node workflows started directly (the pool's start activity's call) for a pool and class the bridge runs; "
            "machines boot at once and register a Ready Node without a kubelet loop",
            "stretch_s": round(stretch, 1),
            "usage": usage_delta(a0, a1, stretch),
            "provider_requests_per_s": round((c1[0] - c0[0]) / stretch, 2),
            "provider_describes_per_s": round((c1[1] - c0[1]) / stretch, 2),
            "provider_offer_listings_per_s": round((c1[2] - c0[2]) / stretch, 3),
            "kube_requests_per_s": round(sum(kube.values()), 2),
            "kube_polling_requests_per_s": round(polls, 2),
            "kube_requests_by_verb_per_s": dict(sorted(kube.items(), key=lambda kv: -kv[1])),
            "worker_profile": profile,
            "history_sampled_nodes": len(node_events),
            "history_events_per_node_hour": round(sum(node_events) / max(1, len(node_events)) / hours, 1) if node_events else None,
            "entity_history_events_per_hour": {w: round(v / hours) for w, v in other_events.items()},
            "history_breakdown_per_node_hour": {
                k: round(v / hours, 1) for k, v in (await breakdown(s.client, sample[0], since)).items()
            } if sample else {},
        }  # fmt: skip
        say(
            f"hold {n}: worker {result['usage']['worker']['cpu_pct_of_core']}% of a core, RSS {result['usage']['worker']['rss_mb']} MB; "
            f"provider {result['provider_requests_per_s']} req/s; kube {result['kube_requests_per_s']} req/s; "
            f"{result['history_events_per_node_hour']} history events per node-hour"
        )
        return result


async def settle(s: Stack) -> dict[str, Any]:
    """Wait until the stack is quiet: over the last QUIET_SECONDS no pool or class workflow's
    history grew (nor continued as new) and the worker used under QUIET_WORKER_CPU_PCT of a core;
    at most HOLD_SETTLE seconds. What the last window showed is returned either way."""
    query = f"TaskQueue = '{TASK_QUEUE}' AND ExecutionStatus = 'Running' AND WorkflowType IN ('GPUNodePoolWorkflow', 'GPUNodeClassWorkflow')"
    start = time.monotonic()
    samples: list[tuple[float, float, dict[str, tuple[str, int]]]] = []  # (when, worker CPU s, entity -> (run, length))
    while True:
        s.check_alive()
        entities = [w.id async for w in s.client.list_workflows(query)]
        now, cpu = time.monotonic(), s.usage()["worker"].cpu_s
        samples.append((now, cpu, await describe_all(s.client, entities)))
        # The newest sample at least QUIET_SECONDS old opens the window.
        window = [x for x in samples if now - x[0] >= QUIET_SECONDS]
        if window:
            t0, c0, h0 = window[-1]
            h1 = samples[-1][2]
            grew = {w: h1[w][1] - h0.get(w, ("", 0))[1] for w in h1 if h1[w] != h0.get(w)}
            cpu_pct = 100 * (cpu - c0) / (now - t0)
            last = {"seconds": round(now - t0, 1), "worker_cpu_pct_of_core": round(cpu_pct, 1), "entity_events": grew}
            quiet = not grew and cpu_pct < QUIET_WORKER_CPU_PCT
            if quiet or now - start >= HOLD_SETTLE:
                return {"quiet": quiet, "settle_s": round(now - start, 1), "deadline_s": HOLD_SETTLE, "quiet_s": QUIET_SECONDS,
                        "quiet_worker_cpu_pct": QUIET_WORKER_CPU_PCT, "last_window": last}  # fmt: skip
        await asyncio.sleep(QUIET_EVERY)


# --- the run ------------------------------------------------------------------------------------


async def floor(n: int) -> dict[str, Any]:
    """bench/temporal_floor.py in a process of its own, so its CPU is its worker's and client's
    alone (not what this process's earlier phases left running)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.temporal_floor", str(n), "--json", cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), FLOOR_TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.temporal_floor exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.strip())
    return {"nproc": os.cpu_count(), "cpu_model": model, "python": platform.python_version(), "commit": commit + ("+dirty" if dirty else "")}


async def main() -> int:
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_at_start": list(os.getloadavg()),
        "quick": QUICK,
        "knobs": {"workflow_cache": workflow_cache(), "bursts": BURSTS, "hold_nodes": HOLD_NODES, "hold_seconds": HOLD_SECONDS, "boot_s": BOOT, "idle_timeout_s": IDLE},
    }
    cpu0, wall0 = time.process_time(), time.monotonic()
    say(f"make bench ({'quick' if QUICK else 'full'}): {results['machine']}, load {results['load_at_start']}")
    if "offers" in PHASES:
        say("offers: ranking 10,000 offers")
        results["offer_selection"] = offer_selection.measure(10_000)
        say(f"offers: rank worst {results['offer_selection']['rank_all_worst_ms']:.1f} ms; listings per node started (pricing cache)")
        results["offer_cache"] = await offer_cache.run(100)
    if "burst" in PHASES:
        results["bursts"] = {}
        for i, n in enumerate(BURSTS):
            try:
                results["bursts"][str(n)] = await burst(n, idle=i == 0 and os.environ.get("BENCH_SKIP_IDLE") != "1")
            except Exception as exc:  # noqa: BLE001 - a phase that breaks is reported, the others still run
                say(f"burst {n} failed: {exc!r}")
                results["bursts"][str(n)] = {"error": repr(exc)[:500]}
        if LATENCY_PODS:
            try:
                results["latency"] = await burst(LATENCY_PODS, idle=False)
            except Exception as exc:  # noqa: BLE001
                say(f"burst {LATENCY_PODS} failed: {exc!r}")
                results["latency"] = {"error": repr(exc)[:500]}
    if "hold" in PHASES:
        try:
            results["hold"] = await hold(HOLD_NODES)
        except Exception as exc:  # noqa: BLE001
            say(f"hold failed: {exc!r}")
            results["hold"] = {"error": repr(exc)[:500]}
    if "floor" in PHASES:
        say(f"floor: {FLOOR_WORKFLOWS} workflows of the smallest life at once, on a dev server of their own")
        try:
            results["temporal_floor"] = await floor(FLOOR_WORKFLOWS)
        except Exception as exc:  # noqa: BLE001
            say(f"floor failed: {exc!r}")
            results["temporal_floor"] = {"error": repr(exc)[:500]}
    results["load_at_end"] = list(os.getloadavg())
    results["bench_wall_s"] = round(time.monotonic() - wall0, 1)
    results["bench_process_cpu_s"] = round(time.process_time() - cpu0, 1)
    out = Path(os.environ.get("BENCH_OUT") or ROOT / "bench" / "results" / ("quick.json" if QUICK else "latest.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    say(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    doc = os.environ.get("BENCH_DOC", "" if QUICK else str(ROOT / "docs" / "benchmarks.md"))
    # The figures the work started from, in a column beside (bench/results/baseline.json).
    base_file = ROOT / "bench" / "results" / "baseline.json"
    baseline = json.loads(base_file.read_text()) if base_file.exists() and not os.environ.get("BENCH_NO_BASELINE") else None
    table = render(results, baseline)
    if doc and doc != "-":
        Path(doc).write_text(table)
        say(f"wrote {doc}")
    print(table.split("## Targets", 1)[-1].split("\n## ", 1)[0])
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
