"""`tgp worker` and `tgp bridge` stop gracefully on SIGTERM, as Kubernetes stops their pods
(issue 19: the worker died at once, 5 of 5; only SIGINT was clean)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta

from temporalio.testing import WorkflowEnvironment

from sim.world import sim_world
from tests.conftest import binary
from tests.test_node_lifecycle import FAST, assert_nothing_left, request, start, wait_phase
from tgp.types import NodePhase, NodeStatus
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow

# The Deployment's terminationGracePeriodSeconds: the process must be gone by then.
POD_GRACE = 30.0


async def _exited(process: subprocess.Popen[bytes], timeout: float) -> int:
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.run_in_executor(None, process.wait), timeout)


async def _line(process: subprocess.Popen[bytes], text: str, *, timeout: float) -> str:
    """The process's stderr up to the first line containing `text` (or its end)."""
    assert process.stderr is not None
    stream = process.stderr
    loop = asyncio.get_running_loop()

    def read() -> str:
        seen = []
        for raw in iter(stream.readline, b""):
            seen.append(raw.decode(errors="replace"))
            if text in seen[-1]:
                break
        return "".join(seen)

    return await asyncio.wait_for(loop.run_in_executor(None, read), timeout)


async def test_a_worker_stopped_with_sigterm_mid_launch_exits_cleanly_and_buys_once(temporal: WorkflowEnvironment) -> None:
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        queue = f"sigterm-{uuid.uuid4().hex[:6]}"
        env = {**os.environ, **world.worker_env(), "TGP_TASK_QUEUE": queue,
               "TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host, "TGP_METRICS_PORT": "0"}
        log = stack.enter_context(tempfile.TemporaryFile())  # a pipe nobody reads could fill up
        stopping = subprocess.Popen([binary("tgp"), "worker"], env=env, stdout=subprocess.DEVNULL, stderr=log)
        stack.callback(lambda: stopping.poll() is None and stopping.kill())

        world.cloud.hold_creates()
        req = request(timeouts=FAST.model_copy(update={"api_call": timedelta(seconds=3)}))
        handle = await start(temporal, queue, req)
        await asyncio.wait_for(world.cloud.create_arrived.wait(), 60)  # the purchase is in flight ...
        stopping.send_signal(signal.SIGTERM)  # ... when Kubernetes stops the pod
        world.cloud.release_creates()
        code = await _exited(stopping, POD_GRACE)
        log.seek(0)
        stderr = log.read().decode(errors="replace")
        assert code == 0, stderr[-2000:]
        assert "stopped on SIGTERM" in stderr and "Traceback" not in stderr

        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))
        ready = await wait_phase(handle, NodePhase.READY, timeout=60)
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED
        assert world.cloud.create_requests == 1, "one purchase, whichever worker finished the launch"
        assert list(world.cloud.instances) == [ready.instance_id]
        assert_nothing_left(world, req.node_name)


async def test_the_bridge_stops_on_sigterm(temporal: WorkflowEnvironment) -> None:
    async with sim_world(boot_delay=0.2) as world:
        env = {**os.environ, "TGP_KUBE_URL": world.kube_url, "TGP_METRICS_PORT": "0",
               "TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host}
        bridge = subprocess.Popen([binary("tgp"), "bridge"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            assert bridge.stderr is not None
            started = await _line(bridge, "tgp bridge watching", timeout=60)
            assert "watching" in started, started
            bridge.send_signal(signal.SIGTERM)
            code = await _exited(bridge, POD_GRACE)
            stderr = bridge.stderr.read().decode()
            assert code == 0, stderr[-2000:]
            assert "stopped on SIGTERM" in stderr and "Traceback" not in stderr
        finally:
            if bridge.poll() is None:
                bridge.kill()
