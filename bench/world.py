"""The simulated world `make bench` measures tgp against, spread over processes so that it is
never the bottleneck (issue 37: in one process it was pinned at one core before tgp was):

    python -m bench.world kube      READY_FILE                 # the Kubernetes API with tgp's CRDs
    python -m bench.world scheduler READY_FILE KUBE_URL        # the scheduler, a client of that API
    python -m bench.world kubelets READY_FILE KUBE_URL [--no-loop]   # every machine's kubelet
    python -m bench.world cloud    READY_FILE KUBELETS_URL BOOT_S    # the simulated cloud and the tailnet

Each writes READY_FILE (JSON: its URLs, and for the cloud the credentials a worker needs) once it
serves, and answers GET <stats>/stats with what the harness reads from it: the API's requests by
(agent, verb, resource), the cloud's requests and when each machine's first terminate call came.
A machine's kubelet runs in the kubelets process from its boot (the cloud posts it there) until
its instance is terminated (the cloud deletes it there), as sim.world wires it in one process.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from collections import Counter, deque
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import kmock
import yaml
from aiohttp import web

from activities.http_wire import new_client
from sim.cloud import SimulatedCloud, boot_env
from sim.kube import KubeEmulator
from sim.kube_kubelet import SimKubelet, register_node
from sim.scheduler import SimScheduler
from sim.tailscale import FakeTailscale
from sim.world import NODE_TAG

CRDS = Path(__file__).resolve().parent.parent / "deploy" / "crds"
# The simulated kubelets' heartbeats, longer than a real kubelet's (a Lease every 10 s, a pod
# resync every 10 s: three requests per node every 10 s). Nothing in the stack reads a Lease (the
# emulator has no node lifecycle controller, tgp reads none), and a kubelet's watch still starts
# a bound pod at once.
BENCH_KUBELET_INTERVALS = {"lease_renew_interval": 60.0, "status_interval": 300.0, "pod_sync_interval": 120.0}
# The scheduler's pass follows a change within this (kube-scheduler's informers react at once).
SCHEDULER_INTERVAL = 0.05


def agent(request: kmock.Request) -> str:
    """tgp's processes use the official Kubernetes client; the simulated world and the harness
    send with httpx (activities.http.new_client)."""
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

    async def _handle(self, request: kmock.Request) -> Any:  # type: ignore[override]
        try:
            what = (request.resource.plural if request.resource is not None else "-") + (f"/{request.subresource}" if request.subresource else "")
            self.counts[(agent(request), verb(request), what)] += 1
        except Exception:  # noqa: BLE001 - counting never breaks a request
            self.counts[("?", "?", "?")] += 1
        return await super()._handle(request)


class TimedCloud(SimulatedCloud):
    """The simulated cloud, noting when the first terminate call for each machine arrived (by
    its hostname, the Kubernetes Node's name) and every request by route."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.first_delete: dict[str, float] = {}
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
            self.first_delete.setdefault(boot_env(inst.user_data).get("TS_HOSTNAME", inst.name), time.time())
        return await super()._delete(request)


async def serve_stats(stack: AsyncExitStack, stats: Any) -> str:
    """GET /stats answers `stats()` as JSON, on a port of its own; returns the base URL."""

    async def handle(_: web.Request) -> web.Response:
        return web.json_response(stats())

    app = web.Application()
    app.add_routes([web.get("/stats", handle)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def kube(stack: AsyncExitStack, _: list[str]) -> dict[str, Any]:
    emulator = await stack.enter_async_context(CountingEmulator())
    # kmock scans its request log for each new request; nothing here reads past requests.
    emulator._requests = deque(maxlen=8)
    for path in sorted(CRDS.glob("*.yaml")):
        emulator.install_crd(yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))  # noqa: S506 - libyaml where present
    stats = await serve_stats(stack, lambda: {"counts": [[*k, v] for k, v in emulator.counts.items()]})
    return {"url": emulator.url, "stats": stats}


async def scheduler(stack: AsyncExitStack, args: list[str]) -> dict[str, Any]:
    """The scheduler in a process of its own (it reaches the API over HTTP, as kube-scheduler
    does): beside the API in one process, the two were pinned at one core in a burst of 500 on
    16 cores (issue 37), and pods waited for the harness, not for tgp."""
    # kube-scheduler's queue as v1.34 has it; a pending pod is marked Unschedulable once, not on
    # every attempt as its message's node count changes (tgp reads the reason only).
    await stack.enter_async_context(SimScheduler(args[0], interval=SCHEDULER_INTERVAL, refresh_unschedulable=False))
    return {"stats": await serve_stats(stack, lambda: {})}


async def kubelets(stack: AsyncExitStack, args: list[str]) -> dict[str, Any]:
    """POST /machines {name, labels, gpus, taints} starts a machine's kubelet (with --no-loop:
    registers its Node once); DELETE /machines/{name} stops it (the machine is gone)."""
    kube_url, loop = args[0], "--no-loop" not in args
    running: dict[str, asyncio.Task[None]] = {}

    async def start(request: web.Request) -> web.Response:
        m = await request.json()
        if loop:
            k = SimKubelet(kube_url, m["name"], labels=m["labels"], taints=m["taints"], gpus=m["gpus"], **BENCH_KUBELET_INTERVALS)
            running[m["name"]] = asyncio.create_task(k.run())
        else:
            await register_node(kube_url, m["name"], labels=m["labels"], taints=m["taints"], gpus=m["gpus"])
        return web.json_response({})

    async def stop(request: web.Request) -> web.Response:
        task = running.pop(request.match_info["name"], None)
        if task is not None:
            task.cancel()
        return web.json_response({})

    app = web.Application()
    app.add_routes([web.post("/machines", start), web.delete("/machines/{name}", stop)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    return {"url": url, "stats": await serve_stats(stack, lambda: {"kubelets": len(running)})}


async def cloud(stack: AsyncExitStack, args: list[str]) -> dict[str, Any]:
    kubelets_url, boot = args[0], float(args[1])
    client_id = "k" + secrets.token_hex(6) + "CNTRL"
    client_secret = f"tskey-client-{client_id}-{secrets.token_hex(16)}"
    tailscale = await stack.enter_async_context(FakeTailscale(clients={client_id: (client_secret, [NODE_TAG])}))
    http = await stack.enter_async_context(new_client(base_url=kubelets_url, timeout=30))
    leaving: set[asyncio.Task[Any]] = set()

    async def join_tailnet(auth_key: str, hostname: str) -> None:
        tailscale.register(auth_key, hostname)

    async def join_cluster(name: str, labels: dict[str, str], gpus: int, taints: list[dict[str, str]]) -> None:
        (await http.post("/machines", json={"name": name, "labels": labels, "gpus": gpus, "taints": taints})).raise_for_status()
        try:
            await asyncio.Event().wait()  # the machine runs until its boot task is cancelled (terminated)
        finally:
            task = asyncio.get_running_loop().create_task(http.delete(f"/machines/{name}"))
            leaving.add(task)
            task.add_done_callback(leaving.discard)

    api_key = "sim-" + secrets.token_hex(16)
    c = await stack.enter_async_context(TimedCloud(boot_delay=boot, tailnet_register=join_tailnet, node_register=join_cluster, api_key=api_key))

    def stats() -> dict[str, Any]:
        return {
            "first_delete": c.first_delete, "requests": dict(c.requests), "instances": len(c.instances),
            "offer_lists": sum(c.offer_lists.values()), "requests_by_key": sum(c.requests_by_key.values()),
            "describe_requests": c.describe_requests,
            "tailnet_device_lists": tailscale.device_lists,
        }  # fmt: skip

    worker_env = {
        "TGP_SIMULATED_CLOUD_URL": c.url, "TGP_SIMULATED_CLOUD_API_KEY": api_key, "TGP_TAILSCALE_API_URL": tailscale.url,
        "TS_OAUTH_CLIENT_ID": client_id, "TS_OAUTH_CLIENT_SECRET": client_secret,
    }  # fmt: skip
    return {"url": c.url, "worker_env": worker_env, "stats": await serve_stats(stack, stats)}


ROLES = {"kube": kube, "scheduler": scheduler, "kubelets": kubelets, "cloud": cloud}


async def main(role: str, ready: Path, args: list[str]) -> None:
    async with AsyncExitStack() as stack:
        info = await ROLES[role](stack, args)
        tmp = ready.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        tmp.rename(ready)  # whole, or not there: the harness reads it as soon as it appears
        await asyncio.Event().wait()  # until the harness kills this process


if __name__ == "__main__":
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    asyncio.run(main(sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
