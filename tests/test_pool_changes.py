"""Changes to a GPUNodePool reach the nodes it already runs: lowering minNodes releases the
surplus floor nodes, and new disruption settings apply to running nodes. End to end through the
CRD bridge, as `kubectl apply` / `kubectl patch` would."""

from __future__ import annotations

from typing import Any

from temporalio.testing import WorkflowEnvironment

from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_bridge import POOLS, apply, gpu_class, gpu_pool, ready_nodes, running_stack

MERGE = {"Content-Type": "application/merge-patch+json"}


async def patch_pool(kube: Any, name: str, spec: dict[str, Any]) -> None:
    (await kube.patch(f"{POOLS.format(ns='ml')}/{name}", json={"spec": spec}, headers=MERGE)).raise_for_status()


async def test_lowering_min_nodes_releases_the_surplus_floor_nodes(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        await apply(s.kube, gpu_pool("rtx", minNodes=2))
        await ready_nodes(s, "ml", "rtx", 2)

        await patch_pool(s.kube, "rtx", {"minNodes": 1})

        async def one_left() -> dict[str, Any] | None:
            status = await s.pool_status("ml", "rtx")
            return status if len(status.get("nodes") or []) == 1 and status.get("readyNodes") == 1 else None

        await eventually(one_left, timeout=60, what="the surplus floor node to idle out")
        assert len(s.world.cloud.live_instances()) == 1, "the released node's instance was terminated; the floor node stays"


async def test_a_new_idle_timeout_reaches_a_running_node(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class())
        pool = gpu_pool("rtx", minNodes=1)
        pool["spec"]["disruption"] = {"idleTimeout": "1h", "drainTimeout": "10s"}
        await apply(s.kube, pool)
        await ready_nodes(s, "ml", "rtx", 1)

        # The floor goes and the idle timeout drops: the running node must idle out in seconds.
        await patch_pool(s.kube, "rtx", {"minNodes": 0, "disruption": {"idleTimeout": "2s"}})

        async def empty() -> dict[str, Any] | None:
            status = await s.pool_status("ml", "rtx")
            return status if status.get("nodes") == [] and status.get("readyNodes") == 0 else None

        await eventually(empty, timeout=60, what="the running node to idle out with its new idle timeout")
        assert s.world.cloud.live_instances() == []


# The typo's minNodes: more nodes than one launch at a time, fewer than the 30 it was (each node
# bought and released is about half a CPU-second of the suite).
TYPO = 10


async def test_deleting_a_pool_stops_its_purchases_at_once(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """A pool asking for many nodes (a typo) is deleted while it buys: purchases stop within one
    pass, everything bought is released, and the finalizer goes."""
    async with running_stack(temporal, kube_api) as s:
        await apply(s.kube, gpu_class(maxNodes=1000))
        await apply(s.kube, gpu_pool("typo", minNodes=TYPO))
        async def bought() -> bool:
            return s.world.cloud.create_requests > 0

        await eventually(bought, what="the first purchase")
        (await s.kube.delete(f"{POOLS.format(ns='ml')}/typo")).raise_for_status()

        async def gone() -> bool:
            return (await s.kube.get(f"{POOLS.format(ns='ml')}/typo")).status_code == 404

        # TYPO node workflows started in one pass each end what they bought (some mid-launch, each
        # waiting out its provider's consistency window by name); the bound leaves room for a
        # loaded machine.
        await eventually(gone, timeout=240, what="the pool's nodes to be released and its finalizer to go")
        assert s.world.cloud.live_instances() == []
        # Batched launches start all TYPO in the first pass (a typo is bounded by the class's
        # limits.maxNodes, here raised to 1000); none is bought twice, no pass buys after it.
        assert s.world.cloud.create_requests <= TYPO, "purchases went on after the deletion was seen"
