"""The simulated cluster's scheduler and kubelet stand-ins (sim.scheduler): they bind what
fits, mark what does not Unschedulable, run pods for the time they declare and complete them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import httpx
import kmock
import pytest

from activities.http_wire import default_tls
from tests.conftest import eventually
from sim.kube import KubeEmulator
from sim.kube_kubelet import register_node
from sim.scheduler import RUN_SECONDS_ANNOTATION, UNSCHEDULABLE_LEFTOVER, SimScheduler, fits

READY_NODE = {
    "metadata": {"name": "n1", "labels": {"tgp.io/gpu-type": "RTX4090", "cuda": "12"}},
    "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]},
    "status": {"conditions": [{"type": "Ready", "status": "True"}], "allocatable": {"nvidia.com/gpu": "1"}},
}
TOLERATE = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
GPU = [{"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "default"}, "spec": {"containers": GPU, "tolerations": TOLERATE, **spec}}


@pytest.mark.parametrize(
    ("spec", "free", "why"),
    [
        ({}, 1, None),
        ({"tolerations": []}, 1, "untolerated taint nvidia.com/gpu"),
        ({}, 0, "insufficient nvidia.com/gpu"),
        ({"nodeSelector": {"tgp.io/gpu-type": "A100"}}, 1, "node selector"),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "cuda", "operator": "Gt", "values": ["11"]}]}]}}}}, 1, None),
        ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "cuda", "operator": "Lt", "values": ["11"]}]}]}}}}, 1, "node affinity"),
    ],
)
def test_what_fits_a_node(spec: dict[str, Any], free: int, why: str | None) -> None:
    assert fits(pod(**spec), READY_NODE, free) == why


async def test_pods_are_bound_run_for_their_declared_time_and_complete() -> None:
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        await register_node(kube.url, "gpu-1", labels={"tgp.io/gpu-type": "RTX4090"}, gpus=1)
        merge = {"Content-Type": "application/merge-patch+json"}
        await http.patch("/api/v1/nodes/gpu-1", json={"spec": {"taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]}}, headers=merge)

        def job(name: str, seconds: str | None, tolerations: list[dict[str, Any]] = TOLERATE) -> dict[str, Any]:
            annotations = {RUN_SECONDS_ANNOTATION: seconds} if seconds else {}
            return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations}, "spec": {"containers": GPU, "tolerations": tolerations}}

        for body in (job("first", "1"), job("second", "1"), job("intolerant", None, tolerations=[])):
            (await http.post("/api/v1/namespaces/default/pods", json=body)).raise_for_status()

        async def state(name: str) -> dict[str, Any]:
            return (await http.get(f"/api/v1/namespaces/default/pods/{name}")).json()

        async with SimScheduler(kube.url, interval=0.1):

            async def completed(name: str) -> dict[str, Any] | None:
                p = await state(name)
                return p if p["status"].get("phase") == "Succeeded" else None

            first = await eventually(lambda: completed("first"), what="the first pod to complete")
            second = await eventually(lambda: completed("second"), what="the second pod to get the GPU once free, and complete")
            assert first["spec"]["nodeName"] == second["spec"]["nodeName"] == "gpu-1"

            async def unschedulable() -> dict[str, Any] | None:
                conditions = (await state("intolerant"))["status"].get("conditions") or []
                return next((c for c in conditions if c.get("reason") == "Unschedulable"), None)

            condition = await eventually(unschedulable, what="the intolerant pod to be Unschedulable")
            assert "untolerated taint" in condition["message"]
            assert not (await state("intolerant"))["spec"].get("nodeName")


class Clock:
    """The scheduler's monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gpu_pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": GPU, "tolerations": TOLERATE}}


async def node_of(http: httpx.AsyncClient, name: str) -> str | None:
    return (await http.get(f"/api/v1/namespaces/default/pods/{name}")).json()["spec"].get("nodeName")


async def taken_from_under(http: httpx.AsyncClient, kube_url: str, scheduler: SimScheduler, clock: Clock, i: int) -> None:
    """A Node that fits the waiting pod comes, and with it a new pod, which is in the active
    queue while the waiting one backs off: the new one takes the Node, the waiting one fails."""
    (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod(f"ahead-{i}"))).raise_for_status()
    await register_node(kube_url, f"gpu-{i}", gpus=1)
    clock.now += 0.1
    await scheduler.step()
    assert await node_of(http, f"ahead-{i}") == f"gpu-{i}"


async def test_a_pod_that_did_not_fit_waits_for_a_change_and_its_backoff_doubles_up_to_ten_seconds() -> None:
    """kube-scheduler v1.34: a pod that did not fit is not tried again while nothing changes,
    nor for a Node that cannot fit it (queueing hints); a Node that fits it tries it again, and
    each failure doubles its backoff, 1 s to 10 s (podInitialBackoff, podMaxBackoff)."""
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        clock = Clock()
        scheduler = SimScheduler(kube.url, clock=clock)
        (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod("waits"))).raise_for_status()
        await scheduler.step()
        [queued] = scheduler._queue.values()
        backoffs = []
        for i in range(6):
            await taken_from_under(http, kube.url, scheduler, clock, i)
            backoffs.append(scheduler._backoff(queued.attempts))
        assert queued.attempts == 7 and backoffs == [2, 4, 8, 10, 10, 10]
        for i in range(3):  # nothing changes, or a Node comes that cannot fit it: no attempt
            await register_node(kube.url, f"no-gpus-{i}", gpus=0)
            clock.now += 60
            await scheduler.step()
        assert queued.attempts == 7
        clock.now += UNSCHEDULABLE_LEFTOVER + 1  # five minutes with no event: tried again anyway
        await scheduler.step()
        assert queued.attempts == 8
        await scheduler.__aexit__()


async def test_a_node_that_appears_while_the_pod_backs_off_is_taken_at_once() -> None:
    """Since v1.33 (SchedulerPopFromBackoffQ) a pod still backing off is tried when no other pod
    waits in the active queue: the node it waited for is taken on the next pass, not after its
    backoff (up to 10 s later, as the simulated scheduler had it before)."""
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        clock = Clock()
        scheduler = SimScheduler(kube.url, clock=clock)
        (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod("waits"))).raise_for_status()
        await scheduler.step()
        for i in range(4):
            await taken_from_under(http, kube.url, scheduler, clock, i)
        [queued] = scheduler._queue.values()
        assert scheduler._backoff(queued.attempts) == 10
        await register_node(kube.url, "gpu-last", gpus=1)
        clock.now += 0.5
        await scheduler.step()
        assert await node_of(http, "waits") == "gpu-last"
        await scheduler.__aexit__()


async def test_a_pod_out_of_backoff_takes_the_node_another_pod_waited_for() -> None:
    """The pod first in line is backing off when the node it waited for appears; a newer pod
    takes it (what exposes a pool that remembers which node was bought for which pod)."""
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        clock = Clock()
        scheduler = SimScheduler(kube.url, clock=clock)
        (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod("first"))).raise_for_status()
        await scheduler.step()  # no Node: it backs off for 1 s
        clock.now += 0.5
        (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod("second"))).raise_for_status()
        await register_node(kube.url, "bought-for-first", gpus=1)
        await scheduler.step()
        assert await node_of(http, "second") == "bought-for-first" and await node_of(http, "first") is None
        await scheduler.__aexit__()


async def test_no_pod_is_bound_to_a_node_with_the_not_ready_taint_or_without_free_gpus() -> None:
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        scheduler = SimScheduler(kube.url, clock=Clock())
        # The emulator taints a Node not-ready until its Ready condition is True, as
        # TaintNodesByCondition does.
        await register_node(kube.url, "registering", gpus=1, ready=False)
        await register_node(kube.url, "full", gpus=1)
        busy = {**gpu_pod("busy"), "spec": {**gpu_pod("busy")["spec"], "nodeName": "full"}}
        (await http.post("/api/v1/namespaces/default/pods", json=busy)).raise_for_status()
        (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod("waits"))).raise_for_status()
        await scheduler.step()
        pod = (await http.get("/api/v1/namespaces/default/pods/waits")).json()
        assert not pod["spec"].get("nodeName")
        [condition] = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
        assert "insufficient nvidia.com/gpu" in condition["message"] and "node not ready" in condition["message"]
        ready_but_tainted = {**READY_NODE, "spec": {"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"}]}}
        assert fits(gpu_pod("p"), ready_but_tainted, 1) == "untolerated taint node.kubernetes.io/not-ready"
        await scheduler.__aexit__()


@attrs.define(kw_only=True)
class ListCountingEmulator(KubeEmulator):
    """The emulator, counting the lists (not watches, not gets) of pods and Nodes, and the binds
    (a pod's own PATCH: the simulated scheduler's bind) of each pod."""

    lists: Counter[str] = attrs.field(factory=Counter)
    binds: Counter[str] = attrs.field(factory=Counter)

    async def _handle(self, request: kmock.Request) -> Any:  # type: ignore[override]
        method = str(request.method).upper().rsplit(".", 1)[-1]
        watching = str(request.params.get("watch", "")).lower() in ("1", "true")
        if method == "GET" and not watching and not request.name and request.resource is not None:
            self.lists[request.resource.plural] += 1
        if method == "PATCH" and request.resource is not None and request.resource.plural == "pods" and not request.subresource:
            self.binds[str(request.name)] += 1
        return await super()._handle(request)


async def test_the_running_scheduler_binds_from_its_watches_without_listing_each_pass() -> None:
    """Like kube-scheduler's informers: Nodes and pods are listed once and kept from watches, so
    a running scheduler binds pods as they and their Nodes come (one pass per change) without
    listing the whole cluster again for each pass, and binds no pod twice."""
    async with ListCountingEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        async with SimScheduler(kube.url, interval=0.02):
            for i in range(5):  # a pod, then its Node: each bound as its Node registers
                (await http.post("/api/v1/namespaces/default/pods", json=gpu_pod(f"p{i}"))).raise_for_status()
                await register_node(kube.url, f"gpu-{i}", gpus=1)

                async def bound(name: str = f"p{i}") -> str | None:
                    return await node_of(http, name)

                await eventually(bound, timeout=30, what=f"p{i} bound")
        nodes = {(await node_of(http, f"p{i}")) for i in range(5)}
        assert nodes == {f"gpu-{i}" for i in range(5)}, nodes  # one pod per 1-GPU Node
        assert kube.binds == {f"p{i}": 1 for i in range(5)}, kube.binds  # each bound once
        assert kube.lists["pods"] <= 2 and kube.lists["nodes"] <= 2, kube.lists  # listed at the start (and a relist at most)
