"""Typed stage records (`tgp.types.StageRecord`) replace the free-string `stage_times` map; what
older versions stored (continue-as-new inputs, query answers) still loads."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from temporalio.api.common.v1 import Payload

from tgp.node import NodeState, NodeWorkflowInput
from tgp.types import NodePhase, NodeRequest, NodeStatus, Stage, StageRecord, upsert_stage
from workers.temporal import DATA_CONVERTER

T0 = datetime(2026, 11, 1, tzinfo=UTC)
OLD_TIMES = {"Pending": T0, "Launching": T0 + timedelta(seconds=5), "TailnetJoined": T0 + timedelta(minutes=2), "Ready": T0 + timedelta(minutes=3)}


def test_a_continue_as_new_input_from_before_the_records_loads_with_its_times() -> None:
    request = NodeRequest(namespace="ml", pool="rtx", node_name="gpu-1")
    old = {"request": request.model_dump(mode="json"), "state": {"phase": "Ready", "stage_times": {k: v.isoformat() for k, v in OLD_TIMES.items()}}}
    payload = DATA_CONVERTER.payload_converter.to_payloads([old])[0]
    [loaded] = DATA_CONVERTER.payload_converter.from_payloads([Payload(metadata=payload.metadata, data=payload.data)], [NodeWorkflowInput])

    assert loaded.state is not None and loaded.state.phase is NodePhase.READY
    assert [(r.stage, r.at) for r in loaded.state.stages] == [(Stage(k), v) for k, v in OLD_TIMES.items()]


def test_an_old_status_answer_loads_and_unknown_stage_names_are_dropped() -> None:
    answer = {"workflow_id": "w", "node_name": "gpu-1", "phase": "Ready", "pool": "rtx",
              "stage_times": {**{k: v.isoformat() for k, v in OLD_TIMES.items()}, "SomethingNewer": T0.isoformat()}}
    status = NodeStatus.model_validate(answer)
    assert status.stage_times == OLD_TIMES
    assert NodeStatus.model_validate_json(status.model_dump_json()).stages == status.stages, "the new shape round-trips"


def test_a_stage_entered_again_keeps_its_latest_time_and_reason_last() -> None:
    records = [StageRecord(stage=Stage.READY, at=T0), StageRecord(stage=Stage.DRAINING, at=T0 + timedelta(minutes=10), reason="idle: 10m")]
    again = upsert_stage(records, StageRecord(stage=Stage.READY, at=T0 + timedelta(minutes=11)))
    assert [(r.stage, r.at) for r in again] == [(Stage.DRAINING, T0 + timedelta(minutes=10)), (Stage.READY, T0 + timedelta(minutes=11))]
    assert NodeState(stages=again).stages == again
