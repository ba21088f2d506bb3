"""The simulated cluster's scheduler and kubelet stand-ins (sim.scheduler): they bind what
fits, mark what does not Unschedulable, run pods for the time they declare and complete them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import eventually
from sim.kube import KubeEmulator
from sim.kube_kubelet import register_node
from sim.scheduler import RUN_SECONDS_ANNOTATION, SimScheduler, fits

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
    async with KubeEmulator() as kube, httpx.AsyncClient(base_url=kube.url) as http:
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
