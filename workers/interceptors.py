"""Worker interceptors: each activity's log events carry who it works for."""

from __future__ import annotations

from typing import Any

from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from workers.logs import activity_log


class ActivityLogContext(Interceptor):
    """Binds every activity's workflow id, type, node, pool and provider (`workers.logs.activity_log`)
    once, before it runs, so none of its events has to repeat them."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _BindActivityLog(next)


class _BindActivityLog(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        with activity_log(*input.args):
            return await super().execute_activity(input)
