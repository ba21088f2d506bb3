"""Two builds of tgp for tests/test_upgrade.py: the release's own (`v1`) and a test-only next one
(`v2`) whose node, pool and class workflows each issue a command the release's never do, so a v1
run replayed by a v2 worker (a pin that did not hold) fails its workflow task with a
non-determinism error. And a dev server that reports drainage within seconds instead of minutes."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.api.enums.v1 import EventType, WorkflowTaskFailedCause
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import WorkerDeploymentConfig

with workflow.unsafe.imports_passed_through():
    from tgp.messages import ClassInput
    from tgp.node import NodeWorkflowInput
    from tgp.types import NodeStatus
    from workers.main import WORKFLOWS
    from workflows.node import GPUNodeWorkflow
    from workflows.node_class import GPUNodeClassWorkflow
    from workflows.pool import GPUNodePoolWorkflow, PoolInput

# The v2 build's extra command: a timer of this length at the start of every run.
V2_TIMER = timedelta(milliseconds=10)

F = TypeVar("F", bound=Callable[..., Any])


def init_parameters(base: type) -> Callable[[F], F]:
    """A v2 run takes its parameters exactly as its base's @workflow.init declares them: Temporal
    compares the two as written, and a string annotation (a module with `from __future__ import
    annotations`) differs from the class it names."""

    def same(run: F) -> F:
        run.__signature__ = inspect.signature(base.__init__).replace(return_annotation=inspect.signature(base.run).return_annotation)  # type: ignore[attr-defined]
        return run

    return same


@workflow.defn(name="GPUNodeWorkflow")
class GPUNodeWorkflowV2(GPUNodeWorkflow):
    """The next build's node: as the release's, with a timer first (a command the release never
    issues there)."""

    @workflow.run
    @init_parameters(GPUNodeWorkflow)
    async def run(self, inp: NodeWorkflowInput) -> NodeStatus:
        await workflow.sleep(V2_TIMER, summary="build v2")
        return await super().run(inp)


@workflow.defn(name="GPUNodePoolWorkflow")
class GPUNodePoolWorkflowV2(GPUNodePoolWorkflow):
    """The next build's pool: as the release's, with a timer first."""

    @workflow.run
    @init_parameters(GPUNodePoolWorkflow)
    async def run(self, inp: PoolInput) -> None:
        await workflow.sleep(V2_TIMER, summary="build v2")
        await super().run(inp)


@workflow.defn(name="GPUNodeClassWorkflow")
class GPUNodeClassWorkflowV2(GPUNodeClassWorkflow):
    """The next build's class: as the release's, with a timer first."""

    @workflow.run
    @init_parameters(GPUNodeClassWorkflow)
    async def run(self, inp: ClassInput) -> None:
        await workflow.sleep(V2_TIMER, summary="build v2")
        await super().run(inp)


# What build v2's workers host: the release's workflows, its node, pool and class replaced.
V2_REPLACES = {GPUNodeWorkflow: GPUNodeWorkflowV2, GPUNodePoolWorkflow: GPUNodePoolWorkflowV2, GPUNodeClassWorkflow: GPUNodeClassWorkflowV2}
V2_WORKFLOWS = [V2_REPLACES.get(w, w) for w in WORKFLOWS]


def versioned(build: str) -> WorkerDeploymentConfig:
    """A worker's deployment options as workers.versioning makes them, for build `build`."""
    from workers.versioning import deployment_config

    config = deployment_config({"TGP_WORKER_VERSIONING": "on", "TGP_BUILD_ID": build})
    assert config is not None
    return config


# The server looks at a draining build's open pinned runs this often, and counts a run closed
# this long after it closed (visibility may lag): minutes by default, a second here.
DRAINAGE_SETTINGS = (
    "matching.wv.VersionDrainageStatusRefreshInterval",
    "matching.wv.VersionDrainageStatusVisibilityGracePeriod",
)


@asynccontextmanager
async def versioned_dev_server() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server of the test's own (the session's has the default drainage settings), with
    tgp's search attributes."""
    from tests.conftest import binary
    from workers.temporal import DATA_CONVERTER, search_attribute_keys

    extra = [arg for key in DRAINAGE_SETTINGS for arg in ("--dynamic-config-value", f'{key}="1s"')]
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary("temporal"),
        search_attributes=search_attribute_keys(),
        data_converter=DATA_CONVERTER,
        dev_server_log_level="error",
        dev_server_extra_args=extra,
    )
    async with env:
        yield env


async def build_of_run(handle: WorkflowHandle) -> tuple[str, str]:
    """(run id, build) of the handle's run (its latest, without a run id), from describe."""
    desc = await handle.describe()
    info = desc.raw_description.workflow_execution_info.versioning_info
    return desc.run_id or "", info.deployment_version.build_id


async def runs_of(client: Client, workflow_id: str) -> list[str]:
    """Every run id of `workflow_id`, oldest first."""
    runs = [(wf.start_time, wf.run_id) async for wf in client.list_workflows(f"WorkflowId = '{workflow_id}'")]
    return [run for _, run in sorted(runs)]


# Workflow task failures the server records of its own, not a worker's code failing: a run
# terminated by the test while a task of it is in flight; a run closing (continue-as-new, its
# end) while a new signal came in, which the server refuses so that the next task sees it.
SERVER_SIDE = (
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_FORCE_CLOSE_COMMAND,
    WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_UNHANDLED_COMMAND,
)


async def task_failures(handle: WorkflowHandle) -> list[str]:
    """The workflow task failures of a worker in a run's history (a non-determinism error is one)."""
    history = await handle.fetch_history()
    return [
        f"{WorkflowTaskFailedCause.Name(e.workflow_task_failed_event_attributes.cause)}: {e.workflow_task_failed_event_attributes.failure.message}"
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED and e.workflow_task_failed_event_attributes.cause not in SERVER_SIDE
    ]


async def v2_timers(handle: WorkflowHandle) -> int:
    """How many of the v2 build's timers a run's history holds."""
    history = await handle.fetch_history()
    return sum(
        1
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED and e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta() == V2_TIMER
    )


async def wait_registered(client: Client, build: str, timeout: float = 20.0) -> None:
    """Until the server knows build `build` (its workers' first polls)."""
    from workers.versioning import describe_build

    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            found = await describe_build(client, build)
            if found is not None and found.task_queues:
                return
        except RPCError:
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"build {build} never registered with the server")
        await asyncio.sleep(0.1)
