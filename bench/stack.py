"""The stack `make bench` measures: a Temporal dev server, `tgp worker` and `tgp bridge` as
processes of their own (bench/proc.py), and the simulated world in this process (the Kubernetes
emulator with tgp's CRDs, the simulated scheduler and kubelets, Tailscale, the simulated cloud).

Each process's CPU time and RSS are read from /proc; the emulator counts every request by who
sent it (tgp's processes use the official Kubernetes client, the simulated kubelets, scheduler
and this harness use httpx) and by verb; the simulated cloud records when each instance's first
terminate call arrived.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import time
from collections import Counter, deque
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import attrs
import httpx
import kmock
import yaml
from aiohttp import web
from temporalio.client import Client

from sim.cloud import SimulatedCloud, boot_env
from sim.demo import temporal_binary
from sim.kube import KubeEmulator
from sim.kube_kubelet import register_node
from sim.scheduler import SimScheduler
from sim.world import SimWorld, sim_world
from workers.temporal import DATA_CONVERTER, dev_server_args

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "deploy" / "crds"
CLASSES = "/apis/tgp.io/v1/gpunodeclasses"
POOLS = "/apis/tgp.io/v1/namespaces/{ns}/gpunodepools"
NS = "ml"
TASK_QUEUE = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# How long a process may take to start serving on a loaded machine.
START_TIMEOUT = 120.0
# The simulated kubelets' heartbeats, longer than a real kubelet's (a Lease every 10 s, a pod
# resync every 10 s: three requests per node every 10 s). Nothing in the stack reads a Lease (the
# emulator has no node lifecycle controller, tgp reads none), a kubelet's watch still starts a
# bound pod at once, and at the defaults 500 kubelets kept the one process that serves the API
# (and the scheduler, the cloud, the tailnet) saturated: a bind took 8-12 s in a burst of 500.
BENCH_KUBELET_INTERVALS = {"lease_renew_interval": 60.0, "status_interval": 300.0, "pod_sync_interval": 120.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Usage:
    """CPU seconds (user + system, waited-for children included) and RSS of one process."""

    cpu_s: float
    rss_mb: float
    peak_rss_mb: float


def usage(pid: int | None) -> Usage:
    """From /proc; this process when `pid` is None."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        status = Path("/proc/self/status").read_text()
        cpu = r.ru_utime + r.ru_stime
    else:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = sum(int(f) for f in fields[11:15]) / CLK_TCK  # utime stime cutime cstime
        status = Path(f"/proc/{pid}/status").read_text()
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines() if line.startswith(("VmRSS", "VmHWM"))}
    return Usage(cpu_s=cpu, rss_mb=kb.get("VmRSS", 0) / 1024, peak_rss_mb=kb.get("VmHWM", 0) / 1024)


def agent(request: kmock.Request) -> str:
    ua = request.headers.get("User-Agent", "")
    return "tgp" if ua.startswith("OpenAPI-Generator") or "kubernetes" in ua.lower() else "sim"


def verb(request: kmock.Request) -> str:
    method = request.method.upper() if isinstance(request.method, str) else str(request.method).upper()
    method = method.rsplit(".", 1)[-1]
    if method == "GET":
        if str(request.params.get("watch", "")).lower() in ("1", "true"):
            return "watch"
        return "get" if request.name else "list"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())


@attrs.define(kw_only=True)
class CountingEmulator(KubeEmulator):
    """The emulator, counting requests by (agent, verb, resource[/subresource])."""

    counts: Counter[tuple[str, str, str]] = attrs.field(factory=Counter)
    user_agents: Counter[str] = attrs.field(factory=Counter)

    async def _handle(self, request: kmock.Request) -> Any:  # type: ignore[override]
        try:
            what = (request.resource.plural if request.resource is not None else "-") + (f"/{request.subresource}" if request.subresource else "")
            self.counts[(agent(request), verb(request), what)] += 1
            self.user_agents[request.headers.get("User-Agent", "")] += 1
        except Exception:  # noqa: BLE001 - counting never breaks a request
            self.counts[("?", "?", "?")] += 1
        return await super()._handle(request)


class TimedCloud(SimulatedCloud):
    """The simulated cloud, noting when the first terminate call for each machine arrived
    (by its hostname, the Kubernetes Node's name)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.first_delete: dict[str, float] = {}
        # Every request by (method, route, whole listing or by name): what a launch costs the provider.
        self.requests: Counter[str] = Counter()

    @web.middleware
    async def _auth(self, request, handler):  # type: ignore[no-untyped-def,override]
        route = request.match_info.route.resource
        what = route.canonical if route is not None else request.path
        if request.method == "GET" and what == "/v1/instances":
            what += "?name" if "name" in request.query else " (whole listing)"
        self.requests[f"{request.method} {what}"] += 1
        return await super()._auth(request, handler)

    async def _delete(self, request):  # type: ignore[no-untyped-def,override]
        inst = self.instances.get(request.match_info["id"])
        if inst is not None:
            host = boot_env(inst.user_data).get("TS_HOSTNAME", inst.name)
            self.first_delete.setdefault(host, time.time())
        return await super()._delete(request)


def dev_server(port: int, log: Path) -> Proc:
    """The Temporal dev server `make bench` measures (in memory, tgp's search attributes), on
    `port`, not yet started."""
    return Proc(
        "temporal",
        [
            temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(free_port()),
            "--http-port", str(free_port()), "--metrics-port", str(free_port()), "--headless", "--log-level", "error", *dev_server_args(),
        ],
        dict(os.environ), log,
    )  # fmt: skip


async def connect(server: Proc, port: int) -> Client:
    """A client of the started dev server `server` on `port`, once it answers (START_TIMEOUT)."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        try:
            client = await Client.connect(f"127.0.0.1:{port}", data_converter=DATA_CONVERTER)
            await client.count_workflows()
            return client
        except Exception:
            if time.monotonic() > deadline or not server.alive():
                raise RuntimeError(f"the Temporal dev server did not start:\n{server.tail()}") from None
            await asyncio.sleep(0.2)


class Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Stack:
    """One fresh stack; `async with Stack(...)`."""

    boot_delay: float
    logs: Path
    kubelets: bool = True  # False: a machine registers its Node once and runs no kubelet loop
    scheduler: bool = True
    world: SimWorld = field(init=False)
    emulator: CountingEmulator = field(init=False)
    cloud: TimedCloud = field(init=False)
    client: Client = field(init=False)
    kube: httpx.AsyncClient = field(init=False)
    server: Proc = field(init=False)
    worker: Proc = field(init=False)
    bridge: Proc = field(init=False)
    _stack: AsyncExitStack = field(default_factory=AsyncExitStack)

    async def __aenter__(self) -> Stack:
        self.logs.mkdir(parents=True, exist_ok=True)
        s = self._stack
        self.emulator = await s.enter_async_context(CountingEmulator())
        # kmock scans its request log for each new request; nothing here reads past requests
        # (the fault matrix does the same, tests/test_fault_matrix.py).
        self.emulator._requests = deque(maxlen=8)
        for path in sorted(CRDS.glob("*.yaml")):
            self.emulator.install_crd(yaml.safe_load(path.read_text()))
        self._patch_cloud()
        self.world = await s.enter_async_context(sim_world(boot_delay=self.boot_delay, kube_url=self.emulator.url, kubelet_intervals=BENCH_KUBELET_INTERVALS))
        self.world.kube = self.emulator
        self.cloud = self.world.cloud  # type: ignore[assignment]
        if not self.kubelets:
            url = self.emulator.url

            async def register(name: str, labels: dict[str, str], gpus: int, taints: list[dict[str, str]]) -> None:
                await register_node(url, name, labels=labels, taints=taints, gpus=gpus)

            self.cloud._node_register = register
        if self.scheduler:
            # kube-scheduler's queue as v1.34 has it (sim.scheduler; its backoff does not delay a
            # pod when a Node fits it and nothing else waits), on watches like its informers: a
            # pass follows a change within `interval`. A pending pod is marked Unschedulable once,
            # not again on every attempt as its message's node count changes (tgp reads the
            # reason only).
            await s.enter_async_context(SimScheduler(self.emulator.url, interval=0.05, refresh_unschedulable=False))
        self.kube = await s.enter_async_context(httpx.AsyncClient(base_url=self.emulator.url, timeout=30))
        port = free_port()
        self.server = dev_server(port, self.logs / "temporal.log")
        self.server.start()
        s.callback(self.server.stop)
        self.client = await connect(self.server, port)
        env = {**os.environ, "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "TGP_TASK_QUEUE": TASK_QUEUE, "TGP_LOG_LEVEL": "WARNING"}
        env.pop("TEMPORAL_API_KEY", None)
        # As installed (pip compiles bytecode at install, the image then reads it): with
        # PYTHONDONTWRITEBYTECODE and no .pyc beside the sources, Temporal's workflow sandbox
        # compiled the workflow modules from source for every new workflow run (20-30% of the
        # worker's CPU in a burst, a cost of this checkout, not of tgp). Bytecode goes to a cache
        # under the bench's logs, not beside the sources.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(ROOT / "bench" / "results" / "logs" / "pycache")
        run = [sys.executable, "-m", "bench.proc"]
        self.worker_profile = self.logs / "worker-profile.json"
        self.worker_profile.unlink(missing_ok=True)
        worker_env = {**env, **self.world.worker_env(), "TGP_METRICS_PORT": str(free_port()), "BENCH_PROFILE": str(self.worker_profile)}
        self.worker = Proc("worker", [*run, "worker"], worker_env, self.logs / "worker.log")
        self.bridge = Proc("bridge", [*run, "bridge"], {**env, "TGP_KUBE_URL": self.emulator.url, "TGP_METRICS_PORT": str(free_port())}, self.logs / "bridge.log")
        for p in (self.worker, self.bridge):
            p.start()
            s.callback(p.stop)
        return self

    def _patch_cloud(self) -> None:
        import sim.world

        sim.world.SimulatedCloud = TimedCloud  # type: ignore[misc]

    async def __aexit__(self, *exc: object) -> None:
        import sim.world

        sim.world.SimulatedCloud = SimulatedCloud  # type: ignore[misc]
        await self._stack.aclose()

    def pids(self) -> dict[str, int | None]:
        return {"worker": self.worker.pid, "bridge": self.bridge.pid, "temporal": self.server.pid, "sim (this process)": None}

    def usage(self) -> dict[str, Usage]:
        return {name: usage(pid) for name, pid in self.pids().items()}

    def check_alive(self) -> None:
        for p in (self.server, self.worker, self.bridge):
            if not p.alive():
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")

    async def profile_worker(self, seconds: float) -> dict[str, Any] | None:
        """The worker's busiest functions over `seconds` (bench/proc.py samples its stacks)."""
        import signal

        os.kill(self.worker.pid, signal.SIGUSR1)
        await asyncio.sleep(seconds)
        os.kill(self.worker.pid, signal.SIGUSR2)
        for _ in range(50):
            await asyncio.sleep(0.1)
            if self.worker_profile.exists():
                try:
                    return json.loads(self.worker_profile.read_text())  # type: ignore[no-any-return]
                except json.JSONDecodeError:
                    continue
        return None

    async def apply(self, obj: dict[str, Any]) -> None:
        path = CLASSES if obj["kind"] == "GPUNodeClass" else POOLS.format(ns=obj["metadata"]["namespace"])
        r = await self.kube.post(path, json=obj)
        if r.status_code not in (200, 201):
            raise RuntimeError(f"could not apply {obj['kind']}: {r.status_code} {r.text[:300]}")

    async def until(self, check: Any, what: str, timeout: float, every: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while not await check():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} within {timeout:.0f}s")
            await asyncio.sleep(every)

    async def class_ready(self, name: str, timeout: float = START_TIMEOUT) -> None:
        async def ready() -> bool:
            r = await self.kube.get(f"{CLASSES}/{name}")
            conditions = (r.json().get("status") or {}).get("conditions") or [] if r.status_code == 200 else []
            return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

        await self.until(ready, f"GPUNodeClass {name} Ready (worker and bridge serving)", timeout)


def gpu_class(name: str, max_nodes: int) -> dict[str, Any]:
    return {
        "apiVersion": "tgp.io/v1",
        "kind": "GPUNodeClass",
        "metadata": {"name": name},
        "spec": {"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}, "limits": {"maxNodes": max_nodes}},
    }


def gpu_pool(name: str, klass: str, *, idle_timeout: str, max_nodes: int) -> dict[str, Any]:
    return {
        "apiVersion": "tgp.io/v1",
        "kind": "GPUNodePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "nodeClassRef": {"name": klass},
            "template": {
                "metadata": {"labels": {"team": "ml"}},
                "spec": {
                    "requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}],
                    "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
                },
            },
            "maxNodes": max_nodes,
            # The idle reaction measures how fast a node ends once idle; the default budget (10%
            # of the pool at once) paces a whole pool going idle by design (docs/lifecycle.md),
            # so the bench's pool lets every node go unless BENCH_IDLE_BUDGET says otherwise.
            "disruption": {"idleTimeout": idle_timeout, "drainTimeout": "30s", "budgets": [{"nodes": os.environ.get("BENCH_IDLE_BUDGET") or "100%"}]},
        },
    }


def gpu_pod(name: str) -> dict[str, Any]:
    """A 1-GPU pod as a user creates it (the scheduler finds it unschedulable)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "containers": [{"name": "train", "image": "pytorch", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "terminationGracePeriodSeconds": 1,
        },
    }
