"""The chart on the real control plane (the real-cluster lane, `make test-real-cluster`): `helm
install` into tgp-system, a whole node life run by the worker and the bridge on the chart's own
ServiceAccounts (tokens from the API server, RBAC as the chart grants it) with not one forbidden
call, `helm upgrade` to a second build with the node running (it keeps running, and the old
build's Deployment stays beside the new one until it is dropped from worker.previousBuilds), and
`helm uninstall` leaving nothing of tgp but the CRDs (Helm never deletes a chart's CRDs).

The processes run here, not in the chart's pods (the lane has no container runtime): the chart's
Deployments are scaled to zero and kept off every node, so nothing of theirs lands on the
simulated GPU nodes.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from activities.kube.cluster import KubernetesCluster
from activities.kube.connection import authenticated_http
from sim.world import sim_world
from tests.conftest import eventually
from tests.kube_env import KUBECONFIG_ENV, KubeApi
from tests.test_bridge import NS, Stack, apply, clean_real_cluster, gpu_class, gpu_pool, install_crds, new_bridge, ready_nodes
from tests.test_helm import CHART, NAMESPACE, helm_binary
from tests.test_whole_life import CONVERGE, create_job, scheduler
from tgp.messages import class_workflow_id, pool_workflow_id
from workers.main import WorkerConfig, build_activities, make_worker

BUILD_1, BUILD_2 = "0.2.0-1a2b3c4d5e", "0.2.1-6f7a8b9c0d"
# No pod of the chart may be scheduled: the lane has no container runtime, and on a simulated
# GPU node one would hold the node busy.
OFF_EVERY_NODE = ["--set", "worker.replicas=0", "--set-json", 'bridge.nodeSelector={"tgp.test/none":"none"}']


def helm(kubeconfig: str, *args: str) -> str:
    done = subprocess.run(
        [helm_binary(), "--kubeconfig", kubeconfig, "--namespace", NAMESPACE, *args],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
    return done.stdout


async def forbidden_so_far(http: httpx.AsyncClient) -> int:
    """The API server's count of requests its authorizer did not allow (RBAC, the lane's only
    mode, allows or has no opinion: a 403). Every other client of the lane is cluster-admin, so
    each one is the worker's or the bridge's. (apiserver_request_total does not count these: the
    authorization filter answers before the instrumented handler.)"""
    text = (await http.get("/metrics")).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("authorization_attempts_total{") and 'result="allowed"' not in line
    )


async def service_account_kubeconfig(kube_api: KubeApi, account: str, path: Path) -> str:
    """A kubeconfig holding a token of ServiceAccount tgp-system/<account>, as its pod would get."""
    token = (await kube_api.create(
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    ))["status"]["token"]
    config = yaml.safe_load(Path(os.environ[KUBECONFIG_ENV]).read_text())
    config["users"] = [{"name": u["name"], "user": {"token": token}} for u in config["users"]]
    path.write_text(yaml.safe_dump(config))
    return str(path)


async def deployments(kube_api: KubeApi) -> set[str]:
    listed = await kube_api.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments")
    return {d["metadata"]["name"] for d in (listed or {}).get("items", [])}


# 39 s alone; past the suite's 120 s per test at load 5 (a helm install, a life, two upgrades).
@pytest.mark.timeout(360)
async def test_helm_install_runs_a_life_on_its_own_accounts_upgrades_and_uninstalls(
    temporal: WorkflowEnvironment, kube_api: KubeApi, tmp_path: Path,
) -> None:
    if not kube_api.real:
        pytest.skip("helm install, RBAC and ServiceAccount tokens need a real API server: runs in `make test-real-cluster`")
    admin = os.environ[KUBECONFIG_ENV]
    await install_crds(kube_api)  # as a cluster with tgp's CRDs already: helm skips existing CRDs
    helm(admin, "install", "tgp", str(CHART), "--create-namespace", "--set", f"worker.buildId={BUILD_1}", *OFF_EVERY_NODE)
    try:
        worker = await service_account_kubeconfig(kube_api, "tgp-worker", tmp_path / "worker")
        bridge = await service_account_kubeconfig(kube_api, "tgp-bridge", tmp_path / "bridge")
        # RBAC's cache takes the new bindings within a second or two; the count starts after.
        await _granted(bridge, "/apis/tgp.io/v1/gpunodepools")
        await _granted(worker, f"/api/v1/namespaces/{NAMESPACE}/secrets/none")
        # A fresh namespace refuses pods (403) until its ServiceAccount exists: not a call of theirs.
        await eventually(lambda: kube_api.get(f"/api/v1/namespaces/{NS}/serviceaccounts/default"), timeout=CONVERGE,
                         what=f"namespace {NS} ready for pods")
        before = await forbidden_so_far(kube_api.http)
        await _a_life_across_an_upgrade(temporal, kube_api, worker, bridge, admin)
        assert await forbidden_so_far(kube_api.http) == before, "the chart's RBAC refused a call of the worker or the bridge"
    finally:
        helm(admin, "uninstall", "tgp", "--wait", "--timeout", "60s")
    await _only_the_crds_are_left(kube_api)


async def _granted(kubeconfig: str, path: str) -> None:
    async with authenticated_http(kubeconfig) as http:
        async def answered() -> bool:
            return (await http.get(path)).status_code != 403

        await eventually(answered, timeout=30, what=f"RBAC to grant GET {path}")


async def _a_life_across_an_upgrade(
    temporal: WorkflowEnvironment, kube_api: KubeApi, worker_config: str, bridge_config: str, admin: str,
) -> None:
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2, kube_url=kube_api.url, kube_client=kube_api.http, kubeconfig=admin))
        activities = await build_activities(WorkerConfig.from_env({**world.worker_env(), "KUBECONFIG": worker_config}), stack)
        queue = f"helm-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        cluster = await stack.enter_async_context(KubernetesCluster.from_kubeconfig(bridge_config))
        bridge = new_bridge(temporal, cluster, queue)
        s = Stack(world, temporal, queue, kube_api.http, bridge, asyncio.create_task(bridge.run()), cluster)
        try:
            await stack.enter_async_context(scheduler(kube_api))
            assert (await apply(s.kube, gpu_class())).status_code == 201
            assert (await apply(s.kube, gpu_pool("rtx", disruption={"idleTimeout": "2s", "drainTimeout": "10s"}))).status_code == 201
            # Long enough to run through both upgrades; it then completes, as test_whole_life's does.
            await create_job(s.kube, "train", seconds=20)
            [node] = await ready_nodes(s, NS, "rtx", 1)

            # Upgrade with the node running: the new build's Deployment beside the old one's.
            helm(admin, "upgrade", "tgp", str(CHART), "--reuse-values", "--set", f"worker.buildId={BUILD_2}",
                 "--set-json", f'worker.previousBuilds=[{{"buildId":"{BUILD_1}","tag":"0.2.0"}}]', *OFF_EVERY_NODE)
            assert {f"tgp-worker-{BUILD_1}", f"tgp-worker-{BUILD_2}"} <= await deployments(kube_api)
            [still] = await ready_nodes(s, NS, "rtx", 1)
            assert still["name"] == node["name"] and len(world.cloud.live_instances()) == 1, "the upgrade touched the node"
            # Drained (here: told so): the old build leaves the list and its Deployment goes.
            helm(admin, "upgrade", "tgp", str(CHART), "--reuse-values", "--set-json", "worker.previousBuilds=[]", *OFF_EVERY_NODE)
            assert f"tgp-worker-{BUILD_1}" not in await deployments(kube_api)

            # The rest of the life on the same accounts: the pod completes, the node idles out, is
            # drained and terminated.

            async def back_to_zero() -> bool:
                status = await s.pool_status(NS, "rtx")
                return status.get("readyNodes") == 0 and not status.get("nodes") and not world.cloud.live_instances()

            await eventually(back_to_zero, timeout=CONVERGE, what="the node idled out and terminated")
            await _node_gone(s.kube, node["name"])
        finally:
            s.bridge_task.cancel()
            listed = [w.id async for w in temporal.client.list_workflows(f"TaskQueue = '{queue}' AND ExecutionStatus = 'Running'")]
            for wid in dict.fromkeys([pool_workflow_id(NS, "rtx"), class_workflow_id("sim"), *listed]):
                try:
                    await temporal.client.get_workflow_handle(wid).terminate("test finished")
                except RPCError:
                    pass  # it ended meanwhile, or never started
            await clean_real_cluster(kube_api)


async def _node_gone(kube: httpx.AsyncClient, name: str) -> None:
    async def gone() -> bool:
        return (await kube.get(f"/api/v1/nodes/{name}")).status_code == 404

    await eventually(gone, timeout=CONVERGE, what=f"Node {name} deleted")


async def _only_the_crds_are_left(kube_api: KubeApi) -> None:
    """helm uninstall removes every object of the release (each carries its instance label:
    tests/test_helm.py); CRDs stay (Helm's convention: every namespace's resources depend on them)."""
    release = "?labelSelector=app.kubernetes.io%2Finstance%3Dtgp"
    left: list[str] = []
    for path in (
        f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts",
        f"/api/v1/namespaces/{NAMESPACE}/configmaps",
        f"/api/v1/namespaces/{NAMESPACE}/services",
        f"/apis/policy/v1/namespaces/{NAMESPACE}/poddisruptionbudgets",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/roles",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NAMESPACE}/rolebindings",
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    ):
        items: list[dict[str, Any]] = ((await kube_api.get(path + release)) or {}).get("items", [])
        left += [f"{path.rsplit('/', 1)[1]}/{i['metadata']['name']}" for i in items]
    assert not left, left
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    for name in ("gpunodeclasses.tgp.io", "gpunodepools.tgp.io"):
        assert await kube_api.get(f"{crds}/{name}") is not None, f"CRD {name} was removed"
