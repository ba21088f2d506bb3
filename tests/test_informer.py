"""The bridge's informer over the emulator: nothing is lost when a handler fails once."""

from __future__ import annotations

import asyncio

import httpx

from activities.http_wire import default_tls
from activities.kube.cluster import KubernetesCluster
from crd_bridge.informer import Informer
from tests.conftest import eventually
from sim.kube import KubeEmulator


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
            await asyncio.wait_for(informer.synced.wait(), 30)
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "train", "namespace": "ml"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
            async with httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
                (await http.post("/api/v1/namespaces/ml/pods", json=pod)).raise_for_status()

            async def delivered() -> bool:
                return any(s.endswith(" train") for s in seen)

            await eventually(delivered, what="the pod to be delivered after the handler failed")
            assert informer.failed == {}
        finally:
            task.cancel()


async def test_an_object_whose_handler_always_fails_holds_up_no_other() -> None:
    """The informer lists past it, syncs, keeps watching, and retries it with backoff."""
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        core = await cluster._client()
        seen: list[str] = []
        attempts = {"bad": 0}

        async def create(namespace: str, name: str) -> None:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
            (await http.post(f"/api/v1/namespaces/{namespace}/pods", json=pod)).raise_for_status()

        async def handler(kind: str, obj: dict) -> None:
            name = obj["metadata"]["name"]
            if name == "bad" and kind != "DELETED":
                attempts["bad"] += 1
                raise ValueError("a shape this handler cannot read")
            seen.append(name)

        await create("aaa", "bad")  # listed first: before the fix, nothing after it was ever delivered
        await create("ml", "listed")
        informer = Informer("pods", core.list_pod_for_all_namespaces_without_preload_content, handler)
        task = asyncio.create_task(informer.run())
        try:
            await asyncio.wait_for(informer.synced.wait(), 30)
            assert "listed" in seen
            await create("ml", "watched")

            async def watched_and_retried() -> bool:
                return "watched" in seen and attempts["bad"] >= 3

            await eventually(watched_and_retried, what="a watched pod, and the bad one retried")
            assert list(informer.failed) == ["aaa/bad"] and informer.relists == 1, "retried alone, without re-listing"
            (await http.delete("/api/v1/namespaces/aaa/pods/bad")).raise_for_status()

            async def forgotten() -> bool:
                return not informer.failed

            await eventually(forgotten, what="its deletion to end the retries")
        finally:
            task.cancel()
