"""The simulated kubelet (sim.kube_kubelet.SimKubelet) keeps its Node alive and runs its pods the
way a real kubelet does, against `kube_api`: the emulator, and a real control plane in the
real-cluster lane (whose node lifecycle controller would mark a silent Node NotReady).

Issue 19: simulated Nodes never renewed their Lease nor posted status, registered without the
pool's taints, and nothing ran their pods on a real cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

# The harmless join material that template checks render with (no real secret).
from activities.http_wire import default_tls
from activities.boot.checks import SAMPLE_JOIN
from activities.boot.render import BootSettings, render_boot_payload, shipped_template
from sim.cloud import SimulatedCloud
from sim.kube_kubelet import (
    LEASE_NAMESPACE,
    RUN_SECONDS_ANNOTATION,
    STOP_SECONDS_ANNOTATION,
    SimKubelet,
    kubelet_registration,
)
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tgp.types import Taint

POOL_TAINTS = [{"key": "example.com/tenant", "value": "blue", "effect": "NoSchedule"}]
POOL_LABELS = {"tgp.io/pool": "blue", "example.com/team": "ml"}
# A real control plane's controllers and kubelet stand-in need seconds under load.
CONVERGE = 60.0


@contextlib.asynccontextmanager
async def running(kubelet: SimKubelet) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(kubelet.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def fast(kube_api: KubeApi, name: str, **kwargs: Any) -> SimKubelet:
    return SimKubelet(kube_api.url, name, client=kube_api.http, lease_renew_interval=0.2, status_interval=0.2,
                      pod_sync_interval=0.1, **kwargs)


async def test_registers_with_its_taints_in_the_create_and_renews_its_lease(kube_api: KubeApi) -> None:
    name = kube_api.unique("kubelet")
    listed = await kube_api.get("/api/v1/nodes")
    assert listed is not None
    since = listed["metadata"]["resourceVersion"]
    async with running(fast(kube_api, name, labels=POOL_LABELS, taints=POOL_TAINTS, gpus=2)):
        # The first event of the Node already carries the pool's taints: no window for any pod.
        async with kube_api.http.stream(
            "GET", "/api/v1/nodes", timeout=CONVERGE,
            params={"watch": "true", "resourceVersion": since, "fieldSelector": f"metadata.name={name}", "timeoutSeconds": "30"},
        ) as stream:
            async for line in stream.aiter_lines():
                event = json.loads(line)
                if event["object"]["metadata"].get("name") == name:
                    break
        assert event["type"] == "ADDED"
        registered = event["object"]
        assert POOL_TAINTS[0] in registered["spec"]["taints"]
        assert registered["metadata"]["labels"].items() >= POOL_LABELS.items()

        lease_path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}"
        first = await eventually(lambda: kube_api.get(lease_path), timeout=CONVERGE, what="the Node's Lease")
        assert first["spec"]["holderIdentity"] == name and first["spec"]["leaseDurationSeconds"] == 40
        node = await kube_api.get(f"/api/v1/nodes/{name}")
        assert node is not None
        assert first["metadata"]["ownerReferences"][0]["uid"] == node["metadata"]["uid"]

        async def renewed() -> bool:
            lease = await kube_api.get(lease_path)
            return lease is not None and lease["spec"]["renewTime"] != first["spec"]["renewTime"]

        await eventually(renewed, timeout=CONVERGE, what="a Lease renewal")

        async def ready_with_gpus() -> bool:
            node = await kube_api.get(f"/api/v1/nodes/{name}") or {}
            status = node.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            return ready and (status.get("allocatable") or {}).get("nvidia.com/gpu") == "2"

        await eventually(ready_with_gpus, timeout=CONVERGE, what="Ready with 2 allocatable GPUs")
        if kube_api.real:
            # The node lifecycle controller lifts the not-ready taint of a Node that reports Ready.
            async def untainted() -> bool:
                node = await kube_api.get(f"/api/v1/nodes/{name}") or {}
                keys = [t["key"] for t in (node.get("spec") or {}).get("taints") or []]
                return "node.kubernetes.io/not-ready" not in keys and POOL_TAINTS[0]["key"] in keys

            await eventually(untainted, timeout=CONVERGE, what="the not-ready taint lifted")


async def test_runs_its_pods_completes_them_and_honours_grace_periods(kube_api: KubeApi) -> None:
    name = kube_api.unique("kubelet")
    kubelet = fast(kube_api, name)
    async with running(kubelet):
        await eventually(lambda: kube_api.get(f"/api/v1/nodes/{name}"), timeout=CONVERGE, what="the Node")
        pods = f"/api/v1/namespaces/{kube_api.namespace}/pods"

        def pod(pod_name: str, *, grace: int, annotations: dict[str, str]) -> dict[str, Any]:
            return {"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": pod_name, "annotations": annotations},
                    "spec": {"nodeName": name, "terminationGracePeriodSeconds": grace,
                             "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9"}]}}

        await kube_api.create(pods, pod("job", grace=0, annotations={RUN_SECONDS_ANNOTATION: "0"}))
        await kube_api.create(pods, pod("server", grace=3600, annotations={}))
        await kube_api.create(pods, pod("quick", grace=3600, annotations={STOP_SECONDS_ANNOTATION: "0"}))

        async def phase(pod_name: str, wanted: str) -> bool:
            found = await kube_api.get(f"{pods}/{pod_name}")
            return found is not None and (found.get("status") or {}).get("phase") == wanted

        await eventually(lambda: phase("job", "Succeeded"), timeout=CONVERGE, what="the job Succeeded")
        await eventually(lambda: phase("server", "Running"), timeout=CONVERGE, what="the server Running")
        await eventually(lambda: phase("quick", "Running"), timeout=CONVERGE, what="quick Running")

        for pod_name in ("server", "quick"):
            response = await kube_api.http.delete(f"{pods}/{pod_name}")
            assert response.status_code == 200, response.text
        # `quick` stops at once; `server` stays Terminating for its grace period (an hour), over
        # many passes of the kubelet.
        await eventually(lambda: _gone(kube_api, f"{pods}/quick"), timeout=CONVERGE, what="quick deleted")
        passes = kubelet.passes
        await eventually(lambda: _true(kubelet.passes >= passes + 3), timeout=CONVERGE, what="three kubelet passes")
        server = await kube_api.get(f"{pods}/server")
        assert server is not None and server["metadata"].get("deletionTimestamp")


async def test_registers_again_when_its_node_is_deleted_and_its_lease_goes_with_it(kube_api: KubeApi) -> None:
    """A kubelet whose Node object is deleted while its machine runs re-creates it (a new uid),
    as a real kubelet does once its status updates find no Node: a deleted Node object alone
    does not take a running machine out of the cluster (tgp's finalizer is why)."""
    name = kube_api.unique("kubelet")
    kubelet = fast(kube_api, name)
    async with running(kubelet):
        node = await eventually(lambda: kube_api.get(f"/api/v1/nodes/{name}"), timeout=CONVERGE, what="the Node")
        lease = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}"
        first_lease = await eventually(lambda: kube_api.get(lease), timeout=CONVERGE, what="the Node's Lease")
        assert (await kube_api.http.delete(f"/api/v1/nodes/{name}")).status_code == 200

        async def registered_again() -> dict[str, Any] | None:
            again = await kube_api.get(f"/api/v1/nodes/{name}")
            return again if again is not None and again["metadata"]["uid"] != node["metadata"]["uid"] else None

        await eventually(registered_again, timeout=CONVERGE, what="the Node registered again")
        assert kubelet.registrations == 1

        # The old Lease was owned by the deleted Node: collected; the new Node gets its own.
        async def new_lease() -> dict[str, Any] | None:
            current = await kube_api.get(lease)
            return current if current is not None and current["metadata"]["uid"] != first_lease["metadata"]["uid"] else None

        await eventually(new_lease, timeout=CONVERGE, what="a new Lease for the new Node")


@pytest.mark.parametrize("template", ["talos-worker.yaml.j2", "ubuntu-cloud-init.yaml.j2"])
def test_the_kubelet_reads_labels_and_taints_from_the_shipped_templates(template: str) -> None:
    settings = BootSettings(
        node_pool="blue", node_labels=POOL_LABELS, node_taints=[Taint(**t) for t in POOL_TAINTS],
        tailscale_tags=["tag:gpu-node"], kubernetes_version="1.34.1",
    )
    payload = render_boot_payload(
        "cloud-init", hostname="blue-1", auth_key=SecretStr("tskey-auth-k1-x"), template=shipped_template(template),
        settings=settings, join=SAMPLE_JOIN,
    )
    labels, taints = kubelet_registration(payload.content)
    assert labels.items() >= POOL_LABELS.items()
    assert taints == POOL_TAINTS


def test_an_env_payload_without_pool_labels_or_taints_registers_with_none() -> None:
    assert kubelet_registration("TS_AUTHKEY=tskey-auth-x\nTS_HOSTNAME=n1\n") == ({}, [])


def test_the_env_payload_registers_with_the_pools_labels_and_taints() -> None:
    """The payload of the simulated provider (`env`, what `tgp dev` buys) carries the pool's
    labels and taints as the kubelet flags the shipped templates use (issue 19: simulated
    Nodes registered untainted, leaving a window for any pod before tgp tainted them)."""
    settings = BootSettings(node_pool="blue", node_labels=POOL_LABELS, node_taints=[Taint(**t) for t in POOL_TAINTS])
    payload = render_boot_payload("env", hostname="blue-1", auth_key=SecretStr("tskey-auth-k1-x"), settings=settings)
    labels, taints = kubelet_registration(payload.content)
    assert labels == POOL_LABELS
    assert taints == POOL_TAINTS


async def test_a_simulated_machine_registers_with_its_payload_taints() -> None:
    """The simulated cloud hands the boot payload's labels and taints to the kubelet."""
    seen: list[tuple[str, dict[str, str], int, list[dict[str, str]]]] = []

    async def register(name: str, labels: dict[str, str], gpus: int, taints: list[dict[str, str]]) -> None:
        seen.append((name, labels, gpus, taints))

    payload = f"TS_HOSTNAME=blue-1\nnodeLabels: {json.dumps(POOL_LABELS)}\nregisterWithTaints: {json.dumps(POOL_TAINTS)}\n"
    async with SimulatedCloud(boot_delay=0.0, node_register=register, api_key="k") as cloud:
        async with httpx.AsyncClient(verify=default_tls(), base_url=cloud.url, headers={"Authorization": "Bearer k"}) as http:
            offer = (await http.get("/v1/offers")).json()["offers"][0]["id"]
            response = await http.post("/v1/instances", json={"offerId": offer, "name": "blue-1", "userData": payload})
            assert response.status_code == 201, response.text
        await eventually(lambda: _true(bool(seen)), what="the machine's registration")
    [(name, labels, _, taints)] = seen
    assert name == "blue-1" and labels.items() >= POOL_LABELS.items() and taints == POOL_TAINTS


async def _gone(kube_api: KubeApi, path: str) -> bool:
    return await kube_api.get(path) is None


async def _true(value: bool) -> bool:
    return value
