"""The saved histories of the current code replay through it (tests/histories_io.py).

A history recorded by this build's tests that no longer replays means the change alters the
commands a running workflow issues: it must ship as a new build through Worker Versioning (the
build id changes with the workflow source, workers/versioning.py), never into the workers of a
running one. Re-record with `make histories` once that is the intent (docs/workflow-versioning.md)."""

from collections.abc import AsyncIterator

from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from tests.histories_io import HISTORIES, read_history
from workers.main import workflow_runner
from workers.temporal import DATA_CONVERTER
from workflows.fleet import FleetLookWorkflow
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow

SAVED = sorted(HISTORIES.glob("*.json.gz"))
# Through the worker's own runner (the sandbox, tgp's workflow code passed through), as
# production replays them.
REPLAYER = Replayer(
    workflows=[GPUNodeWorkflow, GPUNodePoolWorkflow, GPUNodeClassWorkflow, FleetLookWorkflow],
    data_converter=DATA_CONVERTER,
    workflow_runner=workflow_runner({}),  # always the sandbox, whatever TGP_WORKFLOW_SANDBOX says
)


def test_the_saved_histories_cover_every_workflow_type_and_stay_small() -> None:
    names = {p.name.removesuffix(".json.gz") for p in SAVED}
    assert {"happy_path_evicted", "cancel_during_launch", "capacity_failover", "preempted", "idle_drained"} <= names, names
    assert {"whole_life_pool", "whole_life_class", "fleet_look"} <= names, "the entity workflows replay too"
    assert sum(p.stat().st_size for p in HISTORIES.iterdir()) < 1_000_000, "tests/histories/ over 1 MB"


async def test_saved_histories_replay() -> None:
    """Every saved history replays; a failure names each history that did not, and why."""
    names: dict[str, str] = {}

    async def histories() -> AsyncIterator[WorkflowHistory]:
        for path in SAVED:
            history = read_history(path)
            names[history.run_id] = path.name
            yield history

    results = await REPLAYER.replay_workflows(histories(), raise_on_replay_failure=False)
    failed = {names[run_id]: f"{type(exc).__name__}: {str(exc)[:500]}" for run_id, exc in results.replay_failures.items()}
    assert not failed, f"{len(failed)} of {len(SAVED)} saved histories do not replay:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(failed.items()))
