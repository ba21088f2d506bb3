"""The pool's carried state (workflows.pool.PoolState) is one pydantic model whose schema only
grows: a run continued as new onto a newer build reads what an older build carried, and a
rollback reads what a newer one carried. tests/data/pool_state_fields.json records its fields;
add new ones there, never remove one."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from tgp.messages import PoolNode
from tgp.types import NodePhase
from workflows.pool import PoolInput, PoolState

RECORDED = Path(__file__).parent / "data" / "pool_state_fields.json"


def test_the_pool_states_schema_only_grows() -> None:
    recorded = set(json.loads(RECORDED.read_text()))
    fields = set(PoolState.model_fields)
    assert not recorded - fields, f"fields a carried state may hold are gone: {sorted(recorded - fields)}"
    assert not fields - recorded, f"new fields: add them to {RECORDED.name}: {sorted(fields - recorded)}"
    required = [name for name, f in PoolState.model_fields.items() if f.is_required()]
    assert not required, f"a state carried by an older build lacks them: give them defaults: {required}"


def test_a_carried_state_comes_back_whole_and_a_newer_ones_fields_are_ignored() -> None:
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    node = PoolNode(workflow_id="gpunode/ml/p/n", node_name="n", phase=NodePhase.READY, created_at=at, phase_at=at, floor=True)
    state = PoolState(demand=["ml/a"], nodes={node.workflow_id: node}, failures=2, ended=["gpunode/ml/p/old"])
    carried = PoolInput(namespace="ml", name="p", state=state).model_dump(mode="json")
    assert PoolInput.model_validate(carried).state == state
    carried["state"]["a_field_of_a_newer_build"] = 1
    carried["a_setting_of_a_newer_build"] = 1
    assert PoolInput.model_validate(carried).state == state
