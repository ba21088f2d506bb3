"""`tgp plan`'s disruption section (issue 21 item 4), run as a user would (a subprocess) over the
emulator and the simulated cloud's HTTP API: which nodes tgp would replace (drift), remove
(underutilized) or move to a cheaper offer, what each saves, and what holds the rest back."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import httpx
import yaml

from activities.http_wire import default_tls
from sim.cloud import SimOffer
from sim.demo import EXAMPLES, apply
from sim.world import sim_world
from tests.test_ops_cli import tgp
from tgp.drift import DRIFT_HASH_VERSION
from workers.crdgen import manifests

MERGE_PATCH = "application/merge-patch+json"
POOL = "/apis/tgp.io/v1/namespaces/default/gpunodepools/ml-workload-pool"


async def node(kube: httpx.AsyncClient, name: str, gpus: int, *, annotations: dict[str, str] | None = None) -> None:
    labels = {"tgp.io/pool": "ml-workload-pool", "tgp.io/pool-namespace": "default", "tgp.io/provider": "simulated", "tgp.io/managed": "true"}
    meta: dict[str, Any] = {"name": name, "labels": labels, "annotations": annotations or {}}
    assert (await kube.post("/api/v1/nodes", json={"apiVersion": "v1", "kind": "Node", "metadata": meta})).status_code == 201
    status = {"status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "conditions": [{"type": "Ready", "status": "True"}]}}
    response = await kube.patch(f"/api/v1/nodes/{name}/status", json=status, headers={"Content-Type": MERGE_PATCH})
    assert response.status_code == 200, response.text


async def pod(kube: httpx.AsyncClient, name: str, on: str, gpus: int, *, annotations: dict[str, str] | None = None) -> None:
    container = {"name": "main", "image": "pause", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}}
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ml", "annotations": annotations or {}}, "spec": {"nodeName": on, "containers": [container]}}
    assert (await kube.post("/api/v1/namespaces/ml/pods", json=body)).status_code == 201
    response = await kube.patch(f"/api/v1/namespaces/ml/pods/{name}/status", json={"status": {"phase": "Running"}}, headers={"Content-Type": MERGE_PATCH})
    assert response.status_code == 200, response.text


async def test_plan_shows_what_disruption_would_do_its_savings_and_what_holds_each_node_back() -> None:
    async with sim_world() as world, httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        assert world.kube is not None
        for crd in manifests().values():
            world.kube.install_crd(crd)
        for name in ("gpunodeclass.yaml", "gpunodepool.yaml"):
            for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                await apply(kube, obj)
        env = {"TGP_KUBE_URL": world.kube_url, "TGP_SIMULATED_CLOUD_URL": world.cloud.url, "TGP_SIMULATED_CLOUD_API_KEY": world.cloud_api_key}

        # Consolidation off and no node: the plan says so.
        code, out, err = await tgp("plan", "default/ml-workload-pool", env=env)
        assert code == 0, err
        assert "DISRUPTION now (0 Ready node(s), 0 disrupting" in out and "consolidation: off" in out and "nothing to do" in out

        disruption = {"consolidation": {"cheaperBy": "20%", "after": "30m"}, "budgets": [{"nodes": "2"}]}
        response = await kube.patch(POOL, json={"spec": {"disruption": disruption}}, headers={"Content-Type": MERGE_PATCH})
        assert response.status_code == 200, response.text
        for n, gpus in (("gpu-a", 2), ("gpu-b", 2), ("gpu-c", 1), ("gpu-d", 1), ("gpu-e", 1)):
            await node(kube, n, gpus)
        await node(kube, "gpu-f", 1, annotations={"tgp.io/drift-hash": f"{DRIFT_HASH_VERSION}-0000000000000000"})  # made by another class spec
        await pod(kube, "a", "gpu-a", 1)
        await pod(kube, "b", "gpu-b", 1)
        await pod(kube, "c", "gpu-c", 1)
        await pod(kube, "d", "gpu-d", 1, annotations={"karpenter.sh/do-not-disrupt": "true"})
        # The pool's record of its nodes (its workflow writes it): prices and when each started.
        old, young = datetime.now(UTC) - timedelta(hours=2), datetime.now(UTC) - timedelta(minutes=5)
        prices = {"gpu-a": ("0.95", old), "gpu-b": ("0.95", old), "gpu-c": ("0.90", old), "gpu-d": ("0.90", old), "gpu-e": ("0.90", young), "gpu-f": ("0.44", old)}
        nodes = [{"name": n, "phase": "Ready", "hourlyPrice": p, "createdAt": at.isoformat(), "workflowId": f"w-{n}"} for n, (p, at) in prices.items()]
        response = await kube.patch(f"{POOL}/status", json={"status": {"nodes": nodes}}, headers={"Content-Type": MERGE_PATCH})
        assert response.status_code == 200, response.text

        code, out, err = await tgp("plan", "default/ml-workload-pool", env=env)
        assert code == 0, err
        section = out[out.index("DISRUPTION now") :].splitlines()
        assert section[0].startswith("DISRUPTION now (6 Ready node(s), 0 disrupting")
        assert "consolidation: WhenEmptyOrUnderutilized, cheaperBy 20%, after 30m" in section[1] and "nodes: 2" in section[2]
        rows = {line.split()[1]: line for line in section if line.strip().split()[0] in ("remove", "replace", "held")}
        assert rows["gpu-f"].split()[:3] == ["replace", "gpu-f", "Drifted"], rows
        assert rows["gpu-a"].split()[:3] == ["remove", "gpu-a", "Underutilized"] and "saves $0.95/h" in rows["gpu-a"] and "gpu-b" in rows["gpu-a"]
        # gpu-c's pod would fit on gpu-e's free GPU, but gpu-e is inside its own after window (no destination);
        # a cheaper offer fits gpu-c, but the budget of 2 is spent.
        assert rows["gpu-c"].split()[:3] == ["held", "gpu-c", "Cheaper"] and "[budget]" in rows["gpu-c"] and "budgets[0] (nodes: 2)" in rows["gpu-c"]
        assert sum(1 for line in section if " gpu-c " in line) == 1, "one line per node"
        assert "[do-not-disrupt]" in rows["gpu-d"] and "ml/d" in rows["gpu-d"]
        assert "[after]" in rows["gpu-e"] and "less than after (30m)" in rows["gpu-e"]
        assert "gpu-b" not in rows, "the node that takes gpu-a's pod stays"
        assert section[-1].strip() == "savings found: $0.95/h"
        assert world.cloud.create_requests == 0, "a plan buys nothing"

        # Every pool at once: the same section for each.
        code, out, err = await tgp("plan", env=env)
        assert code == 0, err
        assert out.startswith("Plan for GPUNodePool default/ml-workload-pool") and "savings found: $0.95/h" in out


async def test_plan_shows_several_nodes_merged_into_one_cheaper_node_and_what_it_saves() -> None:
    """Three 1-GPU RTX4090 nodes ($0.44/h each), one pod each, and a 4-GPU offer at $0.99/h (under
    the example pool's maxHourlyPrice): the plan merges the three into one new node (issue 35
    item 9) and counts the $0.33/h it saves."""
    catalog = (SimOffer("rtx4090-1x", "RTX4090", "us-east", Decimal("0.44")), SimOffer("rtx4090-4x", "RTX4090", "us-east", Decimal("0.99"), gpu_count=4))
    async with sim_world(catalog=catalog) as world, httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        assert world.kube is not None
        for crd in manifests().values():
            world.kube.install_crd(crd)
        for name in ("gpunodeclass.yaml", "gpunodepool.yaml"):
            for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                await apply(kube, obj)
        env = {"TGP_KUBE_URL": world.kube_url, "TGP_SIMULATED_CLOUD_URL": world.cloud.url, "TGP_SIMULATED_CLOUD_API_KEY": world.cloud_api_key}
        disruption = {"consolidation": {"cheaperBy": "10%", "after": "30m"}, "budgets": [{"nodes": "3"}]}
        response = await kube.patch(POOL, json={"spec": {"disruption": disruption}}, headers={"Content-Type": MERGE_PATCH})
        assert response.status_code == 200, response.text
        old = datetime.now(UTC) - timedelta(hours=2)
        for n in ("gpu-a", "gpu-b", "gpu-c"):
            await node(kube, n, 1)
            await pod(kube, f"p-{n}", n, 1)
        nodes = [{"name": n, "phase": "Ready", "hourlyPrice": "0.44", "createdAt": old.isoformat(), "workflowId": f"w-{n}"} for n in ("gpu-a", "gpu-b", "gpu-c")]
        response = await kube.patch(f"{POOL}/status", json={"status": {"nodes": nodes}}, headers={"Content-Type": MERGE_PATCH})
        assert response.status_code == 200, response.text

        code, out, err = await tgp("plan", "default/ml-workload-pool", env=env)
        assert code == 0, err
        section = out[out.index("DISRUPTION now") :].splitlines()
        merges = [line for line in section if line.strip().startswith("merge")]
        assert len(merges) == 1, out
        merge = merges[0]
        assert "gpu-a, gpu-b, gpu-c" in merge and "Consolidating 3 nodes into 1, saving $0.33/h" in merge and "4-GPU node ($0.99/h)" in merge, merge
        assert section[-1].strip() == "savings found: $0.33/h"
        assert world.cloud.create_requests == 0, "a plan buys nothing"
