"""The launch activity alone, N at once: what tgp's `launch_instance` costs, apart from the
rest of the stack (issue 20: bring-up).

    PYTHONPATH=. .venv/bin/python bench/launch_path.py [N] [--kind env|cloud-init]

The simulated cloud and Tailscale run in a child process (so this process's CPU is tgp's: the
activity, its adapters and Temporal's ActivityEnvironment); N launches of distinct nodes start
at once through NodeActivities over real HTTP and real time. Prints one JSON line: launch
duration p50/p99/max, the cloud's requests by kind and per launch, this process's CPU seconds
per launch, and the child's (the simulated world's). Not part of `make bench`: a development
measurement (bench/results/findings.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import resource
import secrets
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import asyncio, json, sys, signal
import structlog
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
from aiohttp import web
from sim.cloud import SimulatedCloud
from sim.tailscale import FakeTailscale

class Counting(SimulatedCloud):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = {}

    @web.middleware
    async def _auth(self, request, handler):
        route = request.match_info.route.resource
        what = route.canonical if route is not None else request.path
        if request.method == "GET" and what == "/v1/instances":
            what += "?name" if "name" in request.query else " (whole listing)"
        key = f"{request.method} {what}"
        self.requests[key] = self.requests.get(key, 0) + 1
        return await super()._auth(request, handler)

async def main():
    api_key, client_id, secret, tag = sys.argv[1:5]
    async with Counting(api_key=api_key, boot_delay=3600) as cloud, FakeTailscale(clients={client_id: (secret, [tag])}) as ts:
        print(json.dumps({"cloud": cloud.url, "tailscale": ts.url}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        print(json.dumps({"requests": cloud.requests, "cpu_s": r.ru_utime + r.ru_stime}), flush=True)

asyncio.run(main())
"""


class JoinSecretOnly:
    """The one Kubernetes read a launch makes: its class's join Secret (the test fixtures')."""

    async def read_secret(self, namespace: str, name: str) -> dict[str, bytes]:
        from tests.test_bootstrap import JOIN_VALUES

        return {k: v.encode() for k, v in JOIN_VALUES.items()}

    async def record_class_event(self, *args: Any, **kwargs: Any) -> None:
        return None


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))], 3)


async def run(n: int, kind: str) -> dict[str, Any]:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    from pydantic import SecretStr
    from temporalio.testing import ActivityEnvironment

    from activities.boot.render import BootSettings  # noqa: F401 - imported before timing
    from activities.clouds.simulated import SimulatedProvider
    from activities.node import NodeActivities
    from activities.tailnets.tailscale import TailscaleTailnet
    from tests.money_env import OFFER
    from tests.test_bootstrap import JOIN_VALUES  # noqa: F401
    from tgp.types import LaunchInput

    tag = "tag:tgp-node"
    api_key = "sim-" + secrets.token_hex(8)
    client_id = "k" + secrets.token_hex(6) + "CNTRL"
    secret = f"tskey-client-{client_id}-{secrets.token_hex(16)}"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, api_key, client_id, secret, tag],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    urls = json.loads(child.stdout.readline())
    try:
        async with (
            SimulatedProvider(urls["cloud"], api_key=SecretStr(api_key)) as provider,
            TailscaleTailnet(base_url=urls["tailscale"], client_id=client_id, client_secret=SecretStr(secret)) as tailnet,
        ):
            if kind != "env":
                provider.capabilities = provider.capabilities.model_copy(update={"boot_payload": kind})
            activities = NodeActivities(providers={"simulated": provider}, tailnets={"tailscale": tailnet}, cluster=JoinSecretOnly())  # type: ignore[arg-type]
            boot = {"kubernetes_version": "1.34.1", "join_secret": "tgp-system/join"} if kind == "cloud-init" else {}
            durations: list[float] = []

            async def one(i: int) -> None:
                env = ActivityEnvironment()
                env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=30))
                inp = LaunchInput(node_name=f"burst-{i:04d}", attempt=1, offer=OFFER, tailnet_tags=[tag])
                if boot:
                    inp = inp.model_copy(update={"boot": inp.boot.model_copy(update=boot)})
                started = time.monotonic()
                await env.run(activities.launch_instance, inp)
                durations.append(time.monotonic() - started)

            await one(-1)  # warm: connections, the OAuth token, lazy imports
            durations.clear()
            r0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
            await asyncio.gather(*(one(i) for i in range(n)))
            wall = time.monotonic() - w0
            r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        child.stdin.write("\n")
        child.stdin.flush()
        world = json.loads(child.stdout.readline())
        child.wait(10)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    requests = {k: v for k, v in world["requests"].items()}
    counted = sum(requests.values()) - 5  # the warm-up launch: token, mint, 2 look-ups, create, look-up (about)
    return {
        "launches": n,
        "kind": kind,
        "wall_s": round(wall, 2),
        "launch_s": {"p50": pct(durations, 50), "p99": pct(durations, 99), "max": round(max(durations), 3)},
        "tgp_cpu_s_per_launch": round(cpu / n, 4),
        # Template renders' child processes (ended ones; the simulated world's child still runs).
        "render_children_cpu_s_per_launch": round(((c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)) / n, 4),
        "cloud_requests": requests,
        "cloud_requests_per_launch": round(counted / n, 2),
        "sim_cpu_s_total": round(world["cpu_s"], 2),
        "load": os.getloadavg(),
    }


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kind = "cloud-init" if "--kind=cloud-init" in sys.argv or "cloud-init" in sys.argv[1:] else "env"
    n = int(args[0]) if args and args[0].isdigit() else 300
    print(json.dumps(asyncio.run(run(n, kind))))
