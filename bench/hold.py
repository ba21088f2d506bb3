"""The hold `make bench` measures: node workflows started directly (as the pool's start activity
does) on machines that boot at once and register their Node without a kubelet loop; once all are
Ready and the stack is quiet, a stretch at rest: CPU and RSS of each process, provider and
Kubernetes requests per second, history events per node-hour."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

from temporalio.service import RPCError

from bench.history import breakdown, describe_all
from bench.knobs import (
    HISTORY_SAMPLE, HOLD_BRINGUP_DEADLINE, HOLD_SECONDS, HOLD_SETTLE, PROFILE_SECONDS, QUIET_EVERY, QUIET_SECONDS,
    QUIET_WORKER_CPU_PCT, RPC_TIMEOUT, say, usage_delta,
)  # fmt: skip
from bench.stack import NS, ROOT, TASK_QUEUE, Stack, gpu_class, gpu_pool
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
from tgp.node import NodeWorkflowInput
from tgp.pools import node_request

async def hold(n: int) -> dict[str, Any]:
    say(f"hold {n}: starting a fresh stack (machines boot at once and register their Node, no kubelet loop)")
    async with Stack(boot_delay=0.0, logs=ROOT / "bench" / "results" / "logs" / "hold", kubelets=False) as s:
        klass, pool = gpu_class("hold", max_nodes=n), gpu_pool("hold", "hold", idle_timeout="1h", max_nodes=n)
        await s.apply(klass)
        await s.apply(pool)
        await s.class_ready("hold")
        ready, bringup, bringup_usage = await bring_up(s, n, klass, pool)
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
        h0, k0, c0 = time.monotonic(), await kube_counts(s), await cloud_counts(s)
        a0 = s.usage()
        await asyncio.sleep(HOLD_SECONDS)
        s.check_alive()
        a1 = s.usage()
        stretch = time.monotonic() - h0
        k1, c1 = await kube_counts(s), await cloud_counts(s)
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
            "bringup_usage": bringup_usage,
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


async def bring_up(s: Stack, n: int, klass: dict[str, Any], pool: dict[str, Any]) -> tuple[int, float, dict[str, Any]]:
    """Start `n` node workflows at once; (nodes Ready, seconds, each process's CPU meanwhile)
    once all are Ready or HOLD_BRINGUP_DEADLINE passed."""
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
    return ready, bringup, usage_delta(u0, u1, bringup)


async def kube_counts(s: Stack) -> dict[tuple[str, ...], int]:
    return {tuple(k[:3]): k[3] for k in (await s.stats("kube"))["counts"]}


async def cloud_counts(s: Stack) -> tuple[int, int, int]:
    """Requests by tgp's key, describes and offer listings at the simulated cloud so far."""
    c = await s.stats("cloud")
    return c["requests_by_key"], c["describe_requests"], c["offer_lists"]


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

