"""The worker's tuning (issue 20): its workflow cache, activity slots, workflow task polls and
workflow sandbox, each settable for a deployment that wants another trade."""

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


def test_the_default_cache_holds_fewer_workflows_than_a_fleet_at_rest() -> None:
    """The SDK's default cache (1,000) kept every resting node of a 1,000-node fleet in memory
    (~0.29 MB each); tgp's keeps the busy ones. What a worker then uses at rest is measured, not
    computed: `make bench`'s hold (docs/benchmarks.md, bench/results/findings.md; 385-410 MB at
    1,000 nodes with the sandbox, 304 MB without: the bare worker is ~173 MB)."""
    assert WORKFLOW_CACHE < 1_000


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
    from workers.main import worker_options

    assert isinstance(worker_options()["workflow_runner"], SandboxedWorkflowRunner)  # what make_worker gives the SDK
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


def test_a_burst_of_new_workflows_is_polled_by_more_than_one_poller() -> None:
    """A new workflow's first task waits on the task queue itself, which the SDK polls with a
    fifth of the worker's workflow task polls: its default of 5 left one poller for a burst of
    new node workflows (start -> first task p50 1.5-2.6 s at 100 pods, make bench)."""
    from temporalio.worker import PollerBehaviorSimpleMaximum

    from workers.main import WORKFLOW_TASK_POLLS, WORKFLOW_TASK_POLLS_ENV, worker_options, workflow_task_polls

    nonsticky_share = 0.2  # the SDK's nonsticky_to_sticky_poll_ratio
    assert WORKFLOW_TASK_POLLS * nonsticky_share >= 4
    behavior = worker_options()["workflow_task_poller_behavior"]
    assert isinstance(behavior, PollerBehaviorSimpleMaximum) and behavior.maximum == WORKFLOW_TASK_POLLS
    assert workflow_task_polls({WORKFLOW_TASK_POLLS_ENV: "40"}) == 40
    for bad in ("1", "some"):
        with pytest.raises(ConfigError, match=WORKFLOW_TASK_POLLS_ENV):
            workflow_task_polls({WORKFLOW_TASK_POLLS_ENV: bad})
    # What a caller gives wins.
    assert worker_options(workflow_task_poller_behavior=PollerBehaviorSimpleMaximum(maximum=7))["workflow_task_poller_behavior"].maximum == 7  # type: ignore[attr-defined]


def test_a_worker_works_on_a_bounded_number_of_workflow_tasks_at_once() -> None:
    """Workflow code shares one interpreter lock: the SDK's 100 tasks in flight made 1,000 new
    node workflows' tasks time out and replay (make bench's hold); the default is 20."""
    from workers.main import WORKFLOW_TASK_SLOTS, WORKFLOW_TASK_SLOTS_ENV, worker_options, workflow_task_slots

    assert worker_options()["max_concurrent_workflow_tasks"] == WORKFLOW_TASK_SLOTS < 100
    assert workflow_task_slots({WORKFLOW_TASK_SLOTS_ENV: "50"}) == 50
    for bad in ("1", "lots"):
        with pytest.raises(ConfigError, match=WORKFLOW_TASK_SLOTS_ENV):
            workflow_task_slots({WORKFLOW_TASK_SLOTS_ENV: bad})
