"""What one workflow per node costs at the least: the floor `make bench` sets tgp's per-node CPU
against (issue 37), measured in the same run.

    PYTHONPATH=. .venv/bin/python bench/temporal_floor.py [N] [--json]

N workflows started at once (started, as the pool starts its nodes, not awaited one result each)
on a dev server with the flags `make bench` gives its own, in memory, on a worker without the
sandbox (the cheapest runner): first the smallest life (start, ONE activity that returns at once,
complete: 11 history events), then a life of TWO activities one after the other: a node's way to
its pod is at least two steps (the launch, whose purchase must be in the history before anything
waits on it, then the wait for its join), so the two-step life is the floor a node is held to.
It runs in a process of its own (`make bench` starts it so), whose CPU is the worker's and the
client's alone.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from bench.stack import connect, dev_server, free_port, usage

QUEUE = "floor"
LOGS = Path(__file__).resolve().parent / "results" / "logs"
# How often the run looks whether every workflow has closed, once their last activities ran.
CLOSED_EVERY = 0.2


class Ran:
    """Activities run in this process, counted: the workflows are started, not awaited."""

    count = 0


@activity.defn
async def launch(name: str) -> str:
    """A node's launch at its cheapest: returns at once."""
    Ran.count += 1
    return name


@workflow.defn
class SmallestLife:
    """The least a node's life can be in a workflow: `steps` activities one after another."""

    @workflow.run
    async def run(self, name: str, steps: int) -> str:
        for _ in range(steps):  # one after another, as a node's launch and join are
            name = await workflow.execute_activity(launch, name, start_to_close_timeout=timedelta(seconds=30))
        return name


async def _lives(client: Client, n: int, steps: int, prefix: str) -> None:
    """Start `n` lives at once and return once every one has closed."""
    Ran.count = 0
    await asyncio.gather(*(client.start_workflow(SmallestLife.run, args=(f"n{i}", steps), id=f"{prefix}-{i}", task_queue=QUEUE) for i in range(n)))
    while Ran.count < n * steps:
        await asyncio.sleep(CLOSED_EVERY)
    while (await client.count_workflows("WorkflowType = 'SmallestLife' AND ExecutionStatus = 'Running'")).count:
        await asyncio.sleep(CLOSED_EVERY)


async def measure(n: int, steps: int) -> dict[str, float]:
    """CPU per workflow of `n` lives of `steps` activities started at once: the dev server's and
    this process's (the worker and the client)."""
    port = free_port()
    server = dev_server(port, LOGS / "temporal-floor.log")
    server.start()
    try:
        client = await connect(server, port)
        async with Worker(
            client, task_queue=QUEUE, workflows=[SmallestLife], activities=[launch], workflow_runner=UnsandboxedWorkflowRunner(),
            max_concurrent_activities=200,
        ):
            await _lives(client, 20, steps, f"warm-{uuid.uuid4().hex[:6]}")  # the server's first workflows pay for its caches
            s0, w0, t0 = usage(server.pid).cpu_s, usage(None).cpu_s, time.monotonic()
            await _lives(client, n, steps, f"floor-{uuid.uuid4().hex[:6]}")
            s1, w1, t1 = usage(server.pid).cpu_s, usage(None).cpu_s, time.monotonic()
        return {"wall_s": t1 - t0, "server_ms": 1000 * (s1 - s0) / n, "worker_and_client_ms": 1000 * (w1 - w0) / n}
    finally:
        server.stop()


def _total(r: dict[str, float]) -> float:
    return r["server_ms"] + r["worker_and_client_ms"]


async def run(n: int) -> dict[str, float]:
    """Lives of one and of two activities, `n` of each at once: CPU per workflow, and per step."""
    LOGS.mkdir(parents=True, exist_ok=True)
    one = await measure(n, 1)
    two = await measure(n, 2)
    return {
        "n": n,
        "one_step_server_ms": round(one["server_ms"], 1),
        "one_step_worker_ms": round(one["worker_and_client_ms"], 1),
        "one_step_ms": round(_total(one), 1),
        "one_step_wall_s": round(one["wall_s"], 1),
        "two_steps_server_ms": round(two["server_ms"], 1),
        "two_steps_worker_ms": round(two["worker_and_client_ms"], 1),
        "two_steps_ms": round(_total(two), 1),
        "two_steps_wall_s": round(two["wall_s"], 1),
        "per_step_ms": round(_total(two) - _total(one), 1),
        # Temporal Cloud actions of a two-step life (bench/actions.py's rule): its start and two activities.
        "two_steps_actions": 3,
    }


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--json"]
    n = int(args[0]) if args else 500
    r = asyncio.run(run(n))
    if "--json" in sys.argv:
        print(json.dumps(r))
        return
    print(
        f"{n} lives at once, CPU per workflow: one activity {r['one_step_ms']} ms (dev server {r['one_step_server_ms']}, "
        f"worker and client {r['one_step_worker_ms']}); two activities {r['two_steps_ms']} ms (dev server {r['two_steps_server_ms']}, "
        f"worker and client {r['two_steps_worker_ms']}); each further step {r['per_step_ms']} ms"
    )


if __name__ == "__main__":
    main()
