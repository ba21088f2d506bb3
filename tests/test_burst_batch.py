"""Issue 20, batched launches: a burst of pending pods through the bridge, with the project's own
scheduler (sim.scheduler) binding them as nodes come up. Every pod some offer fits gets a node,
one node per one-GPU pod, and the pool starts a batch's nodes together.

Sized to stay fast in the suite; `TGP_BURST_PODS=500` runs the issue's burst (and prints the time
from the first pod to the last one Running)."""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from typing import Any

from temporalio.testing import WorkflowEnvironment

from sim.scheduler import SimScheduler
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_bridge import NO_IDLING, apply, gpu_class, gpu_pool, running_stack
from tests.test_burst import plain_pod
from tgp.messages import class_workflow_id, pool_workflow_id

PODS = int(os.environ.get("TGP_BURST_PODS", "12"))


async def test_a_burst_through_the_bridge_gets_every_pod_a_node(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s:
        if s.world.kube is None:
            return  # the emulator's scheduler stand-in; a real cluster's bursts are its own
        await apply(s.kube, gpu_class(maxNodes=PODS + 10))
        await apply(s.kube, gpu_pool("burst", disruption=NO_IDLING))
        began = time.monotonic()
        await asyncio.gather(*(plain_pod(s.kube, f"b-{i}") for i in range(PODS)))
        started = asyncio.create_task(_all_started(s, began))
        async with SimScheduler(kube_api.url, interval=0.2, client=kube_api.http):

            async def all_running() -> list[dict[str, Any]] | None:
                pods = (await s.kube.get("/api/v1/namespaces/ml/pods")).json()["items"]
                waiting = [p for p in pods if (p.get("status") or {}).get("phase") != "Running"]
                return None if waiting else pods

            try:
                await eventually(all_running, timeout=120 + 2 * PODS, what=f"all {PODS} pods Running")
            except AssertionError:
                started.cancel()
                raise AssertionError(await _what_stalled(s)) from None
        took = time.monotonic() - began
        print(f"burst: {PODS} pods Running in {took:.1f} s (their node workflows all started after {await started:.1f} s); {len(s.world.cloud.instances)} instances bought")
        assert len(s.world.cloud.instances) == PODS, f"{len(s.world.cloud.instances)} nodes bought for {PODS} one-GPU pods"


async def _all_started(s: Any, began: float) -> float:
    """Seconds from the burst until the pool counts a node for every pod (its status)."""
    while (await s.pool_status("ml", "burst")).get("desiredNodes", 0) < PODS:
        await asyncio.sleep(0.5)
    took = time.monotonic() - began
    print(f"burst: the pool counts {PODS} nodes after {took:.1f} s", flush=True)
    return took


async def _what_stalled(s: Any) -> str:
    """What a stalled burst looks like: the pods, the pool's view, and the pool's and class's
    histories (what they are waiting on)."""
    pods = (await s.kube.get("/api/v1/namespaces/ml/pods")).json()["items"]
    waiting = sorted(p["metadata"]["name"] for p in pods if (p.get("status") or {}).get("phase") != "Running")
    status = await s.pool_status("ml", "burst")
    phases: dict[str, int] = {}
    for n in status.get("nodes") or []:
        phases[n["phase"]] = phases.get(n["phase"], 0) + 1
    conditions = {c["type"]: (c["status"], c["reason"], c["message"][:200]) for c in status.get("conditions") or []}
    extra = ""
    for wid in (class_workflow_id("sim"), pool_workflow_id("ml", "burst")):
        h = s.env.client.get_workflow_handle(wid)
        d = await h.describe()
        hist = await h.fetch_history()
        kinds = Counter(e.WhichOneof("attributes") for e in hist.events)
        extra += f"\n{wid}: run {d.run_id} status {d.status} events {len(hist.events)} {dict(kinds.most_common(12))}"
        extra += f"\n  last: {[e.WhichOneof('attributes') for e in hist.events[-15:]]}"
        extra += f"\n  pending activities: {[(a.activity_type.name, a.attempt, a.state) for a in d.raw_description.pending_activities][:12]}"
    return extra + (
        f"{len(waiting)} of {PODS} pods not Running ({waiting[:10]}); {len(s.world.cloud.instances)} instances bought; "
        f"pool nodes by phase {phases}; conditions {conditions}"
    )
