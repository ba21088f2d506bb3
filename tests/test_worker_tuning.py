"""The worker's workflow cache (issue 20): sized for 1,000 resting nodes within 300 MB, and
settable for a deployment that wants another trade of memory against replays."""

from __future__ import annotations

import uuid

import pytest
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from tests.clock_reading_workflow import ReadsTheClock
from tests.conftest import eventually
from tgp.errors import ConfigError
from workers.main import WORKFLOW_CACHE, WORKFLOW_CACHE_ENV, WORKFLOW_SANDBOX_ENV, workflow_cache, workflow_runner

# What a cached node workflow costs (issue 20, measured on e9a7c55) and what the worker may use
# for 1,000 nodes, of which the process itself takes about 175 MB with a few workflows
# (make bench, docs/benchmarks.md).
MB_PER_CACHED_NODE = 0.29
RSS_TARGET_MB, PROCESS_MB = 300, 180


def test_the_default_cache_fits_the_memory_target() -> None:
    assert PROCESS_MB + WORKFLOW_CACHE * MB_PER_CACHED_NODE < RSS_TARGET_MB
    assert WORKFLOW_CACHE < 1_000  # the SDK's default, which held every resting node


def test_the_cache_size_comes_from_the_environment() -> None:
    assert workflow_cache({}) == WORKFLOW_CACHE
    assert workflow_cache({WORKFLOW_CACHE_ENV: "0"}) == 0
    assert workflow_cache({WORKFLOW_CACHE_ENV: " 2000 "}) == 2000
    with pytest.raises(ConfigError, match=WORKFLOW_CACHE_ENV):
        workflow_cache({WORKFLOW_CACHE_ENV: "lots"})


def test_activity_slots_hold_a_burst_of_waiting_launches() -> None:
    """A node being brought up holds one or two activity slots while it waits (a stage's poll,
    the twin watch): the SDK's 100 slots brought a 500-node burst up ~50 nodes at a time."""
    from workers.main import ACTIVITY_SLOTS, ACTIVITY_SLOTS_ENV, activity_slots

    assert ACTIVITY_SLOTS >= 2 * 500 + 100  # a 500-pod burst's waits, twin watches and the rest
    assert activity_slots({}) == ACTIVITY_SLOTS
    assert activity_slots({ACTIVITY_SLOTS_ENV: "300"}) == 300
    for bad in ("0", "many"):
        with pytest.raises(ConfigError, match=ACTIVITY_SLOTS_ENV):
            activity_slots({ACTIVITY_SLOTS_ENV: bad})


def test_workflows_run_sandboxed_unless_the_operator_turns_the_sandbox_off() -> None:
    assert isinstance(workflow_runner({}), SandboxedWorkflowRunner)
    assert isinstance(workflow_runner({WORKFLOW_SANDBOX_ENV: "on"}), SandboxedWorkflowRunner)
    assert isinstance(workflow_runner({WORKFLOW_SANDBOX_ENV: " OFF "}), UnsandboxedWorkflowRunner)
    with pytest.raises(ConfigError, match=WORKFLOW_SANDBOX_ENV):
        workflow_runner({WORKFLOW_SANDBOX_ENV: "maybe"})


async def test_the_default_worker_refuses_a_workflow_that_reads_the_clock(temporal: WorkflowEnvironment) -> None:
    """The runner a worker gets by default fails the task of a workflow that reads the clock
    (the sandbox), instead of running it and diverging at a later replay."""
    async with Worker(temporal.client, task_queue="sandbox", workflows=[ReadsTheClock], workflow_runner=workflow_runner({})):
        handle = await temporal.client.start_workflow(ReadsTheClock.run, id=f"reads-the-clock-{uuid.uuid4()}", task_queue="sandbox")

        async def refused() -> str | None:
            async for event in handle.fetch_history_events():
                if event.HasField("workflow_task_failed_event_attributes"):
                    return event.workflow_task_failed_event_attributes.failure.message
            return None

        message = await eventually(refused, timeout=60, what="the workflow task refused")
        assert "datetime" in message, message
        await handle.terminate()
