"""The stack `make bench` measures, every part a process of its own so that no part of the
harness is the bottleneck (issue 37): a Temporal dev server; `tgp worker` (BENCH_WORKERS of them,
on one task queue) and `tgp bridge` (bench/proc.py); and the simulated world (bench/world.py):
the Kubernetes API with tgp's CRDs and the scheduler, the machines' kubelets, the simulated cloud
with the tailnet. This process only creates pods, watches them and reads Temporal.

Each process's CPU time and RSS are read from /proc; the API counts every request by who sent it
and by verb, and the cloud records when each instance's first terminate call arrived (read over
their GET /stats).
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
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from temporalio.client import Client

from activities.http_wire import new_client
from sim.demo import temporal_binary
from workers.temporal import DATA_CONVERTER, dev_server_args

ROOT = Path(__file__).resolve().parent.parent
CLASSES = "/apis/tgp.io/v1/gpunodeclasses"
POOLS = "/apis/tgp.io/v1/namespaces/{ns}/gpunodepools"
NS = "ml"
TASK_QUEUE = "bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
# How long a process may take to start serving on a loaded machine.
START_TIMEOUT = 120.0
# The harness's own process, in usage() and the saturation table.
HARNESS = "harness (pods, Temporal reads)"


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


def machine_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far, every process's (/proc/stat): on a
    shared machine the others' load is no process of the stack's, yet it takes their cores."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def busy_pct(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How busy all the machine's cores were between two readings, in percent."""
    total = after[1] - before[1]
    return round(100 * (after[0] - before[0]) / total, 1) if total else 0.0


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


async def world_part(s: AsyncExitStack, name: str, logs: Path, *args: str) -> tuple[Proc, dict[str, Any]]:
    """Start `python -m bench.world <name> ...` and return it with what it wrote once serving."""
    ready = logs / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    proc = Proc(name, [sys.executable, "-m", "bench.world", name, str(ready), *args], {**os.environ}, logs / f"{name}.log")
    proc.start()
    s.callback(proc.stop)
    deadline = time.monotonic() + START_TIMEOUT
    while not ready.exists():
        if time.monotonic() > deadline or not proc.alive():
            raise RuntimeError(f"bench.world {name} did not start:\n{proc.tail()}")
        await asyncio.sleep(0.1)
    return proc, json.loads(ready.read_text())


@dataclass
class Stack:
    """One fresh stack; `async with Stack(...)`."""

    boot_delay: float
    logs: Path
    kubelets: bool = True  # False: a machine registers its Node once and runs no kubelet loop
    workers: int = 1  # `tgp worker` processes on the one task queue
    client: Client = field(init=False)
    kube: httpx.AsyncClient = field(init=False)
    server: Proc = field(init=False)
    worker_procs: list[Proc] = field(init=False)
    bridge: Proc = field(init=False)
    world: dict[str, tuple[Proc, dict[str, Any]]] = field(init=False)  # kube, scheduler, kubelets, cloud
    _stack: AsyncExitStack = field(default_factory=AsyncExitStack)

    @property
    def worker(self) -> Proc:
        """The first worker (the one profiled)."""
        return self.worker_procs[0]

    async def __aenter__(self) -> Stack:
        self.logs.mkdir(parents=True, exist_ok=True)
        s = self._stack
        kube = await world_part(s, "kube", self.logs)
        scheduler = await world_part(s, "scheduler", self.logs, kube[1]["url"])
        kubelets = await world_part(s, "kubelets", self.logs, kube[1]["url"], *([] if self.kubelets else ["--no-loop"]))
        cloud = await world_part(s, "cloud", self.logs, kubelets[1]["url"], str(self.boot_delay))
        self.world = {"kube": kube, "scheduler": scheduler, "kubelets": kubelets, "cloud": cloud}
        self.kube = await s.enter_async_context(new_client(base_url=kube[1]["url"], timeout=30))
        self._stats = await s.enter_async_context(new_client(timeout=30))
        port = free_port()
        self.server = dev_server(port, self.logs / "temporal.log")
        self.server.start()
        s.callback(self.server.stop)
        self.client = await connect(self.server, port)
        env = {**os.environ, "TEMPORAL_ADDRESS": f"127.0.0.1:{port}", "TGP_TASK_QUEUE": TASK_QUEUE, "TGP_LOG_LEVEL": "WARNING", "TGP_KUBE_URL": kube[1]["url"]}
        env.pop("TEMPORAL_API_KEY", None)
        # As installed (pip compiles bytecode at install, the image then reads it): with
        # PYTHONDONTWRITEBYTECODE and no .pyc beside the sources, each process compiles every
        # module from source at start (and, while tgp's workflow code was imported again for each
        # run, did so for every new workflow run: 20-30% of the worker's CPU in a burst, a cost of
        # this checkout, not of tgp). Bytecode goes to a cache under the bench's logs, not beside
        # the sources.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(ROOT / "bench" / "results" / "logs" / "pycache")
        run = [sys.executable, "-m", "bench.proc"]
        self.worker_profile = self.logs / "worker-profile.json"
        self.worker_profile.unlink(missing_ok=True)
        self.worker_procs = [
            Proc(f"worker{i + 1}" if self.workers > 1 else "worker", [*run, "worker"],
                 {**env, **cloud[1]["worker_env"], "TGP_METRICS_PORT": str(free_port()), **({"BENCH_PROFILE": str(self.worker_profile)} if i == 0 else {})},
                 self.logs / f"worker{i + 1}.log")
            for i in range(self.workers)
        ]  # fmt: skip
        self.bridge = Proc("bridge", [*run, "bridge"], {**env, "TGP_METRICS_PORT": str(free_port())}, self.logs / "bridge.log")
        for p in (*self.worker_procs, self.bridge):
            p.start()
            s.callback(p.stop)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def stats(self, part: str) -> dict[str, Any]:
        """What a part of the simulated world counted (bench/world.py): kube, scheduler, kubelets or cloud."""
        r = await self._stats.get(self.world[part][1]["stats"] + "/stats")
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def pids(self) -> dict[str, int | None]:
        world = {f"sim {name}": p.pid for name, (p, _) in self.world.items()}
        return {**{p.name: p.pid for p in self.worker_procs}, "bridge": self.bridge.pid, "temporal": self.server.pid, **world, HARNESS: None}

    def usage(self) -> dict[str, Usage]:
        return {name: usage(pid) for name, pid in self.pids().items()}

    def check_alive(self) -> None:
        for p in (self.server, *self.worker_procs, self.bridge, *(p for p, _ in self.world.values())):
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
