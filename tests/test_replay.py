"""Saved histories replay through the current workflow code, so a non-deterministic change (a
reordered or inserted command without a `workflow.patched` branch) fails CI.

Two kinds of history (docs/workflow-versioning.md):
* tests/histories/*.json: the lifecycle scenarios, re-recorded by `make histories` only for an
  intended, patched change;
* tests/histories/<release>/*.json.gz: pool, class and node histories recorded by a released
  commit's own tests (`make release-histories RELEASE=<sha>`). They are never re-recorded: they
  are what workflows started by that release look like when the next release's worker picks
  them up. A failure here names the release and the test that recorded the history; patch the
  change, do not re-record."""

import gzip
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.main import workflow_runner
from workers.temporal import DATA_CONVERTER
from workflows.fleet import FleetLookWorkflow
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow

ROOT = Path(__file__).parent / "histories"
SCENARIOS = sorted(ROOT.glob("*.json"))
RELEASES = sorted(p for p in ROOT.iterdir() if p.is_dir())
RELEASED = sorted(ROOT.rglob("*.json.gz"))
# Through the worker's own runner (workers.main.workflow_runner: the sandbox, its runs sharing the
# workflow modules' code), as production replays them; about half the CPU of a default runner.
REPLAYER = Replayer(
    workflows=[GPUNodeWorkflow, GPUNodePoolWorkflow, GPUNodeClassWorkflow, FleetLookWorkflow],
    data_converter=DATA_CONVERTER,
    workflow_runner=workflow_runner({}),  # always the sandbox, whatever TGP_WORKFLOW_SANDBOX says
)
# One test per release (and one for the scenarios), all of its histories through one replay
# worker: a worker per history cost more than the replays (~900 histories).
GROUPS = {"scenarios": SCENARIOS} | {release.name: sorted(release.glob("*.json.gz")) for release in RELEASES}


def test_histories_exist_for_every_scenario() -> None:
    names = {p.stem for p in SCENARIOS}
    assert {"happy_path_evicted", "cancel_during_launch", "capacity_failover", "join_timeout_failover", "preempted", "idle_drained", "thirty_days"} <= names
    assert {"pool_heals", "class_heals"} <= names, "the entity workflows replay too"
    assert "fleet_look" in names, "the fleet look (workflows/fleet.py) replays too"


def test_each_release_recorded_pool_class_and_node_histories() -> None:
    assert RELEASES, "no release histories under tests/histories/<release>/"
    for release in RELEASES:
        kinds = {p.name.split(".")[0].rsplit("-", 1)[1].rstrip("0123456789") for p in release.glob("*.json.gz")}
        assert {"pool", "class", "node"} <= kinds, f"{release.name} lacks some workflow's histories: {kinds}"


def test_every_saved_history_is_in_a_group() -> None:
    assert sorted(p for paths in GROUPS.values() for p in paths) == sorted(SCENARIOS + RELEASED)


def read(path: Path) -> WorkflowHistory:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return WorkflowHistory.from_json(path.name, text)


@pytest.mark.parametrize("group", GROUPS)
async def test_saved_histories_replay(group: str) -> None:
    """Every history of the group replays; a failure names each history that did not, and why."""
    paths = GROUPS[group]
    assert paths, f"no histories in {group}"
    names: dict[str, list[str]] = {}

    async def histories() -> AsyncIterator[WorkflowHistory]:
        for path in paths:
            history = read(path)
            names.setdefault(history.run_id, []).append(str(path.relative_to(ROOT)))
            yield history

    results = await REPLAYER.replay_workflows(histories(), raise_on_replay_failure=False)
    failed = {", ".join(names[run_id]): f"{type(exc).__name__}: {str(exc)[:500]}" for run_id, exc in results.replay_failures.items()}
    assert not failed, f"{len(failed)} of {len(paths)} histories of {group} do not replay:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(failed.items()))
