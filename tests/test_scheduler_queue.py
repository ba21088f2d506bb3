"""The simulated scheduler's queue against the real kube-scheduler (v1.34 in the real-cluster
lane): a pod that has waited for a node long enough to be deep in its per-pod backoff is bound
as soon as a Node that fits it is Ready. kube-scheduler waits for an event that could make the
pod fit (queueing hints) and, with nothing else to schedule, does not wait out the backoff
(SchedulerPopFromBackoffQ); the simulated one used to try each pod again at every backoff's end
(1, 2, 4, 8, 10 s...), so a node could wait up to ten seconds for its pod, which the bench then
counted as tgp's overhead.

On the emulator sim.scheduler plays kube-scheduler; on a real cluster the real one does."""

from __future__ import annotations

import asyncio

from sim.kube_kubelet import register_node
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_whole_life import scheduler

# Long enough for the old simulated backoff to have reached 8 s (tries at 0, 1, 3 and 7 s, the
# next at 15 s): the node appears 7 s before that try, so a pod bound within BOUND_WITHIN of its
# node was not waiting out a backoff.
WAITED = 8.0
# kube-scheduler binds within milliseconds; this leaves room for a loaded machine.
BOUND_WITHIN = 5.0


async def test_a_pod_deep_in_backoff_is_bound_as_soon_as_a_node_fits(kube_api: KubeApi) -> None:
    node = kube_api.unique("queue")
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "waits", "namespace": kube_api.namespace},
        "spec": {
            "nodeSelector": {"tgp.io/test-node": node},  # only the Node this test registers fits
            "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "terminationGracePeriodSeconds": 0,
        },
    }
    path = f"/api/v1/namespaces/{kube_api.namespace}/pods"
    async with scheduler(kube_api):
        await kube_api.create(path, pod)

        async def unschedulable() -> bool:
            current = await kube_api.get(f"{path}/waits") or {}
            conditions = (current.get("status") or {}).get("conditions") or []
            return any(c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

        await eventually(unschedulable, timeout=60, what="the pod found unschedulable")
        await asyncio.sleep(WAITED)  # the waiting is the scenario: the pod's backoff grows meanwhile
        await register_node(kube_api.url, node, labels={"tgp.io/test-node": node}, gpus=1, client=kube_api.http)
        ready_at = asyncio.get_running_loop().time()

        async def bound() -> str | None:
            current = await kube_api.get(f"{path}/waits") or {}
            return (current.get("spec") or {}).get("nodeName")

        assert await eventually(bound, timeout=60, what="the pod bound") == node
        took = asyncio.get_running_loop().time() - ready_at
        assert took < BOUND_WITHIN, f"bound {took:.1f} s after its Node was Ready: the scheduler waited out a backoff"
