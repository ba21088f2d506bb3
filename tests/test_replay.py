"""Saved histories of every lifecycle scenario replay through the current workflow code, so a
non-deterministic change (a reordered or inserted command) fails CI. Regenerate them with
`make histories` only for an intended, patched change."""

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from workers.temporal import DATA_CONVERTER
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_histories_exist_for_every_scenario() -> None:
    names = {p.stem for p in HISTORIES}
    assert {"happy_path_evicted", "cancel_during_launch", "capacity_failover", "join_timeout_failover", "preempted", "idle_drained", "thirty_days"} <= names
    assert {"pool_heals", "class_heals"} <= names, "the entity workflows replay too"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_saved_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    workflows = [GPUNodeWorkflow, GPUNodePoolWorkflow, GPUNodeClassWorkflow]
    await Replayer(workflows=workflows, data_converter=DATA_CONVERTER).replay_workflow(history)
