"""The bursts `make bench` measures: pending pods through the bridge until each is bound (per pod,
tgp's overhead; per node, the CPU each process spent), the idle reaction and one short life's
history and actions after the first burst, and the workers phase (the same burst with 1, 2, 4
`tgp worker` processes: nodes Ready per second)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import httpx
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError

from bench.history import PHASES_EVERY, breakdown, describe_all, entity_histories, idle_stages, launch_durations, life_actions, node_phases, node_workflows, sequence
from bench.knobs import BOOT, CLOSE_DEADLINE, IDLE, IDLE_DEADLINE, RUN_BEFORE_IDLE, burst_deadline, fmt, pct, say, summary, usage_delta
from bench.stack import NS, ROOT, Stack, busy_pct, gpu_class, gpu_pod, gpu_pool, machine_jiffies
from tgp.types import node_workflow_id

# Short lives whose actions are counted from their histories (each a whole history read).
ACTIONS_SAMPLE = 10


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



# --- burst and idle reaction ---------------------------------------------------------------------


async def burst(n: int, *, idle: bool, workers: int = 1, name: str = "") -> dict[str, Any]:
    """`n` pending pods at once on a fresh stack with `workers` worker processes."""
    name = name or f"burst{n}"
    say(f"{name}: starting a fresh stack (boot {BOOT:.0f} s simulated, {workers} worker(s))")
    async with Stack(boot_delay=BOOT, logs=ROOT / "bench" / "results" / "logs" / name, workers=workers) as s:
        await s.apply(gpu_class("sim", max_nodes=min(1000, 2 * n)))
        await s.apply(gpu_pool("burst", "sim", idle_timeout=f"{IDLE}s" if idle else "1h", max_nodes=min(1000, 2 * n)))
        await s.class_ready("sim")
        clock = PodClock(s.kube)
        clock.start()
        u0, w0, m0 = s.usage(), time.monotonic(), machine_jiffies()
        say(f"{name}: creating {n} pending GPU pods")
        started = time.time()
        await create_pods(s, "p", n, clock)
        # BENCH_BURST_PROFILE=<seconds>: the worker's busiest functions over the burst's start.
        profile_s = float(os.environ.get("BENCH_BURST_PROFILE") or 0)
        profiling = asyncio.ensure_future(s.profile_worker(profile_s)) if profile_s else None
        timeline = await wait_bound(s, clock, n, name, w0)
        wall = time.monotonic() - w0
        u1, m1 = s.usage(), machine_jiffies()
        result = await burst_result(s, clock, n, wall, usage_delta(u0, u1, wall), started)
        result["workers"], result["timeline"], result["machine_busy_pct"] = workers, timeline, busy_pct(m0, m1)
        if profiling is not None:
            result["worker_profile"] = await profiling
        say(f"{name}: served {len(clock.bound)}/{n} in {wall:.0f} s; overhead p99 {fmt(result['overhead_s']['p99'])} s; "
            f"{result['nodes_ready_per_s']} nodes Ready per second ({result.get('nodes_ready_per_s_steady')} while coming Ready); busiest: {busiest(result['usage'])}")  # fmt: skip
        if idle:
            result["idle"] = await idle_reaction(s, clock)
        clock.stop()
        return result


def busiest(usage: dict[str, dict[str, float]]) -> str:
    name, u = max(usage.items(), key=lambda kv: kv[1]["cpu_pct_of_core"])
    return f"{name} {u['cpu_pct_of_core']}% of a core"


async def wait_bound(s: Stack, clock: PodClock, n: int, name: str, w0: float) -> list[dict[str, Any]]:
    """Until every pod is bound or the burst's deadline; where the nodes sat every PHASES_EVERY."""
    deadline = burst_deadline(n)
    last, timeline, looked = 0, [], 0.0
    while len(clock.bound) < n and time.monotonic() - w0 < deadline:
        s.check_alive()
        await asyncio.sleep(1)
        if len(clock.bound) // max(1, n // 5) != last:
            last = len(clock.bound) // max(1, n // 5)
            say(f"{name}: {len(clock.bound)}/{n} pods bound")
        if time.monotonic() - looked >= PHASES_EVERY:
            looked = time.monotonic()
            timeline.append({"s": round(looked - w0, 1), "pods_bound": len(clock.bound), **await node_phases(s.client)})
    return timeline


async def burst_result(s: Stack, clock: PodClock, n: int, wall: float, used: dict[str, Any], started: float) -> dict[str, Any]:
    """The burst's figures once its pods are bound (or its deadline passed)."""
    overheads = [clock.bound[p] - clock.created[p] - BOOT for p in clock.bound]
    workflows = await node_workflows(s.client)
    starts = sorted(w.start_time.timestamp() for w in workflows)
    to_start = [st - cr for st, cr in zip(starts, sorted(clock.created.values()))]
    cloud, kube = await s.stats("cloud"), await s.stats("kube")
    bought = cloud["instances"]
    result: dict[str, Any] = {
        "pods": n,
        "boot_s": BOOT,
        "served": len(clock.bound),
        "never_served": n - len(clock.bound),  # within the deadline
        "deadline_s": burst_deadline(n),
        "wall_s": round(wall, 1),
        "overhead_s": summary(overheads),
        "pending_to_node_workflow_start_s": summary(to_start),
        "node_workflows": len(workflows),
        "instances_bought": bought,
        "offer_listings": cloud["offer_lists"],
        "offer_listings_per_node": round(cloud["offer_lists"] / bought, 3) if bought else None,
        "usage": used,
        "kube_requests": {"/".join(k[:3]): k[3] for k in sorted(kube["counts"])},
        "cloud_requests": dict(sorted(cloud["requests"].items(), key=lambda kv: -kv[1])),
        "cloud_requests_per_instance": round(sum(cloud["requests"].values()) / bought, 2) if bought else None,
        # The joins' looks for their devices: whole-tailnet listings (coalesced, activities.fresh_reads).
        "tailnet_device_lists": cloud.get("tailnet_device_lists"),
    }
    try:
        bound_at: dict[str, float] = {}
        for pod, node in clock.node_of.items():
            wid = node_workflow_id(NS, "burst", node)
            bound_at[wid] = min(bound_at.get(wid, clock.bound[pod]), clock.bound[pod])
        result["launch_instance"] = path = await launch_durations(s.client, [w.id for w in workflows], bound_at)
        # From the first pod's creation to the last node's Ready: the burst's throughput.
        span = (path["last_ready_at"] or started) - started
        result["nodes_ready_per_s"] = round(path["ready"] / span, 2) if span > 0 else None
        # While they come Ready: the workers' throughput, without the batch window and the boot.
        steady = path["ready_steady"]
        result["nodes_ready_per_s_steady"] = round(steady["nodes"] / steady["s"], 2) if steady and steady["s"] > 0 else None
        result["entities"] = await entity_histories(s.client)
    except RPCError as exc:
        result["nodes_ready_per_s"] = result["nodes_ready_per_s_steady"] = None
        result["history_error"] = str(exc)[:200]
    return result


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
    asked: dict[str, float] = {}  # when the deletion was sent (the bridge may see it before it returns)
    sem = asyncio.Semaphore(50)

    async def delete(pod: str) -> None:
        async with sem:
            node = clock.node_of[pod]
            asked[node] = max(asked.get(node, 0.0), time.time())
            await s.kube.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")
            deleted[node] = max(deleted.get(node, 0.0), time.time())

    u0, w0, m0 = s.usage(), time.monotonic(), machine_jiffies()
    profile_s = float(os.environ.get("BENCH_IDLE_PROFILE") or 0)
    profiling = asyncio.ensure_future(s.profile_worker(profile_s)) if profile_s else None
    await asyncio.gather(*(delete(p) for p in list(clock.bound)))

    first_delete: dict[str, float] = {}

    async def all_terminated() -> bool:
        first_delete.update((await s.stats("cloud"))["first_delete"])
        return set(deleted) <= set(first_delete)

    try:
        await s.until(all_terminated, "a terminate call for every idle node", IDLE_DEADLINE)
    except TimeoutError:
        pass
    wall = time.monotonic() - w0
    u1 = s.usage()
    reactions = [first_delete[n] - t - IDLE for n, t in deleted.items() if n in first_delete]
    result: dict[str, Any] = {
        "nodes": len(deleted),
        "idle_timeout_s": IDLE,
        "never_terminated": len(deleted) - len(reactions),
        "reaction_s": summary(reactions),
        "wall_s": round(wall, 1),
        "usage": usage_delta(u0, u1, wall),
        "machine_busy_pct": busy_pct(m0, machine_jiffies()),
    }
    say(f"idle: terminate call after the idle timeout p50 {fmt(result['reaction_s']['p50'])} s, p99 {fmt(result['reaction_s']['p99'])} s")

    if profiling is not None:
        result["worker_profile"] = await profiling
    result["short_life"] = await short_lives(s)
    # Read once the lives closed (a running activity's start is written at its end).
    wids = {node: node_workflow_id(NS, "burst", node) for node in asked}
    result["stages_s"] = stages = await idle_stages(s.client, wids, asked, first_delete, IDLE)
    say("idle: where it went (p50/p99 s): " + ", ".join(f"{k} {fmt(v['p50'])}/{fmt(v['p99'])}" for k, v in stages.items() if isinstance(v, dict)))
    return result


async def short_lives(s: Stack) -> dict[str, Any]:
    """Once the idle nodes' workflows closed: each one short life's history events, and the
    Temporal Cloud actions of a sample of them (bench/actions.py)."""

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
    life: dict[str, Any] = {
        "workflows": len(events),
        "history_events": summary([float(e) for e in events]),
        "life_s": summary(durations),
    }
    if lives:
        life["breakdown"] = await breakdown(s.client, lives[0].id, None)
        life["sequence"] = await sequence(s.client, lives[0].id)
        counted = [await life_actions(s.client, w.id, w.run_id) for w in lives[:ACTIONS_SAMPLE]]
        totals = sorted(sum(c.values()) for c in counted)
        life["actions"] = {"sampled": len(counted), "p50": totals[len(totals) // 2], "max": totals[-1], "by_kind": counted[0]}
    say(f"idle: one short life ({fmt(pct(durations, 50))} s) = {fmt(pct([float(e) for e in events], 50))} history events (median of {len(events)})")
    return life

