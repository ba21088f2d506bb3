"""A run continued as new on a newer build reads the state an older build wrote (Worker
Versioning: the new run starts on the current build with its predecessor's input). One carried
state per workflow type, recorded by the release they come from (tests/carried_state.py says
how), is decoded through the worker's data converter into the current input models and
re-encoded without loss."""

from __future__ import annotations

import pytest

from tests.carried_state import CARRIED, load, models
from workers.temporal import DATA_CONVERTER


def test_every_workflow_type_that_continues_as_new_has_a_recorded_state() -> None:
    assert sorted(p.stem for p in CARRIED.glob("*.json")) == sorted(models())


@pytest.mark.parametrize("workflow_type", sorted(models()))
async def test_the_current_code_reads_the_carried_state_of_the_previous_release(workflow_type: str) -> None:
    model = models()[workflow_type]
    payload = load(workflow_type)
    (value,) = await DATA_CONVERTER.decode([payload], [model])
    assert isinstance(value, model)
    # Nothing read is dropped or changed: encoded again, it reads back the same.
    (again,) = await DATA_CONVERTER.decode(await DATA_CONVERTER.encode([value]), [model])
    assert again == value


async def test_a_node_continued_as_new_resumes_its_watch_from_the_carried_state() -> None:
    """The node's run starts from it as `Life` does: past bring-up, Ready, its instance known."""
    from tgp.node import NodeWorkflowInput
    from tgp.types import NodePhase
    from workflows.node.life import Life

    (inp,) = await DATA_CONVERTER.decode([load("GPUNodeWorkflow")], [NodeWorkflowInput])
    life = Life(inp)
    assert life.state.phase is NodePhase.READY and life.state.watch is not None
    assert life.state.instance is not None and life.state.instance.instance_id
    assert life.state.offer is not None and life.timeouts == inp.state.timeouts
