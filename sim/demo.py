"""`tgp demo`: the product as a user lives it, on this machine, without a cloud account.

Starts the Temporal dev server (Web UI included) with tgp's search attributes, the simulated
world (a Kubernetes API with a scheduler and kubelet stand-in, a Tailscale API, a GPU cloud),
a worker and the CRD bridge; writes a kubeconfig for the simulated cluster; applies
`examples/` (a GPUNodeClass, a GPUNodePool, a GPU pod) and tells the story as it happens:
pod Pending -> node bought -> tailnet joined -> Ready -> pod Running -> pod Completed -> idle ->
drained -> terminated -> pool back to zero. While it runs, use kubectl (`kubectl apply -f
examples/burst.yaml`, `kubectl annotate node ... tgp.io/evict=manual`) and the printed
`temporal workflow signal` command. Ctrl-C deletes the pool (its nodes are drained and
terminated first) and stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import yaml

from activities.http_wire import default_tls
from activities.kube.cluster import KubernetesCluster
from activities.kube.connection import load_client_classes
from crd_bridge.bridge import Bridge
from sim.dev_server import (
    TASK_QUEUE, cancel, check_ports_free, interrupt_event, start_dev_server, temporal_binary,
)
from sim.scheduler import SimScheduler
from sim.story import Story
from sim.terminal import terminal_foreground
from sim.world import SimWorld, sim_world
from tgp.errors import ConfigError
from workers.crdgen import manifests
from workers.main import WorkerConfig, build_activities, ensure_fleet_look, make_worker

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STORY_FILES = ("gpunodeclass.yaml", "gpunodepool.yaml", "gpu-job.yaml")
POOLS = "/apis/tgp.io/v1/namespaces/{ns}/gpunodepools"
# How often the story looks: often enough that it reads as it happens.
LOOK_EVERY = 0.5
# How long Ctrl-C waits for the pool's nodes to be drained and terminated.
TEARDOWN_TIMEOUT = 120.0


def write_env(path: Path, kubeconfig: Path, world: SimWorld, port: int) -> Path:
    """Shell variables that point kubectl, `tgp plan`, `tgp status` and `tgp evict` at the demo."""
    env = {
        "KUBECONFIG": str(kubeconfig),
        "TEMPORAL_ADDRESS": f"127.0.0.1:{port}",
        "TGP_SIMULATED_CLOUD_URL": world.cloud.url,
        "TGP_SIMULATED_CLOUD_API_KEY": world.cloud_api_key,  # a throwaway key of the simulated cloud
        "PATH": f"{Path(sys.executable).parent}:$PATH",
    }
    path.write_text("".join(f'export {k}="{v}"\n' for k, v in env.items()))
    path.chmod(0o600)
    return path.resolve()


async def apply(kube: httpx.AsyncClient, obj: dict[str, Any]) -> None:
    """Create `obj` (what `kubectl apply` does for a new object)."""
    kind, meta = obj["kind"], obj["metadata"]
    ns = meta.get("namespace", "default")
    path = {
        "GPUNodeClass": "/apis/tgp.io/v1/gpunodeclasses",
        "GPUNodePool": POOLS.format(ns=ns),
        "Pod": f"/api/v1/namespaces/{ns}/pods",
    }[kind]
    response = await kube.post(path, json=obj)
    if response.status_code not in (200, 201, 409):
        raise ConfigError(f"could not apply {kind} {meta['name']}: {response.status_code} {response.text[:300]}")


async def run_demo(args: argparse.Namespace) -> int:
    """`tgp demo`: start everything, apply the examples, tell the story until Ctrl-C (or, with
    --exit-when-done, until the pool is back to zero). Ctrl-C deletes the pool, waits for its
    nodes' ends and exits 0: a clean stop is not an error (`make demo` stays quiet)."""
    check_ports_free(args.port, args.port + 1000)
    load_client_classes()
    async with AsyncExitStack() as stack:
        stack.enter_context(terminal_foreground())  # Ctrl-C reaches this command, not make (sim.terminal)
        print("Starting the Temporal dev server (Web UI), the simulated cloud, tailnet and cluster, a worker and the bridge ...")
        server = await start_dev_server(args.port, stack)
        client = server.client
        world = await stack.enter_async_context(sim_world(boot_delay=args.boot_delay))
        assert world.kube is not None
        for crd in manifests().values():
            world.kube.install_crd(crd)
        await stack.enter_async_context(SimScheduler(world.kube_url))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=1)
        await stack.enter_async_context(make_worker(client, activities, task_queue=TASK_QUEUE))
        await ensure_fleet_look(client, TASK_QUEUE)  # interruptions are noticed by the fleet look (workflows.fleet)
        cluster = KubernetesCluster.from_url(world.kube_url)
        stack.push_async_callback(cluster.close)
        bridge = asyncio.create_task(Bridge(client, cluster, task_queue=TASK_QUEUE).run())
        stack.push_async_callback(cancel, bridge)
        kube = await stack.enter_async_context(httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url, timeout=10))
        # Per port: a second demo on other ports does not overwrite the first one's files.
        state = Path(args.state_dir) / str(args.port)
        kubeconfig = world.kube.write_kubeconfig(state / "kubeconfig", context="tgp-demo").resolve()
        ui = f"http://localhost:{args.port + 1000}"
        interrupted = interrupt_event()  # before the banner: whoever reads it may press Ctrl-C
        print(banner(args.port, ui, kubeconfig, write_env(state / "env", kubeconfig, world, args.port),
                     await server.serve_metrics(stack, activities)))
        for name in STORY_FILES:
            for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                await apply(kube, obj)
            print(f"applied examples/{name}")
        print()
        story = Story(client, kube, ui)
        await tell(story, world, bridge, interrupted, exit_when_done=args.exit_when_done)
        if interrupted.is_set():
            print("\nCtrl-C: deleting the pool; its nodes are drained and terminated first ...")
            await teardown(kube, story)
            report(world)
        print("Stopping ...")
    return 0


def banner(port: int, ui: str, kubeconfig: Path, env_file: Path, metrics: str) -> str:
    """Where everything is and what to try."""
    return (
        f"\nWeb UI:  {ui}   (filter: TgpPool = 'default/ml-workload-pool')\n"
        f"kubectl: export KUBECONFIG={kubeconfig}   (kubectl is {Path(sys.executable).parent / 'kubectl'})\n"
        f"         kubectl get gnp -A    kubectl get nodes -L tgp.io/gpu-type    kubectl get pods -w\n"
        f"         kubectl apply -f examples/burst.yaml          (three GPU pods: three nodes in one batch)\n"
        f"         kubectl annotate node <node> tgp.io/evict=manual\n"
        f"tgp:     source {env_file}; tgp plan default/ml-workload-pool; tgp status; tgp evict <node>\n"
        f"evict:   {temporal_binary()} workflow signal --address 127.0.0.1:{port} "
        f"--workflow-id <node workflow id> --name evict --input '{{\"reason\":\"manual\"}}'\n"
        f"metrics: {metrics}\n"
    )


async def tell(story: Story, world: SimWorld, bridge: asyncio.Task[None], interrupted: asyncio.Event, *, exit_when_done: bool) -> None:
    """Tell the story until interrupted (or, with `exit_when_done`, until it is done)."""
    done_once = False
    while not interrupted.is_set():
        if bridge.done():
            raise ConfigError(f"the CRD bridge stopped: {bridge.exception()!r}")
        if await story.look() and not done_once:
            done_once = True
            report(world)
            if exit_when_done:
                return
            print(f"\nEverything is back to zero. The Web UI stays up at {story.ui}; try the kubectl commands above. Ctrl-C to stop.\n")
        try:
            await asyncio.wait_for(interrupted.wait(), LOOK_EVERY)
        except TimeoutError:
            pass


async def teardown(kube: httpx.AsyncClient, story: Story) -> None:
    """Delete the pool and tell its nodes' ends: until the pool is gone and every node the
    story followed has told its end (a node leaves the pool's status as it ends)."""
    path = f"{POOLS.format(ns='default')}/ml-workload-pool"
    await kube.delete(path)
    deadline = asyncio.get_running_loop().time() + TEARDOWN_TIMEOUT
    while True:
        await story.look()
        if (await kube.get(path)).status_code == 404 and not story.following:
            return
        if asyncio.get_running_loop().time() > deadline:
            print(f"The pool was not gone within {TEARDOWN_TIMEOUT:.0f}s; see the Web UI.")
            return
        await asyncio.sleep(LOOK_EVERY)


def report(world: SimWorld) -> None:
    """What the simulated world still holds: after a clean end, nothing."""
    live = world.cloud.live_instances()
    devices = len(world.tailscale.devices)
    print(f"\nLeft behind: {len(live)} instance(s), {devices} tailnet device(s), {len(world.usable_keys())} usable tailnet key(s)")
