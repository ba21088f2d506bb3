"""What a demo at rest costs the Kubernetes emulator, after two minutes and after an hour.

A demo at rest still talks to the API: one simulated kubelet (Lease every 10 s, Node status every
60 s, its pods every 10 s between watches) and the simulated scheduler (nodes and pods every 0.5 s). This replays
an hour of that traffic as fast as it can (no sleeping) and prints the CPU each request costs
(client and server, one process) after 2 and after 60 simulated minutes. They must be about the
same: the emulator keeps a bounded request log and a bounded history per object (issue 19: a demo
left up for an hour went from 21% to 80% of a core at rest).

    .venv/bin/python bench/emulator_at_rest.py   # about 3 minutes
"""

from __future__ import annotations

import asyncio
import resource
import time

import httpx

from activities.http_wire import default_tls
from sim.kube import KubeEmulator
from sim.kube_kubelet import SimKubelet, register_node

SECONDS = 3600
CHECKPOINTS = (120, 3600)
SAMPLE = 60  # simulated seconds measured at each checkpoint


async def one_second(second: int, kubelet: SimKubelet, http: httpx.AsyncClient, uid: str) -> int:
    """The requests of one simulated second; returns how many were sent."""
    sent = 0
    if second % 10 == 0:
        await kubelet._renew_lease(http, uid)
        sent += 1
    if second % 60 == 0:
        await kubelet._post_status(http)
        sent += 1
    if second % 10 == 0:
        await kubelet.sync_pods(http)
        sent += 1
    for _ in range(2):  # the scheduler's two passes
        await http.get("/api/v1/nodes")
        await http.get("/api/v1/pods")
        sent += 2
    return sent


async def main() -> None:
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url, timeout=10) as http:
        await register_node(kube.url, "gpu-1", client=http)
        uid = (await http.get("/api/v1/nodes/gpu-1")).json()["metadata"]["uid"]
        kubelet = SimKubelet(kube.url, "gpu-1", client=http)
        second = 0
        for checkpoint in CHECKPOINTS:
            while second < checkpoint - SAMPLE:
                await one_second(second, kubelet, http, uid)
                second += 1
            started, sent = time.process_time(), 0
            while second < checkpoint:
                sent += await one_second(second, kubelet, http, uid)
                second += 1
            cpu = time.process_time() - started
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
            print(f"after {checkpoint // 60:3d} simulated minutes: {cpu / sent * 1e3:6.2f} ms CPU per request, "
                  f"so {cpu / SAMPLE * 100:4.1f}% of a core in real time, max RSS {rss} MB", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
