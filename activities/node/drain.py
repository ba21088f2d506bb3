"""Draining the node (activities.drain, as `kubectl drain`), its pool's budgets asked first for a
voluntary end, and the release of a node that goes in the same activity."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

from pydantic import BaseModel, ConfigDict, Field
from temporalio import activity

from activities import metrics
from activities.drain import drain
from activities.errors import temporal_errors
from activities.node.base import log
from activities.node.release import RELEASE_STEP_TIMEOUT, Release, ReleaseInput, ReleaseResult
from activities.node.reports import REPORT_WAIT, _dated, carrying, sends_reports
from activities.node.watch import Watch
from tgp.messages import PoolReport
from tgp.types import DrainInput, DrainResult

# A drain whose node goes releases it (`drain_node`'s `then`): its terminate, until the provider
# confirms, at most this long; past it, or failed, the workflow's release (retried until confirmed,
# TerminationStuck shown) is the one. Clouds that honour a terminate show it within seconds.
TERMINATE_ONCE_TIMEOUT = timedelta(seconds=30)
# What a drain that releases its node (`then`) may take beyond the drain: terminate, steps, report.
DRAIN_RELEASE_BOUND = TERMINATE_ONCE_TIMEOUT + 3 * RELEASE_STEP_TIMEOUT + REPORT_WAIT


class DrainRelease(BaseModel):
    """What a drain whose node goes does next, in the same activity: the release of the current
    attempt (`release_attempt`'s input, without `stuck_at`) and its Terminating report."""

    model_config = ConfigDict(extra="forbid")
    release: ReleaseInput
    report: PoolReport | None = None
    end: PoolReport | None = Field(None, description="The node's end report (Terminated), sent once the release did every step: the workflow then sends none.")
    at: datetime = Field(description="The workflow's time at the drain's start: the release begins no earlier.")


class DrainOutcome(DrainResult):
    """The drain's result and, when the node went and the drain released it, the release's."""

    released: ReleaseResult | None = Field(None, description="The release made by the drain (its terminate confirmed); None: the workflow releases.")
    released_at: datetime | None = Field(None, description="When the drain's release began: the node's Terminating, as its pool was told.")
    ended_at: datetime | None = Field(None, description="When the release had done every step and the pool was told the node's end (`DrainRelease.end`).")


def _all_done(inp: ReleaseInput, done: ReleaseResult | None) -> bool:
    """Whether the drain's release did every step: terminate, tailnet, Node, the class ledger's."""
    return done is not None and done.tailnet_cleaned and done.node_deleted and (done.released or inp.ledger is None)


class Drain(Release, Watch):
    """The drain's activity, `drain_node`, which may ask the budgets first and release after."""

    terminate_once_timeout: timedelta

    @activity.defn
    async def drain_node(self, inp: DrainInput, report: PoolReport | None = None, then: DrainRelease | None = None) -> DrainOutcome:
        """Cordon, evict the workload pods and wait until they are gone, as `kubectl drain`
        does (activities.drain). Never fails for a stuck pod: the result says which pods were
        not evicted or still shutting down, and the node goes anyway. `report` (Draining) goes to
        the pool meanwhile (`carrying`).

        With `inp.ask` (a voluntary end) the pool's budgets are asked first, as
        `ask_pool_to_disrupt` asks them: refused, the result carries the answer and nothing is
        touched (nor reported); the node stays Ready.

        With `then`, a node that goes is released here (`release_attempt` without its own
        activity and workflow task), carrying the Terminating report: billing stops at the
        drain's end; once every step is done, the end's report (`then.end`) too. A terminate the
        provider does not confirm within TERMINATE_ONCE_TIMEOUT is left to the workflow's release."""
        if inp.ask is not None and activity.info().attempt == 1:  # a retry holds the first attempt's grant
            answer = await self._ask_pool(inp.ask)
            if not answer.allowed:
                return DrainOutcome(evicted=0, answer=answer)
        started = time.monotonic()
        # The Draining report's send is waited for at the activity's end, not before the release:
        # the terminate does not wait on the pool (the Terminating report queues behind it).
        async with carrying(report, self.reports):
            with temporal_errors():
                result = await drain(
                    self.cluster, inp, poll_interval=self.poll_interval, heartbeat=activity.heartbeat, retry=activity.info().attempt > 1
                )
            outcome = "timed_out" if result.remaining or result.terminating else "drained"
            metrics.DRAIN_DURATION.labels(outcome).observe(time.monotonic() - started)
            if then is None or result.called_off or result.held:
                return DrainOutcome(**dict(result))
            at = max(then.at, datetime.now(timezone.utc))  # never before the workflow's time (a test server's runs ahead)
            async with carrying(_dated(then.report, at), self.reports):
                released = await self._release_after_drain(then.release)
            ended_at = None
            # Not after pods stayed (the workflow's end report carries the DrainTimedOut record),
            # nor from an attempt that sends no report.
            if then.end is not None and _all_done(then.release, released) and not (result.remaining or result.terminating or result.deleted) and sends_reports():
                ended_at = max(at, datetime.now(timezone.utc))
                async with carrying(_dated(then.end, ended_at), self.reports):
                    pass  # the end's report, here rather than from a local activity of its own
        return DrainOutcome(**dict(result), released=released, released_at=at, ended_at=ended_at)

    async def _release_after_drain(self, inp: ReleaseInput) -> ReleaseResult | None:
        """A drained node's release. Its terminate is bounded and never raised (None: the
        workflow's release makes it, with its retries and TerminationStuck)."""
        try:
            async with asyncio.timeout(self.terminate_once_timeout.total_seconds()):
                seen = await self._terminate_instance(inp.instance, running=True)
        except Exception as exc:  # noqa: BLE001 - the workflow's release makes it
            log.warning("release_after_drain_left_to_the_workflow", instance_name=inp.instance.instance_name, error=type(exc).__name__)
            return None
        return await self._release_rest(inp, seen)
