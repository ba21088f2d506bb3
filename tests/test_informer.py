"""The bridge's informer over the emulator: nothing is lost when a handler fails once."""

from __future__ import annotations

import asyncio

import httpx

from activities.cluster import KubernetesCluster
from crd_bridge.informer import Informer
from tests.conftest import eventually
from tgp.sim.kube import KubeEmulator


async def test_an_event_whose_handler_failed_is_delivered_again() -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        core = await cluster._client()
        seen: list[str] = []
        failures = {"train": 1}

        async def handler(kind: str, obj: dict) -> None:
            name = obj["metadata"]["name"]
            if failures.get(name):
                failures[name] -= 1
                raise RuntimeError("Temporal unavailable")
            seen.append(f"{kind} {name}")

        informer = Informer("pods", core.list_pod_for_all_namespaces_without_preload_content, handler)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 10)
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "ml"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
            async with httpx.AsyncClient(base_url=kube.url) as http:
                (await http.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()

            async def delivered() -> bool:
                return any(s.endswith(" train") for s in seen)

            await eventually(delivered, timeout=10, what="the pod to be delivered after the handler failed")
            assert informer.relists >= 2, "the failure led to a re-list that delivered it again"
        finally:
            task.cancel()
