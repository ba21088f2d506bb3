"""The money path's workflow wiring, end to end on the dev server (issue 17, items 1, 3, 4):
GPUNodeWorkflow against a simulated cloud whose provider model lags and lies, in real time
with a consistency window of seconds. The fault space itself is covered at the activity level
(tests/test_money_properties.py); these show the workflow passes what it knows (the create
time, every id) to its activities and runs the twin watch.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta

import httpx
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.provider_model import CreateOutcome
from sim.world import SimWorld, sim_world
from tests.conftest import eventually
from tests.test_node_lifecycle import FAST, request, start, wait_phase
from tgp.types import NodePhase, NodeStatus, instance_name
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow


@asynccontextmanager
async def lagging_world(env: WorkflowEnvironment, *, window: timedelta, boot_delay: float = 0.2) -> AsyncIterator[tuple[SimWorld, str]]:
    """running_world, with the simulated provider's consistency window set to `window`."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=boot_delay))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        activities.node.create_settle = timedelta(0)
        for provider in activities.node.providers.values():
            provider.consistency_window = window  # type: ignore[misc]
        task_queue = f"test-{uuid.uuid4().hex[:8]}"
        await stack.enter_async_context(make_worker(env.client, activities, task_queue=task_queue))
        yield world, task_queue


def billing(world: SimWorld, node: str) -> list[str]:
    return sorted(r.id for r in world.cloud.model.billing() if r.name.startswith(f"tgp-{node}-"))


async def test_a_late_create_on_a_lagging_cloud_gives_one_node_and_leaves_nothing(temporal: WorkflowEnvironment) -> None:
    """The create's connection drops and the backend buys 1.5 s later; lists lag 1 s and
    describes 3 s. The launch finds it by looking over the window, the wait for running reads
    the 404s as lag, and a terminate that lies is verified and sent again."""
    async with lagging_world(temporal, window=timedelta(seconds=4)) as (world, queue):
        model = world.cloud.model
        model.list_lag, model.describe_lag, model.late_create_after = 1.0, 3.0, 1.5
        model.next_creates(CreateOutcome.LATE)
        req = request(timeouts=FAST)
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)
        assert billing(world, req.node_name) == [ready.instance_id]
        assert world.cloud.create_requests == 1, "the unknown outcome was resent blind"

        model.next_terminates("lie")
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED
        assert billing(world, req.node_name) == [], "the node ended Terminated with its instance billing"


async def test_a_twin_landing_under_a_live_node_is_ended_and_the_recorded_one_kept(temporal: WorkflowEnvironment) -> None:
    """A create that lands after the launch returned (a dead worker's) bills under the node's
    name: the node's twin watch ends it within the consistency window, keeps the instance it
    recorded, and the release ends everything."""
    async with lagging_world(temporal, window=timedelta(seconds=15)) as (world, queue):
        req = request(timeouts=FAST)
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.cloud.url, headers={"Authorization": f"Bearer {world.cloud_api_key}"}) as cloud:
            twin = (await cloud.post("/v1/instances", json={"offerId": "rtx4090-us-east", "name": instance_name(req.node_name, 1)})).json()

        async def only_the_recorded_one() -> bool:
            return billing(world, req.node_name) == [ready.instance_id]

        await eventually(only_the_recorded_one, timeout=30, what=f"the twin {twin['id']} ended by the node's twin watch")
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED
        assert billing(world, req.node_name) == []
