"""What users run on the cluster, compared between the emulator and the real control plane
(issue 36: the demo's cluster ran bare pods only): Namespaces, a Deployment's ReplicaSet and
pods, a Job's pods, the pod garbage collector replacing pods whose Node was deleted, and the
scheduler's Events on pods. Every test asks for `kube_api`, so the real-cluster lane runs it
against kube-apiserver, kube-scheduler and kube-controller-manager; in `make test` against the
emulator (sim/kube_controllers.py, sim/kube_namespaces.py, sim/kube_scheduler_events.py) with
sim.scheduler as the scheduler. Simulated kubelets (sim.kube_kubelet.SimKubelet) run the pods
in both. Assertions hold for both; deadlines are generous (a real pod GC waits 40 s, checks
every 20 s), and a pass returns as soon as its check holds.

The last test is the demo's world end to end: a Deployment asking for a GPU makes tgp buy a
node, and its pod runs there (a node's idling out and termination are tests/test_whole_life.py's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from sim.kube_kubelet import RUN_SECONDS_ANNOTATION, SimKubelet
from tests.conftest import binary, eventually
from tests.kube_env import KUBECONFIG_ENV, KubeApi
from tests.test_bridge import NO_IDLING, apply, gpu_class, gpu_pool, ready_nodes, running_stack
from tests.test_whole_life import scheduler

# A real pod GC deletes a pod 40-60 s after its Node went; the rest converges in seconds.
CONVERGE = 150.0
NODE_LABEL = "tgp.io/test-node"


@contextlib.asynccontextmanager
async def kubelet(kube_api: KubeApi, node: str, *, gpus: int) -> AsyncIterator[asyncio.Task[None]]:
    """A simulated machine's kubelet for Node `node` (labelled `NODE_LABEL=node`) while the block
    runs; the task, to stop the machine early."""
    stand_in = SimKubelet(kube_api.url, node, labels={NODE_LABEL: node}, gpus=gpus, client=kube_api.http, pod_sync_interval=1.0)
    task = asyncio.create_task(stand_in.run())
    try:
        yield task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def pod_template(app: str, node: str, *, gpus: int = 0, run_seconds: int | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "main", "image": "registry.k8s.io/pause:3.9"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    annotations = {RUN_SECONDS_ANNOTATION: str(run_seconds)} if run_seconds is not None else {}
    return {
        "metadata": {"labels": {"app": app}, "annotations": annotations},
        "spec": {"nodeSelector": {NODE_LABEL: node}, "containers": [container], "terminationGracePeriodSeconds": 0,
                 **({"restartPolicy": "Never"} if run_seconds is not None else {})},
    }


def deployment(name: str, node: str, replicas: int) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": name}}, "template": pod_template(name, node, gpus=1)}}


async def items(kube_api: KubeApi, path: str) -> list[dict[str, Any]]:
    listing = await kube_api.get(path) or {}
    return [i for i in listing.get("items") or [] if not i["metadata"].get("deletionTimestamp")]


async def owned(kube_api: KubeApi, path: str, owner: dict[str, Any]) -> list[dict[str, Any]]:
    """The objects at `path` whose controller is `owner`."""
    uid = owner["metadata"]["uid"]
    return [i for i in await items(kube_api, path)
            if any(r.get("uid") == uid and r.get("controller") for r in i["metadata"].get("ownerReferences") or [])]


async def events_of(kube_api: KubeApi, pod: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.name={pod}"
    return await items(kube_api, f"/api/v1/namespaces/{kube_api.namespace}/events?fieldSelector={selector}")


def quick_pod_gc(kube_api: KubeApi) -> None:
    if kube_api.emulator is not None:
        kube_api.emulator.pod_gc_quarantine = 1.0  # the real one's 40 s, shortened


async def test_namespaces_are_created_listed_and_deleted(kube_api: KubeApi) -> None:
    name = f"tgp-test-ns-{secrets.token_hex(3)}"
    created = await kube_api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    assert created["status"]["phase"] == "Active" and created["spec"]["finalizers"] == ["kubernetes"]
    listed = {n["metadata"]["name"] for n in await items(kube_api, "/api/v1/namespaces")}
    assert {name, "default", "kube-system"} <= listed
    response = await kube_api.http.delete(f"/api/v1/namespaces/{name}")
    assert response.status_code == 200, response.text

    async def gone() -> bool:
        return await kube_api.get(f"/api/v1/namespaces/{name}") is None

    await eventually(gone, timeout=CONVERGE, what=f"namespace {name} deleted")


async def test_a_deployment_runs_its_pods_and_replaces_them_when_their_node_goes(kube_api: KubeApi) -> None:
    quick_pod_gc(kube_api)
    ns, node = kube_api.namespace, kube_api.unique("workloads")
    pods_path = f"/api/v1/namespaces/{ns}/pods"
    async with scheduler(kube_api), kubelet(kube_api, node, gpus=2) as machine:
        made = await kube_api.create(f"/apis/apps/v1/namespaces/{ns}/deployments", deployment("web", node, 2))

        async def running() -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
            sets = await owned(kube_api, f"/apis/apps/v1/namespaces/{ns}/replicasets", made)
            pods = await owned(kube_api, pods_path, sets[0]) if len(sets) == 1 else []
            ok = len(pods) == 2 and all(p["spec"].get("nodeName") == node and p["status"].get("phase") == "Running" for p in pods)
            return (sets[0], pods) if ok else None

        replica_set, pods = await eventually(running, timeout=CONVERGE, what="a ReplicaSet and 2 pods running")
        digest = replica_set["metadata"]["labels"]["pod-template-hash"]
        assert replica_set["metadata"]["name"] == f"web-{digest}" and all(p["metadata"]["labels"]["pod-template-hash"] == digest for p in pods)

        async def available() -> bool:
            status = (await kube_api.get(f"/apis/apps/v1/namespaces/{ns}/deployments/web") or {}).get("status") or {}
            return status.get("readyReplicas") == 2 and status.get("availableReplicas") == 2

        await eventually(available, timeout=CONVERGE, what="the Deployment's 2 replicas ready and available")
        scheduled = [e for e in await events_of(kube_api, pods[0]["metadata"]["name"]) if e["reason"] == "Scheduled"]
        assert scheduled and scheduled[0]["message"] == f"Successfully assigned {ns}/{pods[0]['metadata']['name']} to {node}"

        # A third replica finds no GPU left: Pending, with kube-scheduler's FailedScheduling Event.
        assert (await kube_api.merge_patch(f"/apis/apps/v1/namespaces/{ns}/deployments/web", {"spec": {"replicas": 3}})).status_code == 200

        async def failed_scheduling() -> list[dict[str, Any]] | None:
            pending = [p for p in await owned(kube_api, pods_path, replica_set) if not p["spec"].get("nodeName")]
            found = [e for p in pending for e in await events_of(kube_api, p["metadata"]["name"]) if e["reason"] == "FailedScheduling"]
            return found or None

        [event, *_] = await eventually(failed_scheduling, timeout=CONVERGE, what="a FailedScheduling Event on the third pod")
        assert event["type"] == "Warning" and event["message"].startswith("0/") and "1 Insufficient nvidia.com/gpu" in event["message"], event

        # The machine goes, then its Node: the pod GC deletes its pods and the ReplicaSet makes new ones.
        machine.cancel()
        await asyncio.gather(machine, return_exceptions=True)
        assert (await kube_api.http.delete(f"/api/v1/nodes/{node}")).status_code == 200
        old = {p["metadata"]["uid"] for p in pods}

        async def replaced() -> bool:
            now = await owned(kube_api, pods_path, replica_set)
            return len(now) == 3 and not old & {p["metadata"]["uid"] for p in now} and not any(p["spec"].get("nodeName") for p in now)

        await eventually(replaced, timeout=CONVERGE, what="the lost pods replaced by Pending ones")

        # Deleting the Deployment deletes its ReplicaSet and their pods (garbage collection).
        assert (await kube_api.http.delete(f"/apis/apps/v1/namespaces/{ns}/deployments/web")).status_code == 200

        async def collected() -> bool:
            return not await items(kube_api, f"/apis/apps/v1/namespaces/{ns}/replicasets") and not await items(kube_api, pods_path)

        await eventually(collected, timeout=CONVERGE, what="the ReplicaSet and pods deleted with the Deployment")


def pod_gone(kube_api: KubeApi, pod: str) -> Callable[[], Awaitable[bool]]:
    """Whether `pod` (in the test's namespace) is gone, for `eventually`."""

    async def gone() -> bool:
        return await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/pods/{pod}") is None

    return gone


async def test_the_pod_gc_deletes_a_bare_pod_whose_node_goes(kube_api: KubeApi) -> None:
    """A pod no controller owns stays while its Node is there and is deleted by the pod GC once
    the Node is deleted (on the emulator, the Node's deletion is the only write that wakes its
    controllers here)."""
    quick_pod_gc(kube_api)
    here, kept = (await kube_api.create_node(kube_api.unique("here")))["metadata"]["name"], kube_api.unique("kept")
    await kube_api.create_pod(kept, node=here)
    assert await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/pods/{kept}") is not None
    assert (await kube_api.http.delete(f"/api/v1/nodes/{here}")).status_code == 200
    await eventually(pod_gone(kube_api, kept), timeout=CONVERGE, what="the pod of a deleted Node deleted by the pod GC")


async def test_the_pod_gc_deletes_a_bare_pod_bound_to_a_node_that_is_not_there(kube_api: KubeApi) -> None:
    """The emulator's controllers wake for a pod no controller owns when it is bound to a Node
    that does not exist, created so or moved there, and the pod GC deletes it; one on a Node
    that is there stays. (A real cluster's pod GC is the previous test's: a pod whose Node is
    missing.)"""
    if kube_api.emulator is None:
        pytest.skip("the same pod GC as the previous test on a real cluster, another 40-60 s there")
    quick_pod_gc(kube_api)
    here = (await kube_api.create_node(kube_api.unique("here")))["metadata"]["name"]
    kept, lost = kube_api.unique("kept"), kube_api.unique("lost")
    await kube_api.create_pod(kept, node=here)
    await kube_api.create_pod(lost, node=kube_api.unique("nowhere"))
    await eventually(pod_gone(kube_api, lost), timeout=CONVERGE, what="the pod on a missing Node deleted by the pod GC")
    assert await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/pods/{kept}") is not None
    # Bound again to a missing Node (the simulated scheduler binds by patching spec.nodeName).
    moved = await kube_api.merge_patch(f"/api/v1/namespaces/{kube_api.namespace}/pods/{kept}", {"spec": {"nodeName": kube_api.unique("gone")}})
    assert moved.status_code == 200, moved.text
    await eventually(pod_gone(kube_api, kept), timeout=CONVERGE, what="the pod moved to a missing Node deleted by the pod GC")


async def test_a_job_runs_its_completions_and_fails_past_its_backoff_limit(kube_api: KubeApi) -> None:
    ns, node = kube_api.namespace, kube_api.unique("job")
    jobs = f"/apis/batch/v1/namespaces/{ns}/jobs"
    async with scheduler(kube_api), kubelet(kube_api, node, gpus=1):
        await kube_api.create(jobs, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "train"},
                                     "spec": {"completions": 2, "parallelism": 1, "template": pod_template("train", node, run_seconds=1)}})
        # Its pod never fits (no Node has this label); it is failed by hand, as a crashed container would be.
        doomed = pod_template("doomed", "no-such-node", run_seconds=1)
        failing = await kube_api.create(jobs, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "doomed"},
                                               "spec": {"backoffLimit": 0, "template": doomed}})

        async def condition(name: str, kind: str) -> dict[str, Any] | None:
            job = await kube_api.get(f"{jobs}/{name}") or {}
            found = [c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == kind and c["status"] == "True"]
            return job if found else None

        done = await eventually(lambda: condition("train", "Complete"), timeout=CONVERGE, what="the Job Complete")
        assert done["status"]["succeeded"] == 2

        [pod] = await eventually(lambda: owned(kube_api, f"/api/v1/namespaces/{ns}/pods", failing), timeout=CONVERGE, what="the Job's pod")
        response = await kube_api.merge_patch(f"/api/v1/namespaces/{ns}/pods/{pod['metadata']['name']}/status", {"status": {"phase": "Failed"}})
        assert response.status_code == 200, response.text
        failed = await eventually(lambda: condition("doomed", "Failed"), timeout=CONVERGE, what="the Job Failed")
        [why] = [c for c in failed["status"]["conditions"] if c["type"] == "Failed"]
        assert why["reason"] == "BackoffLimitExceeded"


async def test_kubectl_shows_namespaces_and_scheduler_events(kube_api: KubeApi, tmp_path: Path) -> None:
    kubeconfig = os.environ.get(KUBECONFIG_ENV) or str(kube_api.emulator.write_kubeconfig(tmp_path / "kubeconfig"))  # type: ignore[union-attr]
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": kubeconfig}

    async def kubectl(*args: str) -> str:
        process = await asyncio.create_subprocess_exec(binary("kubectl"), "-n", kube_api.namespace, *args, env=env,
                                                       stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err.decode()
        return out.decode()

    name = f"tgp-test-ns-{secrets.token_hex(3)}"
    await kubectl("create", "namespace", name)
    assert name in await kubectl("get", "ns") and "Active" in await kubectl("get", "ns", name, "--no-headers")
    await kubectl("delete", "namespace", name, "--wait=false")
    async with scheduler(kube_api):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "wants-a-gpu"},
               "spec": pod_template("gpu", "no-such-node", gpus=1)["spec"]}
        await kube_api.create(f"/api/v1/namespaces/{kube_api.namespace}/pods", pod)

        async def described() -> str | None:
            out = await kubectl("describe", "pod", "wants-a-gpu")
            return out if "FailedScheduling" in out else None

        out = await eventually(described, timeout=CONVERGE, what="FailedScheduling in kubectl describe pod")
        assert "0/" in out and "nodes are available" in out or "no nodes available to schedule pods" in out, out
        assert json.loads(await kubectl("get", "pod", "wants-a-gpu", "-o", "json"))["status"]["phase"] == "Pending"


async def test_a_gpu_deployment_in_the_demo_world_buys_a_node_and_runs_there(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s, scheduler(kube_api):
        assert (await apply(s.kube, gpu_class())).status_code == 201
        assert (await apply(s.kube, gpu_pool("rtx", disruption=NO_IDLING))).status_code == 201
        template = {"metadata": {"labels": {"app": "serve"}}, "spec": {
            "containers": [{"name": "serve", "image": "vllm", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 1}}
        body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "serve", "namespace": "ml"},
                "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "serve"}}, "template": template}}

        async def created() -> bool:  # a fresh namespace refuses pods until its ServiceAccount exists
            response = await s.kube.post("/apis/apps/v1/namespaces/ml/deployments", json=body)
            assert response.status_code in (201, 403, 409), response.text
            return response.status_code != 403

        await eventually(created, timeout=CONVERGE, what="the Deployment created")
        try:
            [node] = await ready_nodes(s, "ml", "rtx", 1)

            async def serving() -> bool:
                pods = (await s.kube.get("/api/v1/namespaces/ml/pods", params={"labelSelector": "app=serve"})).json()["items"]
                return any(p["spec"].get("nodeName") == node["name"] and p["status"].get("phase") == "Running" for p in pods)

            await eventually(serving, timeout=CONVERGE, what=f"the Deployment's pod running on {node['name']}")
        finally:
            # Namespace ml outlives the test on a real cluster: a Deployment left there has its
            # controller make pods for ever, and the next tests' pools buy nodes for them.
            await s.kube.delete("/apis/apps/v1/namespaces/ml/deployments/serve", params={"propagationPolicy": "Background"})
