"""A workflow that reads the clock, in a module of its own (the sandbox imports a workflow's
module again when it validates it): tests/test_worker_tuning.py shows the worker's default
runner refuses it."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow


@workflow.defn(name="ReadsTheClock")
class ReadsTheClock:
    @workflow.run
    async def run(self) -> str:
        return datetime.now().isoformat()  # not deterministic: the sandbox must refuse it
