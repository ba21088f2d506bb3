"""The `Cluster` adapter over real HTTP, against the emulator or (with TGP_TEST_KUBECONFIG) a
real API server. Expected values come from the API-server contract in
docs/reference/kubernetes-testing.md, not from the emulator. Fault injection (401, 403, 5xx,
timeouts, conflicts, an old server) needs the emulator's DSL and runs on it only."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from activities.http_wire import default_tls
from tests.kube_env import KubeApi

from activities.kube.cluster import MERGE_PATCH, SEEN_FOR, KubernetesCluster
from activities.ports import Cluster, EvictionBlocked
from tgp.errors import AuthError, ConfigError, PermissionDenied, TransientError
from sim.kube import KubeEmulator
from sim.kube_kubelet import register_node, set_node_ready
from sim.kube_machinery import NODES
from sim.kube_store import TAINT_NOT_READY
from tgp.types import GPU_RESOURCE, Taint

GPU_TAINT = Taint(key="nvidia.com/gpu", value="present", effect="NoSchedule")


def _has_not_ready_taint(taints: list[Taint]) -> bool:
    return any(t.key == TAINT_NOT_READY and t.effect == "NoSchedule" for t in taints)


def _gone(kube_api: KubeApi, pod: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return not await kube_api.pod_exists(pod)

    return check


async def _register_ready_node(kube_api: KubeApi, name: str, labels: dict[str, str] | None = None) -> None:
    """A registered Node whose not-ready taint is already gone, so that no controller of a real
    cluster writes to it during the test."""
    await register_node(kube_api.url, name, labels=labels, client=kube_api.http)

    async def settled() -> bool:
        node = await kube_api.cluster.get_node(name)
        return node is not None and node.ready and not _has_not_ready_taint(node.taints)

    await kube_api.eventually(settled)


async def test_kubernetes_cluster_is_a_cluster() -> None:
    async with KubernetesCluster.from_url("http://127.0.0.1:1") as adapter:
        cluster: Cluster = adapter  # checked by mypy against the Protocol
        assert cluster is adapter


def test_a_process_that_talks_to_kubernetes_never_loads_core_v1_api() -> None:
    """kubernetes.aio's CoreV1Api costs 1.3 s of CPU to load (618 generated methods): the worker,
    the bridge and every `tgp plan` make their core/v1 calls without it (core_calls.py)."""
    probe = (
        "import sys, workers.main, crd_bridge.bridge, workers.plan; "
        "from activities.kube.connection import load_client_classes; load_client_classes(); "
        "print('kubernetes.aio.client.api.core_v1_api' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr[-2000:]


# --- the API-server contract the adapter relies on ------------------------------------


async def test_create_answers_201_with_server_set_metadata(kube_api: KubeApi) -> None:
    response = await kube_api.http.post(
        f"/apis/policy/v1/namespaces/{kube_api.namespace}/poddisruptionbudgets",
        json={"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "budget"},
              "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "x"}}}},
    )
    assert response.status_code == 201
    meta = response.json()["metadata"]
    assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
    assert meta["generation"] == 1


async def test_resource_version_increases_on_every_write(kube_api: KubeApi) -> None:
    name = kube_api.unique("rv")
    created = await kube_api.create_node(name)
    labelled = await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {"a": "1"}}})
    reported = await kube_api.merge_patch(f"/api/v1/nodes/{name}/status", {"status": {"capacity": {"cpu": "4"}}})
    versions = [int(created["metadata"]["resourceVersion"])] + [
        int(r.json()["metadata"]["resourceVersion"]) for r in (labelled, reported)
    ]
    assert versions == sorted(set(versions))


async def test_patch_with_stale_resource_version_is_a_conflict(kube_api: KubeApi) -> None:
    name = kube_api.unique("stale")
    created = await kube_api.create_node(name)
    stale = created["metadata"]["resourceVersion"]
    assert (await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"metadata": {"labels": {"a": "1"}}})).status_code == 200
    response = await kube_api.merge_patch(
        f"/api/v1/nodes/{name}", {"metadata": {"resourceVersion": stale, "labels": {"a": "2"}}}
    )
    assert response.status_code == 409
    node = await kube_api.get(f"/api/v1/nodes/{name}")
    assert node is not None and node["metadata"]["labels"]["a"] == "1"


async def test_status_subresource_changes_status_only(kube_api: KubeApi) -> None:
    name = kube_api.unique("status")
    await kube_api.create_node(name)
    via_status = await kube_api.merge_patch(
        f"/api/v1/nodes/{name}/status", {"spec": {"unschedulable": True}, "status": {"capacity": {"cpu": "4"}}}
    )
    assert via_status.status_code == 200
    via_main = await kube_api.merge_patch(f"/api/v1/nodes/{name}", {"status": {"capacity": {"cpu": "8"}}})
    assert via_main.status_code == 200
    node = await kube_api.get(f"/api/v1/nodes/{name}")
    assert node is not None
    assert not node["spec"].get("unschedulable")
    assert node["status"]["capacity"]["cpu"] == "4"


async def test_generation_follows_spec_not_status(kube_api: KubeApi) -> None:
    path = f"/apis/policy/v1/namespaces/{kube_api.namespace}/poddisruptionbudgets/budget"
    await kube_api.create_pdb("budget", match_labels={"app": "x"}, min_available=1)
    status = await kube_api.merge_patch(f"{path}/status", {"status": {"observedGeneration": 1}})
    assert status.status_code == 200 and status.json()["metadata"]["generation"] == 1
    spec = await kube_api.merge_patch(path, {"spec": {"minAvailable": 2}})
    assert spec.status_code == 200 and spec.json()["metadata"]["generation"] == 2


async def test_list_pods_honours_label_selector(kube_api: KubeApi) -> None:
    node = kube_api.unique("labels")
    await kube_api.create_node(node)
    await kube_api.create_pod("web", node=node, labels={"app": "web"})
    await kube_api.create_pod("db", node=node, labels={"app": "db"})
    response = await kube_api.http.get(
        f"/api/v1/namespaces/{kube_api.namespace}/pods", params={"labelSelector": "app=web"}
    )
    assert [p["metadata"]["name"] for p in response.json()["items"]] == ["web"]


# --- nodes ---------------------------------------------------------------------------


async def test_get_node_of_missing_node_is_none(kube_api: KubeApi) -> None:
    assert await kube_api.cluster.get_node(kube_api.unique("missing")) is None


async def test_new_node_is_tainted_not_ready_until_ready(kube_api: KubeApi) -> None:
    name = kube_api.unique("joining")
    created = await kube_api.create_node(name)
    # Admission adds the taint in the create; a real node lifecycle controller lifts it within
    # seconds from a Node that reports no conditions, so a later read may already miss it.
    assert {"key": TAINT_NOT_READY, "effect": "NoSchedule"}.items() <= next(
        (t for t in created["spec"].get("taints") or [] if t["key"] == TAINT_NOT_READY), {}
    ).items()
    node = await kube_api.cluster.get_node(name)
    assert node is not None and not node.ready
    if not kube_api.real:
        assert _has_not_ready_taint(node.taints)

    await set_node_ready(kube_api.url, name, True, client=kube_api.http)

    async def ready_and_untainted() -> bool:
        node = await kube_api.cluster.get_node(name)
        return node is not None and node.ready and not _has_not_ready_taint(node.taints)

    await kube_api.eventually(ready_and_untainted)


async def test_register_node_and_set_node_ready_are_seen_through_get_node(kube_api: KubeApi) -> None:
    name = kube_api.unique("kubelet")
    await register_node(kube_api.url, name, labels={"tgp.io/pool": "p1"}, client=kube_api.http)
    node = await kube_api.cluster.get_node(name)
    assert node is not None and node.name == name and node.ready
    assert node.labels["tgp.io/pool"] == "p1" and node.labels["kubernetes.io/hostname"] == name
    raw = await kube_api.get(f"/api/v1/nodes/{name}")
    assert raw is not None and raw["status"]["capacity"][GPU_RESOURCE] == "1"

    await set_node_ready(kube_api.url, name, False, client=kube_api.http)
    node = await kube_api.cluster.get_node(name)
    assert node is not None and not node.ready
    await set_node_ready(kube_api.url, name, True, client=kube_api.http)
    node = await kube_api.cluster.get_node(name)
    assert node is not None and node.ready


async def test_register_node_unready_then_ready(kube_api: KubeApi) -> None:
    name = kube_api.unique("slow-boot")
    await register_node(kube_api.url, name, ready=False, client=kube_api.http)
    node = await kube_api.cluster.get_node(name)
    assert node is not None and not node.ready and _has_not_ready_taint(node.taints)


async def test_label_and_taint_merges_and_is_idempotent(kube_api: KubeApi) -> None:
    name = kube_api.unique("label")
    await _register_ready_node(kube_api, name, labels={"keep": "me"})
    labels = {"tgp.io/pool": "p1", "tgp.io/gpu-type": "a100"}

    await kube_api.cluster.label_and_taint(name, labels, [GPU_TAINT])
    first = await kube_api.get(f"/api/v1/nodes/{name}")
    await kube_api.cluster.label_and_taint(name, labels, [GPU_TAINT])
    second = await kube_api.get(f"/api/v1/nodes/{name}")

    assert first is not None and second is not None
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]  # nothing written
    node = await kube_api.cluster.get_node(name)
    assert node is not None
    assert node.labels["keep"] == "me" and node.labels["tgp.io/pool"] == "p1" and node.labels["tgp.io/gpu-type"] == "a100"
    assert [t for t in node.taints if t.key == GPU_TAINT.key] == [GPU_TAINT]


async def test_label_and_taint_keeps_other_taints_and_updates_a_value(kube_api: KubeApi) -> None:
    name = kube_api.unique("retaint")
    await _register_ready_node(kube_api, name)
    other = Taint(key="example.com/other", value="x", effect="NoExecute")
    await kube_api.cluster.label_and_taint(name, {}, [other, GPU_TAINT.model_copy(update={"value": "old"})])
    await kube_api.cluster.label_and_taint(name, {}, [GPU_TAINT])
    node = await kube_api.cluster.get_node(name)
    assert node is not None
    assert other in node.taints and GPU_TAINT in node.taints
    assert len([t for t in node.taints if t.key == GPU_TAINT.key]) == 1


async def test_label_and_taint_of_missing_node_is_transient(kube_api: KubeApi) -> None:
    with pytest.raises(TransientError):
        await kube_api.cluster.label_and_taint(kube_api.unique("absent"), {"a": "b"}, [])


async def test_cordon_marks_unschedulable(kube_api: KubeApi) -> None:
    name = kube_api.unique("cordon")
    await register_node(kube_api.url, name, client=kube_api.http)
    await kube_api.cluster.cordon(name)
    await kube_api.cluster.cordon(name)
    node = await kube_api.cluster.get_node(name)
    assert node is not None and node.unschedulable
    await kube_api.cluster.cordon(kube_api.unique("gone"))  # no Node, nothing to cordon


async def test_delete_node_twice_is_fine(kube_api: KubeApi) -> None:
    name = kube_api.unique("delete")
    await register_node(kube_api.url, name, client=kube_api.http)
    await kube_api.cluster.delete_node(name)
    await kube_api.cluster.delete_node(name)
    assert await kube_api.cluster.get_node(name) is None


# --- pods and eviction ---------------------------------------------------------------


async def test_list_pods_on_node_filters_by_node_and_summarises(kube_api: KubeApi) -> None:
    node, other = kube_api.unique("pods"), kube_api.unique("other")
    await kube_api.create_node(node)
    await kube_api.create_node(other)
    if kube_api.real:
        # A made-up ReplicaSet would be garbage-collected, a real one would adopt or delete the
        # pod: a ConfigMap is a controller owner that no controller acts on.
        owner = await kube_api.create(f"/api/v1/namespaces/{kube_api.namespace}/configmaps",
                                      {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "trainer-owner"}})
        owner_kind = "ConfigMap"
        await kube_api.create_pod("trainer", node=node, gpu=True, owner_kind=owner_kind, owner_api_version="v1",
                                  owner_uid=owner["metadata"]["uid"])
    else:
        owner_kind = "ReplicaSet"
        await kube_api.create_pod("trainer", node=node, gpu=True, owner_kind=owner_kind)
    await kube_api.create_pod("static", node=node, mirror=True, phase="Pending")
    await kube_api.create_pod("elsewhere", node=other)

    pods = {p.name: p for p in await kube_api.cluster.list_pods_on_node(node)}

    assert set(pods) == {"trainer", "static"}
    trainer, static = pods["trainer"], pods["static"]
    assert (trainer.namespace, trainer.phase, trainer.owner_kind) == (kube_api.namespace, "Running", owner_kind)
    assert trainer.requests_gpu and not trainer.is_mirror and not trainer.deleting
    assert static.is_mirror and not static.requests_gpu and static.phase == "Pending" and static.owner_kind is None


async def test_list_pods_on_node_without_pods_is_empty(kube_api: KubeApi) -> None:
    assert await kube_api.cluster.list_pods_on_node(kube_api.unique("empty")) == []


async def test_evict_allowed_removes_the_pod(kube_api: KubeApi) -> None:
    node = kube_api.unique("evict")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node)
    await kube_api.cluster.evict_pod(kube_api.namespace, "job", grace_period=timedelta(0))

    async def gone() -> bool:  # grace period 0: removed without waiting for a kubelet
        return await kube_api.cluster.list_pods_on_node(node) == []

    await kube_api.eventually(gone)


async def test_evict_blocked_by_disruption_budget(kube_api: KubeApi) -> None:
    node = kube_api.unique("pdb")
    await kube_api.create_node(node)
    await kube_api.create_pod("only", node=node, labels={"app": "db"})
    await kube_api.create_pdb("db", match_labels={"app": "db"}, min_available=1)

    with pytest.raises(EvictionBlocked, match="disruption budget"):
        await kube_api.cluster.evict_pod(kube_api.namespace, "only")
    assert await kube_api.pod_exists("only")


async def test_evict_allowed_while_budget_has_room(kube_api: KubeApi) -> None:
    node = kube_api.unique("room")
    await kube_api.create_node(node)
    for name in ("a", "b"):
        await kube_api.create_pod(name, node=node, labels={"app": "web"})
    await kube_api.create_pdb("web", match_labels={"app": "web"}, min_available=1)

    async def evicted() -> bool:  # a real disruption controller first has to compute the budget
        try:
            await kube_api.cluster.evict_pod(kube_api.namespace, "a", grace_period=timedelta(0))
        except EvictionBlocked:
            return False
        return True

    await kube_api.eventually(evicted)
    await kube_api.eventually(_gone(kube_api, "a"))
    with pytest.raises(EvictionBlocked):
        await kube_api.cluster.evict_pod(kube_api.namespace, "b")


async def test_evict_blocked_when_budget_cannot_count_bare_pods(kube_api: KubeApi) -> None:
    # maxUnavailable counts against the controllers' replicas; bare pods have none.
    node = kube_api.unique("bare")
    await kube_api.create_node(node)
    for name in ("a", "b"):
        await kube_api.create_pod(name, node=node, labels={"app": "bare"})
    await kube_api.create_pdb("bare", match_labels={"app": "bare"}, max_unavailable=1)
    with pytest.raises(EvictionBlocked):
        await kube_api.cluster.evict_pod(kube_api.namespace, "a")


async def test_evict_ignores_budget_for_pod_that_is_not_running(kube_api: KubeApi) -> None:
    node = kube_api.unique("pending")
    await kube_api.create_node(node)
    await kube_api.create_pod("waiting", node=node, labels={"app": "db"}, phase="Pending")
    await kube_api.create_pdb("db", match_labels={"app": "db"}, min_available=1)
    await kube_api.cluster.evict_pod(kube_api.namespace, "waiting", grace_period=timedelta(0))
    await kube_api.eventually(_gone(kube_api, "waiting"))


async def test_evict_missing_pod_counts_as_evicted(kube_api: KubeApi) -> None:
    await kube_api.cluster.evict_pod(kube_api.namespace, "never-existed")


# --- emulator-only: faults a real cluster cannot be made to produce on demand ----------


async def test_label_and_taint_retries_after_a_conflict() -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        await register_node(kube.url, "n1")

        async def read_then_someone_else_writes(request: kmock.Request) -> dict[str, Any]:
            snapshot = copy.deepcopy(kube.objects[NODES, None, "n1"].raw)
            async with httpx.AsyncClient(verify=default_tls()) as other:
                await other.patch(f"{kube.url}/api/v1/nodes/n1", json={"metadata": {"labels": {"other": "writer"}}},
                                  headers={"Content-Type": MERGE_PATCH})
            return snapshot

        kube["get /api/v1/nodes/n1"][:1] << read_then_someone_else_writes
        await cluster.label_and_taint("n1", {"ours": "yes"}, [GPU_TAINT])

        node = await cluster.get_node("n1")
        assert node is not None and node.labels["other"] == "writer" and node.labels["ours"] == "yes"
        assert GPU_TAINT in node.taints
        assert len(kube["patch /api/v1/nodes/n1"]) == 3  # the other writer, our stale try, our retry


async def test_a_label_right_after_a_look_writes_from_that_look() -> None:
    """The launch looks at its Node (`get_node`) and labels it: the write starts from that read
    (one GET, one PATCH). A copy gone stale meanwhile costs a 409 and a read; the other
    writer's change is kept."""
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        await register_node(kube.url, "n1")
        assert await cluster.get_node("n1") is not None
        await cluster.label_and_taint("n1", {"ours": "yes"}, [GPU_TAINT])
        assert (len(kube["get /api/v1/nodes/n1"]), len(kube["patch /api/v1/nodes/n1"])) == (1, 1)

        assert await cluster.get_node("n1") is not None
        async with httpx.AsyncClient(verify=default_tls()) as other:
            await other.patch(f"{kube.url}/api/v1/nodes/n1", json={"metadata": {"labels": {"other": "writer"}}}, headers={"Content-Type": MERGE_PATCH})
        await cluster.label_and_taint("n1", {"ours": "again"}, [GPU_TAINT])
        node = await cluster.get_node("n1")
        assert node is not None and node.labels["other"] == "writer" and node.labels["ours"] == "again"
        assert (len(kube["get /api/v1/nodes/n1"]), len(kube["patch /api/v1/nodes/n1"])) == (4, 4)  # looks 2, re-read 1, final 1; ours 1+2, other 1

        # A look older than SEEN_FOR is not written from: the label reads the Node afresh, and a
        # Node that already has what is asked is left as it is.
        assert await cluster.get_node("n1") is not None
        at, node = cluster._seen["n1"]
        cluster._seen["n1"] = (at - SEEN_FOR - 1, node)
        await cluster.label_and_taint("n1", {"ours": "again"}, [GPU_TAINT])
        assert (len(kube["get /api/v1/nodes/n1"]), len(kube["patch /api/v1/nodes/n1"])) == (6, 4)


async def test_a_folded_event_is_written_with_its_count(kube_api: KubeApi) -> None:
    """A pass's Events of one reason are one Event (tgp.events.folded): the API keeps its count,
    on a pool and on a pod alike (`kubectl describe` shows "x3")."""
    from activities.kube.cluster import CustomResource
    from tgp.types import PodSummary

    ns = kube_api.namespace
    pool = CustomResource("tgp.io", "v1alpha1", "gpunodepools", "GPUNodePool", "folded", namespace=ns)
    await kube_api.cluster.create_event(pool, type="Normal", reason="NodeLaunched", message="launching node a | launching node b | and 1 more", count=3)
    await kube_api.cluster.record_pod_event(PodSummary(namespace=ns, name="trainer", uid="u-1"), type="Warning", reason="PodDoesNotFit", message="x", count=2)
    listed = await kube_api.get(f"/api/v1/namespaces/{ns}/events")
    assert listed is not None
    counts = {e["reason"]: (e["count"], e["involvedObject"]["name"]) for e in listed["items"] if e["reason"] in ("NodeLaunched", "PodDoesNotFit")}
    assert counts == {"NodeLaunched": (3, "folded"), "PodDoesNotFit": (2, "trainer")}


async def test_an_event_whose_generated_name_is_taken_is_recorded_under_another() -> None:
    """A server before 1.32 answers 409 AlreadyExists when a generated name is taken: the Event
    is sent again for a new name (EVENT_NAME_TRIES), not failed with the pass's other Events."""
    from activities.kube.cluster import CustomResource

    taken = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "AlreadyExists", "code": 409, "message": 'events "pool.bbbbb" already exists'}
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        kube["post /api/v1/namespaces/ml/events"][:1] << 409 << taken
        pool = CustomResource("tgp.io", "v1alpha1", "gpunodepools", "GPUNodePool", "pool", namespace="ml")
        await cluster.create_event(pool, type="Normal", reason="NodeLaunched", message="launching node n1")
        events = [e for e in kube.objects.values() if not e.deleted and e.raw.get("kind") == "Event"]
        assert [e.raw["reason"] for e in events] == ["NodeLaunched"]
        assert len(kube["post /api/v1/namespaces/ml/events"]) == 2


async def test_emulated_budget_counts_max_unavailable_against_replicas(kube_api: KubeApi) -> None:
    # Emulator only: on a real cluster the ReplicaSet would start pods of its own.
    if kube_api.real:
        pytest.skip("a real ReplicaSet controller would create and adopt pods")
    node = kube_api.unique("replicas")
    await kube_api.create_node(node)
    await kube_api.create(
        f"/apis/apps/v1/namespaces/{kube_api.namespace}/replicasets",
        {"metadata": {"name": "web-owner"}, "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}}}},
    )
    for name in ("a", "b", "c"):
        await kube_api.create_pod(name, node=node, labels={"app": "web"}, owner_kind="ReplicaSet", owner_name="web-owner")
    await kube_api.create_pdb("web", match_labels={"app": "web"}, max_unavailable=1)

    await kube_api.cluster.evict_pod(kube_api.namespace, "a")
    with pytest.raises(EvictionBlocked):  # 2 of 3 replicas healthy: no more room until "a" is back
        await kube_api.cluster.evict_pod(kube_api.namespace, "b")


async def test_eviction_falls_back_to_policy_v1beta1_on_an_old_server() -> None:
    async with KubeEmulator(eviction_versions=frozenset({"policy/v1beta1"})) as kube, \
            KubernetesCluster.from_url(kube.url) as cluster, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        await http.post("/api/v1/namespaces/ns/pods", json={"metadata": {"name": "p"}, "spec": {"nodeName": "n"}})
        await cluster.evict_pod("ns", "p")
        sent = [r.data["apiVersion"] for r in kube["post /api/v1/namespaces/ns/pods/p/eviction"]]
        assert sent == ["policy/v1", "policy/v1beta1"]
        # Accepted: the pod is Terminating for its (default, 30 s) grace period.
        assert (await http.get("/api/v1/namespaces/ns/pods/p")).json()["metadata"]["deletionGracePeriodSeconds"] == 30


async def test_eviction_429_without_budget_details_is_still_blocked() -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        kube["post /api/v1/namespaces/ns/pods/p/eviction"] << 429
        with pytest.raises(EvictionBlocked):
            await cluster.evict_pod("ns", "p")


async def test_a_status_write_sends_the_merge_patch_and_says_whether_the_object_is_there() -> None:
    """`patch_custom_status` merge-patches the status subresource of a namespaced or a
    cluster-scoped object (the answer's body is not read): True when written, False when the
    object is gone (404), and any other refusal is the typed error with the API's message."""
    from activities.kube.cluster import CustomResource

    pool = CustomResource("tgp.io", "v1alpha1", "gpunodepools", "GPUNodePool", "rtx", namespace="ml")
    klass = CustomResource("tgp.io", "v1alpha1", "gpunodeclasses", "GPUNodeClass", "cls")
    gone = CustomResource("tgp.io", "v1alpha1", "gpunodeclasses", "GPUNodeClass", "gone")
    pool_path, class_path = "patch /apis/tgp.io/v1alpha1/namespaces/ml/gpunodepools/rtx/status", "patch /apis/tgp.io/v1alpha1/gpunodeclasses/cls/status"
    gone_path = "patch /apis/tgp.io/v1alpha1/gpunodeclasses/gone/status"
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        kube[pool_path] << 200 << {"kind": "GPUNodePool", "status": {"readyNodes": 3}}
        kube[class_path] << 200 << {"kind": "GPUNodeClass", "status": {"pools": 1}}
        kube[gone_path] << 404 << {"kind": "Status", "code": 404, "reason": "NotFound", "message": "not found"}
        assert await cluster.patch_custom_status(pool, {"readyNodes": 3}) is True
        assert await cluster.patch_custom_status(klass, {"pools": 1}) is True
        for path, status in ((pool_path, {"readyNodes": 3}), (class_path, {"pools": 1})):
            [sent] = kube[path]
            assert sent.headers["Content-Type"] == MERGE_PATCH and json.loads(sent.body) == {"status": status}
        assert await cluster.patch_custom_status(gone, {"pools": 1}) is False
        assert len(kube[gone_path]) == 1

        bad = CustomResource("tgp.io", "v1alpha1", "gpunodepools", "GPUNodePool", "bad", namespace="ml")
        kube["patch /apis/tgp.io/v1alpha1/namespaces/ml/gpunodepools/bad/status"] << 422 << {
            "kind": "Status", "code": 422, "reason": "Invalid", "message": "status.readyNodes: Invalid value: -1",
        }
        with pytest.raises(ConfigError, match="Invalid value: -1"):
            await cluster.patch_custom_status(bad, {"readyNodes": -1})


async def test_401_is_an_auth_error_that_does_not_leak_the_token() -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url, token="s3cr3t-t0ken") as cluster:
        kube["get /api/v1/nodes/n1"] << 401 << {"kind": "Status", "code": 401, "reason": "Unauthorized",
                                               "message": "Unauthorized"}
        with pytest.raises(AuthError) as caught:
            await cluster.get_node("n1")
        assert "s3cr3t" not in str(caught.value) and "kubeconfig" in str(caught.value)
        assert kube["get /api/v1/nodes/n1"][0].headers["Authorization"] == "Bearer s3cr3t-t0ken"


async def test_403_is_permission_denied_naming_what_to_grant() -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        kube["patch /api/v1/nodes/n1"] << 403 << {
            "kind": "Status", "code": 403, "reason": "Forbidden",
            "message": 'nodes "n1" is forbidden: User "system:serviceaccount:tgp:worker" cannot patch resource "nodes"',
        }
        with pytest.raises(PermissionDenied, match="cannot patch resource") as caught:
            await cluster.cordon("n1")
        assert "ClusterRole" in str(caught.value)


@pytest.mark.parametrize("status", [500, 503])
async def test_5xx_is_transient(status: int) -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        kube["get /api/v1/pods"] << status
        with pytest.raises(TransientError):
            await cluster.list_pods_on_node("n1")


async def test_throttling_429_is_transient_with_retry_after() -> None:
    async with KubeEmulator() as kube, KubernetesCluster.from_url(kube.url) as cluster:
        kube["get /api/v1/nodes/n1"] << 429 << kmock.headers({"Retry-After": "7"})
        with pytest.raises(TransientError) as caught:
            await cluster.get_node("n1")
        assert caught.value.retry_after == 7.0


async def test_timeout_is_transient() -> None:
    never = asyncio.Event()
    async with KubeEmulator() as kube, \
            KubernetesCluster.from_url(kube.url, request_timeout=timedelta(seconds=0.2)) as cluster:
        kube["get /api/v1/nodes/n1"] << never.wait
        with pytest.raises(TransientError, match="timed out"):
            await cluster.get_node("n1")


async def test_connection_refused_is_transient() -> None:
    async with KubeEmulator() as kube:
        url = kube.url  # the port is free again once the emulator stops
    async with KubernetesCluster.from_url(url) as cluster:
        with pytest.raises(TransientError):
            await cluster.get_node("n1")


async def test_from_kubeconfig_uses_server_and_token(tmp_path: Path) -> None:
    async with KubeEmulator() as kube:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": kube.url}}],
            "users": [{"name": "worker", "user": {"token": "kubeconfig-t0ken"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "worker"}}],
        }))
        async with KubernetesCluster.from_kubeconfig(str(kubeconfig)) as cluster:
            assert await cluster.get_node("n1") is None
        assert kube["get /api/v1/nodes/n1"][0].headers["Authorization"] == "Bearer kubeconfig-t0ken"


async def test_unusable_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    async with KubernetesCluster.from_kubeconfig(str(tmp_path / "missing")) as cluster:
        with pytest.raises(ConfigError, match="kubeconfig"):
            await cluster.get_node("n1")
