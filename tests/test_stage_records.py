"""Typed stage records (`tgp.types.StageRecord`): one entry a stage, the latest last."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tgp.node import NodeState
from tgp.types import Stage, StageRecord, upsert_stage

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def test_a_stage_entered_again_keeps_its_latest_time_and_reason_last() -> None:
    records = [StageRecord(stage=Stage.READY, at=T0), StageRecord(stage=Stage.DRAINING, at=T0 + timedelta(minutes=10), reason="idle: 10m")]
    again = upsert_stage(records, StageRecord(stage=Stage.READY, at=T0 + timedelta(minutes=11)))
    assert [(r.stage, r.at) for r in again] == [(Stage.DRAINING, T0 + timedelta(minutes=10)), (Stage.READY, T0 + timedelta(minutes=11))]
    assert NodeState(stages=again).stages == again
