"""A node's reports to its pool: carried by the activity that begins the phase (`carrying`),
or signalled on their own (`report_to_pool`); a worker's reports to one pool go as one signal
(ReportBatcher)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any

import structlog
from temporalio import activity
from temporalio.service import RPCError, RPCStatusCode

from activities.batching import UpdateBatcher
from tgp.messages import NodeReports, PoolReport

log = structlog.get_logger("tgp.activities")

# A report carried by an activity (`carrying`) is signalled this many times at most, pausing
# REPORT_PAUSE, doubled each time, between tries; each try's signal bounded by REPORT_RPC_TIMEOUT
# (with the reports made meanwhile: REPORT_BATCH_TIMEOUT, the client's retries included).
REPORT_TRIES = 4
REPORT_PAUSE = 0.5
REPORT_RPC_TIMEOUT = timedelta(seconds=5)
# Only the first attempts of an activity send its report, and its end waits this long at most
# for the send (`carrying`).
REPORT_ATTEMPTS = 2
REPORT_WAIT = timedelta(seconds=2)

# Reports to one pool sent as one signal (`node_phases`); more wait for the next.
MAX_REPORT_BATCH = 100
# A pool's signals from one worker go at least this far apart; the reports made meanwhile go
# together. Each signal is a workflow task of the pool's, a pass over all its nodes: a burst of
# 100 nodes coming Ready over a few seconds, one report after another, cost the pool about one
# task a node (issue 37). A report is the pool's view, not the node's progress: it may wait.
REPORT_GAP = timedelta(seconds=1)
# The most one batch's signal may take, the client's retries included (its default retry
# gives up after 10 s, each try bounded by REPORT_RPC_TIMEOUT).
REPORT_BATCH_TIMEOUT = timedelta(seconds=20)


class ReportBatcher(UpdateBatcher):
    """Per worker process: the reports of a pool's nodes go to it together, one signal in
    flight per pool at a time (activities.batching). A pool's 100 nodes going idle at once
    reported Draining, Terminating and Terminated as 300 signals: each an event in the pool's
    history and a write of the server's. A report alone goes as before (`node_phase`); one made
    within REPORT_GAP of the last signal waits for the gap's end, with the others made by then."""

    def __init__(self) -> None:
        # Past the client's own retries of the signal (each try bounded by REPORT_RPC_TIMEOUT):
        # a batch that still hangs then is given up, and `carrying` tries its reports again.
        super().__init__(MAX_REPORT_BATCH, timeout=REPORT_BATCH_TIMEOUT.total_seconds(), gap=REPORT_GAP.total_seconds())

    async def _update(self, client: Any, pool_workflow_id: str, kind: str, items: list[Any]) -> list[Any]:
        handle = client.get_workflow_handle(pool_workflow_id)
        try:
            if len(items) == 1:
                await handle.signal("node_phase", items[0], rpc_timeout=REPORT_RPC_TIMEOUT)
            else:
                await handle.signal("node_phases", NodeReports(reports=items), rpc_timeout=REPORT_RPC_TIMEOUT)
        except RPCError as exc:
            if exc.status is RPCStatusCode.NOT_FOUND:
                return [False] * len(items)
            raise
        return [True] * len(items)


async def signal_report(call: PoolReport, reports: ReportBatcher) -> bool:
    """Signal a node's report to its pool (`node_phase`, or with the reports this worker made
    meanwhile `node_phases`). False when the pool is gone (deleted, or a node started by hand):
    nobody is listening. Other RPC errors are raised."""
    sent: bool = await reports.call(call.pool_workflow_id, "report", call.report)
    return sent


# Reports still being signalled when their activity ended (held here, so none is collected
# mid-flight).
_reports_in_flight: set[asyncio.Task[None]] = set()


def sends_reports() -> bool:
    """Whether this attempt of the activity sends the reports it carries (the first
    REPORT_ATTEMPTS do: `carrying`)."""
    return activity.info().attempt <= REPORT_ATTEMPTS


@asynccontextmanager
async def carrying(report: PoolReport | None, reports: ReportBatcher) -> AsyncIterator[None]:
    """While the block (an activity's work) runs, signal `report`, the phase the activity
    begins, to the node's pool: the activity starts at once, where a local activity in the same workflow task held its schedule until
    the pool's signal was accepted. A few tries, then given up (logged): a report is the pool's
    view, never the node's progress, and the next one carries the phase again. Sent by the
    first REPORT_ATTEMPTS attempts of the activity only (a terminate the provider refuses for
    hours is retried every two minutes: each repeat would cost the pool a workflow task). At
    the end of the block the send is waited for REPORT_WAIT at most, then left to finish on its
    own: the activity's heartbeats have stopped by then, and its result must not wait on the
    pool. Nothing the send raises reaches the activity."""
    if report is None or not sends_reports():
        yield
        return

    async def send() -> None:
        pause = REPORT_PAUSE
        for attempt in range(1, REPORT_TRIES + 1):
            try:
                await signal_report(report, reports)
                return
            except Exception as exc:  # noqa: BLE001 - a report never fails its activity
                status = exc.status.name if isinstance(exc, RPCError) and exc.status else type(exc).__name__
                if attempt == REPORT_TRIES or not isinstance(exc, (RPCError, TimeoutError)):
                    log.warning("report_not_sent", pool=report.pool_workflow_id, phase=report.report.phase.value, status=status)
                    return
                await asyncio.sleep(pause)
                pause *= 2

    sent = asyncio.get_running_loop().create_task(send())
    _reports_in_flight.add(sent)
    sent.add_done_callback(_reports_in_flight.discard)
    try:
        yield
    finally:
        await asyncio.wait([sent], timeout=REPORT_WAIT.total_seconds())


def _dated(report: PoolReport | None, at: datetime) -> PoolReport | None:
    """A report the workflow made ahead (the Terminating a drain may begin), dated when it began."""
    if report is None:
        return None
    stages = [s.model_copy(update={"at": at}) for s in report.report.stages]
    return report.model_copy(update={"report": report.report.model_copy(update={"at": at, "stages": stages})})
