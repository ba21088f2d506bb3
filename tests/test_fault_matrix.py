"""The fault matrix: every lifecycle stage × every fault, each cell one real node life.

A cell is a GPUNodeClass, a GPUNodePool and one pending GPU pod applied to a Kubernetes API
(the emulator), served by real `tgp worker` and `tgp bridge` processes on a real Temporal dev
server; the node launches, joins, runs the pod, is evicted (annotation), drains and terminates,
and the pool is deleted. The fault strikes when the life reaches the cell's stage, detected from
the simulated world (an offer listing, a create or the instance's boot held, the
tailnet device, the Node turning Ready, its labels, the pod bound, the pod Terminating, a
terminate held in flight). Each cell then checks what must hold after any fault:

* exactly one instance per launch attempt (never two alive under one name, never two bought);
* every instance terminated; no usable tailnet key and no device left; no Node object left;
* the node ended TERMINATED (evicted), the pool's status came back to no nodes and 0 ready,
  the pool's finalizer let it go, and the class ledger holds no reservation.

Faults (columns):
  worker-kill   `tgp worker` SIGKILLed, started again at once (as its Deployment would)
  temporal-kill the dev server SIGKILLed, started again on its database file; a worker or bridge
                that exits meanwhile is restarted by the supervisor, as Kubernetes would
  bridge-kill   `tgp bridge` SIGKILLed, started again at once
  kube-burst    the API server forgets its watch history and cuts every stream (410 on resume),
                then answers the next 8 requests tgp sends about the cell's objects with 409
                (writes) / 429 (Retry-After) / 500 / 502 / 503 / 504
  capacity      the cheapest offer answers 409 insufficient capacity to every create from then on
  5xx-before    the next create answers 503 without buying, and the next 3 other instance calls
                answer 503 without taking effect
  5xx-after     the next create buys, then answers 503; the next 3 other instance calls take
                effect (a delete terminates), then answer 503
  slow-create   creates take 12 s before buying (longer than the nodes' 10 s API-call timeout),
                the next 3 describes 1.5 s; at the launch stage the create in flight (already
                bought) is held 12 s more
  delete-fails  the next 8 terminate calls answer 500 and terminate nothing
  late-create   the next create's connection drops before any answer; the cloud buys 3 s later
                (the provider model, sim.provider_model: a create that completes after its
                caller gave up)
  lagging-list  from then on, a new instance is missing from lists and describes 404 for 3 s
  429-after-buy the next create buys, then answers 429 (a gateway throttling after its backend acted)
  lying-terminate the next two terminates answer success: one does nothing, one acts 3 s later

The worker's simulated provider has a consistency window of 6 s (tests/fault_matrix_proc.py),
longer than the model's lags and late creates, as a real provider's window must be.

A fault strikes at its stage and affects what comes after; where nothing it breaks comes
after (no create follows the Ready stage), the cell still runs and is marked PASS°.

Cells run in lanes: each lane is an independent stack (its own dev server on a database file,
simulated world, worker and bridge processes) running its cells one after another, once its
processes serve; the lanes run side by side (TGP_FAULT_MATRIX_LANES, default 6), each starting
at a different fault. The table is printed at the end, whether the cells passed or not.

The replacement row has one cell: with the node Ready and its pod bound, the pool's requirements
change (the node drifts); once the replacement's instance is bought the worker is SIGKILLed.
Besides the checks above: exactly one replacement was bought, it ran before the old instance
was terminated and was Ready before the old node began draining; the old node ended drifted,
the replacement is then evicted like the other cells' nodes.

The burst test launches 40 nodes at once for 40 pending pods while the worker is SIGKILLed three
times, waits for all 40 Ready, then scales the pool to zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from tests.kube_env import load_crd
from activities.http_wire import default_tls
from tests.conftest import binary
from tests.fault_matrix_proc import ENTITY_ACTIVITY
from tgp.messages import Ledger, class_workflow_id, pool_workflow_id
from sim.cloud import SimulatedCloud
from sim.provider_model import CreateOutcome, TerminateOutcome
from sim.kube import KubeEmulator
from sim.kube_machinery import NODES, PODS
from sim.world import SimWorld, sim_world
from workers.temporal import DATA_CONVERTER, dev_server_args
from tgp.types import LABEL_POOL, LABEL_POOL_NAMESPACE, NodePhase, NodeStatus, instance_name, node_workflow_id

pytestmark = pytest.mark.fault_matrix

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "deploy" / "crds"
POOLS = "/apis/tgp.io/v1/namespaces/{ns}/gpunodepools"
CLASSES = "/apis/tgp.io/v1/gpunodeclasses"
MERGE = {"Content-Type": "application/merge-patch+json"}
POOL_RESOURCE = kmock.resource("tgp.io", "v1", "gpunodepools")
CLASS_RESOURCE = kmock.resource("tgp.io", "v1", "gpunodeclasses")

STAGES = ("select", "launch", "running", "join", "ready", "label", "watch", "drain", "terminate", "replace")
STAGE_TITLES = {
    "select": "select offer",
    "launch": "create in flight",
    "running": "wait running",
    "join": "tailnet join",
    "ready": "node Ready",
    "label": "label/taint",
    "watch": "watch (pod bound)",
    "drain": "drain",
    "terminate": "terminate",
    "replace": "replacement",
}
# The replacement row (make-before-break, issue 21) has the cells of these faults only.
REPLACE_FAULTS = ("worker-kill",)
PROCESS_FAULTS = ("worker-kill", "temporal-kill", "bridge-kill")
MODEL_FAULTS = ("late-create", "lagging-list", "429-after-buy", "lying-terminate")
FAULTS = (*PROCESS_FAULTS, "kube-burst", "capacity", "5xx-before", "5xx-after", "slow-create", "delete-fails", *MODEL_FAULTS)
# The provider model's lags and late actions, in seconds (shorter than MATRIX_WINDOW).
MODEL_DELAY = 3.0

CHEAPEST = "rtx4090-us-east"  # the offer every cell's pool picks first
BOOT_DELAY = 0.2
POD_GRACE = 3  # the pod's shutdown after eviction: the "drain" cells strike meanwhile
SLOW_CREATE = 12.0  # longer than the API-call timeout tests/fault_matrix_proc.py gives the nodes
CELL_DEADLINE = float(os.environ.get("TGP_FAULT_MATRIX_DEADLINE", "300"))
# How long a lane's processes may take to start and serve (all lanes start at once; on a loaded
# 2-core machine that has taken 150 s): not part of any cell's time.
LANE_START_DEADLINE = 600.0
LANES = int(os.environ.get("TGP_FAULT_MATRIX_LANES", "6"))


# --- processes ---------------------------------------------------------------------------


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free port below the ephemeral range. A dev server restarts on the ports it had (its
    clients know them); a port from the ephemeral range (`bind(0)`) can meanwhile become the
    local end of some outgoing connection, and the server could not listen again ("address
    already in use": seen under load). The kernel never picks a port below that range."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        port = random.randrange(10_000, max(low, 10_001))
        if port in _PORTS_GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise AssertionError(f"no free port between 10000 and {low}")


class Process:
    """A child process the lane's supervisor keeps running: when it exits without being told
    to, it is started again (as a Deployment's pod is)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0
        self.crashes: list[int] = []  # exit codes of unexpected exits

    def start(self) -> None:
        with self.log.open("ab") as out:
            out.write(f"--- start {self.name} #{self.started + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            # In the test's process group: a Ctrl-C or a CI timeout that ends the test ends them too.
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.started += 1

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.proc = None

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# --- the Kubernetes API burst --------------------------------------------------------------

BURST_STATUSES = (409, 429, 500, 503, 504, 429, 502, 500)


class KubeBurst:
    """Answers the next `n` requests tgp's processes send about one cell's objects (path or
    query naming its namespace, pool, class or nodes) with errors; the request changes nothing.
    The simulated kubelet and the test itself (httpx's User-Agent) are never refused."""

    def __init__(self, emulator: KubeEmulator) -> None:
        self.left = 0
        self.served = 0
        self.scope: tuple[str, ...] = ()
        emulator[lambda request: True] << self._answer

    def arm(self, n: int, scope: tuple[str, ...]) -> None:
        self.left, self.scope = n, scope

    def disarm(self) -> None:
        self.left = 0

    async def _answer(self, request: kmock.Request) -> kmock.Response:
        agent = request.headers.get("User-Agent", "")
        url = str(request.url)
        if self.left <= 0 or agent.startswith("python-httpx") or not any(s in url for s in self.scope):
            raise NotImplementedError  # not ours: the emulator serves it
        self.left -= 1
        status = BURST_STATUSES[self.served % len(BURST_STATUSES)]
        self.served += 1
        if status == 409 and request.method.upper() not in ("PATCH", "PUT"):
            status = 429
        reason = {409: "Conflict", 429: "TooManyRequests"}.get(status, "InternalError")
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": f"injected {status}", "reason": reason, "code": status}
        headers = {"Retry-After": "1"} if status == 429 else None
        return kmock.Response(status=status, payload=body, headers=headers)


# --- a lane: one independent stack --------------------------------------------------------


@dataclass
class Cell:
    stage: str
    fault: str
    ok: bool | None = None
    hit: bool = True
    seconds: float = 0.0
    note: str = ""
    error: str = ""
    lane: int = -1

    @property
    def name(self) -> str:
        return f"{self.stage} × {self.fault}"


@dataclass
class CellNames:
    ns: str
    pool: str
    klass: str

    @property
    def prefix(self) -> str:
        """Instance names of the pool's launch attempts start with this (tgp.types.instance_name)."""
        return f"tgp-{self.pool}-"


class Lane:
    """Its own Temporal dev server (SQLite file), simulated world (Kubernetes API emulator with
    tgp's CRDs, Tailscale API, GPU cloud) and task queue, with `tgp worker` and `tgp bridge`
    (tests/fault_matrix_proc.py) under a supervisor."""

    def __init__(self, index: int, root: Path, *, watch_interval: float = 1.0) -> None:
        self.index = index
        self.dir = root / f"lane{index}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.queue = f"matrix-{index}"
        self.watch_interval = watch_interval
        self.port = free_port()
        self.server = Process(
            "temporal",
            [
                binary("temporal"), "server", "start-dev", "--db-filename", str(self.dir / "temporal.db"),
                "--ip", "127.0.0.1", "--port", str(self.port), "--ui-port", str(free_port()), "--http-port", str(free_port()),
                "--metrics-port", str(free_port()), "--headless", "--log-level", "error", *dev_server_args(),
                # A SIGKILLed server loses nothing the OS has (only a power cut would): no fsync.
                "--sqlite-pragma", "synchronous=OFF",
            ],
            dict(os.environ),
            self.dir / "temporal.log",
        )
        self.stack = AsyncExitStack()
        self.counter = itertools.count(1)
        self.klass = f"k{index}"  # the lane's GPUNodeClass: each cell's pool uses it in turn
        self.worker: Process
        self.bridge: Process
        self.world: SimWorld
        self.kube: httpx.AsyncClient
        self.client: Client
        self.burst: KubeBurst
        self._supervisor: asyncio.Task[None] | None = None
        self.waiting_for = ""
        self.timeline: list[tuple[str, float]] = []
        self.failed = False

    @property
    def cloud(self) -> SimulatedCloud:
        return self.world.cloud

    @property
    def emulator(self) -> KubeEmulator:
        assert self.world.kube is not None
        return self.world.kube

    async def __aenter__(self) -> Lane:
        """The lane's simulated world, in this process. kmock's server hooks aiohttp's resolver
        as a chain, which must be unhooked in the reverse order: lanes are entered one after
        another, left in reverse (`lanes`), and their processes started side by side (`start`)."""
        self.world = await self.stack.enter_async_context(sim_world(boot_delay=BOOT_DELAY))
        # kmock keeps every request for assertions and finds each new one's reaction by scanning
        # that whole history once per reaction (`request in view`): over a lane's thousands of
        # requests that is quadratic, and it was most of this process's CPU. Nothing here asserts
        # on past requests; a request is matched right as it arrives (no await in between), so a short window is enough.
        self.emulator._requests = deque(maxlen=8)
        for path in sorted(CRDS.glob("*.yaml")):
            self.emulator.install_crd(load_crd(path))
        self.burst = KubeBurst(self.emulator)
        self.kube = await self.stack.enter_async_context(httpx.AsyncClient(verify=default_tls(), base_url=self.world.kube_url, timeout=30))
        return self

    async def start(self) -> None:
        """Start the dev server, the worker and the bridge, and wait until they serve."""
        self.server.start()
        self.stack.callback(self.server.kill)
        self.client = await self._connect()
        # No metrics endpoint: the lanes' processes would all want the same port.
        env = {**os.environ, "TEMPORAL_ADDRESS": f"127.0.0.1:{self.port}", "TGP_TASK_QUEUE": self.queue, "TGP_METRICS_PORT": "0"}
        env.pop("TEMPORAL_API_KEY", None)
        run = [sys.executable, "-m", "tests.fault_matrix_proc"]
        self.worker = Process("worker", [*run, "worker"], {**env, **self.world.worker_env()}, self.dir / "worker.log")
        self.bridge = Process(
            "bridge", [*run, "bridge"],
            # INFO: the informers' relists and re-watches, for the report of a failed cell.
            {**env, "TGP_KUBE_URL": self.world.kube_url, "TGP_MATRIX_WATCH_INTERVAL": str(self.watch_interval), "TGP_LOG_LEVEL": "INFO"},
            self.dir / "bridge.log",
        )
        for p in (self.worker, self.bridge):
            p.start()
            self.stack.callback(p.kill)
        self._supervisor = asyncio.create_task(self._supervise())
        await self.apply(CLASSES, class_spec(self.klass, max_nodes=2))
        await self._serving()

    async def _serving(self) -> None:
        """Wait until the bridge and the worker serve the lane: the class's status says Ready
        (the bridge started its workflow, the worker ran it and wrote the status). Starting
        processes is no cell's time, and a cell's deadline does not pay for it."""

        def class_ready() -> bool:
            status = (self.stored(CLASS_RESOURCE, None, self.klass) or {}).get("status") or {}
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])

        try:
            await asyncio.wait_for(self.until(class_ready, "the lane's class to be Ready", every=0.2), LANE_START_DEADLINE)
        except TimeoutError:
            tails = "\n".join(f"{p.name}:\n{p.tail()}" for p in (self.server, self.worker, self.bridge))
            raise AssertionError(f"lane {self.index} did not serve within {LANE_START_DEADLINE:.0f}s:\n{tails}") from None

    async def __aexit__(self, *exc: object) -> None:
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        await self.stack.aclose()

    async def _connect(self) -> Client:
        deadline = time.monotonic() + 180  # a loaded machine starts a dev server slowly
        while True:
            try:
                client = await Client.connect(f"127.0.0.1:{self.port}", data_converter=DATA_CONVERTER)
                await client.count_workflows()
                return client
            except Exception:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the Temporal dev server of lane {self.index} did not start:\n{self.server.tail()}") from None
                await asyncio.sleep(0.2)

    async def _supervise(self) -> None:
        while True:
            for p in (self.server, self.worker, self.bridge):
                code = p.exited()
                if code is not None:
                    p.crashes.append(code)
                    p.proc = None
                    await asyncio.sleep(0.5)  # a crash-looping process is not restarted in a hot loop
                    if p.proc is None:  # unless a fault restarted it meanwhile
                        p.start()
            await asyncio.sleep(0.1)

    # --- faults ----------------------------------------------------------------------------

    async def restart(self, p: Process) -> None:
        p.kill()
        p.start()
        if p is self.server:
            await self._connect()  # answers again; the clients reconnect by themselves

    def crashes(self) -> dict[str, int]:
        return {p.name: len(p.crashes) for p in (self.server, self.worker, self.bridge) if p.crashes}

    def reset_world(self) -> None:
        """Take every injected fault and hold away (after a cell, whatever it did)."""
        c = self.cloud
        c.release_offer_lists()
        c.release_creates()
        c.release_deletes()
        c.release_boots()
        c.slow_creates(0)
        c.slow_describes(0)
        c.fail_creates_after_buying(0)
        c.fail_deletes(0)
        c._faults.clear()
        c.set_capacity(CHEAPEST, True)
        c.model.reset()
        c.boot_delay = BOOT_DELAY
        self.burst.disarm()

    # --- Kubernetes helpers ------------------------------------------------------------------

    async def get(self, path: str) -> dict[str, Any] | None:
        r = await self.kube.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        result: dict[str, Any] = r.json()
        return result

    async def apply(self, path: str, obj: dict[str, Any]) -> None:
        (await self.kube.post(path, json=obj)).raise_for_status()

    def stored(self, resource: kmock.resource, ns: str | None, name: str) -> dict[str, Any] | None:
        """An object as the API server stores it now, read in-process (cheaper than a GET, so
        the waits below can look often)."""
        try:
            obj = self.emulator.objects[resource, ns, name]
        except KeyError:
            return None
        return None if obj.deleted else obj.raw

    def pool(self, names: CellNames) -> dict[str, Any] | None:
        return self.stored(POOL_RESOURCE, names.ns, names.pool)

    async def until(self, check: Callable[[], Any], what: str, *, every: float = 0.05) -> Any:
        """Wait for `check` (plain or async) to hold; the cell's deadline bounds every wait."""
        self.waiting_for = what
        while True:
            try:
                result = check()
                if inspect.isawaitable(result):
                    result = await result
            except (httpx.HTTPError, RPCError):
                result = None  # an API restarting: look again
            if result:
                self.waiting_for = ""
                self.timeline.append((what, time.monotonic()))
                return result
            await asyncio.sleep(every)

    async def event(self, event: asyncio.Event, what: str) -> None:
        self.waiting_for = what
        await event.wait()
        self.waiting_for = ""
        self.timeline.append((what, time.monotonic()))


def class_spec(name: str, max_nodes: int) -> dict[str, Any]:
    return {
        "apiVersion": "tgp.io/v1",
        "kind": "GPUNodeClass",
        "metadata": {"name": name},
        "spec": {"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}, "limits": {"maxNodes": max_nodes}},
    }


def pool_spec(names: CellNames, *, idle: str = "1h", max_nodes: int | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "nodeClassRef": {"name": names.klass},
        "template": {
            "metadata": {"labels": {"team": "ml"}},
            "spec": {
                "requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}],
                "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
            },
        },
        # The node ends by eviction, not by idling out; the drain waits for the pod's shutdown.
        "disruption": {"idleTimeout": idle, "drainTimeout": "60s"},
    }
    if max_nodes is not None:
        spec["maxNodes"] = max_nodes
    return {"apiVersion": "tgp.io/v1", "kind": "GPUNodePool", "metadata": {"name": names.pool, "namespace": names.ns}, "spec": spec}


async def pending_pod(lane: Lane, ns: str, name: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "containers": [{"name": "train", "image": "pytorch", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": POD_GRACE,
        },
    }
    await lane.apply(f"/api/v1/namespaces/{ns}/pods", pod)
    status = {"status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}}
    (await lane.kube.patch(f"/api/v1/namespaces/{ns}/pods/{name}/status", json=status, headers=MERGE)).raise_for_status()


async def bind(lane: Lane, ns: str, pod: str, node: str) -> None:
    """What the scheduler and the kubelet would do: put the pod on the node and run it."""
    (await lane.kube.patch(f"/api/v1/namespaces/{ns}/pods/{pod}", json={"spec": {"nodeName": node}}, headers=MERGE)).raise_for_status()
    running = {"status": {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}]}}
    (await lane.kube.patch(f"/api/v1/namespaces/{ns}/pods/{pod}/status", json=running, headers=MERGE)).raise_for_status()


def node_of(instance_name: str) -> str:
    """The Node (and tailnet hostname) of a launch attempt's instance, `tgp-<node>-<attempt>`."""
    return instance_name[len("tgp-") :].rsplit("-", 1)[0]


def ready(node: dict[str, Any] | None) -> bool:
    conditions = ((node or {}).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


# --- one cell ------------------------------------------------------------------------------


class Strike:
    """The cell's fault, armed or done at its stage; records whether anything met it."""

    def __init__(self, lane: Lane, cell: Cell, names: CellNames) -> None:
        self.lane, self.cell, self.names = lane, cell, names
        self.nodes: list[str] = []
        self._check_hit: Callable[[], bool] = lambda: True

    async def __call__(self) -> None:
        lane, cloud, fault = self.lane, self.lane.cloud, self.cell.fault
        if fault == "worker-kill":
            await lane.restart(lane.worker)
        elif fault == "bridge-kill":
            await lane.restart(lane.bridge)
        elif fault == "temporal-kill":
            await lane.restart(lane.server)
        elif fault == "kube-burst":
            lane.emulator.compact()
            lane.emulator.cut_watches()
            lane.burst.served = 0
            lane.burst.arm(8, (f"/{self.names.ns}/", self.names.pool, f"/gpunodeclasses/{self.names.klass}", *self.nodes))
            self._check_hit = lambda: lane.burst.served > 0
        elif fault == "capacity":
            cloud.set_capacity(CHEAPEST, False)
            creates = cloud.create_requests
            self._check_hit = lambda: cloud.create_requests > creates
        elif fault in ("5xx-before", "5xx-after"):
            after = fault == "5xx-after"
            start = len(cloud._faults)
            if after:
                cloud.fail_creates_after_buying(1)
            else:
                cloud.fail("/v1/instances", 503, times=1, method="POST")
            cloud.fail("/v1/instances", 503, times=1, method="GET", after_handling=after)
            cloud.fail("/v1/instances/*", 503, times=2, after_handling=after)
            faults = [(f, f.remaining) for f in cloud._faults[start:]]
            self._check_hit = lambda: any(f.remaining < n for f, n in faults) or (after and cloud._creates_failing_after_buy == 0)
        elif fault == "slow-create":
            creates = cloud.create_requests
            cloud.slow_creates(SLOW_CREATE)
            cloud.slow_describes(1.5, count=3)
            # At the launch stage the create in flight is held longer: that is the slow create.
            self._check_hit = lambda: self.cell.stage == "launch" or cloud.create_requests > creates or cloud._slow_describes_left != 3
        elif fault == "delete-fails":
            cloud.fail_deletes(8)
            self._check_hit = lambda: cloud._deletes_failing < 8
        elif fault in MODEL_FAULTS:
            self._strike_model(fault)
        else:
            raise AssertionError(f"unknown fault {fault}")

    def _strike_model(self, fault: str) -> None:
        """The provider model's behaviours (sim.provider_model), in real time."""
        model = self.lane.cloud.model
        model.late_create_after = model.late_terminate_after = MODEL_DELAY
        if fault in ("late-create", "429-after-buy"):
            outcome = CreateOutcome.LATE if fault == "late-create" else CreateOutcome.THROTTLED_AFTER_BUY
            model.next_creates(outcome)
            met = model.creates_by_outcome[outcome]  # the lane's model counts every cell's
            self._check_hit = lambda: model.creates_by_outcome[outcome] > met
        elif fault == "lagging-list":
            model.list_lag = model.describe_lag = MODEL_DELAY
            bought = len(model.records)
            self._check_hit = lambda: len(model.records) > bought
        else:
            model.next_terminates(TerminateOutcome.LIE, TerminateOutcome.LATE)
            self._check_hit = lambda: not model.terminate_outcomes

    def hit(self) -> bool:
        return self._check_hit()


async def live_cell(lane: Lane, cell: Cell, names: CellNames, strike: Strike, notes: dict[str, Any]) -> None:
    """One node's life with the fault striking at the cell's stage."""
    cloud, stage, ns = lane.cloud, cell.stage, names.ns
    await lane.apply(POOLS.format(ns=ns), pool_spec(names))

    def offers_checked() -> bool:
        pool = lane.pool(names) or {}
        conditions = {c["type"]: c["status"] for c in (pool.get("status") or {}).get("conditions") or []}
        return conditions.get("OffersAvailable") == "True" and conditions.get("Ready") == "True"

    await lane.until(offers_checked, "the pool's first pass (offers checked, Ready)")
    if stage == "select":
        cloud.hold_offer_lists()
    elif stage == "launch":
        cloud.hold_creates()
    elif stage == "running":
        cloud.hold_boots()  # until the fault struck: however slow the node is to look, it boots
    await pending_pod(lane, ns, "job")

    if stage == "select":
        await lane.event(cloud.offers_listed, "the node to list offers")
        await strike()
        cloud.release_offer_lists()
    elif stage == "launch":
        await lane.event(cloud.create_arrived, "the create to reach the cloud")
        await strike()
        if cell.fault == "slow-create":
            await asyncio.sleep(SLOW_CREATE)  # the fault itself: the create stays in flight longer
        cloud.release_creates()

    def ours() -> list[Any]:
        return [i for i in cloud.instances.values() if i.name.startswith(names.prefix)]

    def bought() -> Any:
        live = [i for i in ours() if i.status != "terminated"]
        return live[0] if live else None

    inst = await lane.until(bought, "an instance to be bought")
    node = node_of(inst.name)
    strike.nodes.append(node)
    if stage == "running":
        describes = cloud.describe_requests

        def booting() -> bool:
            return cloud.describe_requests > describes and inst.status == "pending"

        await lane.until(booting, "the workflow to look at the booting instance", every=0.01)
        await strike()
        cloud.release_boots()

    await lane.until(lambda: lane.world.tailnet_devices(node), "the tailnet device", every=0.01)
    if stage == "join":
        await strike()
    node_path = f"/api/v1/nodes/{node}"

    await lane.until(lambda: ready(lane.stored(NODES, None, node)), "the Node to be Ready", every=0.01)
    if stage == "ready":
        await strike()

    def labelled() -> bool:
        k8s = lane.stored(NODES, None, node) or {}
        return (k8s.get("metadata") or {}).get("labels", {}).get(LABEL_POOL) == names.pool

    await lane.until(labelled, "the Node to be labelled", every=0.01)
    if stage == "label":
        await strike()
    await bind(lane, ns, "job", node)
    if stage == "watch":
        await strike()

    describes = cloud.describe_requests

    def watched() -> bool:
        return cloud.describe_requests >= describes + 2

    await lane.until(watched, "the watch stage to look at the node twice")
    if stage == "replace":
        await replacement_life(lane, names, strike, notes, node)
        return
    if stage == "terminate":
        cloud.hold_deletes()
    annotate = {"metadata": {"annotations": {"tgp.io/evict": "fault matrix"}}}
    (await lane.kube.patch(node_path, json=annotate, headers=MERGE)).raise_for_status()

    def pod_terminating() -> bool:
        pod = lane.stored(PODS, ns, "job")
        return pod is None or bool(pod["metadata"].get("deletionTimestamp"))

    await lane.until(pod_terminating, "the drain to evict the pod", every=0.01)
    if stage == "drain":
        await strike()
    if stage == "terminate":
        await lane.event(cloud.delete_arrived, "the terminate to reach the cloud")
        await strike()
        cloud.release_deletes()

    handle = lane.client.get_workflow_handle(node_workflow_id(ns, names.pool, node), result_type=NodeStatus)

    async def result() -> NodeStatus:
        return await handle.result()  # a long poll; a restarting server fails it, so ask again

    final: NodeStatus = await lane.until(result, "the node workflow to end", every=0.2)
    notes["attempts"] = len(final.attempts)
    assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("evicted"), (
        f"the node ended {final.phase.value}: {final.end_reason}; last error: {final.last_error}"
    )
    for attempt in final.attempts:  # each attempt bought at most one instance, the one it recorded
        named = sorted(i.id for i in ours() if i.name == instance_name(node, attempt.attempt))
        assert len(named) <= 1 and (attempt.instance_id is None or named == [attempt.instance_id]), (
            f"attempt {attempt.attempt} ({attempt.outcome}) recorded {attempt.instance_id}; the cloud has {named} under its name"
        )

    def pool_empty() -> bool:
        pool = lane.pool(names) or {}
        status = pool.get("status") or {}
        return not status.get("nodes") and status.get("readyNodes", 0) == 0 and status.get("desiredNodes", 0) == 0

    await lane.until(pool_empty, "the pool's status to show no nodes", every=0.2)
    await lane.kube.delete(f"{POOLS.format(ns=ns)}/{names.pool}")

    def pool_gone() -> bool:
        return lane.pool(names) is None

    await lane.until(pool_gone, "the pool's finalizer to let it go", every=0.2)


async def replacement_life(lane: Lane, names: CellNames, strike: Strike, notes: dict[str, Any], node: str) -> None:
    """The pool's requirements change under the Ready node (drift); the worker is killed while
    its replacement launches. Exactly one replacement; Ready before the old node drains; the old
    node ends drifted; then the replacement is evicted and the pool deleted as in every cell."""
    cloud, ns = lane.cloud, names.ns
    # A type list the node's type is no longer in: it drifts (drift is by compatibility since
    # issue 35 item 7: a list widened to RTX4090 and L40S would leave the RTX4090 node alone).
    drift = {"spec": {"template": {"spec": {"requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["L40S"]}]}}}}
    (await lane.kube.patch(f"{POOLS.format(ns=ns)}/{names.pool}", json=drift, headers=MERGE)).raise_for_status()

    def replacement() -> str | None:
        names_bought = {node_of(i.name) for i in cloud.instances.values() if i.name.startswith(names.prefix)}
        return next(iter(sorted(names_bought - {node})), None)

    new = await lane.until(replacement, "the replacement to be bought", every=0.01)
    strike.nodes.append(new)
    await strike()

    async def result_of(name: str) -> NodeStatus:
        handle = lane.client.get_workflow_handle(node_workflow_id(ns, names.pool, name), result_type=NodeStatus)
        return await handle.result()

    old_final: NodeStatus = await lane.until(lambda: result_of(node), "the drifted node to end", every=0.2)
    assert old_final.phase is NodePhase.TERMINATED and (old_final.end_reason or "").startswith("drifted"), (
        f"the old node ended {old_final.phase.value}: {old_final.end_reason}; last error: {old_final.last_error}"
    )
    bought = sorted({node_of(i.name) for i in cloud.instances.values() if i.name.startswith(names.prefix)})
    assert bought == sorted({node, new}), f"not exactly one replacement for {node}: {bought}"
    new_handle = lane.client.get_workflow_handle(node_workflow_id(ns, names.pool, new), result_type=NodeStatus)
    new_status: NodeStatus = await new_handle.query("status", result_type=NodeStatus)
    assert new_status.phase is NodePhase.READY, f"the replacement is {new_status.phase.value}"
    new_ready = next(r.at for r in new_status.stages if r.stage.value == NodePhase.READY.value)
    old_draining = next(r.at for r in old_final.stages if r.stage.value == NodePhase.DRAINING.value)
    assert new_ready <= old_draining, f"{node} began draining at {old_draining}, before {new} was Ready at {new_ready}"
    log = cloud.log
    running_new = next(i for i, e in enumerate(log) if e[0] == "running" and node_of(e[1]) == new)
    deleted_old = next(i for i, e in enumerate(log) if e[0] == "deleted" and node_of(e[1]) == node)
    assert running_new < deleted_old, f"{node}'s instance was terminated before {new}'s ran"
    notes["attempts"] = len(old_final.attempts)

    annotate = {"metadata": {"annotations": {"tgp.io/evict": "fault matrix"}}}
    (await lane.kube.patch(f"/api/v1/nodes/{new}", json=annotate, headers=MERGE)).raise_for_status()
    final: NodeStatus = await lane.until(lambda: result_of(new), "the replacement to end", every=0.2)
    assert final.phase is NodePhase.TERMINATED and (final.end_reason or "").startswith("evicted"), final.end_reason

    def pool_empty() -> bool:
        status = (lane.pool(names) or {}).get("status") or {}
        return not status.get("nodes") and status.get("readyNodes", 0) == 0 and status.get("desiredNodes", 0) == 0

    await lane.until(pool_empty, "the pool's status to show no nodes", every=0.2)
    await lane.kube.delete(f"{POOLS.format(ns=ns)}/{names.pool}")
    await lane.until(lambda: lane.pool(names) is None, "the pool's finalizer to let it go", every=0.2)


async def assert_clean(lane: Lane, names: CellNames) -> list[str]:
    """What must hold after any fault; returns what does not."""
    world, problems = lane.world, []
    ours = [i for i in world.cloud.instances.values() if i.name.startswith(names.prefix)]
    bought = Counter(i.name for i in ours)
    if twins := {n: c for n, c in bought.items() if c > 1}:
        problems.append(f"bought more than one instance for one launch attempt: {twins}")
    if together := {n: m for n, m in world.cloud.max_live_per_name.items() if n.startswith(names.prefix) and m > 1}:
        problems.append(f"instances alive together under one name: {together}")
    if live := [f"{i.id} ({i.name}, {i.status})" for i in ours if i.status != "terminated"]:
        problems.append(f"instances not terminated: {live}")
    now = datetime.now(timezone.utc)
    if keys := [k.id for k in world.tailscale.keys.values() if k.description.startswith(f"tgp {names.pool}-") and not k.invalid(now)]:
        problems.append(f"usable tailnet keys left: {keys}")
    nodes = sorted({node_of(i.name) for i in ours})
    if devices := [d for n in nodes for d in world.tailnet_devices(n)]:
        problems.append(f"tailnet devices left: {devices}")
    listed = await lane.get(f"/api/v1/nodes?labelSelector={LABEL_POOL}={names.pool},{LABEL_POOL_NAMESPACE}={names.ns}") or {}
    left = [n["metadata"]["name"] for n in listed.get("items") or []] + [n for n in nodes if await lane.get(f"/api/v1/nodes/{n}")]
    if left:
        problems.append(f"Node objects left: {sorted(set(left))}")
    if await lane.get(f"{POOLS.format(ns=names.ns)}/{names.pool}") is not None:
        problems.append("the pool was not deleted (its finalizer stayed)")
    try:
        ledger = await lane.client.get_workflow_handle(class_workflow_id(names.klass)).query("budget", result_type=Ledger)
        if held := sorted(k for k, r in ledger.reservations.items() if r.pool == f"{names.ns}/{names.pool}"):
            problems.append(f"the class ledger still holds {held}")
    except RPCError as exc:
        problems.append(f"the class ledger could not be read: {exc}")
    listed_running = [w.id async for w in lane.client.list_workflows(f"WorkflowType = 'GPUNodeWorkflow' AND TgpPool = '{names.ns}/{names.pool}' AND ExecutionStatus = 'Running'")]
    # Visibility lags behind the workflows (more so on a loaded machine): each one it lists is
    # asked directly.
    running = [wid for wid in listed_running if (await lane.client.get_workflow_handle(wid).describe()).status is WorkflowExecutionStatus.RUNNING]
    if running:
        problems.append(f"node workflows still running: {running}")
    problems += await slow_pool_activities(lane, names)
    return problems


async def slow_pool_activities(lane: Lane, names: CellNames) -> list[str]:
    """The matrix's processes shorten every pool activity's timeout (tests/fault_matrix_proc.py):
    one that escapes it (a wrapper with a default of its own) still passes, but every worker
    kill that meets it costs a minute where the matrix budgets seconds. Say which."""
    slow: set[str] = set()
    with contextlib.suppress(RPCError):
        async for event in lane.client.get_workflow_handle(pool_workflow_id(names.ns, names.pool)).fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                scheduled = event.activity_task_scheduled_event_attributes
                timeout = scheduled.start_to_close_timeout.ToTimedelta()
                if timeout > ENTITY_ACTIVITY:
                    slow.add(f"{scheduled.activity_type.name} ({timeout.total_seconds():.0f}s)")
    if slow:
        return [f"pool activities with a longer timeout than the matrix's {ENTITY_ACTIVITY.total_seconds():.0f}s: {sorted(slow)}"]
    return []


async def run_cell(lane: Lane, cell: Cell) -> Cell:
    n = next(lane.counter)
    names = CellNames(ns=f"fm{lane.index}-{n}", pool=f"p{lane.index}x{n}", klass=lane.klass)
    strike = Strike(lane, cell, names)
    notes: dict[str, Any] = {}
    crashes_before = lane.crashes()
    creates_before = lane.cloud.create_requests
    started = time.monotonic()
    lane.timeline = []
    cell.lane = lane.index
    try:
        await asyncio.wait_for(live_cell(lane, cell, names, strike, notes), CELL_DEADLINE)
        problems = await asyncio.wait_for(assert_clean(lane, names), 60)
        cell.ok = not problems
        cell.error = "; ".join(problems)
    except TimeoutError:
        cell.ok = False
        cell.error = f"deadline of {CELL_DEADLINE:.0f}s passed while waiting for {lane.waiting_for or '?'}"
    except Exception as exc:  # noqa: BLE001 - a failed cell is reported, the lane goes on
        cell.ok = False
        cell.error = f"{type(exc).__name__}: {exc}"[:400]
    cell.seconds = time.monotonic() - started
    cell.hit = strike.hit()
    crashes = {k: v - crashes_before.get(k, 0) for k, v in lane.crashes().items() if v - crashes_before.get(k, 0)}
    bits = []
    if notes.get("attempts", 1) != 1:
        bits.append(f"{notes['attempts']} launch attempts, {lane.cloud.create_requests - creates_before} create(s) reached the cloud")
    if crashes:
        bits.append("restarted after exiting: " + ", ".join(f"{k}×{v}" for k, v in crashes.items()))
    if os.environ.get("TGP_FAULT_MATRIX_TIMELINE"):  # when each wait of the cell ended
        bits.append("[" + ", ".join(f"{what} +{at - started:.1f}" for what, at in lane.timeline) + "]")
    cell.note = ", ".join(bits)
    if not cell.ok:
        lane.failed = True
        cell.error += await diagnose(lane, names)
    lane.reset_world()
    await cleanup(lane, names)
    return cell


async def diagnose(lane: Lane, names: CellNames) -> str:
    """What the node and pool workflows and the pool object said, for a failed cell's report."""
    lines = []
    pool = lane.pool(names)
    if pool is not None:
        meta = pool.get("metadata") or {}
        lines.append(f"pool object: deletionTimestamp={meta.get('deletionTimestamp')} finalizers={meta.get('finalizers')} status={pool.get('status')}"[:600])
    with contextlib.suppress(Exception):
        handle = lane.client.get_workflow_handle(pool_workflow_id(names.ns, names.pool))
        desc = await asyncio.wait_for(handle.describe(), 5)
        pending = [f"{a.activity_type.name} attempt {a.attempt} {a.last_failure.message[:150] if a.HasField('last_failure') else ''}" for a in desc.raw_description.pending_activities]
        lines.append(f"pool workflow: {desc.status.name if desc.status else '?'}, pending activities {pending}")
    with contextlib.suppress(Exception):
        async for w in lane.client.list_workflows(f"WorkflowType = 'GPUNodeWorkflow' AND TgpPool = '{names.ns}/{names.pool}'"):
            try:
                status: NodeStatus = await asyncio.wait_for(lane.client.get_workflow_handle(w.id).query("status", result_type=NodeStatus), 5)
                lines.append(f"{w.id}: {w.status.name if w.status else '?'} phase={status.phase.value} last_error={status.last_error}")
            except Exception:  # noqa: BLE001
                lines.append(f"{w.id}: {w.status.name if w.status else '?'}")
    lines.append(f"logs: {lane.dir}")
    return "\n      " + "\n      ".join(lines)


async def cleanup(lane: Lane, names: CellNames) -> None:
    """After a failed cell, let the next one start from a quiet lane: its pod and pool go."""
    with contextlib.suppress(Exception):
        await lane.kube.request("DELETE", f"/api/v1/namespaces/{names.ns}/pods/job", json={"gracePeriodSeconds": 0})
        await lane.kube.delete(f"{POOLS.format(ns=names.ns)}/{names.pool}")


# --- the matrix ----------------------------------------------------------------------------

# Seconds a cell of each fault took (6 lanes on a loaded 2-core machine), to spread the slow
# ones over the lanes, longest first: a SIGKILLed worker's activities wait for their timeouts,
# and a restarted process takes a while to start on a busy machine.
COST = {
    "worker-kill": 38, "temporal-kill": 16, "bridge-kill": 27, "kube-burst": 17, "5xx-before": 16, "5xx-after": 15, "slow-create": 21,
    "delete-fails": 22, "capacity": 14, "late-create": 20, "lagging-list": 20, "429-after-buy": 18, "lying-terminate": 18,
}


def plan(cells: list[Cell], lanes: int) -> list[list[Cell]]:
    """Cells to lanes, longest first to the least loaded lane. Each lane's queue then starts at
    a different point, so the lanes do not all begin with the same fault: six workers restarted
    at once (each loading its workflow sandboxes) starve a 2-core machine."""
    queues: list[list[Cell]] = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    for cell in sorted(cells, key=lambda c: -COST[c.fault]):
        i = load.index(min(load))
        queues[i].append(cell)
        load[i] += COST[cell.fault]
    for i, queue in enumerate(queues):
        turn = i * len(queue) // lanes
        queues[i] = queue[turn:] + queue[:turn]
    return queues


def table(cells: list[Cell], seconds: float, serving: float | None = None) -> str:
    """The outcome of each cell (stage rows × fault columns), then the seconds each took, then
    what was out of the ordinary: a second launch attempt, a process restarted after exiting,
    and why a cell failed."""
    by = {(c.stage, c.fault): c for c in cells}
    width = max(len(f) for f in FAULTS) + 1
    head = f"{'stage':<18}" + "".join(f"{f:<{width}}" for f in FAULTS)
    failures: list[Cell] = []

    def grid(mark: Callable[[Cell], str]) -> list[str]:
        return [f"{STAGE_TITLES[s]:<18}" + "".join(f"{(mark(by[s, f]) if (s, f) in by else '-'):<{width}}" for f in FAULTS) for s in STAGES]

    def outcome(c: Cell) -> str:
        if c.ok is None:  # the run was cut short (a timeout, Ctrl-C) before it ended
            return "not run"
        if c.ok:
            return "PASS" if c.hit else "PASS°"
        failures.append(c)
        return f"FAIL[{len(failures)}]"

    out = [
        "",
        f"Fault matrix: {len(cells)} cells (lifecycle stage × fault), {sum(1 for c in cells if c.ok)} passed, in {seconds:.0f}s"
        + (f" ({serving:.0f}s of it until the lanes' processes served)" if serving is not None else ""),
        "  PASS: the node lived its life through the fault, and after it: one instance per launch attempt, every",
        "  instance terminated, no usable tailnet key or device, no Node object, the pool's status back to no nodes",
        "  and the pool deleted, the class ledger empty.  PASS°: the same; nothing after the fault needed what it breaks.",
        "",
        head,
        *grid(outcome),
        "",
        "Seconds per cell (several lanes side by side on one machine):",
        head,
        *grid(lambda c: f"{c.seconds:.0f}" if c.ok is not None else "-"),
        "",
    ]
    out += [f"  {c.name}: {c.note}" for c in sorted(cells, key=lambda c: (STAGES.index(c.stage), FAULTS.index(c.fault))) if c.ok and c.note]
    out += [f"[{i}] {c.name} (lane {c.lane}{', ' + c.note if c.note else ''}): {c.error}" for i, c in enumerate(failures, 1)]
    return "\n".join(out)


_CAPTURE: list[pytest.CaptureFixture[str]] = []


def report(text: str) -> None:
    """Past pytest's capture, so the table shows in CI output whether the test passes or not."""
    if _CAPTURE:
        with _CAPTURE[0].disabled():
            print(text, flush=True)
    else:
        print(text, file=sys.__stdout__, flush=True)


@pytest.fixture(autouse=True)
def _uncaptured(capsys: pytest.CaptureFixture[str]) -> Any:
    _CAPTURE[:] = [capsys]
    yield
    _CAPTURE.clear()


@contextlib.asynccontextmanager
async def lanes(count: int, **options: Any) -> AsyncIterator[list[Lane]]:
    """`count` lanes; their processes' logs are kept (and named) when something failed, or
    always with TGP_FAULT_MATRIX_KEEP_LOGS=1."""
    tmp = Path(tempfile.mkdtemp(prefix="tgp-matrix-"))
    failed = False
    try:
        async with AsyncExitStack() as stack:
            started = [await stack.enter_async_context(Lane(i, tmp, **options)) for i in range(count)]  # see Lane.__aenter__
            try:
                async with asyncio.TaskGroup() as group:
                    for lane in started:
                        group.create_task(lane.start())
            except BaseExceptionGroup as group_error:
                failed = True
                raise group_error.exceptions[0] from None  # the first lane that did not start says why
            try:
                yield started
            except BaseException:
                failed = True
                for lane in started:
                    report(f"--- lane {lane.index} logs\n" + "\n".join(f"{p.name}:\n{p.tail()}" for p in (lane.server, lane.worker, lane.bridge)))
                raise
            failed = failed or any(lane.failed for lane in started)
    finally:
        if failed or os.environ.get("TGP_FAULT_MATRIX_KEEP_LOGS"):
            report(f"The lanes' logs are in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def selected_cells() -> list[Cell]:
    """Every cell (stage × fault), or the ones named in TGP_FAULT_MATRIX_CELLS ("stage:fault,stage:fault", "stage:*")."""
    wanted = [w.split(":") for w in os.environ.get("TGP_FAULT_MATRIX_CELLS", "").split(",") if w]
    cells = [Cell(s, f) for s in STAGES for f in FAULTS if s != "replace" or f in REPLACE_FAULTS]
    if not wanted:
        return cells
    return [c for c in cells if any(s in (c.stage, "*") and f in (c.fault, "*") for s, f in wanted)]


@pytest.mark.timeout(1500)
async def test_every_stage_survives_every_fault() -> None:
    cells = selected_cells()
    started = time.monotonic()
    queues = plan(cells, min(LANES, len(cells)))
    serving: float | None = None
    try:
        async with lanes(len(queues)) as stacks:
            serving = time.monotonic() - started

            async def run_lane(lane: Lane, queue: list[Cell]) -> None:
                for cell in queue:
                    await run_cell(lane, cell)

            await asyncio.gather(*(run_lane(lane, queue) for lane, queue in zip(stacks, queues, strict=True)))
    finally:  # the table, whatever happened (a cut-short run shows what it got to)
        report(table(cells, time.monotonic() - started, serving))
    failed = [c.name for c in cells if not c.ok]
    assert not failed, f"{len(failed)} cell(s) failed: {', '.join(failed)} (the table above says why)"


# --- the burst -----------------------------------------------------------------------------


async def within(lane: Lane, names: CellNames, wait: Awaitable[Any], seconds: float) -> Any:
    """`wait`, or a failure that says where the burst stood."""
    try:
        return await asyncio.wait_for(wait, seconds)
    except TimeoutError:
        raise AssertionError(f"timed out after {seconds:.0f}s waiting for {lane.waiting_for}: {await burst_state(lane, names)}") from None


async def burst_state(lane: Lane, names: CellNames) -> str:
    ours = [i for i in lane.cloud.instances.values() if i.name.startswith(names.prefix)]
    status = (lane.pool(names) or {}).get("status") or {}
    phases: Counter[str] = Counter()
    with contextlib.suppress(Exception):
        async for w in lane.client.list_workflows("WorkflowType = 'GPUNodeWorkflow'"):
            phase = (w.search_attributes or {}).get("TgpPhase") or ["?"]
            phases[f"{w.status.name if w.status else '?'}/{phase[0]}"] += 1
    conditions = {c["type"]: f"{c['status']} {c.get('message', '')}"[:120] for c in status.get("conditions") or []}
    return (
        f"instances bought {len(ours)}, live {sum(i.status != 'terminated' for i in ours)}; pool readyNodes {status.get('readyNodes')}, "
        f"desiredNodes {status.get('desiredNodes')}, conditions {conditions}; node workflows {dict(phases)}; "
        f"worker started {lane.worker.started} times, crashes {lane.crashes()}"
    )


BURST = 40


@pytest.mark.timeout(900)
async def test_forty_launches_at_once_with_the_worker_killed_three_times() -> None:
    seed = int(os.environ.get("TGP_FAULT_MATRIX_SEED") or random.randrange(10_000))  # printed: rerun with it
    kills_at = sorted(random.Random(seed).sample(range(4, BURST - 4), 3))  # creates reached before each SIGKILL
    report(f"\nBurst: {BURST} pods, the worker SIGKILLed once {kills_at} creates have reached the cloud (TGP_FAULT_MATRIX_SEED={seed})")
    started = time.monotonic()
    async with lanes(1, watch_interval=10.0) as [lane]:
        names = CellNames(ns="burst", pool="burst", klass="burst")
        await lane.apply(CLASSES, class_spec(names.klass, max_nodes=BURST + 10))
        await lane.apply(POOLS.format(ns=names.ns), pool_spec(names, max_nodes=BURST + 10))
        for i in range(BURST):
            await pending_pod(lane, names.ns, f"job-{i}")

        for threshold in kills_at:
            await lane.until(lambda: lane.cloud.create_requests >= threshold, f"{threshold} creates", every=0.02)
            await lane.restart(lane.worker)

        def all_ready() -> bool:
            pool = lane.pool(names) or {}
            return (pool.get("status") or {}).get("readyNodes") == BURST

        await within(lane, names, lane.until(all_ready, "40 Ready nodes", every=0.5), 600)
        ready_after = time.monotonic() - started
        bought = [i for i in lane.cloud.instances.values() if i.name.startswith(names.prefix)]
        assert len(bought) == BURST, f"{len(bought)} instances bought for {BURST} nodes"

        # Scale to zero: the pods are done, and the pool now idles its nodes out after 2 s.
        for i in range(BURST):
            await lane.kube.request("DELETE", f"/api/v1/namespaces/{names.ns}/pods/job-{i}", json={"gracePeriodSeconds": 0})
        idle = {"spec": {"disruption": {"idleTimeout": "2s", "drainTimeout": "60s"}}}
        (await lane.kube.patch(f"{POOLS.format(ns=names.ns)}/{names.pool}", json=idle, headers=MERGE)).raise_for_status()

        def zero() -> bool:
            pool = lane.pool(names) or {}
            status = pool.get("status") or {}
            return not status.get("nodes") and status.get("readyNodes", 0) == 0 and not [i for i in bought if i.status != "terminated"]

        await within(lane, names, lane.until(zero, "the pool to scale to zero", every=0.5), 600)
        await lane.kube.delete(f"{POOLS.format(ns=names.ns)}/{names.pool}")

        def gone() -> bool:
            return lane.pool(names) is None

        await within(lane, names, lane.until(gone, "the pool to be deleted", every=0.5), 120)
        problems = await assert_clean(lane, names)
        runs = [w async for w in lane.client.list_workflows("WorkflowType = 'GPUNodeWorkflow'")]
        nodes = {w.id for w in runs}  # one id per node; a long life continues as new under it
        bought = [i for i in lane.cloud.instances.values() if i.name.startswith(names.prefix)]
        report(
            f"Burst: {BURST} pending pods -> {len(bought)} instances, all Ready after {ready_after:.0f}s; "
            f"scaled to zero and deleted after {time.monotonic() - started:.0f}s; "
            f"{len(bought)} instances and {len(nodes)} node workflows in all; worker started {lane.worker.started} times; "
            f"{'clean' if not problems else 'PROBLEMS: ' + '; '.join(problems)}"
        )
        assert not problems
        assert len(nodes) == len(bought) == BURST, f"{len(nodes)} node workflows and {len(bought)} instances for {BURST} pods"
