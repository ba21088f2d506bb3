"""Issue 17 items 8 and 21 through the bridge, with the project's own scheduler (sim.scheduler,
which backs off per pod like kube-scheduler): pods that arrive while the first ones back off
take the nodes bought for those; the first ones still get nodes, and nothing is blamed."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from temporalio.testing import WorkflowEnvironment

from sim.scheduler import SimScheduler
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_bridge import NO_IDLING, Stack, apply, gpu_class, gpu_pool, pending_pod, ready_nodes, running_stack

FIRST = 5


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def plain_pod(kube: httpx.AsyncClient, name: str) -> None:
    """A 1-GPU pod as a user creates it: the scheduler has not looked at it yet."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {
            "containers": [{"name": "train", "image": "pytorch", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 1,
        },
    }
    (await kube.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()


async def bound(s: Stack, prefix: str) -> dict[str, str | None]:
    pods: list[dict[str, Any]] = (await s.kube.get("/api/v1/namespaces/ml/pods")).json()["items"]
    return {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods if p["metadata"]["name"].startswith(prefix)}


async def test_item8_item21_pods_whose_nodes_others_took_get_nodes_again(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s:
        if s.world.kube is None:
            return  # a real cluster has its own scheduler; this drives the emulator's step by step
        await apply(s.kube, gpu_class(maxNodes=4 * FIRST))
        await apply(s.kube, gpu_pool("burst", disruption=NO_IDLING))
        clock = Clock()
        scheduler = SimScheduler(kube_api.url, clock=clock)
        for i in range(FIRST):
            await pending_pod(s.kube, f"first-{i}")
        await scheduler.step()  # no node yet: every first pod backs off for 1 s
        await ready_nodes(s, "ml", "burst", FIRST)
        # Newer pods arrive while the first ones back off, and take the nodes bought for them.
        for i in range(FIRST):
            await plain_pod(s.kube, f"later-{i}")
        await scheduler.step()
        assert all((await bound(s, "later-")).values()) and not any((await bound(s, "first-")).values())

        async def schedule() -> None:
            while True:
                clock.now += 0.2
                await scheduler.step()
                await asyncio.sleep(0.2)

        task = asyncio.create_task(schedule())
        try:

            async def all_bound() -> bool:
                return all((await bound(s, "first-")).values())

            await eventually(all_bound, timeout=60, what="the first pods to get nodes again")
        finally:
            task.cancel()
        assert len(s.world.cloud.instances) == 2 * FIRST, f"{len(s.world.cloud.instances)} nodes bought for {2 * FIRST} one-GPU pods"
        events = (await s.kube.get("/api/v1/namespaces/ml/events")).json()["items"]
        assert not [e for e in events if e["reason"] == "PodDoesNotFit"], "no pod that had no room is blamed"
        # A pass's launches are one NodeLaunched Event, counting them (activities.entity.folded).
        launched = [e for e in events if e["reason"] == "NodeLaunched"]
        assert sum(e["count"] for e in launched) == 2 * FIRST and len(launched) < 2 * FIRST, [(e["count"], e["message"]) for e in launched]
