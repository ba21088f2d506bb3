"""GPUNodeWorkflow: one GPU node's whole life, read top to bottom.

    select offer -> settle its price with the class budget -> mint tailnet key + launch
    -> wait for join (tailnet, then Node Ready) -> label/taint
    -> watch until idle, expired, interrupted or evicted -> drain -> terminate

Failover: a capacity error, a launch failure or a join timeout releases what that attempt
bought, takes the offer out of rotation and tries the next offer, up to max_launch_attempts.
Cleanup (instance, tailnet key and device, Node object) runs on every way out: success,
failure, eviction and cancellation, including a cancellation that lands while the launch
activity is still buying the instance.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from collections.abc import Callable
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError, TimeoutError

with workflow.unsafe.imports_passed_through():
    from activities.node_class import LedgerCall, NodeClassActivities
    from activities.node import RELEASE_STEP_TIMEOUT, REPORT_WAIT, JoinResult, NodeActivities, ReleaseInput, ReleaseResult
    from activities.search_attributes import (
        SA_CLASS,
        SA_GPU_TYPE,
        SA_HOURLY_PRICE,
        SA_INSTANCE_ID,
        SA_NODE_NAME,
        SA_PHASE,
        SA_POOL,
        SA_PROVIDER,
        SA_READY_SINCE,
        start_attributes,
    )
    from activities.termination import VERIFY_FOR
    from tgp.messages import DisruptionAnswer, DisruptionAsk, NodeReport, PoolAsk, PoolReport, Reservation
    from tgp.node import NodeState, NodeWorkflowInput
    from workflows.entity import describe as _describe
    from workflows.entity import history_is_long
    from workflows.legacy.r31e9066.frozen import frozen_node
    from workflows.retries import API_RETRY, CLEANUP_RETRY, LAUNCH_RETRY, POLL_RETRY
    from activities.node import POOL_ANSWER_TIMEOUT
    from tgp.disruption import DisruptionReason, held_message, termination_deadline
    from tgp.drift import label_removals, taint_removals
    from tgp.facts_order import take_facts
    from tgp.lifecycle import EndReason, WatchState, apply_view, backstop_period, facts_view, held_by, judge_observation, judge_view, longest_life, next_deadline
    from tgp.types import (
        GPU_RESOURCE,
        TAINT_JOINING,
        LABEL_GPU_TYPE,
        LABEL_MANAGED,
        LABEL_POOL,
        LABEL_POOL_NAMESPACE,
        LABEL_PROVIDER,
        LABEL_REGION,
        DeviceQuery,
        DisruptRequest,
        DrainInput,
        DrainResult,
        EvictRequest,
        GpuQuery,
        Instance,
        InstanceRef,
        InstanceSighting,
        InstanceState,
        LabelInput,
        LaunchAttempt,
        LaunchInput,
        LaunchResult,
        MarkUnavailableInput,
        NodePhase,
        NodeFacts,
        NodeObservation,
        NodeRequest,
        NodeStatus,
        ObserveInput,
        Offer,
        SelectOfferInput,
        Stage,
        StageCheck,
        StageLook,
        StageRecord,
        TailnetCleanupInput,
        TemplateUpdate,
        TimeoutsUpdate,
        TwinWatchInput,
        instance_name,
        upsert_stage,
    )


# Continue-as-new well before Temporal's own suggestion (4,096 events), so a node that lives
# for weeks keeps each run's history small and quick to replay.
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 600

# Heartbeat timeout of the polling activities (or the request's apiCall, if shorter): they
# heartbeat through every look, slow ones included, so a missed heartbeat means a dead or
# stalled worker, noticed (and the attempt retried elsewhere) within this long.
POLL_HEARTBEAT_TIMEOUT = timedelta(seconds=30)
# Marks runs whose wait stages look once more at the deadline before failing over.
STAGE_CHECK_PATCH = "stage-deadline-check"
# Marks runs in which a cancel that an activity's failure absorbed still ends the node Cancelled.
CANCEL_PATCH = "cancel-ends-cancelled"
# Marks runs whose drain of an idle node looks again after the cordon (and may be called off).
DRAIN_REVALIDATE_PATCH = "drain-revalidate"
# Marks runs whose join waits for the Node's GPUs after Ready.
GPU_REGISTRATION_PATCH = "gpu-registration-stage"
# Marks runs that remember every instance id seen under the node's names, look for twins over
# the provider's consistency window, and terminate every name (verified) on the way out.
MONEY_BY_IDS_PATCH = "money-by-ids"
# Marks runs whose Ready node is watched by events (the bridge's `node_facts`, the provider
# listing's `instance_seen`) and durable timers, with a slow backstop look, instead of a poll.
EVENT_DRIVEN_WATCH_PATCH = "event-driven-watch"
# Marks runs whose watch holds voluntary ends (expiry, idle) while do-not-disrupt pods or the
# Node's annotation hold the node (issue 21), saying so in a DisruptionHeld stage record.
DISRUPTION_RULES_PATCH = "node-disruption-rules"
# Marks runs that repair a Node NotReady past NODE_NOT_READY_REPAIR_AFTER while its instance runs
# (budgeted, no drain, a NodeRepair record) instead of ending it lost after NODE_LOST_AFTER.
NOT_READY_REPAIR_PATCH = "node-repair-not-ready"
# Marks runs in which terminationGracePeriod bounds a do-not-disrupt hold of an expired node: it
# lives at most expireAfter + terminationGracePeriod, drain included (Karpenter's bound).
GRACE_BOUNDS_HOLD_PATCH = "grace-bounds-expiry-hold"
# Marks runs whose voluntary ends (idle, expired) ask the pool's disruption budgets first.
DISRUPTION_BUDGETS_PATCH = "disruption-budgets"
# After the pool grants a voluntary end, the facts that came while the ask was in flight are
# judged again (a do-not-disrupt pod that started meanwhile holds the node) before the drain.
RECHECK_AFTER_GRANT_PATCH = "recheck-after-grant"
# Marks a life begun by this release's code (checked once, at the start of a new life, and
# carried in the state across continue-as-new): every patch above is taken as applied without
# asking `workflow.patched` again (each ask records a marker event); the short calls (select,
# settle, label, budget ask, stage look, release, mark unavailable, reports to the pool) run as
# local activities, one marker event each instead of three events and a workflow task; a pool's
# node waits for its instance and device in one activity, and for Node Ready and the GPUs on the
# bridge's `node_facts` with a durable timer, not polled (docs/lifecycle.md). Runs without it
# replay as they were recorded.
LIFE_V2_PATCH = "life-v2"
# Marks lives whose calls to the class ledger (settle, release) are activities, also in a v2
# life: as local activities they hold the node's workflow task open while the class workflow, on
# the same worker, answers the update, and under load the worker stopped handing out workflow
# tasks altogether (tests/test_class_refusal.py froze 1 run in 4 on a loaded machine, 0 in 20 as
# activities). Asked at each ledger call, not once per life: a v2 life begun before it replays.
LEDGER_ACTIVITIES_PATCH = "ledger-calls-as-activities"
# Marks lives whose launch, drain and terminate carry the report of the phase they begin
# (Launching, Draining, Terminating) and signal it to the pool themselves, while they work. As a
# local activity in the same workflow task, the report held that task, and so the schedule of
# the activity, until the pool's signal was accepted: with 100 nodes idle at once their reports
# queued on the one pool and the terminate calls came ~1 s later (bench/results/findings.md).
# Asked where a report would be carried, not once per life: a life begun before it replays.
CARRIED_REPORTS_PATCH = "reports-carried-by-activities"
# Marks a life begun by this release's code, asked once at the start of a new life instead of
# LIFE_V2_PATCH and carried in the state: a v2 life in which every node patch after it
# (LEDGER_ACTIVITIES_PATCH, CARRIED_REPORTS_PATCH) is taken as applied without asking. Each ask
# records a marker and a `TemporalChangeVersion` upsert: a new life records 2 events for its
# patches instead of 6. A life begun before it (a v2 life) asks them as before and replays.
LIFE_V3_PATCH = "life-v3"
# Marks a life begun by this release's code, asked once at the start of a new life instead of
# LIFE_V3_PATCH and carried in the state: a v3 life with fewer calls. The launch settles the
# price with the class ledger before it buys (`launch_instance`'s `settle`) instead of a settle
# activity before it, and not at all at the price the pool reserved (`NodeRequest.reserved_price`);
# a pool's node watches for twins inside its join's wait (`wait_for_join`); the release of an
# attempt terminates, removes the tailnet device, deletes the Node and, the life's last, gives
# the place back to the ledger in one activity (`release_attempt`) instead of four calls; the
# Pending phase's search attributes are those the pool started the run with. A short life: about
# 20 events fewer, and two workflow tasks fewer on a burst's way to a launch. A life begun
# before it replays.
LIFE_V4_PATCH = "life-v4"
# Marks a life begun by this release's code, asked once at the start of a new life instead of
# LIFE_V4_PATCH and carried in the state: a v4 life with fewer workflow tasks at its ends. An
# idle or expired node's drain asks the pool's budgets itself, first (`drain_node`'s `ask`), and
# looks again for do-not-disrupt right after its cordon, instead of an ask activity before it;
# the watch keeps its timer when a change only moves the next deadline later (it wakes early
# once and sleeps again); a node the pool bought for one pod ends its hold on that pod's place
# itself when the bridge first shows a workload pod on it (`NodeRequest.hold_ends_when_busy`),
# so the pool sends it nothing when the pod binds; the labels' call carries the Ready report;
# the release says when it is stuck (`stuck_at`) instead of a timer beside it. A short life:
# about 17 events fewer (docs/lifecycle.md). A life begun before it replays.
LIFE_V5_PATCH = "life-v5"
# A v2 join that heard nothing from the bridge looks for itself this often, or every watch
# interval if that is shorter (a lost signal, or a Node registered without the pool's labels,
# which the bridge does not follow).
JOIN_BACKSTOP = timedelta(seconds=30)
# ... once the bridge has told the node anything (it follows the Node). Until then (the Node not
# registered yet, or no bridge at all) the looks come sooner: after JOIN_FIRST_LOOK, doubling up
# to JOIN_BACKSTOP, so a node nobody tells is Ready a few seconds late, not half a minute.
JOIN_FIRST_LOOK = timedelta(seconds=2)
# A report to the pool (v2: a local activity that signals it): bounded, a few tries; a pool
# that is gone is nobody to tell.
REPORT_TIMEOUT = timedelta(seconds=10)
REPORT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5), maximum_attempts=5)
# A node a budget holds asks its pool again this often (each ask: a timer and an activity).
BUDGET_ASK_AGAIN = timedelta(minutes=1)
# An ask the pool could not take (Temporal's in-flight update limit) is no refusal: asked again
# after this, plus up to as much again at random (nodes that asked together do not again).
BUDGET_ASK_SOON = timedelta(seconds=5)
# Repair too (Karpenter caps concurrent repairs): a device-plugin rollout that takes every
# node's GPUs away must not end the whole pool at once.
_BUDGETED_ENDS = {
    EndReason.IDLE: DisruptionReason.EMPTY,
    EndReason.EXPIRED: DisruptionReason.EXPIRED,
    EndReason.REPAIR: DisruptionReason.REPAIR,
    EndReason.NOT_READY: DisruptionReason.REPAIR,
    EndReason.DRIFTED: DisruptionReason.DRIFTED,
    EndReason.CHEAPER: DisruptionReason.CHEAPER,
    EndReason.UNDERUTILIZED: DisruptionReason.UNDERUTILIZED,
}
# The ends a pool's `disrupt` asks for, by its reason (make-before-break replacement).
_DISRUPT_ENDS = {
    DisruptionReason.DRIFTED.value: EndReason.DRIFTED,
    DisruptionReason.CHEAPER.value: EndReason.CHEAPER,
    DisruptionReason.UNDERUTILIZED.value: EndReason.UNDERUTILIZED,
}
# A change of the pool's labels and taints that could not be applied (the API down, the Node
# being replaced) is tried again this much later; the node lives on meanwhile.
TEMPLATE_RETRY_AFTER = timedelta(minutes=1)
# Applying it: a few quick tries inside the watch (which waits for them), not API_RETRY's
# minutes: an evict must not wait behind a Kubernetes outage.
TEMPLATE_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=5), maximum_attempts=3)
# A launch that failed with one of these was refused before anything was bought: no create of
# it can still be landing, so its release need not wait out the consistency window.
_CLEAR_REFUSALS = ("CapacityError", "OfferRefused", "ConfigError", "TemplateError", "AuthError", "PermissionDenied", "ClassBudgetRefused")
# v4: a launch that failed with one of these was stopped by its settle with the class ledger.
_NOT_SETTLED = ("ClassBudgetRefused", "ClassBudgetRefusedOnRetry", "LedgerUnavailable")


class LaunchAttemptFailed(Exception):
    """This offer did not give a node; the next one may."""


class NotSettled(LaunchAttemptFailed):
    """v4: the launch's settle was refused by the class ledger, or the ledger did not answer:
    not the offer's fault, and no other offer is tried (the node ends Failed)."""


class NodeEvicted(Exception):
    """An `evict` signal arrived before the node was up."""


@workflow.defn(name="GPUNodeWorkflow")
class GPUNodeWorkflow:
    @workflow.init
    def __init__(self, inp: NodeWorkflowInput) -> None:
        self.legacy = frozen_node(inp)  # a run of release 31e9066 ends in its own code
        self.req = inp.request
        self.state = inp.state or NodeState()
        self._reports: list[asyncio.Future[None]] = []
        self._unreported: list[StageRecord] = []  # stage records the pool has not been sent yet
        self._twin_watch: asyncio.Future[None] | None = None
        self.v2 = False  # set by `run`: a life begun under LIFE_V2_PATCH (or LIFE_V3_PATCH)
        self.v3 = False  # set by `run`: a life begun under LIFE_V3_PATCH (or LIFE_V4_PATCH)
        self.v4 = False  # set by `run`: a life begun under LIFE_V4_PATCH (or LIFE_V5_PATCH)
        self.v5 = False  # set by `run`: a life begun under LIFE_V5_PATCH
        self._watch_timer: tuple[datetime, asyncio.Future[None]] | None = None  # v2: the watch's timer, when it fires
        self._asking = ""  # the budget asked for, while the ask is in flight (a v2 ask is a local activity: no pending activity shows it)

    # What the `instance_seen` and `budget_freed` signals ask of the watch lives in the state,
    # which continue-as-new carries (in fields of the workflow, one received just before it
    # was lost: a preempted instance unseen until the 45-minute backstop look).
    @property
    def _sighting(self) -> InstanceSighting | None:
        return self.state.sighting

    @_sighting.setter
    def _sighting(self, sighting: InstanceSighting | None) -> None:
        self.state.sighting = sighting

    @property
    def _budget_freed(self) -> bool:
        return self.state.budget_freed

    @_budget_freed.setter
    def _budget_freed(self, freed: bool) -> None:
        self.state.budget_freed = freed

    # --- messages ------------------------------------------------------------------------

    @workflow.signal
    def evict(self, request: EvictRequest) -> None:
        """Drain and terminate this node now. The first reason wins."""
        if self.legacy:
            return self.legacy.handle("evict", request)
        if self.state.evict_reason is None:
            self.state.evict_reason = request.reason or "manual"

    @workflow.signal
    def update_timeouts(self, u: TimeoutsUpdate) -> None:
        """The pool's new idle, drain and expiry settings; they apply from the next look."""
        if self.legacy:
            return self.legacy.handle("update_timeouts", u)
        timeouts = self.req.timeouts.model_copy(update={"idle": u.idle, "drain": u.drain, "expire_after": u.expire_after})
        if u.hold is not None:  # the pool's nominations: hold the pods' place, or no more
            timeouts = timeouts.model_copy(update={"bind_grace": u.hold or None})
        if "termination_grace" in u.model_fields_set:  # senders before it leave the node's as it was
            timeouts = timeouts.model_copy(update={"termination_grace": u.termination_grace})
        # Reasons the pool's budgets can never refuse: its drains for them do not ask (v5).
        timeouts = timeouts.model_copy(update={"unlimited_reasons": u.unlimited_reasons or []})
        self.req = self.req.model_copy(update={"timeouts": timeouts})
        self.state.settings_from_pool = True  # the pool says when the hold ends from now on

    @workflow.signal
    def update_template(self, u: TemplateUpdate) -> None:
        """The pool's template labels and taints changed: the watch applies the difference to
        the Node in place (only what tgp had set is removed; tgp's own labels stay)."""
        if self.legacy:
            return None
        if self.state.template_applied is None:  # what bring-up put (or will put) on the Node
            self.state.template_applied = TemplateUpdate(labels=self.req.labels, taints=self.req.taints)
        self.state.template_retry_at = None
        self.req = self.req.model_copy(update={"labels": dict(u.labels), "taints": list(u.taints)})

    @workflow.signal
    def node_facts(self, facts: NodeFacts) -> None:
        """The bridge's facts about the Node (sent on a change, and for every node after the
        bridge starts). Kept, even before the watch, unless older than the facts already kept
        (tgp.facts_order: an older send never overwrites a newer one)."""
        if self.legacy:
            return self.legacy.handle("node_facts", facts)
        # By the bridge's incarnation and sequence, not its clock (unnumbered facts of earlier
        # bridges as before: by `at`).
        take, self.state.facts_sources = take_facts(self.state.facts, self.state.facts_sources, facts)
        if take:
            self.state.facts = facts

    @workflow.signal
    def disrupt(self, request: DisruptRequest) -> None:
        """The pool: this node has been replaced (make-before-break) and its replacement is
        Ready; end voluntarily, for `request.reason` (Drifted, Cheaper), within the budget and
        not while do-not-disrupt holds it. The first request wins; a Ready node acts on it."""
        if self.legacy:
            return None
        if self.state.disrupt is None and request.reason in _DISRUPT_ENDS:
            self.state.disrupt = request
        elif not request.reason and self.state.phase is NodePhase.READY:
            self.state.disrupt = None  # called off (a re-shop that do-not-disrupt holds): it stays
            self.state.disrupt_held = ""

    @workflow.signal
    def budget_freed(self) -> None:
        """The pool: a disruption ended or its budgets changed; a node a budget holds asks again now."""
        if self.legacy:
            return None
        self._budget_freed = True

    @workflow.signal
    def instance_seen(self, sighting: InstanceSighting) -> None:
        """The provider's bulk listing shows the instance not plainly running (or not at all):
        the watch looks for itself before acting, since lists lag behind the truth."""
        if self.legacy:
            return self.legacy.handle("instance_seen", sighting)
        self._sighting = sighting

    @workflow.query
    def status(self) -> NodeStatus:
        if self.legacy:
            return self.legacy.query("status")
        offer, inst = self.state.offer, self.state.instance
        return NodeStatus(
            workflow_id=self.req.workflow_id,
            phase=self.state.phase,
            node_name=self.req.node_name,
            pool=self.req.pool,
            provider=offer.provider if offer else None,
            gpu_type=offer.gpu_type if offer else None,
            region=offer.region if offer else None,
            instance_id=inst.instance_id if inst else None,
            hourly_price=offer.hourly_price if offer else None,
            stages=self.state.stages,
            attempts=self.state.attempts,
            last_error=self.state.last_error,
            end_reason=self.state.end_reason,
            asking=self._asking,
        )

    # --- the life ------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: NodeWorkflowInput) -> NodeStatus:
        """Bring the node up, watch it, drain it; whatever happens, release what was bought."""
        if self.legacy:
            return await self.legacy.run()
        if self.state.watch is None and not self.state.life_v2:
            # A new life (a run continued as new is past bring-up: it keeps its version). Started by
            # a pool at a known version, it takes it from its request: no marker, no upsert.
            self.state.life_v5 = self.req.life >= 5 or workflow.patched(LIFE_V5_PATCH)
            self.state.life_v4 = self.state.life_v5 or workflow.patched(LIFE_V4_PATCH)
            self.state.life_v3 = self.state.life_v4 or workflow.patched(LIFE_V3_PATCH)
        self.v5 = self.state.life_v5
        self.v4 = self.state.life_v4
        self.v3 = self.state.life_v3
        self.v2 = self.v3 or self.state.life_v2 or workflow.patched(LIFE_V2_PATCH)
        self.state.life_v2 = self.v2
        try:
            if self.state.watch is None:  # a run continued as new is already past bring-up
                await self._bring_up()
            while True:
                end = await self._watch_until_done()
                if end in (EndReason.INTERRUPTED, EndReason.LOST):
                    final = NodePhase.INTERRUPTED  # the instance is gone: nothing left to drain
                    break
                if end is EndReason.NOT_READY:
                    # Its kubelet is gone: an eviction would be accepted but its pod never
                    # leave. Terminated at once (as Karpenter's repair does); deleting the Node
                    # lets the pod garbage collector remove its pods for their owners to recreate.
                    final = NodePhase.TERMINATED
                    break
                if await self._drain(end):
                    final = NodePhase.TERMINATED
                    break
        except NodeEvicted:
            final = NodePhase.TERMINATED
            if self._pods_before_ready():
                await self._drain_before_ready()
        except (LaunchAttemptFailed, ApplicationError, ActivityError) as exc:
            if self._cancel_requested():
                # The cancel reached an activity in flight (drain, label, a cleanup) and came
                # back as its failure: it is still a cancel, not a failed node.
                await self._finish_cancelled()
                raise asyncio.CancelledError() from None
            final = self._failed(exc)
        except asyncio.CancelledError:
            await self._finish_cancelled()
            raise
        return await self._finish(final)

    def _pods_before_ready(self) -> bool:
        """v2, evicted before Ready: the bridge says the Node is there with workload pods on it
        (pods that landed before the workflow called it Ready): they are drained, not killed."""
        facts = self.state.facts
        return self.v2 and self.state.phase is not NodePhase.READY and facts is not None and facts.present and facts.busy_pods > 0

    async def _drain_before_ready(self) -> None:
        """Drain the pods of a node evicted before Ready; a failed drain does not keep the
        instance (the release follows), a cancel still releases everything."""
        try:
            await self._drain(EndReason.EVICTED)
        except ActivityError as exc:
            if self._cancel_requested():
                await self._finish_cancelled()
                raise asyncio.CancelledError() from None
            workflow.logger.warning("the drain of a node evicted before Ready failed; terminating: %s", _describe(exc))
        except asyncio.CancelledError:
            await self._finish_cancelled()
            raise

    async def _finish(self, final: NodePhase) -> NodeStatus:
        """Release what was bought, then end in `final`.

        The cleanup runs in its own task, shielded: a cancel that lands meanwhile must not stop
        it half-way. The node waits for it and then ends Cancelled instead."""
        cleanup = asyncio.ensure_future(self._release_all())
        try:
            await asyncio.shield(cleanup)
        except asyncio.CancelledError:
            await cleanup
            await self._end(NodePhase.CANCELLED)
            raise
        await self._end(final)
        await workflow.wait_condition(workflow.all_handlers_finished)
        return self.status()

    async def _finish_cancelled(self) -> None:
        """Cancelled while alive: release what was bought, then end Cancelled.

        The cleanup starts at once, in this task, not in a shielded task as in `_finish`: its
        first commands (the phase, the terminate) then go out before the cancel of a poll in
        flight, which `_poll` asks for but Temporal hears of only on the loop's next turn.
        Histories of running nodes hold that order; another would not replay."""
        self.state.end_reason = self.state.end_reason or "cancelled"
        await self._release_all()
        await self._end(NodePhase.CANCELLED)

    async def _end(self, phase: NodePhase) -> None:
        """Enter the phase the node ends in and wait until the pool has every report, this last
        one included, before the run closes."""
        self._enter(phase)
        self._tell_pool()
        await asyncio.gather(*self._reports)

    def _failed(self, exc: LaunchAttemptFailed | ApplicationError | ActivityError) -> NodePhase:
        """A life that ends in failure keeps its cause as the last error, for the status and the
        pool's Event."""
        if isinstance(exc, ActivityError):
            self.state.last_error = _describe(exc)
        elif isinstance(exc, ApplicationError):
            # A non-retryable error the workflow has no plan for (bad config, auth).
            self.state.last_error = exc.message
        else:
            self.state.last_error = str(exc)
        self.state.end_reason = "failed"
        return NodePhase.FAILED

    async def _bring_up(self) -> None:
        """Select, settle the price with the class budget, launch and join, failing over to the
        next offer until one works."""
        self._enter(NodePhase.PENDING)
        self._tell_pool()
        tried = [a.offer.key for a in self.state.attempts]
        while len(self.state.attempts) < self.req.max_launch_attempts:
            self._check_evicted()
            offer = await self._select_offer(tried)
            self.state.offer = offer
            if not self.v4:
                await self._settle_with_class(offer)  # v4: the launch settles it, before it buys
            self._check_evicted()  # evicted while choosing: buy nothing
            attempt = LaunchAttempt(attempt=len(self.state.attempts) + 1, offer=offer, started_at=workflow.now())
            self.state.attempts.append(attempt)
            tried.append(offer.key)
            try:
                await self._launch(attempt)
                await self._join()
                await self._label_and_taint()
                return
            except NotSettled:
                raise  # past the failover, as a refused settle before the launch: the node ends Failed
            except LaunchAttemptFailed as exc:
                if self._cancel_requested():
                    raise asyncio.CancelledError() from None  # not this offer's fault: buy nothing more
                self._record(attempt, str(exc))
                self.state.last_error = f"attempt {attempt.attempt} on {offer.key}: {exc}"
                workflow.logger.warning("launch attempt failed, trying the next offer: %s", self.state.last_error)
                await self._release_attempt()
                await self._mark_unavailable(offer)
        raise LaunchAttemptFailed(
            f"gave up after {self.req.max_launch_attempts} launch attempts; last error: {self.state.last_error}"
        )

    async def _select_offer(self, tried: list[str]) -> Offer:
        """The best offer not yet tried. None left ends the node Failed, saying why."""
        choice = await self._call(
            NodeActivities.select_offer,
            SelectOfferInput(requirements=self.req.requirements, exclude=tried),
            timeout=self.req.timeouts.api_call,
            retry=API_RETRY,
            summary="select offer",
        )
        if choice.offer is None:
            if choice.matching == 0:
                why = f"no offer among {choice.seen} satisfies the requirements {self.req.requirements.model_dump(mode='json', exclude_defaults=True)}"
            else:
                why = f"all {choice.matching} matching offers were tried or recently failed"
            raise LaunchAttemptFailed(why if not self.state.last_error else f"{why}; last error: {self.state.last_error}")
        return choice.offer

    async def _settle_with_class(self, offer: Offer) -> None:
        """Tell the class ledger the price this node is about to pay, before anything is bought.
        A refusal (the class's maxHourlyCost would be exceeded) is raised past the failover in
        `_bring_up`: the node ends Failed rather than trying another offer. A node started
        without a class has no budget to settle."""
        if not self.req.class_workflow_id:
            return
        grant = await self._call(
            NodeClassActivities.settle_reservation,
            self._ledger_call(offer),
            timeout=self.req.timeouts.api_call,
            retry=API_RETRY,
            summary="settle price with the class budget",
            local=not self._since_v2(LEDGER_ACTIVITIES_PATCH),
        )
        if not grant.granted:
            raise LaunchAttemptFailed(f"class budget refused {offer.key} at ${offer.hourly_price}/h: {grant.reason}")

    def _reservation(self, offer: Offer | None) -> Reservation:
        return Reservation(
            node_id=self.req.workflow_id,
            pool=f"{self.req.namespace}/{self.req.pool}",
            hourly_price=offer.hourly_price if offer else None,
        )

    async def _launch(self, attempt: LaunchAttempt) -> None:
        """Mint the key and buy the instance (one activity: the key never leaves it), then
        wait for the instance to run."""
        offer = attempt.offer
        # The class's account for this provider (a reference; the key is read by the activities).
        credentials = self.req.requirements.credentials.get(offer.provider)
        # Before the phase: its upsert then says this attempt has no instance yet (not the last one's).
        self.state.instance = InstanceRef(
            provider=offer.provider, instance_name=instance_name(self.req.node_name, attempt.attempt), credentials=credentials
        )
        self._enter(NodePhase.LAUNCHING)
        report = self._tell_pool(carry=True)
        if self._money_by_ids():
            self._remember(self.state.instance)
        if not self.v2:
            self._upsert_offer_attributes(offer)  # v2: with the phase's (`_enter`), one event
        launch_input = LaunchInput(
            node_name=self.req.node_name,
            attempt=attempt.attempt,
            offer=offer,
            credentials=credentials,
            tailnet_tags=self.req.tailnet_tags,
            tailnet=self.req.tailnet,
            tailnet_ref=self.req.tailnet_ref,
            boot=self.req.boot,
            pool=self.req.pool,
            # v2: the Node registers with the labels that name its workflow, so the
            # bridge's facts reach the join (Ready, GPUs) before tgp labels it.
            labels={**self.req.labels, **self._own_labels(pool_only=True)} if self.v2 else self.req.labels,
            taints=[*self.req.taints, TAINT_JOINING] if self.v2 else self.req.taints,
            unavailable_offer_ttl=self.req.unavailable_offer_ttl,
            demand_since=self.req.demand_since,
        )
        launch = workflow.start_activity_method(
            NodeActivities.launch_instance,
            # v4: every argument (the SDK decodes each by its type), the ledger's settle third.
            args=[launch_input, report, self._settle_call(offer)] if self.v4 else self._with_report(launch_input, report),
            # The whole stage budget, not one API call's: a create may wait behind a provider's
            # pacer. The heartbeat notices a dead worker; a live attempt is never retried
            # beside itself (that is how twins get bought).
            start_to_close_timeout=self.req.timeouts.launch,
            schedule_to_close_timeout=self.req.timeouts.launch,
            heartbeat_timeout=min(self.req.timeouts.api_call, POLL_HEARTBEAT_TIMEOUT),
            retry_policy=LAUNCH_RETRY,
            summary=f"launch {offer.gpu_type} on {offer.provider} ({offer.region}, ${offer.hourly_price}/h)",
        )
        try:
            # Shielded: a workflow cancel must not abandon a purchase in flight.
            result: LaunchResult = await asyncio.shield(launch)
        except asyncio.CancelledError:
            try:
                self._launched(await launch)
            except ActivityError as exc:
                self._launch_failed(exc)  # nothing bought, or cleanup finds it by name
            raise
        except ActivityError as exc:
            self._launch_failed(exc)
            if isinstance(exc.cause, ApplicationError) and exc.cause.type in _NOT_SETTLED:
                if exc.cause.type == "ClassBudgetRefused":
                    # Refused on the launch's first try, before anything was minted or bought:
                    # no attempt to release. (On a later try an earlier one may have bought:
                    # the attempt stays, and the release looks for its name.)
                    self.state.attempts.remove(attempt)
                    self.state.seen = [ref for ref in self.state.seen if ref.instance_name != self.state.instance.instance_name]
                    self.state.instance = None
                raise NotSettled(exc.cause.message) from None
            if isinstance(exc.cause, ApplicationError) and exc.cause.type in ("ConfigError", "TemplateError"):
                raise  # a bad template or join Secret fails on every offer: end now, say what to fix
            raise LaunchAttemptFailed(_describe(exc)) from None
        self._launched(result)
        self._record(attempt, "launched", result.instance.instance_id)
        if self._money_by_ids() and not self._twins_with_join():
            self._twin_watch = asyncio.ensure_future(self._watch_for_twins())
        if self._joins_by_facts():
            return  # the join waits for the instance and its device at once
        await self._wait_for(
            NodeActivities.wait_for_instance_running,
            self.state.instance,
            timeout=self.req.timeouts.launch,
            summary="wait for instance to run",
            timeout_error="launch timeout: the instance did not reach running within {}",
            recheck=StageCheck(instance=self.state.instance),
        )

    def _launched(self, result: LaunchResult) -> None:
        assert self.state.instance is not None
        self.state.instance = self.state.instance.model_copy(update={"instance_id": result.instance.instance_id, "account": result.account})
        if self._money_by_ids():
            ids = sorted({*self.state.instance.known_ids, *result.seen_ids, result.instance.instance_id})
            self._remember(self.state.instance.model_copy(update={"created_by": workflow.now(), "known_ids": ids}))
        if result.key_id:
            self.state.key_ids.append(result.key_id)

    def _launch_failed(self, exc: ActivityError) -> None:
        """A launch that failed may still have bought (an unknown outcome, a killed worker): its
        name is looked at until the consistency window after now has passed. A clear refusal
        bought nothing."""
        if self.state.instance is None or not self._money_by_ids():
            return
        if isinstance(exc.cause, ApplicationError) and exc.cause.type in _CLEAR_REFUSALS:
            return
        self._remember(self.state.instance.model_copy(update={"created_by": workflow.now()}))

    def _money_by_ids(self) -> bool:
        return self._patched(MONEY_BY_IDS_PATCH)

    def _remember(self, ref: InstanceRef) -> None:
        """Keep `ref` (a launch attempt's name, with every id seen under it) in the state, and as
        the current instance when it is the current attempt's."""
        merged = ref
        for i, known in enumerate(self.state.seen):
            if known.instance_name == ref.instance_name:
                merged = ref.model_copy(
                    update={
                        "known_ids": sorted(set(known.known_ids) | set(ref.known_ids)),
                        "created_by": ref.created_by or known.created_by,
                        "instance_id": ref.instance_id or known.instance_id,
                    }
                )
                self.state.seen[i] = merged
                break
        else:
            self.state.seen.append(ref)
        current = self.state.instance
        if current is not None and current.instance_name == ref.instance_name:
            self.state.instance = current.model_copy(
                update={"known_ids": merged.known_ids, "created_by": merged.created_by, "instance_id": current.instance_id or merged.instance_id}
            )

    def _twins_with_join(self) -> bool:
        """v4, a pool's node: the twin watch runs inside the join's wait (`wait_for_join`)."""
        return self.v4 and self._joins_by_facts() and self._money_by_ids()

    def _twin_input(self) -> TwinWatchInput:
        assert self.state.instance is not None
        return TwinWatchInput(instances=list(self.state.seen), keep=self.state.instance.instance_id)

    async def _watch_for_twins(self) -> None:
        """In the background while the node lives: end every instance under its names but the
        recorded one until the provider's consistency window has passed (a create can land
        after its caller gave up), and remember every id seen. A failure leaves it to the
        release and the sweeper."""
        assert self.state.instance is not None
        try:
            refs = await workflow.execute_activity_method(
                NodeActivities.watch_for_twins,
                self._twin_input(),
                start_to_close_timeout=self.req.timeouts.launch + self.req.timeouts.api_call,
                heartbeat_timeout=min(self.req.timeouts.api_call, POLL_HEARTBEAT_TIMEOUT),
                retry_policy=API_RETRY,
                summary="end twins over the consistency window",
            )
        except ActivityError as exc:
            workflow.logger.warning("looking for twins failed; the release and the sweeper end them: %s", _describe(exc))
            return
        for ref in refs:
            self._remember(ref)

    def _stop_twin_watch(self) -> None:
        if self._twin_watch is not None and not self._twin_watch.done():
            self._twin_watch.cancel()
        self._twin_watch = None

    async def _join(self) -> None:
        """Both halves of joining, each with its own timeout and failure reason."""
        self._enter(NodePhase.JOINING)
        self._tell_pool()
        t = self.req.timeouts
        device = DeviceQuery(hostname=self.req.node_name, tags=self.req.tailnet_tags, tailnet=self.req.tailnet, tailnet_ref=self.req.tailnet_ref)
        if self._joins_by_facts():
            # One wait (one activity, one workflow task when it ends) for the instance to run
            # and its device to join, within both stages' budgets; the device is looked for
            # every second, the provider read at its own pace.
            check = StageCheck(instance=self.state.instance, device=device)
            twins = self._twins_with_join()
            joined = await self._wait_for(
                NodeActivities.wait_for_join if twins else NodeActivities.wait_for_tailnet_join,
                check,
                # v4: the twin watch goes with the join (one activity, one workflow task).
                more=(self._twin_input(),) if twins else (),
                timeout=t.launch + t.tailnet_join,
                summary="wait for the instance to run and join the tailnet",
                timeout_error="join timeout: no tailnet device within {} of the launch (did the instance boot, the boot payload run and reach the control server?)",
                recheck=check,
            )
            if twins and isinstance(joined, JoinResult) and joined.twins is not None:
                for ref in joined.twins:
                    self._remember(ref)
            elif twins:
                self._twin_watch = asyncio.ensure_future(self._watch_for_twins())  # the rest of its window
        else:
            await self._wait_for(
                NodeActivities.wait_for_tailnet_device,
                device,
                timeout=t.tailnet_join,
                summary="wait for tailnet device",
                timeout_error="join timeout: no tailnet device within {} (did the boot payload run and reach the control server?)",
                recheck=StageCheck(instance=self.state.instance, device=device),
            )
        self._stamp(Stage.TAILNET_JOINED)
        ready_error = "join timeout: the Node did not become Ready within {} (kubelet registration or GPU driver)"
        ready_check = StageCheck(instance=self.state.instance, node_name=self.req.node_name)
        if self._joins_by_facts():
            await self._wait_for_facts(lambda f: f.present and f.ready, timeout=t.node_ready, summary="Node Ready", timeout_error=ready_error, recheck=ready_check)
        else:
            await self._wait_for(
                NodeActivities.wait_for_node_ready,
                self.req.node_name,
                timeout=t.node_ready,
                summary="wait for Node Ready",
                timeout_error=ready_error,
                recheck=ready_check,
            )
        if not self._patched(GPU_REGISTRATION_PATCH):
            return  # a run from before the GPU stage: Ready was enough
        self._stamp(Stage.NODE_READY)
        gpus = self.state.offer.gpu_count if self.state.offer else 1
        gpus_error = f"join timeout: the Node's allocatable {GPU_RESOURCE} did not reach {gpus} within {{}} (GPU driver or device plugin)"
        gpus_check = StageCheck(instance=self.state.instance, node_name=self.req.node_name, gpus=gpus)
        if self._joins_by_facts():
            await self._wait_for_facts(
                lambda f: f.present and f.ready and f.gpus >= gpus,
                timeout=t.gpu_registration,
                summary=f"{gpus} GPUs registered",
                timeout_error=gpus_error,
                recheck=gpus_check,
            )
        else:
            await self._wait_for(
                NodeActivities.wait_for_gpus,
                GpuQuery(node_name=self.req.node_name, gpus=gpus),
                timeout=t.gpu_registration,
                summary=f"wait for {gpus} GPUs to register",
                timeout_error=gpus_error,
                recheck=gpus_check,
            )
        self._stamp(Stage.GPUS_REGISTERED)

    async def _label_and_taint(self) -> None:
        offer = self.state.offer
        assert offer is not None
        labels = {
            **self.req.labels,  # first: tgp's own labels always win (tgp.io/managed must stay "true")
            **self._own_labels(),
        }
        report = None
        if self.v5:  # the labels' call carries the Ready report (sent once they are on)
            self._enter(NodePhase.READY)
            report = self._tell_pool(carry=True)
        await self._call(
            NodeActivities.label_and_taint_node,
            LabelInput(
                node_name=self.req.node_name,
                labels=labels,
                taints=self.req.taints,
                launched_at=self.state.attempts[-1].started_at,
                remove_taints=[TAINT_JOINING] if self.v2 else [],  # pods may land from now on
            ),
            timeout=self.req.timeouts.api_call,
            retry=API_RETRY,
            summary="label and taint",
            more=(report,) if report is not None else (),
        )
        if not self.v5:
            self._enter(NodePhase.READY)
            self._tell_pool()
        self.state.watch = WatchState(ready_at=workflow.now())

    def _joins_by_facts(self) -> bool:
        """v2, for a node of a pool: its Node Ready and GPUs come as the bridge's facts. The
        bridge runs beside every pool (it starts them from their CRDs); a node started without
        a pool (by hand, by a test) may have nobody telling it, and polls as before."""
        return self.v2 and bool(self.req.pool_workflow_id)

    def _own_labels(self, *, pool_only: bool = False) -> dict[str, str]:
        """tgp's labels on the Node: managed, the pool's (which name the node's workflow, for the
        bridge), and unless `pool_only` the offer's."""
        labels = {LABEL_MANAGED: "true", LABEL_POOL: self.req.pool, LABEL_POOL_NAMESPACE: self.req.namespace}
        offer = self.state.offer
        if not pool_only and offer is not None:
            labels.update({LABEL_PROVIDER: offer.provider, LABEL_GPU_TYPE: offer.gpu_type, LABEL_REGION: offer.region})
        return labels

    async def _watch_until_done(self) -> EndReason:
        """Watch the node until it is idle, expired, gone or evicted: by events and timers, or
        (runs from before the event-driven watch) by a look every watch interval."""
        assert self.state.instance is not None and self.state.watch is not None
        if self._patched(EVENT_DRIVEN_WATCH_PATCH):
            return await self._watch_by_events()
        while True:
            t = self.req.timeouts  # `update_timeouts` may have changed them since the last look
            if history_is_long(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
                await workflow.wait_condition(workflow.all_handlers_finished)
                await asyncio.gather(*self._reports)
                workflow.continue_as_new(NodeWorkflowInput(request=self.req, state=self.state))
            try:
                await workflow.wait_condition(
                    lambda: self.state.evict_reason is not None, timeout=t.watch_interval, timeout_summary="watch"
                )
            except asyncio.TimeoutError:
                pass
            else:
                self.state.end_reason = f"evicted: {self.state.evict_reason}"
                return EndReason.EVICTED
            try:
                obs = await workflow.execute_activity_method(
                    NodeActivities.observe_node,
                    ObserveInput(instance=self.state.instance, node_name=self.req.node_name),
                    start_to_close_timeout=self.req.timeouts.api_call,
                    retry_policy=API_RETRY,
                    summary="observe",
                )
            except ActivityError as exc:
                if self._cancel_requested():
                    raise asyncio.CancelledError() from None  # the cancel landed during the look
                # The provider or Kubernetes API is down: keep the node (it may be running a
                # job) and look again next interval rather than end its life for an outage.
                self.state.last_error = f"could not observe the node: {_describe(exc)}"
                continue
            verdict = judge_observation(obs, self.state.watch, workflow.now(), t)
            self.state.watch = verdict.state
            if verdict.end is not None:
                self.state.end_reason = f"{verdict.end.value}: {verdict.detail}"
                return verdict.end

    async def _watch_by_events(self) -> EndReason:
        """The watch of a Ready node, with no request at rest: it holds the latest view of the
        node (the bridge's facts, the instance as last looked at) and sleeps on one durable timer
        until the first deadline of the judge (idle, expiry, lost or unhealthy) or the backstop
        look, whichever comes first. It wakes early on an eviction, new facts, a sighting from
        the provider's listing (then it looks itself: one describe) or new settings.

        tgp.lifecycle's property test proves that judging only at changes and at `next_deadline`
        ends a node when and why a continuous poller would."""
        assert self.state.instance is not None and self.state.watch is not None
        if not self.state.watch.disruption_rules and self._patched(DISRUPTION_RULES_PATCH):
            self.state.watch = self.state.watch.model_copy(update={"disruption_rules": True})
        if self.state.watch.disruption_rules and not self.state.watch.not_ready_repair and self._patched(NOT_READY_REPAIR_PATCH):
            self.state.watch = self.state.watch.model_copy(update={"not_ready_repair": True})
        if self.state.watch.disruption_rules and not self.state.watch.grace_bounds_hold and self._patched(GRACE_BOUNDS_HOLD_PATCH):
            self.state.watch = self.state.watch.model_copy(update={"grace_bounds_hold": True})
        if self.state.watch.view is None:
            self._seed_view()
        while True:
            t = self.req.timeouts
            if self.state.evict_reason is not None:
                self.state.end_reason = f"evicted: {self.state.evict_reason}"
                return EndReason.EVICTED
            if self._template_due():
                await self._apply_template()
            if self._budget_freed:
                self._budget_freed = False
                self.state.watch = self.state.watch.model_copy(update={"blocked_until": None})
            if self._sighting is not None or self._backstop_due() <= workflow.now():
                self._sighting = None
                await self._look()
            self._apply_facts()
            if self._end_hold_when_busy():
                t = self.req.timeouts
            watch = self.state.watch
            if watch.view is not None:
                verdict = judge_view(watch, workflow.now(), t)
                self.state.watch = watch = verdict.state.model_copy(update={"held": verdict.held})
                facts = self.state.facts
                if verdict.end is not None and self._asks_in_drain(verdict.end):
                    if not self._budget_blocked():  # v5: the drain asks the budgets first
                        self.state.end_reason = f"{verdict.end.value}: {verdict.detail}"
                        return verdict.end
                elif verdict.end is not None and not await self._budget_allows(verdict.end):
                    watch = self.state.watch
                    assert watch is not None
                elif verdict.end is not None and self._held_after_the_ask(facts):
                    continue  # judged again at the top of the loop: it holds now (and says so)
                elif verdict.end is not None:
                    self.state.end_reason = f"{verdict.end.value}: {verdict.detail}"
                    if verdict.end in (EndReason.REPAIR, EndReason.NOT_READY):
                        self._stamp(Stage.NODE_REPAIR, verdict.detail)  # the pool's NodeRepair Warning
                    return verdict.end
                if verdict.held and verdict.held != verdict.state.held:
                    # A voluntary end is due but held (or held by others now): say so once.
                    workflow.logger.info("disruption held: %s", verdict.held)
                    self._stamp(Stage.DISRUPTION_HELD, verdict.held)
                    self._tell_pool()
                    workflow.set_current_details(self._details())
                if self.state.disrupt is not None:
                    end = await self._disrupt_due()
                    if end is not None:
                        return end
                    watch = self.state.watch
                    assert watch is not None
            if history_is_long(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
                await workflow.wait_condition(workflow.all_handlers_finished)
                await asyncio.gather(*self._reports)
                workflow.continue_as_new(NodeWorkflowInput(request=self.req, state=self.state))
            due = [d for d in (next_deadline(watch, t), self._backstop_due()) if d is not None]
            if watch.blocked_until is not None and watch.blocked_until > workflow.now():
                # A budget holds a voluntary end that is already due: ask again then.
                due = [d for d in due if d > workflow.now()] + [watch.blocked_until]
            if self.state.template_retry_at is not None and self.state.template_retry_at > workflow.now():
                due.append(self.state.template_retry_at)  # a change that failed is tried again then
            sleep = max(min(due) - workflow.now(), timedelta(milliseconds=1))
            req, facts, disrupt = self.req, self.state.facts, self.state.disrupt
            if self.v2:
                await self._sleep_until(workflow.now() + sleep, lambda: self.state.evict_reason is not None
                    or self._sighting is not None
                    or self.state.facts is not facts
                    or self.req is not req
                    or self.state.disrupt is not disrupt
                    or self._budget_freed)
                continue
            try:
                await workflow.wait_condition(
                    lambda: self.state.evict_reason is not None
                    or self._sighting is not None
                    or self.state.facts is not facts
                    or self.req is not req
                    or self.state.disrupt is not disrupt
                    or self._budget_freed,
                    timeout=sleep,
                    timeout_summary="watch",
                )
            except asyncio.TimeoutError:
                pass

    def _held_after_the_ask(self, facts: NodeFacts | None) -> bool:
        """New facts came while the pool was asked (a do-not-disrupt pod or annotation, a pod
        that makes the node busy): judged with them, is the voluntary end no longer due?"""
        if self.state.facts is facts:
            return False
        self._apply_facts()
        watch = self.state.watch
        assert watch is not None
        return judge_view(watch, workflow.now(), self.req.timeouts).end is None and self._patched(RECHECK_AFTER_GRANT_PATCH)
    async def _disrupt_due(self) -> EndReason | None:
        """The pool's `disrupt` (its replacement is Ready): the end to take now, or None while
        do-not-disrupt holds the node (recorded once per holder set: DisruptionHeld) or a budget
        does (DisruptionBlocked, asked again later). Only a Ready node with a view gets here."""
        d, watch = self.state.disrupt, self.state.watch
        assert d is not None and watch is not None and watch.view is not None
        end = _DISRUPT_ENDS[d.reason]
        holders, holding = held_by(watch.view)
        if holders:
            held = held_message(DisruptionReason(d.reason), holders, total=holding)
            if held != self.state.disrupt_held:
                self.state.disrupt_held = held
                workflow.logger.info("disruption held: %s", held)
                self._stamp(Stage.DISRUPTION_HELD, held)
                self._tell_pool()
            return None
        self.state.disrupt_held = ""
        facts = self.state.facts
        if not await self._budget_allows(end):
            return None
        if self.state.disrupt is not d:
            return None  # called off while the pool was asked (its replacement is let go): it stays
        if self.state.facts is not facts:
            # Facts came during the ask: a do-not-disrupt pod that started holds it (said next turn).
            self._apply_facts()
            if watch := self.state.watch:
                if watch.view is not None and held_by(watch.view)[0]:
                    return None
        if d.replacement:
            self.state.end_reason = f"{end.value}: replaced by {d.replacement} (make-before-break){': ' + d.detail if d.detail else ''}"
        else:  # a consolidation removal: its pods fit on the nodes that stay
            self.state.end_reason = f"{end.value}: {d.detail or 'consolidated'}"
        return end
    async def _sleep_until(self, wake_at: datetime, woken: Callable[[], bool]) -> None:
        """v2: the watch's wait, until `wake_at` or `woken()`. The timer is kept across waits
        while the deadline stays where it was (a signal that moves no deadline, such as a
        pod's arrival on a busy node, starts and cancels no timer); a moved deadline cancels
        it and starts another."""
        timer = self._watch_timer
        if self.v5 and timer is not None and not timer[1].done() and timer[0] <= wake_at:
            wake_at = timer[0]  # v5: an early timer is kept (the watch judges again and sleeps on)
        if timer is None or timer[1].done() or timer[0] != wake_at:
            if timer is not None and not timer[1].done():
                timer[1].cancel()
            timer = (wake_at, asyncio.ensure_future(workflow.sleep(max(wake_at - workflow.now(), timedelta(milliseconds=1)), summary="watch")))
            self._watch_timer = timer
        await workflow.wait_condition(lambda: timer[1].done() or woken())

    async def _budget_allows(self, end: EndReason) -> bool:
        """Whether a voluntary end (idle, expired) may begin now, within the pool's disruption
        budgets: the pool is asked (update `may_disrupt`, bounded: a pool that is gone or does
        not answer does not hold the node). A refusal holds the node until BUDGET_ASK_AGAIN
        from now, recorded once per message as DisruptionBlocked. Runs from before budgets
        do not ask."""
        reason = _BUDGETED_ENDS.get(end)
        watch = self.state.watch
        assert watch is not None
        if reason is None or not self.req.pool_workflow_id or not self._patched(DISRUPTION_BUDGETS_PATCH):
            return True
        now = workflow.now()
        if watch.blocked_until is not None and now < watch.blocked_until:
            return False
        self._asking = reason.value
        try:
            answer = await self._call(
                NodeActivities.ask_pool_to_disrupt,
                PoolAsk(
                    pool_workflow_id=self.req.pool_workflow_id,
                    ask=DisruptionAsk(workflow_id=self.req.workflow_id, node_name=self.req.node_name, reason=reason.value),
                ),
                timeout=POOL_ANSWER_TIMEOUT + timedelta(seconds=10),
                retry=API_RETRY,
                summary=f"ask the pool: {reason.value} disruption",
                # An activity, not a local one, in every life: signals that come while the pool is
                # asked (the bridge's facts: a do-not-disrupt pod that started) are delivered
                # before the answer is acted on (`_held_after_the_ask`); during a local activity
                # the worker holds the workflow task and they would arrive only after the drain began.
                local=False,
            )
        except ActivityError as exc:
            if self._cancel_requested():
                raise asyncio.CancelledError() from None
            workflow.logger.warning("could not ask the pool about the budget, going ahead: %s", _describe(exc))
            answer = DisruptionAnswer(allowed=True)
        finally:
            self._asking = ""
        return self._take_answer(answer)

    def _take_answer(self, answer: DisruptionAnswer) -> bool:
        """The pool's answer to a budget ask: allowed, or held until asked again (soon, when the
        pool could not take the ask; else after BUDGET_ASK_AGAIN, a DisruptionBlocked record
        once per message)."""
        watch = self.state.watch
        assert watch is not None
        if answer.allowed:
            self.state.watch = watch.model_copy(update={"blocked_until": None, "blocked": ""})
            return True
        if answer.unasked:  # not a refusal: no DisruptionBlocked, ask again soon (jittered)
            soon = BUDGET_ASK_SOON * (1 + workflow.random().random())
            self.state.watch = watch.model_copy(update={"blocked_until": workflow.now() + soon})
            return False
        self.state.watch = watch.model_copy(update={"blocked_until": workflow.now() + BUDGET_ASK_AGAIN, "blocked": answer.message})
        if answer.message != watch.blocked:
            self._stamp(Stage.DISRUPTION_BLOCKED, answer.message)
            self._tell_pool()
        return False

    def _end_hold_when_busy(self) -> bool:
        """v5, a node started with `hold_ends_when_busy`: the first workload pod the bridge shows
        on it ends its bind-grace hold (its pods bound: an idle node idles out after the idle
        timeout, not after the grace), unless the pool has sent settings since the start (then
        the pool says). The pool models the same rule and sends nothing for it. Whether it ended."""
        watch, t = self.state.watch, self.req.timeouts
        if not (self.v5 and self.req.hold_ends_when_busy) or self.state.settings_from_pool or t.bind_grace is None:
            return False
        if watch is None or watch.view is None or watch.view.busy_pods == 0:
            return False
        self.req = self.req.model_copy(update={"timeouts": t.model_copy(update={"bind_grace": None})})
        return True

    def _asks_in_drain(self, end: EndReason) -> bool:
        """v5: a voluntary end (idle, expired) whose drain looks for holds and asks the pool's
        budgets itself; `_drain` leaves the ask out when the pool said they cannot refuse
        (`unlimited_reasons`)."""
        return self.v5 and end in (EndReason.IDLE, EndReason.EXPIRED) and bool(self.req.pool_workflow_id)

    def _budget_blocked(self) -> bool:
        """A budget refused the node's voluntary end: not asked again before `blocked_until`."""
        watch = self.state.watch
        assert watch is not None
        return watch.blocked_until is not None and workflow.now() < watch.blocked_until

    def _template_due(self) -> bool:
        """Whether the pool's labels and taints differ from what tgp last put on the Node, and
        are not waiting for a retry."""
        applied = self.state.template_applied
        if applied is None or applied == TemplateUpdate(labels=self.req.labels, taints=self.req.taints):
            return False
        return self.state.template_retry_at is None or workflow.now() >= self.state.template_retry_at

    async def _apply_template(self) -> None:
        """Apply the pool's changed labels and taints to the Node in place (one activity per
        change): set the new and changed ones, remove those tgp had set that the pool no longer
        lists, never tgp's own. A failure is tried again TEMPLATE_RETRY_AFTER later; it never
        ends the node."""
        applied = self.state.template_applied
        assert applied is not None
        wanted = TemplateUpdate(labels=self.req.labels, taints=self.req.taints)
        own = self._own_labels()
        change = LabelInput(
            node_name=self.req.node_name,
            labels={**wanted.labels, **own},
            taints=wanted.taints,
            remove_labels=label_removals(applied.labels, wanted.labels, own),
            remove_taints=taint_removals(applied.taints, wanted.taints),
        )
        try:
            await workflow.execute_activity_method(
                NodeActivities.label_and_taint_node,
                change,
                start_to_close_timeout=self.req.timeouts.api_call,
                retry_policy=TEMPLATE_RETRY,
                summary="apply the pool's new labels and taints",
            )
        except ActivityError as exc:
            if self._cancel_requested():
                raise asyncio.CancelledError() from None
            self.state.last_error = f"could not apply the pool's new labels and taints (trying again): {_describe(exc)}"
            self.state.template_retry_at = workflow.now() + TEMPLATE_RETRY_AFTER
            return
        self.state.template_applied, self.state.template_retry_at = wanted, None

    def _seed_view(self) -> None:
        """The watch's first view: the bridge's facts if they came during bring-up, with the
        instance as the launch left it (running). With none yet, a look is due at once."""
        assert self.state.watch is not None and self.state.instance is not None
        now = workflow.now()
        if self.state.facts is None:
            self.state.watch = self.state.watch.model_copy(update={"looked_at": now - backstop_period(self.req.timeouts)})
            return
        ref = self.state.instance
        running = Instance(provider=ref.provider, instance_id=ref.instance_id or "", name=ref.instance_name, state=InstanceState.RUNNING)
        self.state.watch = self.state.watch.model_copy(update={"looked_at": now, "view": NodeObservation(instance=running, node=None, busy_pods=0)})

    def _backstop_due(self) -> datetime:
        watch = self.state.watch
        assert watch is not None
        return (watch.looked_at or watch.ready_at) + backstop_period(self.req.timeouts)

    async def _look(self) -> None:
        """Look at the node for oneself (the observe activity: provider describe, Node, its
        pods), as a local activity: a look records one marker in history instead of three
        activity events and a second workflow task, which keeps a node at rest under ten events
        an hour. A look that fails keeps the node (an outage is no reason to end a life)."""
        assert self.state.instance is not None and self.state.watch is not None
        try:
            obs: NodeObservation = await workflow.execute_local_activity_method(
                NodeActivities.observe_node,
                ObserveInput(instance=self.state.instance, node_name=self.req.node_name),
                start_to_close_timeout=self.req.timeouts.api_call,
                retry_policy=API_RETRY,
                summary="look",
            )
        except FailureError as exc:  # a local activity's failure comes unwrapped, as its cause
            if self._cancel_requested():
                raise asyncio.CancelledError() from None  # the cancel landed during the look
            self.state.last_error = f"could not observe the node: {_describe_failure(exc)}"
            self.state.watch = self.state.watch.model_copy(update={"looked_at": workflow.now()})
            return
        now = workflow.now()
        self.state.watch = apply_view(self.state.watch, obs, now, self.req.timeouts).model_copy(update={"looked_at": now})

    def _apply_facts(self) -> None:
        """Take the bridge's latest facts into the view, dated when the bridge saw them."""
        watch, facts = self.state.watch, self.state.facts
        assert watch is not None
        if facts is None or facts == watch.facts:
            return
        instance = watch.view.instance if watch.view is not None else None
        if watch.view is None:
            self._seed_view()
            watch = self.state.watch
            assert watch is not None and watch.view is not None
            instance = watch.view.instance
        at = min(facts.at, workflow.now())
        self.state.watch = apply_view(watch, facts_view(facts, instance), at, self.req.timeouts).model_copy(update={"facts": facts})

    async def _drain(self, end: EndReason) -> bool:
        """Drain the node; False when the drain of an idle node was called off because a
        workload pod had arrived since the idle verdict: the node is Ready again."""
        self._enter(NodePhase.DRAINING)
        report = self._tell_pool(carry=True)
        revalidate = end is EndReason.IDLE and self._patched(DRAIN_REVALIDATE_PATCH)
        # The pool's terminationGracePeriod bounds the drain from when it began: at the
        # deadline the instance is terminated, over PDBs and do-not-disrupt pods.
        began = workflow.now()
        timeout, bound = self.req.timeouts.drain, ""
        deadline = termination_deadline(began, self.req.timeouts.termination_grace)
        lifetime = longest_life(self.state.watch, self.req.timeouts) if end is EndReason.EXPIRED and self.state.watch is not None else None
        if deadline is not None and lifetime is not None:
            deadline = max(began, min(deadline, lifetime))  # expireAfter + terminationGracePeriod: no longer
        if deadline is not None and deadline - began < timeout:
            timeout, bound = deadline - began, "terminationGracePeriod"
        ask, holds = None, False
        if self._asks_in_drain(end):
            reason = _BUDGETED_ENDS[end].value
            # Not past expireAfter + terminationGracePeriod: do-not-disrupt holds no longer.
            holds = not (lifetime is not None and began >= lifetime)
            # A reason the pool's budgets can never refuse is not asked: the answer would be yes.
            if reason not in self.req.timeouts.unlimited_reasons:
                ask = PoolAsk(
                    pool_workflow_id=self.req.pool_workflow_id or "",
                    ask=DisruptionAsk(workflow_id=self.req.workflow_id, node_name=self.req.node_name, reason=reason),
                )
        # An activity in every life: it may wait on pods (heartbeating), and the window between
        # its schedule and its end is the Draining that the pool's budgets count.
        result: DrainResult = await workflow.execute_activity_method(
            NodeActivities.drain_node,
            args=self._with_report(
                DrainInput(
                    node_name=self.req.node_name,
                    timeout=timeout,
                    revalidate=revalidate,
                    bound=bound,
                    delete_at_deadline=bool(bound),
                    ask=ask,
                    holds=holds,
                    # A node that goes ends with its release; its instance stops billing at the drain's end.
                    terminate=self.state.instance,
                ),
                report,
            ),
            start_to_close_timeout=timeout + self.req.timeouts.api_call + (POOL_ANSWER_TIMEOUT if ask is not None else timedelta(0)),
            heartbeat_timeout=self.req.timeouts.api_call,
            retry_policy=API_RETRY,
            summary="drain",
        )
        if result.answer is not None and not result.answer.allowed:
            # v5: the pool's budgets said not now; nothing was touched (nor reported: the pool
            # has the node Ready). Asked again later.
            self.state.end_reason = None
            self._enter(NodePhase.READY)
            self._take_answer(result.answer)
            return False
        if result.held and not result.called_off:
            # v5: do-not-disrupt came while the pool was asked: held until the bridge says otherwise.
            assert self.state.watch is not None
            view = self.state.watch.view
            if view is not None:
                held = view.model_copy(update={"holders": result.held, "holding": max(view.holding, len(result.held))})
                self.state.watch = apply_view(self.state.watch, held, workflow.now(), self.req.timeouts)
            workflow.logger.info("drain called off, do-not-disrupt holds the node: %s", ", ".join(result.held))
            self.state.end_reason = None
            self._enter(NodePhase.READY)
            self._tell_pool()
            return False
        stuck = [
            *([f"not evicted (disruption budget?): {', '.join(result.remaining)}"] if result.remaining else []),
            *([f"still shutting down: {', '.join(result.terminating)}"] if result.terminating else []),
        ]
        if result.deleted:
            # Deleted over their PDBs at the deadline minus their own grace (Karpenter's rule).
            stuck.insert(0, f"deleted at the deadline minus their terminationGracePeriodSeconds: {', '.join(result.deleted)}")
        if stuck and bound:
            left = "terminated with pods still on the node" if result.remaining or result.terminating else "its last pods deleted"
            why = f"terminationGracePeriod ({_human(timeout)}) ended the drain; {left}, over their PodDisruptionBudgets and do-not-disrupt"
            self.state.last_error = f"{why}; {'; '.join(stuck)}"
            self._stamp(Stage.DRAIN_TIMED_OUT, f"{why}: {'; '.join(stuck)}")
        elif stuck:
            self.state.last_error = f"drain timed out after {self.req.timeouts.drain}; terminated with pods still on the node; {'; '.join(stuck)}"
            self._stamp(Stage.DRAIN_TIMED_OUT, f"timed out after {_human(self.req.timeouts.drain)}; terminated with pods still on the node: {'; '.join(stuck)}")
        if result.called_off:
            assert self.state.watch is not None
            arrived = ", ".join(result.called_off)
            workflow.logger.info("drain called off, %s arrived after the idle verdict: watching again", arrived)
            self._stamp(Stage.DRAIN_CALLED_OFF, f"{arrived} arrived on the node after it was judged idle")
            self.state.end_reason = None
            self.state.watch = self.state.watch.model_copy(update={"idle_since": None})
            view = self.state.watch.view
            if view is not None:  # the event-driven watch: busy until the bridge says otherwise
                busy = view.model_copy(update={"busy_pods": max(view.busy_pods, len(result.called_off))})
                self.state.watch = apply_view(self.state.watch, busy, workflow.now(), self.req.timeouts)
            self._enter(NodePhase.READY)
            self._tell_pool()
            return False
        return True

    # --- release what was bought ---------------------------------------------------------

    async def _release_attempt(self, report: PoolReport | None = None, ledger: LedgerCall | None = None) -> bool:
        """Give back everything the current launch attempt bought: instance, tailnet key and
        device, Node object. Idempotent, retried until it succeeds. `report` (Terminating) goes
        with the terminate. `ledger` (v4, the life's last release): the class ledger's release
        goes with it too; whether it was made."""
        self._stop_twin_watch()
        tailnet = TailnetCleanupInput(
            hostname=self.req.node_name,
            tags=self.req.tailnet_tags,
            key_ids=self.state.key_ids,
            tailnet=self.req.tailnet,
            tailnet_ref=self.req.tailnet_ref,
        )
        done = ReleaseResult(anything_seen=False)
        if self.state.instance is not None and self.v4:
            # One activity: the terminate, then each later step it could make (the rest below).
            rest = ReleaseInput(instance=self.state.instance, tailnet=tailnet, node_name=self.req.node_name, ledger=ledger)
            done = await self._terminate(self.state.instance, report, rest=rest)
        elif self.state.instance is not None:
            await self._terminate(self.state.instance, report)
        if not done.tailnet_cleaned:
            await self._call(
                NodeActivities.remove_from_tailnet,
                tailnet,
                timeout=self.req.timeouts.api_call,
                retry=CLEANUP_RETRY,
                summary="remove from tailnet",
            )
        if not done.node_deleted:
            await self._call(
                NodeActivities.delete_node,
                self.req.node_name,
                timeout=self.req.timeouts.api_call,
                retry=CLEANUP_RETRY,
                summary="delete Node",
            )
        self.state.key_ids = []
        if self.v2:
            self.state.facts = None  # they were the deleted Node's: the next attempt's join waits for its own
        return done.released

    async def _terminate(self, instance: InstanceRef, report: PoolReport | None = None, *, rest: ReleaseInput | None = None) -> ReleaseResult:
        """Terminate until the provider confirms. Past `termination_stuck` the node shows
        TerminationStuck (search attribute, pool Event and condition) while it keeps trying.
        `rest` (v4): the release's later steps go in the same activity (`release_attempt`);
        what it did of them."""
        # An activity in every life, v2 too: the workflow task that ends the run then holds only
        # the Node's and the tailnet's cleanup (idempotent), so a signal that lands as it
        # completes (the bridge saw the Node go) and has it retried re-decides nothing. Were the
        # terminate a local activity, the idle verdict, the drain and the terminate would sit in
        # that one task, and a retry would replay the watch with the new facts (a missing Node)
        # and take another road.
        def start(args: list[Any]) -> Any:
            return workflow.start_activity_method(
                NodeActivities.release_attempt if rest is not None else NodeActivities.terminate_instance,
                args=args,
                # It terminates, then reads until the instance shows terminated or gone (v4: then
                # the release's later steps, each bounded).
                start_to_close_timeout=self.req.timeouts.api_call + VERIFY_FOR + (3 * RELEASE_STEP_TIMEOUT + REPORT_WAIT if rest is not None else timedelta(0)),
                heartbeat_timeout=min(self.req.timeouts.api_call, POLL_HEARTBEAT_TIMEOUT),
                retry_policy=CLEANUP_RETRY,
                summary="terminate instance",
            )

        stuck_after = self.req.timeouts.termination_stuck
        if self.v5 and rest is not None:
            # The release says itself when it is stuck (no timer beside it): then it is made
            # again, until it succeeds, with TerminationStuck shown meanwhile.
            result = await start([rest.model_copy(update={"stuck_at": workflow.now() + stuck_after}), report])
            if not result.stuck:
                return result
            terminate, stuck = start([rest]), True
        else:
            terminate = start([rest, report] if rest is not None else self._with_report(instance, report))
            done, _ = await workflow.wait([terminate], timeout=stuck_after.total_seconds())
            stuck = not done
        if stuck:
            before, error = self.state.phase, self.state.last_error
            self.state.last_error = (
                f"{instance.provider} has not confirmed the termination of {instance.instance_id or instance.instance_name} "
                f"after {_human(stuck_after)}; still retrying (the pending {'release_attempt' if rest else 'terminate_instance'} activity shows the provider's answer)"
            )
            self._enter(NodePhase.TERMINATION_STUCK)
            self._tell_pool()
            result = await terminate
            self.state.last_error = error
            self._enter(before)
            self._tell_pool()
        else:
            result = await terminate
        return result if isinstance(result, ReleaseResult) else ReleaseResult(anything_seen=bool(result))

    async def _release_all(self) -> None:
        """The way out of every path: terminate whatever any attempt may have bought."""
        self._enter(NodePhase.TERMINATING)
        # Carried by the terminate when there is one to make; told on its own otherwise.
        report = self._tell_pool(carry=bool(self.state.attempts) and self.state.instance is not None)
        released = False
        if self.state.attempts:
            current = self.state.instance.instance_name if self.state.instance else None
            # v4: the ledger's release goes with the life's last terminate (never before one).
            last = self.v4 and all(ref.instance_name == current for ref in self.state.seen)
            released = await self._release_attempt(report, ledger=self._ledger_call(self.state.offer) if last else None)
            if self._money_by_ids():
                # Every earlier attempt's name too: a late create may have landed under it
                # since that attempt was released.
                for ref in list(self.state.seen):
                    if ref.instance_name != current:
                        await self._terminate(ref)
            self._stamp(Stage.RELEASED)
        if self.req.class_workflow_id and not released:
            await self._call(
                NodeClassActivities.release_reservation,
                self._ledger_call(self.state.offer),
                timeout=self.req.timeouts.api_call,
                retry=CLEANUP_RETRY,
                summary="release class budget",
                local=not self._since_v2(LEDGER_ACTIVITIES_PATCH),
            )

    async def _mark_unavailable(self, offer: Offer) -> None:
        await self._call(
            NodeActivities.mark_offer_unavailable,
            MarkUnavailableInput(offer_key=offer.key, ttl=self.req.unavailable_offer_ttl),
            timeout=self.req.timeouts.api_call,
            retry=API_RETRY,
        )

    # --- helpers -------------------------------------------------------------------------

    def _since_v2(self, patch: str) -> bool:
        """`workflow.patched(patch)` for a patch after LIFE_V2_PATCH, except in a v3 life, where
        it is applied without asking (no marker, no upsert)."""
        return self.v3 or workflow.patched(patch)

    def _patched(self, patch: str) -> bool:
        """`workflow.patched(patch)`, except in a v2 life, where every older patch is applied and
        asking would only record one more marker event."""
        return self.v2 or workflow.patched(patch)

    async def _call(
        self,
        activity: Any,
        arg: Any,
        *,
        timeout: timedelta,
        retry: RetryPolicy,
        summary: str | None = None,
        heartbeat: timedelta | None = None,
        local: bool = True,
        more: tuple[Any, ...] = (),
    ) -> Any:
        """One short call. In a v2 life (and `local`) a local activity: one marker event, no
        activity events and no workflow task of its own; it keeps its timeout and retry policy
        (backoffs past the SDK's local retry threshold become durable timers), and a worker that
        dies during it runs it again from the last workflow task, so each such call is
        idempotent. Its failure is raised as an ActivityError, as an activity's is, so every
        handler reads both alike. Before v2: the activity these runs recorded. `more`: the
        arguments after `arg` (none: scheduled with one argument, as older code did)."""
        if not (self.v2 and local):
            return await workflow.execute_activity_method(
                activity, args=[arg, *more], start_to_close_timeout=timeout, heartbeat_timeout=heartbeat, retry_policy=retry, summary=summary
            )
        try:
            return await workflow.execute_local_activity_method(
                activity, args=[arg, *more], start_to_close_timeout=timeout, retry_policy=retry, summary=summary
            )
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

    async def _wait_for(
        self, activity: Any, arg: Any, *, timeout: timedelta, summary: str, timeout_error: str, recheck: StageCheck, more: tuple[Any, ...] = ()
    ) -> Any:
        """Wait for a stage: poll with a heartbeating activity until the stage's deadline,
        `timeout` from now, but give up when an `evict` signal arrives.

        Only that deadline is a stage timeout. A missed heartbeat is a dead or stalled worker:
        Temporal retries the poll on another worker (POLL_RETRY) while the deadline allows.
        When the deadline passes, `recheck` looks once more (on whichever worker is alive by
        then; the instance booted on its own clock all along), and what is in fact up is kept.
        Otherwise the stage fails over, its reason `timeout_error` plus what the look saw.

        `more`: the activity's arguments after `arg`. Returns what the poll returned (None when
        the last look kept the stage)."""
        deadline = workflow.now() + timeout
        failure = timeout_error.format(_human(timeout))
        evicted = asyncio.ensure_future(workflow.wait_condition(lambda: self.state.evict_reason is not None))
        try:
            up, result = await self._poll_until(deadline, activity, [arg, *more], summary=summary, failure=failure, evicted=evicted)
        finally:
            if not evicted.done():
                evicted.cancel()
        if up:
            return result
        await self._last_look(recheck, summary=summary, failure=failure)
        return None

    async def _last_look(self, recheck: StageCheck, *, summary: str, failure: str) -> None:
        """A stage's deadline passed: look once more (the instance booted on its own clock all
        along) and keep what is in fact up; else fail the stage over, saying what the look saw."""
        look = await self._check_stage(recheck)
        if look is not None and look.up:
            workflow.logger.info("%s: deadline passed, but %s: kept", summary, look.seen)
            return
        seen = f"; at the deadline {look.seen}" if look is not None else ""
        raise LaunchAttemptFailed(failure + seen)

    async def _wait_for_facts(
        self, up: Callable[[NodeFacts], bool], *, timeout: timedelta, summary: str, timeout_error: str, recheck: StageCheck
    ) -> None:
        """v2: wait for a join stage on the bridge's `node_facts` (no poll), until the stage's
        deadline, `timeout` from now, or an `evict`.

        One durable timer at a time, started when the wait begins and again only when it fires
        (facts that do not yet show the stage up cost their signal and nothing more): at the
        deadline, or JOIN_BACKSTOP (or the watch interval, if shorter) from the last look if sooner. At a backstop the node looks for
        itself (`check_stage`, a local activity): a lost signal, or a Node the bridge does not
        follow, costs a backstop period, not the node. At the deadline, as a polled stage does:
        one last look, and what is in fact up is kept; otherwise the stage fails over with
        `timeout_error` plus what the look saw."""
        deadline = workflow.now() + timeout
        failure = timeout_error.format(_human(timeout))
        look: StageLook | None = None
        quiet = JOIN_FIRST_LOOK  # the next look's delay while the bridge has said nothing
        while True:
            self._check_evicted()
            if self.state.facts is not None and up(self.state.facts):
                return
            now = workflow.now()
            if now >= deadline:
                break
            period = JOIN_BACKSTOP if self.state.facts is not None else quiet
            wake = min(deadline, now + min(period, backstop_period(self.req.timeouts)))
            timer = asyncio.ensure_future(workflow.sleep(wake - now, summary=f"wait for {summary}"))
            facts = self.state.facts
            try:
                await workflow.wait_condition(
                    lambda: timer.done()
                    or self.state.evict_reason is not None
                    or (self.state.facts is not facts and self.state.facts is not None and up(self.state.facts))
                )
            finally:
                if not timer.done():
                    timer.cancel()
            if timer.done() and workflow.now() < deadline and not (self.state.facts is not None and up(self.state.facts)):
                quiet = min(quiet * 2, JOIN_BACKSTOP)
                look = await self._check_stage(recheck)  # the backstop
                if look is not None and look.up:
                    workflow.logger.info("%s: seen by the backstop look (no facts from the bridge): %s", summary, look.seen)
                    return
        await self._last_look(recheck, summary=summary, failure=failure)

    async def _poll_until(
        self, deadline: datetime, activity: Any, args: list[Any], *, summary: str, failure: str, evicted: asyncio.Future[None]
    ) -> tuple[bool, Any]:
        """Poll until the stage is up (True, and what the poll returned) or its deadline has
        passed (False). When the poll's retries run out before the deadline (the next one would
        have started past it), a new poll watches on for the rest of the stage. Any other poll
        failure fails the stage over."""
        budget = deadline - workflow.now()
        while True:
            try:
                return True, await self._poll(activity, args, budget=budget, summary=summary, evicted=evicted)
            except ActivityError as exc:
                if self._cancel_requested():
                    raise asyncio.CancelledError() from None
                if not isinstance(exc.cause, TimeoutError):
                    raise LaunchAttemptFailed(_describe(exc)) from None
                if not self._patched(STAGE_CHECK_PATCH):
                    raise LaunchAttemptFailed(failure) from None  # a run from before the last look, as it did
            budget = deadline - workflow.now()
            if budget < timedelta(seconds=1):
                return False, None

    async def _poll(self, activity: Any, args: list[Any], *, budget: timedelta, summary: str, evicted: asyncio.Future[None]) -> Any:
        """One poll, with `budget` to finish in, raced against the eviction: raises NodeEvicted if
        the `evict` signal wins, and the poll's ActivityError if it failed; else its result."""
        handle = workflow.start_activity_method(
            activity,
            args=args,
            start_to_close_timeout=budget,
            schedule_to_close_timeout=budget,
            heartbeat_timeout=min(self.req.timeouts.api_call, POLL_HEARTBEAT_TIMEOUT),
            retry_policy=POLL_RETRY,
            summary=summary,
        )
        try:
            await workflow.wait([handle, evicted], return_when=asyncio.FIRST_COMPLETED)
        finally:
            # On eviction or workflow cancellation, stop the poll: cleanup takes over.
            if not handle.done():
                handle.cancel()
        if not handle.done() or handle.cancelled():
            self._check_evicted()
        return handle.result()  # raises the poll's error

    async def _check_stage(self, recheck: StageCheck) -> StageLook | None:
        """The last look before a stage fails over; None if even that look failed."""
        try:
            look: StageLook = await self._call(
                NodeActivities.check_stage,
                recheck,
                timeout=self.req.timeouts.api_call,
                heartbeat=min(self.req.timeouts.api_call, POLL_HEARTBEAT_TIMEOUT),
                retry=API_RETRY,
                summary="look once more at the stage deadline",
            )
            return look
        except ActivityError as exc:
            if self._cancel_requested():
                raise asyncio.CancelledError() from None
            self.state.last_error = f"the last look at the stage deadline failed: {_describe(exc)}"
            return None

    def _cancel_requested(self) -> bool:
        """Whether the workflow was cancelled. Temporal delivers a cancel once, to whatever the
        run awaits: an activity in flight takes it and fails with it, and code that handles
        activity failures (an outage while watching, a failed stage) would swallow it. Each such
        handler asks this first. Runs from before this rule keep their recorded way."""
        return workflow.cancellation_reason() is not None and self._patched(CANCEL_PATCH)

    def _check_evicted(self) -> None:
        if self.state.evict_reason is not None:
            self.state.end_reason = f"evicted before Ready: {self.state.evict_reason}"
            raise NodeEvicted()

    def _enter(self, phase: NodePhase) -> None:
        """Record the phase: state, stage record, search attributes and the Web UI's details."""
        self.state.phase = phase
        self._stamp(Stage(phase.value), self._why(phase))
        offer = self.state.offer
        workflow.set_current_details(self._details())
        if phase is NodePhase.PENDING and self._started_pending():
            return  # v4: the run started with them
        workflow.upsert_search_attributes(
            [
                SA_PHASE.value_set(phase.value),
                SA_POOL.value_set(f"{self.req.namespace}/{self.req.pool}"),
                SA_NODE_NAME.value_set(self.req.node_name),
                # The class ledger finds its live nodes by this after a restart.
                SA_CLASS.value_set(self.req.node_class),
                # v2: the offer's attributes go with the launch's phase, one event for both.
                *(self._offer_attributes(offer) if self.v2 and phase is NodePhase.LAUNCHING and offer is not None else []),
                *(self._instance_attributes(phase) if self.v2 else []),
            ]
        )

    def _started_pending(self) -> bool:
        """v4: the pool started the run with the Pending phase's search attributes."""
        if not self.v4:
            return False
        have = {(p.key.name, p.value) for p in workflow.info().typed_search_attributes}
        return {(p.key.name, p.value) for p in start_attributes(self.req)} <= have

    def _instance_attributes(self, phase: NodePhase) -> list[Any]:
        """v2: the launch's instance in each phase's upsert (no event of its own), unset while a
        new attempt launches, and when the node became Ready: the fleet look and the sweeper read
        them from the listing instead of querying each node workflow."""
        instance = self.state.instance
        if instance is None:
            return []
        found = [SA_INSTANCE_ID.value_set(instance.instance_id) if instance.instance_id else SA_INSTANCE_ID.value_unset()]
        return [*found, SA_READY_SINCE.value_set(workflow.now())] if phase is NodePhase.READY else found

    def _tell_pool(self, *, carry: bool = False) -> PoolReport | None:
        """Report the phase just entered to the pool, if the node has one. The report goes out
        from its own task so the node never waits on the pool; `_end` and continue-as-new wait
        for all of them. With `carry` (a phase that an activity begins: launch, drain,
        terminate), a life under CARRIED_REPORTS_PATCH returns the report instead, for that
        activity to signal while it works (`_with_report`): no local activity holds the
        workflow task that schedules it."""
        if self.v2 and not self._worth_reporting(self.state.phase):
            return None  # its stage records go with the next report
        records, self._unreported = self._unreported, []
        if not self.req.pool_workflow_id:
            return None
        if carry and self.v2 and self._since_v2(CARRIED_REPORTS_PATCH):
            return PoolReport(pool_workflow_id=self.req.pool_workflow_id, report=self._node_report(self.state.phase, records))
        self._reports.append(asyncio.ensure_future(self._report(self.state.phase, records)))
        return None

    @staticmethod
    def _with_report(arg: Any, report: PoolReport | None) -> list[Any]:
        """An activity's arguments: its input, and the report it carries if any (the activities
        take it as an optional second argument; one argument, as older code scheduled them,
        is also what a worker of an older release, during a rollout, can take)."""
        return [arg] if report is None else [arg, report]

    def _settle_call(self, offer: Offer) -> LedgerCall | None:
        """v4: the settle the launch makes first, if the ledger's price for the node may differ
        from the offer's. Not when the pool reserved exactly this price and no launch of this
        life has settled since (a burst's nodes, bought at the price they were sized for, do not
        queue on their class ledger before buying). Granted at the reservation, it would be
        granted again unless the class's limits were lowered meanwhile: a purchase already on
        its way is not called off for that (as a reservation already held is not)."""
        reserved = self.req.reserved_price
        # An earlier launch of this life at another price settled that one: settle again.
        prices = [offer.hourly_price, *(a.offer.hourly_price for a in self.state.attempts)]
        if reserved is not None and all(price == reserved for price in prices):
            return None
        return self._ledger_call(offer)

    def _ledger_call(self, offer: Offer | None) -> LedgerCall | None:
        """The node's call to its class ledger (None: a node without a class has no budget)."""
        if not self.req.class_workflow_id:
            return None
        return LedgerCall(class_workflow_id=self.req.class_workflow_id, reservation=self._reservation(offer))

    def _worth_reporting(self, phase: NodePhase) -> bool:
        """v2: whether the pool learns anything from this phase. Not Pending (the pool recorded
        the node Pending when it started it), not Joining (the pool counts Launching and Joining
        alike as coming; its status shows the node Launching until Ready, while the node's own
        status and its search attribute say Joining); their stage records go with the next
        report. Terminating is: it ends the node's count against the disruption budgets (a
        draining node is disrupting), and the held nodes ask again at once."""
        return phase not in (NodePhase.PENDING, NodePhase.JOINING)

    def _node_report(self, phase: NodePhase, records: list[StageRecord]) -> NodeReport:
        offer = self.state.offer
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
        )

    async def _report(self, phase: NodePhase, records: list[StageRecord]) -> None:
        """Tell the pool where this node is. The pool may be gone (deleted, or a node started
        by hand): then nobody is listening, which is fine."""
        report = self._node_report(phase, records)
        if self.v2:
            # A local activity that signals the pool: one marker event, where a signal from the
            # workflow costs two events and, when its completion comes alone, a workflow task.
            try:
                await self._call(
                    NodeActivities.report_to_pool,
                    PoolReport(pool_workflow_id=self.req.pool_workflow_id or "", report=report),
                    timeout=REPORT_TIMEOUT,
                    retry=REPORT_RETRY,
                    summary=f"report {phase.value}",
                )
            except ActivityError as exc:
                workflow.logger.info("could not report %s to pool %s: %s", phase.value, self.req.pool_workflow_id, _describe(exc))
            return
        try:
            await workflow.get_external_workflow_handle(self.req.pool_workflow_id or "").signal("node_phase", report)
        except Exception as exc:  # noqa: BLE001 - a missing pool must not stop the node
            workflow.logger.info("could not report %s to pool %s: %s", phase.value, self.req.pool_workflow_id, exc)

    def _upsert_offer_attributes(self, offer: Offer) -> None:
        workflow.upsert_search_attributes(self._offer_attributes(offer))

    @staticmethod
    def _offer_attributes(offer: Offer) -> list[Any]:
        return [
            SA_PROVIDER.value_set(offer.provider),
            SA_GPU_TYPE.value_set(offer.gpu_type),
            SA_HOURLY_PRICE.value_set(float(offer.hourly_price)),
        ]

    def _stamp(self, stage: Stage, reason: str = "") -> None:
        """Record that the node entered `stage` now, and why: for the status query, for the pool
        (with the next report) and for `tgp status NODE`."""
        record = StageRecord(stage=stage, at=workflow.now(), reason=reason)
        self.state.stages = upsert_stage(self.state.stages, record)
        self._unreported.append(record)

    def _why(self, phase: NodePhase) -> str:
        """The reason recorded with a phase: why the node drains or ended, or what failed."""
        if phase in (NodePhase.FAILED, NodePhase.TERMINATION_STUCK):
            return self.state.last_error or ""
        if phase in (NodePhase.DRAINING, NodePhase.TERMINATED, NodePhase.INTERRUPTED, NodePhase.CANCELLED):
            return self.state.end_reason or ""
        return ""

    def _record(self, attempt: LaunchAttempt, outcome: str, instance_id: str | None = None) -> None:
        i = attempt.attempt - 1
        current = self.state.attempts[i]
        self.state.attempts[i] = current.model_copy(update={"outcome": outcome, "instance_id": instance_id or current.instance_id})

    def _details(self) -> str:
        """Markdown shown as Current Details in the Web UI."""
        offer = self.state.offer
        lines = [f"**{self.req.node_name}** in pool `{self.req.namespace}/{self.req.pool}` — **{self.state.phase.value}**"]
        if offer:
            lines.append(f"- offer: {offer.gpu_type} × {offer.gpu_count} on {offer.provider} ({offer.region}) at ${offer.hourly_price}/h")
        if self.state.instance and self.state.instance.instance_id:
            lines.append(f"- instance: `{self.state.instance.instance_id}`")
        if self.state.end_reason:
            lines.append(f"- end: {self.state.end_reason}")
        if self.state.watch is not None and self.state.watch.held:
            lines.append(f"- held: {self.state.watch.held}")
        if self.state.last_error:
            lines.append(f"- last error: {self.state.last_error}")
        lines.append(f"- evict: `temporal workflow signal --workflow-id {workflow.info().workflow_id} --name evict --input '{{\"reason\":\"manual\"}}'`")
        return "\n".join(lines)


def _describe_failure(exc: FailureError) -> str:
    """An activity's failure as `_describe` says it, whether it came wrapped in an ActivityError
    (an activity) or as its bare cause (a local activity)."""
    if isinstance(exc, ActivityError):
        return _describe(exc)
    if isinstance(exc, ApplicationError):
        return f"{exc.type}: {exc.message}" if exc.type else exc.message
    if isinstance(exc, TimeoutError):
        return f"activity timed out ({exc.type.name if exc.type else 'timeout'})"
    return str(exc)


def _human(d: timedelta) -> str:
    seconds = int(d.total_seconds())
    if seconds % 60:
        return f"{seconds}s"
    return f"{seconds // 60}m"
