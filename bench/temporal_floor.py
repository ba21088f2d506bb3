"""What one workflow per node costs at the least: the CPU floor under issue 20's burst targets.

    PYTHONPATH=. .venv/bin/python bench/temporal_floor.py [N]

A burst target "tgp overhead p99 under T s" for n pods means 99% of them bound within T + boot
seconds of their creation, so everything that serves them must fit in cores x (T + boot) s of
CPU: on this workplace's 2 cores, with the 3 s simulated boot, 101 ms per pod for a burst of 100
(T = 2 s) and 32 ms per pod for a burst of 500 (T = 5 s), for the Temporal server, the worker,
the bridge and the simulated world together (bench/report.py `cpu_budget`).

This measures the least that the design's one fixed choice costs there, with nothing of tgp in
it: N workflows started at once on the same dev server `make bench` runs (same flags, in
memory), each the smallest life a node could have (start, ONE activity that returns at once,
complete: 11 history events, against the 30-odd of a real node's way to Ready), on a worker
without the sandbox (the cheapest runner). It prints the dev server's and this process's (worker
and client) CPU per workflow. Whatever a node's bring-up is made of, it is at least this.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from bench.stack import Proc, free_port, usage
from sim.demo import temporal_binary
from workers.temporal import dev_server_args

QUEUE = "floor"


@activity.defn
async def launch(name: str) -> str:
    return name


@workflow.defn
class SmallestLife:
    @workflow.run
    async def run(self, name: str, steps: int) -> str:
        for _ in range(steps):  # one after another, as a node's launch, join and labels are
            name = await workflow.execute_activity(launch, name, start_to_close_timeout=timedelta(seconds=30))
        return name


async def measure(n: int, steps: int, logs: Path) -> dict[str, float]:
    port = free_port()
    server = Proc(
        "temporal",
        [
            temporal_binary(), "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(free_port()),
            "--http-port", str(free_port()), "--metrics-port", str(free_port()), "--headless", "--log-level", "error", *dev_server_args(),
        ],
        dict(os.environ), logs / "temporal-floor.log",
    )  # fmt: skip
    server.start()
    try:
        client = None
        for _ in range(600):
            try:
                client = await Client.connect(f"127.0.0.1:{port}")
                break
            except RuntimeError:
                await asyncio.sleep(0.1)
        assert client is not None, "the dev server did not start"
        async with Worker(
            client, task_queue=QUEUE, workflows=[SmallestLife], activities=[launch], workflow_runner=UnsandboxedWorkflowRunner(),
            max_concurrent_activities=200,
        ):
            # Warm up (the server's first workflows pay for its caches).
            await asyncio.gather(*(client.execute_workflow(SmallestLife.run, args=("w", steps), id=f"warm-{steps}-{i}", task_queue=QUEUE) for i in range(20)))
            s0, w0, t0 = usage(server.pid).cpu_s, usage(None).cpu_s, time.monotonic()
            run = uuid.uuid4().hex[:6]
            await asyncio.gather(
                *(client.execute_workflow(SmallestLife.run, args=(f"n{i}", steps), id=f"floor-{run}-{i}", task_queue=QUEUE) for i in range(n))
            )
            s1, w1, t1 = usage(server.pid).cpu_s, usage(None).cpu_s, time.monotonic()
        return {"n": n, "steps": steps, "wall_s": t1 - t0, "server_ms": 1000 * (s1 - s0) / n, "worker_and_client_ms": 1000 * (w1 - w0) / n}
    finally:
        server.stop()


async def run(n: int, logs: Path = Path(__file__).resolve().parent / "results" / "logs") -> dict[str, float]:
    """Lives of one and of three activities, `n` of each at once: CPU per workflow, and per step."""
    logs.mkdir(parents=True, exist_ok=True)
    one = await measure(n, 1, logs)
    three = await measure(n, 3, logs)
    total = lambda r: r["server_ms"] + r["worker_and_client_ms"]  # noqa: E731
    return {
        "n": n,
        "one_step_server_ms": round(one["server_ms"], 1),
        "one_step_worker_ms": round(one["worker_and_client_ms"], 1),
        "one_step_ms": round(total(one), 1),
        "three_steps_ms": round(total(three), 1),
        "per_step_ms": round((total(three) - total(one)) / 2, 1),
    }


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    r = asyncio.run(run(n))
    print(
        f"{n} lives at once, CPU per workflow: one activity {r['one_step_ms']} ms (dev server {r['one_step_server_ms']}, "
        f"worker and client {r['one_step_worker_ms']}); three activities {r['three_steps_ms']} ms; each further step {r['per_step_ms']} ms"
    )
    print("the burst targets allow all processes together 101 ms per pod (burst 100, < 2 s) and 32 ms (burst 500, < 5 s)")


if __name__ == "__main__":
    main()
