"""A whole node life as `tgp dev` runs it, with nobody playing the scheduler or the kubelet by
hand (issue 19): a pod is pending, the pool buys a node, the simulated machine joins and its
kubelet stand-in (sim.kube_kubelet.SimKubelet) keeps the Node alive, a scheduler binds the pod,
the stand-in runs it to completion, the node idles out, is drained and terminated, and nothing
is left: no instance, tailnet device or key, Node or Lease.

Against `kube_api`: on the emulator sim.scheduler plays kube-scheduler; in the real-cluster lane
the real kube-scheduler binds and the real node lifecycle controller watches the Leases (a Node
whose stand-in stopped heartbeating would go NotReady and be declared lost).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from temporalio.testing import WorkflowEnvironment

from sim.kube_kubelet import LEASE_NAMESPACE, RUN_SECONDS_ANNOTATION
from sim.scheduler import SimScheduler
from tests.conftest import eventually
from tests.histories_io import save_history
from tests.kube_env import KubeApi
from tests.test_bridge import NO_IDLING, apply, gpu_class, gpu_pool, ready_nodes, running_stack
from tests.test_node_lifecycle import assert_nothing_left
from tgp.messages import class_workflow_id, pool_workflow_id

# A real scheduler, node lifecycle and garbage collector on a loaded machine need seconds.
CONVERGE = 90.0


@contextlib.asynccontextmanager
async def scheduler(kube_api: KubeApi) -> AsyncIterator[None]:
    """The cluster's scheduler: the real one on a real cluster, sim.scheduler on the emulator."""
    if kube_api.real:
        yield
        return
    async with SimScheduler(kube_api.url, interval=0.2, client=kube_api.http):
        yield


async def create_job(kube: httpx.AsyncClient, name: str, seconds: int | None) -> None:
    """A one-GPU pod that runs for `seconds` and completes (None: until deleted), tolerating the
    pool's taint."""
    annotations = {RUN_SECONDS_ANNOTATION: str(seconds)} if seconds is not None else {}
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ml", "annotations": annotations},
        "spec": {
            "containers": [{"name": "train", "image": "pytorch", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 1, "restartPolicy": "Never",
        },
    }

    async def created() -> bool:  # a fresh namespace refuses pods until its ServiceAccount exists
        response = await kube.post("/api/v1/namespaces/ml/pods", json=pod)
        assert response.status_code in (201, 403), response.text
        return response.status_code == 201

    await eventually(created, timeout=CONVERGE, what=f"pod {name} created")


async def test_a_whole_life_with_a_scheduler_and_kubelet_stand_ins(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s, scheduler(kube_api):
        assert (await apply(s.kube, gpu_class())).status_code == 201
        assert (await apply(s.kube, gpu_pool("rtx", disruption={"idleTimeout": "2s", "drainTimeout": "10s"}))).status_code == 201
        await create_job(s.kube, "train", seconds=2)

        [node] = await ready_nodes(s, "ml", "rtx", 1)
        name = node["name"]

        async def pod() -> dict[str, Any]:
            return (await s.kube.get("/api/v1/namespaces/ml/pods/train")).json()

        async def ran() -> bool:
            current = await pod()
            return current["spec"].get("nodeName") == name and current["status"].get("phase") == "Succeeded"

        await eventually(ran, timeout=CONVERGE, what=f"the pod bound to {name}, run and completed")

        async def back_to_zero() -> bool:
            status = await s.pool_status("ml", "rtx")
            return status.get("readyNodes") == 0 and not status.get("nodes") and not s.world.cloud.live_instances()

        await eventually(back_to_zero, timeout=CONVERGE, what="the node idled out and terminated")
        assert len(s.world.cloud.instances) == 1, "one node was bought in all"

        async def node_and_lease_gone() -> bool:
            node_gone = (await s.kube.get(f"/api/v1/nodes/{name}")).status_code == 404
            lease = await s.kube.get(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{name}")
            return node_gone and lease.status_code == 404

        await eventually(node_and_lease_gone, timeout=CONVERGE, what="the Node and its Lease gone")
        assert_nothing_left(s.world, name)
        for saved, wid in (("whole_life_pool", pool_workflow_id("ml", "rtx")), ("whole_life_class", class_workflow_id("sim"))):
            save_history(saved, await s.env.client.get_workflow_handle(wid).fetch_history())


async def test_a_second_pod_may_take_the_node_bought_for_the_first_and_the_first_still_gets_one(
    temporal: WorkflowEnvironment, kube_api: KubeApi,
) -> None:
    """Nothing reserves a node for the pod it was bought for: when a second pod arrives while
    the first one's node boots, the scheduler may give that node to either. Whichever it
    picks, the other pod gets a node of its own (the demand counts both), and no more."""
    async with running_stack(temporal, kube_api) as s, scheduler(kube_api):
        assert (await apply(s.kube, gpu_class())).status_code == 201
        assert (await apply(s.kube, gpu_pool("rtx", disruption=NO_IDLING))).status_code == 201
        s.world.cloud.hold_boots()
        await create_job(s.kube, "first", seconds=None)
        await eventually(lambda: _true(len(s.world.cloud.instances) >= 1), timeout=CONVERGE, what="a node bought for the first pod")
        await create_job(s.kube, "second", seconds=None)
        s.world.cloud.release_boots()

        async def both_running() -> dict[str, str] | None:
            placed = {}
            for name in ("first", "second"):
                pod = (await s.kube.get(f"/api/v1/namespaces/ml/pods/{name}")).json()
                if pod["status"].get("phase") != "Running":
                    return None
                placed[name] = pod["spec"]["nodeName"]
            return placed

        placed = await eventually(both_running, timeout=CONVERGE, what="both pods running")
        assert placed["first"] != placed["second"], placed
        assert len(await ready_nodes(s, "ml", "rtx", 2)) == 2
        assert len(s.world.cloud.instances) == 2, "one node per pod, no more"


async def _true(value: bool) -> bool:
    return value
