"""Demand by fit through the pool workflow (issue 17, items 5-9 and 19), on the time-skipping
server with the simulated world: the test sends the signals the bridge would (the pods pending,
the free GPUs of Ready nodes) and reads what the cloud sold and what the pool said."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.cloud import SimOffer
from sim.world import SimWorld
from tests.conftest import binary, eventually, running_world, skip_time
from tests.test_pool_accounting import CLASS, end_entities, pool_spec, start_pool
from tgp.capacity import POD_BIND_GRACE, Nomination
from tgp.crds import Condition, GPUNodePoolStatus
from tgp.messages import ClassInput, ClassUpdate, Demand, PoolNode, PoolUpdate, class_workflow_id, pool_workflow_id
from tgp.types import NodePhase
from workers.temporal import DATA_CONVERTER, ensure_search_attributes
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import RESYNC_INTERVAL, GPUNodePoolWorkflow, PoolInput, PoolState

# One RTX4090 for $0.44/h, two for $0.95/h, eight for $3.52/h (as cheap per GPU as one).
CATALOG = (
    SimOffer("rtx4090-1x", "RTX4090", "us-east", Decimal("0.44")),
    SimOffer("rtx4090-2x", "RTX4090", "us-east", Decimal("0.95"), gpu_count=2),
    SimOffer("rtx4090-8x", "RTX4090", "us-east", Decimal("3.52"), gpu_count=8),
)


@pytest.fixture
async def time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping server of the test's own. The shared one (tests/conftest.py) can stop
    skipping for good after a test ends its workflows while they work (seen here after a pool
    reported PodsFit=False: every later skip then ran in real time); these tests skip minutes."""
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=binary("temporal-test-server"), data_converter=DATA_CONVERTER)
    async with env:
        await ensure_search_attributes(env.client)
        yield env


def demand(pods: dict[str, int], free: dict[str, int] | None = None) -> Demand:
    """What the bridge sends: the pods pending (key -> GPUs) and the Ready nodes' free GPUs."""
    return Demand(
        pods=sorted(pods),
        observed_at=datetime.now(timezone.utc),
        max_gpus=max(pods.values(), default=1),
        pod_gpus={k: v for k, v in pods.items() if v != 1},
        free_gpus=free or {},
    )


def bought(world: SimWorld) -> list[str]:
    return sorted(i.offer.id for i in world.cloud.instances.values())


async def settle_and_end(env: WorkflowEnvironment, pool: WorkflowHandle, class_name: str, nodes: int) -> None:
    """Wait until the pool's `nodes` nodes are Ready (nothing bought after the test), then end everything."""

    async def settled() -> bool:
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        return len(status.nodes) == nodes and all(n.phase == "Ready" for n in status.nodes)

    await eventually(settled, timeout=60, what=f"{nodes} Ready node(s)")
    await end_entities(env, pool, class_name)


async def condition(pool: WorkflowHandle, kind: str) -> Condition:
    status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
    found = next((c for c in status.conditions if c.type == kind), None)
    assert found is not None, f"no {kind} condition yet"
    return found


async def events(world: SimWorld, reason: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        items = (await kube.get("/api/v1/namespaces/ml/events")).json()["items"]
    return [e for e in items if e.get("reason") == reason]


async def test_item5_each_node_is_sized_from_its_own_pods(time_skipping: WorkflowEnvironment) -> None:
    """One 8-GPU pod and three 1-GPU pods: one 8-GPU node and three 1-GPU nodes ($4.84/h), not
    four 8-GPU nodes ($14.08/h)."""
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/big": 8, "ml/a": 1, "ml/b": 1, "ml/c": 1}))

        async def four() -> list[str] | None:
            return bought(world) if len(world.cloud.instances) >= 4 else None

        assert await eventually(four, timeout=60, what="four nodes bought") == ["rtx4090-1x"] * 3 + ["rtx4090-8x"]
        await settle_and_end(time_skipping, pool, class_name, 4)


async def test_item6_a_pod_no_offer_fits_is_reported_and_the_pool_serves_the_others(time_skipping: WorkflowEnvironment) -> None:
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"other/absurd": 2048, "ml/a": 1}))

        async def one() -> list[str] | None:
            return bought(world) or None

        assert await eventually(one, timeout=60, what="a node for the pod that fits") == ["rtx4090-1x"]
        [warning] = await eventually(lambda: events(world, "NoOfferFits"), what="a NoOfferFits Warning")
        assert warning["type"] == "Warning" and "other/absurd" in warning["message"] and "2048" in warning["message"] and " 8" in warning["message"]
        fit = await condition(pool, "PodsFit")
        assert fit.status == "False" and fit.reason == "NoOfferFits" and "other/absurd" in fit.message
        ready = await condition(pool, "Ready")
        assert ready.reason != "LaunchBackoff" and not await events(world, "LaunchFailed"), "the pool is not put into backoff"
        await settle_and_end(time_skipping, pool, class_name, 1)


async def test_a_pod_no_offer_fits_learns_it_on_its_own_events_once(time_skipping: WorkflowEnvironment) -> None:
    """Issue 35: `kubectl describe pod` shows tgp's NoOfferFits Warning (an Event on the pod, by
    its uid), written once although the pod stays pending pass after pass."""
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "absurd", "namespace": "ml"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
            created = await kube.post("/api/v1/namespaces/ml/pods", json=pod)
            created.raise_for_status()
        uid = created.json()["metadata"]["uid"]
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/absurd": 2048}))

        async def on_the_pod() -> list[dict[str, Any]]:
            return [e for e in await events(world, "NoOfferFits") if e["involvedObject"]["kind"] == "Pod"]

        [warning] = await eventually(on_the_pod, what="a NoOfferFits Warning on the pod")
        assert warning["type"] == "Warning" and warning["involvedObject"]["uid"] == uid and warning["involvedObject"]["name"] == "absurd"
        assert "2048" in warning["message"] and " 8" in warning["message"]
        await skip_time(time_skipping, RESYNC_INTERVAL * 3, step=RESYNC_INTERVAL)
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/absurd": 2048}))  # the bridge sends it again
        await skip_time(time_skipping, RESYNC_INTERVAL, step=RESYNC_INTERVAL)
        assert len(await on_the_pod()) == 1, "once per pod, not once per pass"
        assert not bought(world)
        await end_entities(time_skipping, pool, class_name)


async def test_item7_a_pod_is_not_nominated_to_a_floor_node_too_small_for_it(time_skipping: WorkflowEnvironment) -> None:
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name, minNodes=1))

        async def floor_started() -> list[str] | None:
            return bought(world) or None

        assert await eventually(floor_started, timeout=60, what="the floor node") == ["rtx4090-1x"]
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/two": 2}))

        async def two() -> list[str] | None:
            return bought(world) if len(world.cloud.instances) >= 2 else None

        assert await eventually(two, timeout=60, what="a 2-GPU node for the 2-GPU pod") == ["rtx4090-1x", "rtx4090-2x"]
        await settle_and_end(time_skipping, pool, class_name, 2)


async def ready_node(pool: WorkflowHandle) -> str:
    async def ready() -> str | None:
        status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
        return next((n.name for n in status.nodes if n.phase == "Ready"), None)

    return await eventually(ready, timeout=60, what="the node bought for the pod to be Ready")


async def test_item8_a_pod_whose_node_another_pod_took_gets_a_node_again(time_skipping: WorkflowEnvironment) -> None:
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/first": 1}))
        node = await ready_node(pool)
        # Another pod took the node: the bridge reports it full while ml/first still pends.
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/first": 1}, free={node: 0}))

        async def again() -> int | None:
            return world.cloud.create_requests if world.cloud.create_requests >= 2 else None

        assert await eventually(again, timeout=60, what="a node bought again for the starved pod") == 2
        assert (await condition(pool, "PodsFit")).status == "True", "a pod that never had room is not blamed"
        assert not await events(world, "PodDoesNotFit")
        await settle_and_end(time_skipping, pool, class_name, 2)


async def test_item9_with_the_shortest_idle_timeout_a_pod_that_never_fits_buys_one_node(time_skipping: WorkflowEnvironment) -> None:
    """idleTimeout 30 s: the node must not idle out before the bind grace judges the pod."""
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name, disruption={"idleTimeout": "30s"}))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/needs-2tb-ram": 1}))
        node = await ready_node(pool)
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/needs-2tb-ram": 1}, free={node: 1}))
        await skip_time(time_skipping, POD_BIND_GRACE + 6 * RESYNC_INTERVAL, step=timedelta(seconds=15))

        assert world.cloud.create_requests == 1, f"{world.cloud.create_requests} nodes bought for one pod that never fits"
        fit = await condition(pool, "PodsFit")
        assert fit.status == "False" and fit.reason == "PodDoesNotFit" and "ml/needs-2tb-ram" in fit.message
        await end_entities(time_skipping, pool, class_name)


async def test_item19_a_pool_at_its_max_nodes_says_so_and_stays_ready(time_skipping: WorkflowEnvironment) -> None:
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        pool = await start_pool(time_skipping, queue, pool_spec(class_name, maxNodes=1))
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/a": 2, "ml/b": 2}))

        async def limited() -> Condition | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return next((c for c in status.conditions if c.type == "BudgetAvailable" and c.status == "False"), None)

        budget = await eventually(limited, timeout=60, what="BudgetAvailable=False")
        assert budget.reason == "MaxNodesReached" and "maxNodes" in budget.message and "1 pending pod" in budget.message
        [warning] = await eventually(lambda: events(world, "MaxNodesReached"), what="a MaxNodesReached Warning")
        # Written by the pass that started the one node: it counts (it said "0 node(s)").
        assert warning["type"] == "Warning" and "the pool has 1 node(s) (1 starting) and its spec.maxNodes is 1" in warning["message"], warning["message"]
        ready = await condition(pool, "Ready")
        assert ready.status == "True" and "maxNodes" in ready.message, "a pool at its own maxNodes works as configured"
        await ready_node(pool)
        assert world.cloud.create_requests == 1
        await settle_and_end(time_skipping, pool, class_name, 1)


async def test_item9_a_node_that_idled_out_while_the_pool_planned_nothing_does_not_buy_again(time_skipping: WorkflowEnvironment) -> None:
    """The class goes missing while the node bought for a pod turns Ready and idles out: the
    passes meanwhile plan nothing, yet they must note when the node turned Ready, else the
    pod's nomination to the gone node is voided (not judged) and a node is bought again."""
    async with running_world(time_skipping, catalog=CATALOG) as (world, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(class_name, disruption={"idleTimeout": "30s"})
        pool = await start_pool(time_skipping, queue, spec)
        await pool.signal(GPUNodePoolWorkflow.demand, demand({"ml/needs-2tb-ram": 1}))

        async def launched() -> list[str] | None:
            return bought(world) or None

        await eventually(launched, timeout=60, what="the node bought for the pod")
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=None))
        await ready_node(pool)

        async def gone() -> bool:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return not status.nodes

        await skip_time(time_skipping, POD_BIND_GRACE + 3 * RESYNC_INTERVAL, step=timedelta(seconds=15))
        await eventually(gone, timeout=60, what="the node to idle out")
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=CLASS))
        await skip_time(time_skipping, 3 * RESYNC_INTERVAL, step=timedelta(seconds=15))

        assert world.cloud.create_requests == 1, f"{world.cloud.create_requests} nodes bought for one pod that never fits"
        fit = await condition(pool, "PodsFit")
        assert fit.status == "False" and fit.reason == "PodDoesNotFit" and "ml/needs-2tb-ram" in fit.message
        await end_entities(time_skipping, pool, class_name)


async def test_item7_a_pod_nominated_to_a_launching_node_of_unknown_gpu_count_is_not_bought_again(time_skipping: WorkflowEnvironment) -> None:
    """A state carried from before demand by fit (or a node rebuilt from its running workflow)
    has no GPU count for a launching node: it was counted as 1 GPU, so the 2-GPU pod
    nominated to it was voided and a second node bought while the first would idle."""
    async with running_world(time_skipping, catalog=CATALOG) as (_, _, queue):
        class_name = f"fit-{uuid.uuid4().hex[:6]}"
        spec = pool_spec(class_name)
        await time_skipping.client.start_workflow(
            GPUNodeClassWorkflow.run,
            ClassInput(name=class_name),
            id=class_workflow_id(class_name),
            task_queue=queue,
            start_signal="update_class",
            start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
        )
        name = f"pool-{uuid.uuid4().hex[:6]}"
        now = datetime.now(timezone.utc)
        wid = f"gpunode/ml/{name}/{name}-old01"
        state = PoolState(
            demand=["ml/two"],
            pod_gpus={"ml/two": 2},
            nodes={wid: PoolNode(workflow_id=wid, node_name=f"{name}-old01", phase=NodePhase.LAUNCHING, created_at=now, phase_at=now, gpus=None)},
            nominations={"ml/two": Nomination(workflow_id=wid, since=now)},
        )
        pool = await time_skipping.client.start_workflow(
            GPUNodePoolWorkflow.run,
            PoolInput(namespace="ml", name=name, state=state),
            id=pool_workflow_id("ml", name),
            task_queue=queue,
            start_signal="update",
            start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=CLASS)],
        )

        async def planned() -> GPUNodePoolStatus | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            return status if any(c.type == "BudgetAvailable" for c in status.conditions) else None

        status = await eventually(planned, timeout=60, what="a planning pass")
        assert [n.workflow_id for n in status.nodes] == [wid], "a second node was bought for the pod nominated to the first"
        await end_entities(time_skipping, pool, class_name)
