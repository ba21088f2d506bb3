"""What every stage of a node's life shares: the request, the carried state and the small
things each stage does to them (enter a phase, stamp a stage, tell the pool, make a short call).

A `Life` is rebuilt from `NodeWorkflowInput` at the start of each run; only `state` is carried
across continue-as-new. The rest (reports in flight, the watch's timer) belongs to one run."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.node import DrainOutcome, NodeActivities
    from activities.node_class import LedgerCall
    from activities.search_attributes import SA_INSTANCE_ID, SA_READY_SINCE, phase_attributes
    from tgp.messages import NodeReport, PoolReport, Reservation
    from tgp.node import NodeState, NodeWorkflowInput, node_details, node_status, phase_reason, remembered
    from tgp.types import (
        LABEL_GPU_TYPE,
        LABEL_MANAGED,
        LABEL_POOL,
        LABEL_POOL_NAMESPACE,
        LABEL_PROVIDER,
        LABEL_REGION,
        InstanceRef,
        LaunchAttempt,
        LifecycleTimeouts,
        NodePhase,
        NodeRequest,
        NodeStatus,
        Offer,
        Stage,
        StageRecord,
        TemplateUpdate,
        upsert_stage,
    )
    from workflows.continuation import continue_as_new, continue_as_new_due
    from workflows.entity import describe

# Continue-as-new well before Temporal's own suggestion (4,096 events), so a node that lives
# for weeks keeps each run's history small and quick to replay.
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 600
# Heartbeat timeout of the long activities (or the request's apiCall, if shorter): a missed
# heartbeat means a dead or stalled worker, noticed (and the attempt retried) within this long.
HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# A report to the pool: bounded, a few tries; a pool that is gone is nobody to tell.
REPORT_TIMEOUT = timedelta(seconds=10)
REPORT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5), maximum_attempts=5)


class LaunchAttemptFailed(Exception):
    """This offer did not give a node; the next one may."""


class NotSettled(LaunchAttemptFailed):
    """The class ledger refused the launch's price, or did not answer: not the offer's fault,
    so no other offer is tried (the node ends Failed)."""


class NodeEvicted(Exception):
    """An `evict` signal arrived before the node was up."""


class Life:
    """One run's view of a node's life: the request (never changed), the carried state, and
    what this run has in flight."""

    def __init__(self, inp: NodeWorkflowInput) -> None:
        self.req: NodeRequest = inp.request
        self.state: NodeState = inp.state or NodeState()
        if self.state.timeouts is None:
            self.state.timeouts = self.req.timeouts
        if self.state.template is None:
            self.state.template = TemplateUpdate(labels=self.req.labels, taints=self.req.taints)
        self.reports: list[asyncio.Future[None]] = []
        self.unreported: list[StageRecord] = []  # stage records the pool has not been sent yet
        self.twin_watch: asyncio.Future[None] | None = None
        self.watch_timer: tuple[datetime, asyncio.Future[None]] | None = None
        self.asking = ""  # the budget asked for, while the ask is in flight
        self.drained: DrainOutcome | None = None  # a drain that released the current attempt

    @property
    def timeouts(self) -> LifecycleTimeouts:
        assert self.state.timeouts is not None
        return self.state.timeouts

    @property
    def template(self) -> TemplateUpdate:
        assert self.state.template is not None
        return self.state.template

    def heartbeat(self) -> timedelta:
        return min(self.timeouts.api_call, HEARTBEAT_TIMEOUT)

    def own_labels(self, *, pool_only: bool = False) -> dict[str, str]:
        """tgp's labels on the Node: managed, the pool's (which name the node's workflow, for the
        bridge), and unless `pool_only` the offer's."""
        labels = {LABEL_MANAGED: "true", LABEL_POOL: self.req.pool, LABEL_POOL_NAMESPACE: self.req.namespace}
        offer = self.state.offer
        if not pool_only and offer is not None:
            labels.update({LABEL_PROVIDER: offer.provider, LABEL_GPU_TYPE: offer.gpu_type, LABEL_REGION: offer.region})
        return labels

    # --- phases and records ----------------------------------------------------------------

    def enter(self, phase: NodePhase, *, upsert: bool = True, at: datetime | None = None) -> None:
        """Record the phase: state, stage record, search attributes and the Web UI's details.
        Not `upsert`: a phase the search attribute skips (one nothing waits in, or an idle
        node's drain); the next upsert says where the node is. Only the attributes that differ
        from the run's are upserted, and none when none does (a run the pool started in this
        phase: each upsert is a write of the server's visibility store)."""
        self.state.phase = phase
        self.stamp(Stage(phase.value), phase_reason(self.state, phase), at=at)
        workflow.set_current_details(self.details())
        if not upsert:
            return
        updates = [*(key.value_set(value) for key, value in phase_attributes(self.req, phase, self.state.offer)), *self._instance_attributes(phase)]
        have = workflow.info().typed_search_attributes
        changed = [u for u in updates if have.get(u.key) != u.value]
        if changed:
            workflow.upsert_search_attributes(changed)

    def stamp(self, stage: Stage, reason: str = "", at: datetime | None = None) -> None:
        """Record that the node entered `stage` now (or `at`, when an activity began it), and why:
        for the status query, for the pool (with the next report) and for `tgp status NODE`."""
        record = StageRecord(stage=stage, at=at or workflow.now(), reason=reason)
        self.state.stages = upsert_stage(self.state.stages, record)
        self.unreported.append(record)

    def record(self, attempt: LaunchAttempt, outcome: str, instance_id: str | None = None) -> None:
        i = attempt.attempt - 1
        current = self.state.attempts[i]
        self.state.attempts[i] = current.model_copy(update={"outcome": outcome, "instance_id": instance_id or current.instance_id})

    def remember(self, ref: InstanceRef) -> None:
        """Keep `ref` in the state's money by ids (tgp.node.remembered)."""
        self.state.seen, self.state.instance = remembered(self.state.seen, self.state.instance, ref)

    def failed(self, exc: Exception) -> NodePhase:
        """A life that ends in failure keeps its cause as the last error, for the status and the
        pool's Event."""
        if isinstance(exc, ActivityError):
            self.state.last_error = describe(exc)
        elif isinstance(exc, ApplicationError):
            self.state.last_error = exc.message  # a non-retryable error with no plan (bad config, auth)
        else:
            self.state.last_error = str(exc)
        self.state.end_reason = "failed"
        return NodePhase.FAILED

    # --- the pool and the class ------------------------------------------------------------

    def tell_pool(self, *, carry: bool = False) -> PoolReport | None:
        """Report the phase just entered to the pool, if the node has one. The one channel: the
        worker's report batcher, which signals the pool (`node_phases`). With `carry` (a phase an
        activity begins: launch, Ready's labels, drain, terminate) the report is returned for
        that activity to send while it works; otherwise a local activity sends it from its own
        task, so the node never waits on the pool. Pending and Joining are not worth a report
        (the pool counts them as coming); their records go with the next one."""
        if self.state.phase in (NodePhase.PENDING, NodePhase.JOINING):
            return None
        records, self.unreported = self.unreported, []
        if not self.req.pool_workflow_id:
            return None
        report = PoolReport(pool_workflow_id=self.req.pool_workflow_id, report=self._node_report(records))
        if carry:
            return report
        self.reports.append(asyncio.ensure_future(self._send(report)))
        return None

    def report_ahead(self, phase: NodePhase) -> PoolReport | None:
        """The report of `phase`, for an activity that may begin it (it dates the report)."""
        record = StageRecord(stage=Stage(phase.value), at=workflow.now(), reason=phase_reason(self.state, phase))
        report = self._node_report([record]).model_copy(update={"phase": phase})
        return PoolReport(pool_workflow_id=self.req.pool_workflow_id, report=report) if self.req.pool_workflow_id else None

    async def _send(self, report: PoolReport) -> None:
        try:
            await self.call(NodeActivities.report_to_pool, report, timeout=REPORT_TIMEOUT, retry=REPORT_RETRY, summary=f"report {report.report.phase.value}")
        except ActivityError as exc:
            workflow.logger.info("could not report %s to pool %s: %s", report.report.phase.value, report.pool_workflow_id, describe(exc))

    def _node_report(self, records: list[StageRecord]) -> NodeReport:
        offer, phase = self.state.offer, self.state.phase
        return NodeReport(
            workflow_id=self.req.workflow_id,
            node_name=self.req.node_name,
            phase=phase,
            provider=offer.provider if offer else None,
            gpu_type=offer.gpu_type if offer else None,
            hourly_price=offer.hourly_price if offer else None,
            # A failed node's end reason is just "failed": the pool's Event needs the cause.
            reason=self.state.last_error if phase is NodePhase.FAILED and self.state.last_error else self.state.end_reason or self.state.last_error,
            at=workflow.now(),
            stages=records,
            drift_hash=self.req.drift_hashes.get(offer.provider) if offer else None,
            region=offer.region if offer else None,
            spot=offer.spot if offer else None,
        )

    def ledger_call(self, offer: Offer | None) -> LedgerCall | None:
        """The node's call to its class ledger (None: a node without a class has no budget)."""
        if not self.req.class_workflow_id:
            return None
        reservation = Reservation(node_id=self.req.workflow_id, pool=f"{self.req.namespace}/{self.req.pool}", hourly_price=offer.hourly_price if offer else None)
        return LedgerCall(class_workflow_id=self.req.class_workflow_id, reservation=reservation)

    async def call(
        self, activity: Any, arg: Any, *, timeout: timedelta, retry: RetryPolicy, summary: str | None = None, local: bool = True, more: tuple[Any, ...] = ()
    ) -> Any:
        """One short call; `local`: a local activity (one marker event, no workflow task of its
        own), so it must be idempotent: a worker that dies during it runs it again. Its failure
        is raised as an ActivityError either way, so every handler reads both alike."""
        if not local:
            return await workflow.execute_activity_method(activity, args=[arg, *more], start_to_close_timeout=timeout, retry_policy=retry, summary=summary)
        try:
            return await workflow.execute_local_activity_method(activity, args=[arg, *more], start_to_close_timeout=timeout, retry_policy=retry, summary=summary)
        except ActivityError:
            raise
        except FailureError as exc:  # a local activity's failure comes as its bare cause
            raise ActivityError(
                "local activity error",
                scheduled_event_id=0,
                started_event_id=0,
                identity="",
                activity_type=getattr(activity, "__name__", str(activity)),
                activity_id="",
                retry_state=None,
            ) from exc

    def cancel_requested(self) -> bool:
        """Whether the workflow was cancelled. Temporal delivers a cancel once, to whatever the
        run awaits: an activity in flight takes it and fails with it, so each handler of an
        activity failure asks this first."""
        return workflow.cancellation_reason() is not None

    def check_evicted(self) -> None:
        if self.state.evict_reason is not None:
            self.state.end_reason = f"evicted before Ready: {self.state.evict_reason}"
            raise NodeEvicted()

    def stop_twin_watch(self) -> None:
        if self.twin_watch is not None and not self.twin_watch.done():
            self.twin_watch.cancel()
        self.twin_watch = None

    async def continue_as_new_if_due(self) -> None:
        """A safe point: nothing in flight but what the state records. Continue as new when the
        worker deployment's current build changed (Worker Versioning: the new run starts on it)
        or the history grew long. Not while the twin watch runs (its window is not over: the next
        wake is a safe point too). Records not yet reported go first, and reports in flight and
        handlers finish."""
        if (self.twin_watch is not None and not self.twin_watch.done()) or not continue_as_new_due(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
            return
        if self.unreported:
            self.tell_pool()
        await workflow.wait_condition(workflow.all_handlers_finished)
        await asyncio.gather(*self.reports)
        continue_as_new(NodeWorkflowInput(request=self.req, state=self.state))

    def status(self) -> NodeStatus:
        return node_status(self.req, self.state, self.asking)

    def details(self) -> str:
        return node_details(self.req, self.state)

    def _instance_attributes(self, phase: NodePhase) -> list[Any]:
        """The launch's instance in each phase's upsert (unset while a new attempt launches), and
        when the node became Ready: the fleet look and the sweeper read them from the listing."""
        instance = self.state.instance
        if instance is None:
            return []
        found = [SA_INSTANCE_ID.value_set(instance.instance_id) if instance.instance_id else SA_INSTANCE_ID.value_unset()]
        return [*found, SA_READY_SINCE.value_set(workflow.now())] if phase is NodePhase.READY else found


def describe_failure(exc: FailureError) -> str:
    """An activity's failure as `describe` says it, whether it came wrapped in an ActivityError
    (an activity) or as its bare cause (a local activity)."""
    if isinstance(exc, ActivityError):
        return describe(exc)
    if isinstance(exc, ApplicationError):
        return f"{exc.type}: {exc.message}" if exc.type else exc.message
    if isinstance(exc, TimeoutError):
        return f"activity timed out ({exc.type.name if exc.type else 'timeout'})"
    return str(exc)


def human(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    return f"{seconds}s" if seconds % 60 else f"{seconds // 60}m"
