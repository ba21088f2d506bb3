"""`tgp dev`: the demo's processes (the Temporal dev server, a worker, the bridge) against the
cluster of the current kube context, telling the same story as the demo.

A fresh API server answers its lists `429 storage is (re)initializing` (or 503) for a while;
`tgp dev` waits for it quietly, for at most API_READY_TIMEOUT, and only then starts the bridge,
whose informers would otherwise log each refusal as a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from contextlib import AsyncExitStack
from pathlib import Path

import httpx

from activities.clouds.registry import API_KEY_ENV
from activities.kube.cluster import KubernetesCluster
from activities.kube.connection import authenticated_http, load_client_classes
from crd_bridge.bridge import Bridge
from sim.dev_server import TASK_QUEUE, cancel, check_ports_free, interrupt_event, start_dev_server
from sim.story import Story
from sim.terminal import terminal_foreground
from sim.world import sim_world
from tgp.errors import ConfigError
from workers.main import WorkerConfig, build_activities, ensure_fleet_look, make_worker

# The lists the bridge's informers start with: each must answer before the bridge starts.
READINESS_PATHS = ("/apis/tgp.io/v1/gpunodeclasses", "/apis/tgp.io/v1/gpunodepools", "/api/v1/pods", "/api/v1/nodes")
# What a starting API server answers while its storage and caches warm up.
NOT_READY_YET = frozenset({429, 500, 502, 503, 504})
# A fresh control plane (hack/kube, on 2 loaded cores) answers within seconds; a minute is
# room for a slow one without hiding an API server that will never be ready.
API_READY_TIMEOUT = 60.0
API_RETRY_EVERY = 1.0
# The story lists every pool and pod of the cluster: each second is live enough for a person
# and light for a real API server.
LOOK_EVERY = 1.0


async def wait_for_api(http: httpx.AsyncClient, kubeconfig: str, *, timeout: float = API_READY_TIMEOUT) -> None:
    """Return once every list the bridge starts with answers; retry quietly while the API
    server is starting. Raises ConfigError saying what to fix when it is down, refuses, lacks
    the tgp CRDs or is not ready within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for path in READINESS_PATHS:
        while True:
            try:
                response = await http.get(path, params={"limit": "1"})
            except httpx.TransportError as exc:  # down, wrong address, TLS: one line naming the server
                raise ConfigError(
                    f"cannot reach the Kubernetes API at {http.base_url} (kubeconfig {kubeconfig}): {type(exc).__name__}"
                    + (f": {str(exc)[:200]}" if str(exc) else "")
                ) from None
            if response.status_code == 200:
                break
            said = f"{response.status_code} {_message(response)}"
            if response.status_code == 404 and path.startswith("/apis/tgp.io/"):
                raise ConfigError(f"the tgp CRDs are not installed in {http.base_url}: kubectl apply -f deploy/crds/")
            if response.status_code not in NOT_READY_YET:
                raise ConfigError(
                    f"the Kubernetes API at {http.base_url} refused to list {path} ({said}): check the credentials "
                    f"and RBAC of kubeconfig {kubeconfig}"
                )
            if loop.time() > deadline:
                raise ConfigError(
                    f"the Kubernetes API at {http.base_url} was not ready within {timeout:.0f}s (it still answers {path} "
                    f"with {said}): when `kubectl get --raw /readyz` says ok, run tgp dev again"
                )
            await asyncio.sleep(API_RETRY_EVERY)


def _message(response: httpx.Response) -> str:
    """The Status message of an API server's refusal, short."""
    try:
        message = response.json().get("message")
    except ValueError:
        message = None
    return str(message or response.reason_phrase)[:200]


async def run_dev(args: argparse.Namespace) -> int:
    """`tgp dev`: the demo's processes against the current kube context: the documented first
    step on a real cluster. With --simulated-cloud (the default when no provider key is set)
    machines come from the simulated cloud and register KWOK-style Nodes in that cluster."""
    kubeconfig = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    if not Path(kubeconfig.split(os.pathsep)[0]).exists():
        raise ConfigError(f"no kubeconfig at {kubeconfig}: set KUBECONFIG or run `tgp demo` for a simulated cluster")
    check_ports_free(args.port, args.port + 1000)
    load_client_classes()
    async with AsyncExitStack() as stack:
        stack.enter_context(terminal_foreground())  # Ctrl-C reaches this command, not make (sim.terminal)
        cluster = await stack.enter_async_context(KubernetesCluster.from_kubeconfig(kubeconfig))
        http = await stack.enter_async_context(authenticated_http(kubeconfig))
        await wait_for_api(http, kubeconfig)
        print(f"Starting the Temporal dev server (Web UI), a worker and the bridge against {http.base_url} ...")
        state = Path(args.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        # On disk: Ctrl-C must not forget node workflows that hold real instances; the next
        # `tgp dev` resumes them (and their cleanup).
        server = await start_dev_server(args.port, stack, db_file=state / "temporal.db")
        simulated = args.simulated_cloud if args.simulated_cloud is not None else not any(os.environ.get(k) for k in API_KEY_ENV.values())
        env = dict(os.environ)
        if simulated:
            world = await stack.enter_async_context(
                sim_world(boot_delay=args.boot_delay, kube_url=str(http.base_url), kube_client=http, kubeconfig=kubeconfig)
            )
            env |= world.worker_env()
        env["KUBECONFIG"] = kubeconfig
        activities = await build_activities(WorkerConfig.from_env(env), stack)
        await stack.enter_async_context(make_worker(server.client, activities, task_queue=TASK_QUEUE))
        await ensure_fleet_look(server.client, TASK_QUEUE)  # interruptions are noticed by the fleet look (workflows.fleet)
        bridge = asyncio.create_task(Bridge(server.client, cluster, task_queue=TASK_QUEUE).run())
        stack.push_async_callback(cancel, bridge)
        interrupted = interrupt_event()  # before the banner: whoever reads it may press Ctrl-C
        ui = f"http://localhost:{args.port + 1000}"
        print(
            f"\nWeb UI:  {ui}\n"
            f"cloud:   {'simulated (KWOK-style Nodes in your cluster)' if simulated else 'the providers configured in the environment'}\n"
            f"metrics: {await server.serve_metrics(stack, activities)}\n"
            "next:    kubectl apply -f examples/gpunodeclass.yaml -f examples/gpunodepool.yaml -f examples/gpu-job.yaml\n"
            f"Ctrl-C stops the processes; the node workflows are kept in {state / 'temporal.db'} and resume with the\n"
            "next `tgp dev`. To stop paying, delete your pools first (their nodes are drained and terminated).\n",
            flush=True,
        )
        await tell(Story(server.client, http, ui), bridge, interrupted)
        print("Stopping ...")
    return 0


async def tell(story: Story, bridge: asyncio.Task[None], interrupted: asyncio.Event) -> None:
    """Tell the story until Ctrl-C; a bridge that stopped is an error saying why."""
    while not interrupted.is_set():
        if bridge.done():
            raise ConfigError(f"the CRD bridge stopped: {bridge.exception()!r}")
        await story.look()
        try:
            await asyncio.wait_for(interrupted.wait(), LOOK_EVERY)
        except TimeoutError:
            pass
