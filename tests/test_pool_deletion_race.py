"""A deleted pool never lets its finalizer go while a node start it made may still happen
(issue 35 item 2), at the activity and end to end. Under load a start's RPC can time out after the server took it, or the
batch's activity outlive the pool's wait: the node workflow then appears after the pool looked.
Its evict, sent as a signal, found no workflow and counted the node closed; the late start then
bought an instance for a pool that was gone (`sim-0056` live after the pool object was gone).
Now such a start is taken by the evict itself (signal-with-start, the same id): the node ends at
once, buying nothing, and the late start is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import Any

import pytest
from temporalio.client import (
    Client,
    Interceptor,
    OutboundInterceptor,
    StartWorkflowInput,
    WorkflowExecutionStatus,
    WorkflowHandle,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.pool import PoolActivities, _start_node_workflow
from crd_bridge.bridge import Bridge
from sim.world import sim_world
from tests.conftest import eventually, running_world
from tests.kube_env import KUBECONFIG_ENV, KubeApi
from tests.test_bridge import POOLS, apply, clean_real_cluster, gpu_class, gpu_pool, install_crds, new_bridge
from tests.test_node_lifecycle import request
from tgp.messages import EvictNodesInput, class_workflow_id, pool_workflow_id
from tgp.types import NodePhase
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow


async def test_a_start_that_may_still_happen_is_taken_by_the_pools_evict(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        req = request()
        env = ActivityEnvironment(client=temporal.client)
        env.info = dataclasses.replace(env.info, task_queue=queue)
        acts = PoolActivities(cluster=None, providers={})  # type: ignore[arg-type]  # evicting reads no cloud

        closed = await env.run(acts.evict_nodes, EvictNodesInput(may_start=[req]))
        assert closed == [], "a node not yet started is not closed: it may still start"
        handle = temporal.client.get_workflow_handle_for(GPUNodeWorkflow.run, req.workflow_id)
        ended = await handle.result()
        assert ended.phase is NodePhase.TERMINATED and not ended.attempts, ended

        await env.run(_start_node_workflow, temporal.client, req)  # the late start
        assert (await handle.describe()).status is WorkflowExecutionStatus.COMPLETED
        assert world.cloud.create_requests == 0, "the late start bought an instance"
        assert await env.run(acts.evict_nodes, EvictNodesInput(may_start=[req])) == [req.workflow_id], "closed now"


class LateStart(Interceptor):
    """The Temporal server as the worker's activities see it: the first start of a GPUNodeWorkflow
    times out and the server takes it only later (`late`, held until the test lets it go); every
    start of that id is refused until then, so it stays unsettled. A start with a signal (the
    pool's evict) goes through."""

    def __init__(self) -> None:
        self.held: StartWorkflowInput | None = None
        self.next: OutboundInterceptor | None = None
        self.late: str = ""  # what the late start found: "started" or "refused"

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _LateStart(next, self)

    async def start_late(self) -> None:
        assert self.held is not None and self.next is not None
        try:
            await self.next.start_workflow(self.held)
            self.late = "started"
        except WorkflowAlreadyStartedError:
            self.late = "refused"


class _LateStart(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, late: LateStart) -> None:
        super().__init__(next)
        self.late = late

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        if input.workflow == "GPUNodeWorkflow" and input.start_signal is None and not self.late.late:
            if self.late.held is None:
                self.late.held, self.late.next = input, self.next
            if input.id == self.late.held.id:
                raise RPCError("injected: the start timed out (the server takes it later)", RPCStatusCode.DEADLINE_EXCEEDED, b"")
        return await super().start_workflow(input)


@pytest.mark.timeout(300)
async def test_a_deleted_pool_keeps_its_finalizer_while_a_start_it_made_may_still_buy(temporal: WorkflowEnvironment, kube_api: KubeApi) -> None:
    """End to end (bridge, pool, nodes, simulated cloud): a pool of two nodes, one Ready, the other's
    start unsettled (timed out; the server takes it later). The pool is deleted; only after its
    finalizer went does the late start reach the server. The pool object never goes while an
    instance it bought runs, and at the end nothing runs. Before (the evict a plain signal), the
    unsettled node was counted closed, the finalizer went, and the late start bought an instance
    for a pool that was gone."""
    late = LateStart()
    async with AsyncExitStack() as stack:
        # The worker reaches a real API server with its kubeconfig (the lane's), as running_stack's does.
        world = await stack.enter_async_context(
            sim_world(boot_delay=0.2, kube_url=kube_api.url, kube_client=kube_api.http, kubeconfig=os.environ.get(KUBECONFIG_ENV))
        )
        world.kube = kube_api.emulator
        await install_crds(kube_api)
        if kube_api.real:  # a real cluster outlives the test: its class and pool go with it
            stack.push_async_callback(clean_real_cluster, kube_api)
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        queue = f"late-{uuid.uuid4().hex[:8]}"
        client = Client(**{**temporal.client.config(), "interceptors": [late]})
        await stack.enter_async_context(make_worker(client, activities, task_queue=queue))
        bridge = new_bridge(temporal, kube_api.cluster, queue)
        bridge_task = asyncio.create_task(bridge.run())
        stack.callback(bridge_task.cancel)
        stack.push_async_callback(end_workflows, temporal, queue, bridge)
        kube = kube_api.http
        pool_url = f"{POOLS.format(ns='ml')}/late"

        await apply(kube, gpu_class("sim"))
        await apply(kube, gpu_pool("late", minNodes=2, disruption={"idleTimeout": "1h", "drainTimeout": "10s"}))

        async def one_ready_one_unsettled() -> bool:
            status = (await kube.get(pool_url)).json().get("status") or {}
            ready = [n for n in status.get("nodes") or [] if n["phase"] == "Ready"]
            return late.held is not None and len(ready) == 1 and len(world.cloud.live_instances()) == 1

        await eventually(one_ready_one_unsettled, timeout=90, what="one node Ready and the other's start unsettled")
        unsettled = late.held.id if late.held else ""

        (await kube.delete(pool_url)).raise_for_status()
        outlived: set[str] = set()  # instances running while the pool object was already gone

        async def pool_gone() -> bool:
            gone = (await kube.get(pool_url)).status_code == 404
            if gone and (live := world.cloud.live_instances()):
                outlived.update(i.id for i in live)
            return gone

        await eventually(pool_gone, timeout=90, what="the pool to be deleted")
        await late.start_late()  # the server takes the start that timed out

        node = temporal.client.get_workflow_handle(unsettled)

        async def settled() -> bool:
            await pool_gone()
            return (await node.describe()).status is not WorkflowExecutionStatus.RUNNING and not world.cloud.live_instances()

        try:
            await eventually(settled, timeout=20, what="the late start to end, buying nothing")
        except AssertionError:
            pass  # said below
        assert not outlived, f"instances {sorted(outlived)} ran after the pool was deleted (the late start of {unsettled}: {late.late})"
        assert world.cloud.live_instances() == [] and world.cloud.create_requests == 1, "one instance bought, and it is ended"
        assert late.late == "refused", f"the late start of {unsettled} was {late.late}: the pool's evict had not taken it"


async def end_workflows(env: WorkflowEnvironment, queue: str, bridge: Bridge) -> None:
    """The dev server is shared: end what ran on this test's queue."""
    entities = [class_workflow_id(name) for name in bridge.classes]
    entities += [pool_workflow_id(p.metadata.namespace or "default", p.metadata.name) for p in bridge.pools.values()]
    listed = [w.id async for w in env.client.list_workflows(f"TaskQueue = '{queue}' AND ExecutionStatus = 'Running'")]
    for wid in dict.fromkeys([*entities, *listed]):
        try:
            await env.client.get_workflow_handle(wid).terminate("test finished")
        except RPCError:
            pass
