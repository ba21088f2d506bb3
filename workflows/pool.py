"""GPUNodePoolWorkflow: one per GPUNodePool, keeping `max(minNodes, demand)` nodes within limits.

The bridge sends it the pool (and its class) and the pending pods it should serve; node
workflows report their phases to it. It starts top-level node workflows (after the class ledger
grants a slot), writes the pool's status and Events, and on deletion drains and terminates its
nodes before it lets the finalizer go. Scale to zero happens through the nodes' idle timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.entity import EntityActivities, EventSpec, PoolStatusWrite
    from activities.pool import PoolActivities
    from tgp.capacity import POD_BIND_GRACE, CapacityNode, CapacityPlan, NewNode, Nomination, OfferSize, no_offer_fits_to_warn, note_ready, plan_capacity
    from tgp.conditions import condition_list
    from tgp.consolidation import ActionKind, ConsolidationPlan, PoolMember, look_at, plan_consolidation
    from tgp.crds import Condition, Consolidation, ConsolidationStatus, GPUNodePoolStatus, PoolNodeStatus
    from tgp.disruption import DisruptionReason, allowed_disruptions, cheaper_by, reshop, unlimited_reasons
    from tgp.lifecycle import EndReason
    from tgp.drift import drift_hash, drifted
    from tgp.replace import Slot, StepKind, first_candidate, in_progress, replacement_name, replacement_steps
    from tgp.messages import (
        Demand,
        DisruptionAnswer,
        DisruptionAsk,
        DisruptionAsks,
        DisruptionAnswers,
        NodeReport,
        NodeReports,
        NodeSighting,
        NodeStart,
        ObjectRef,
        OfferCheck,
        PoolNode,
        PoolUpdate,
        Reservation,
        StartNodeInput,
        StartNodesInput,
    )
    from tgp.pools import node_request, node_timeouts, offer_requirements, request_for
    from tgp.types import DisruptRequest, EvictRequest, NodePhase, NodeRequest, Stage, StageRecord, TemplateUpdate, TimeoutsUpdate, node_workflow_id
    from workflows.entity import best_effort, history_is_long, running_nodes_changed

# Even with no news the pool looks again this often (a lost signal cannot stall it).
RESYNC_INTERVAL = timedelta(minutes=1)
# After a node fails to come up, wait before launching again; doubles per failure.
LAUNCH_BACKOFF = timedelta(seconds=30)
MAX_LAUNCH_BACKOFF = timedelta(minutes=15)
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 2000
# Offers come and go; "no offer" and the price used for reservations are re-checked this often.
OFFER_CHECK_TTL = timedelta(minutes=5)
# A pass starts every node its batch of pending pods needs, with one class ledger call (the
# class grants what fits its budget; its limits.maxNodes, 10 unless set, bounds a typo) and one
# activity. This cap only bounds that activity: ~0.3 KB of input per node, far under Temporal's
# 2 MB payload limit; a 500-pod burst starts in one pass.
MAX_STARTS_PER_BATCH = 500
START_NODES_TIMEOUT = timedelta(minutes=3)
# A pool its class refused asks again when something that could change the answer happened (the
# pool or its class changed, a node of the pool ended), else after this long: a node of another
# pool of the class may have ended meanwhile, which this pool does not hear of.
CLASS_REFUSAL_BACKOFF = timedelta(seconds=30)
# Pods named in a PodDoesNotFit message (the rest are counted).
MAX_PODS_NAMED = 5
# Events kept for a later write while the API refuses them (newest kept).
MAX_PENDING_EVENTS = 100
# Visibility is eventually consistent: a node workflow started this recently may not be listed
# yet, so it is not taken for closed.
VISIBILITY_LAG = timedelta(minutes=1)
# Ended node workflows remembered: Temporal does not keep separate signals in order, and a late
# report about an ended node would bring it back as a ghost.
ENDED_REMEMBERED = 500
# A node let go by a budget counts as disrupting until it reports Draining, at most this long
# (it reports within seconds; one whose drain was called off is Ready again and asks anew).
GRANT_COUNTS_FOR = timedelta(minutes=2)
# Changed settings and labels go to the nodes this many at a time in one workflow task (a pool
# adopting 1,000 nodes one by one recorded ~165,000 events an hour).
SIGNALS_AT_ONCE = 100
# A start whose activity failed may have happened: its node is kept (Pending, its pods nominated
# to it) and started again with the same workflow id this soon, before anything new is bought.
START_RETRY = timedelta(seconds=5)
# A replacement that ended before Ready (or a class that refused it): the next one for the same
# node waits this long.
REPLACEMENT_BACKOFF = timedelta(minutes=5)
# A re-shop called off because do-not-disrupt holds the node is not tried again for this long
# (or consolidation's `after`, if longer): each try buys a replacement for a few minutes.
RESHOP_HELD_WAIT = timedelta(hours=1)
# What the pool's record of a node carries from report to report (the node does not report them).
_REPLACEMENT_FIELDS = {
    "drift_hash", "drifted", "replace_reason", "replace_key", "replaced_by", "replaces", "disrupt_sent",
    "replace_attempts", "replace_after", "cheaper_since", "held", "removing",
}

_LAUNCHING = {NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING}
# Nodes whose disruption settings still matter (later phases are on their way out).
_TUNABLE = _LAUNCHING | {NodePhase.READY}


class ClassRefusal(BaseModel):
    """The class ledger refused this pool's launches: why, and what would make it ask again."""

    model_config = ConfigDict(extra="forbid")
    reason: str
    until: datetime
    generation: int | None = None
    node_class: str = Field("", description="The class spec as it was (JSON): a changed class is asked again at once.")
    nodes_ended: int = 0


class UnsettledStart(BaseModel):
    """A node start that may or may not have happened: started again, with the same name, until
    it is known to have (or its pods are gone, or the class refuses it)."""

    model_config = ConfigDict(extra="forbid")
    start: NodeStart
    pods: list[str] = []
    error: str = ""


class PoolState(BaseModel):
    """Everything the pool knows; carried across continue-as-new."""

    model_config = ConfigDict(extra="forbid")
    update: PoolUpdate | None = None
    demand: list[str] = []
    demand_gpus: int = 1
    pending_since: dict[str, datetime] = Field({}, description="When each pod of the demand was first reported pending (metrics).")
    demand_at: datetime | None = Field(None, description="When the bridge observed the demand last sent (its observed_at).")
    pod_gpus: dict[str, int] = {}
    free_gpus: dict[str, int] = {}
    nominations: dict[str, Nomination] = {}
    unfit: list[str] = []
    no_borrow: list[str] = Field([], description="Pods that did not bind on a node they borrowed GPUs from.")
    no_offer_fits: list[str] = Field([], description="Pending pods larger than every offer, already warned about.")
    nodes: dict[str, PoolNode] = {}
    offer_check: OfferCheck | None = None
    offer_check_key: str = ""
    offer_checked_at: datetime | None = None
    conditions: dict[str, Condition] = {}
    failures: int = 0
    backoff_until: datetime | None = None
    written: str = ""
    events: list[EventSpec] = Field([], description="Events not yet written; kept across continue-as-new.")
    seen_running_at: datetime | None = Field(None, description="Last time the running node workflows were listed.")
    ended: list[str] = Field([], description="Node workflows that ended lately (newest last): late reports about them are stale.")
    failed_at: datetime | None = Field(None, description="When the last launch failure was reported (later failures of nodes started before it are of its wave).")
    nodes_ended: int = Field(0, description="Node workflows of this pool that ended, ever (a count: a class refusal waits for it to change).")
    class_refusal: ClassRefusal | None = Field(None, description="The class's last refusal while it holds (batched launches).")
    granted: dict[str, datetime] = Field({}, description="Nodes let begin a voluntary disruption (budgets), until they report Draining.")
    blocked: dict[str, str] = Field({}, description="Nodes a budget holds back, with the message of their DisruptionBlocked Event.")
    freed: bool = Field(False, description="A disruption ended or the spec changed since the held nodes last asked: tell them to ask again.")
    bound_gpus: dict[str, list[int]] = Field({}, description="GPU requests of the pods bound to each Ready node, from the demand (consolidation).")
    held_nodes: list[str] = Field([], description="Ready nodes do-not-disrupt holds, from the demand (consolidation leaves them).")
    consolidation: ConsolidationStatus | None = Field(None, description="The savings consolidation found and made (status.consolidation).")
    consolidation_looked_at: datetime | None = Field(None, description="When consolidation was last planned (once a resync).")
    unsettled: dict[str, UnsettledStart] = Field({}, description="Node starts that failed and may have happened, by workflow id: started again with the same id.")


class PoolInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    namespace: str
    name: str
    watch_interval: timedelta | None = None
    resync_interval: timedelta = RESYNC_INTERVAL
    bind_grace: timedelta = POD_BIND_GRACE
    visibility_lag: timedelta = VISIBILITY_LAG
    class_refusal_backoff: timedelta = CLASS_REFUSAL_BACKOFF
    start_retry: timedelta = START_RETRY
    offer_check_ttl: timedelta = OFFER_CHECK_TTL
    state: PoolState = PoolState()


@workflow.defn(name="GPUNodePoolWorkflow")
class GPUNodePoolWorkflow:
    @workflow.init
    def __init__(self, inp: PoolInput) -> None:
        self.inp = inp
        self.state = inp.state
        self.dirty = True

    @property
    def events(self) -> list[EventSpec]:
        return self.state.events

    # --- messages ------------------------------------------------------------------------

    @workflow.signal
    def update(self, u: PoolUpdate) -> None:
        """The pool (and its class) as the bridge sees them now."""
        old = self.state.update
        if old is not None and old.deleting and not u.deleting and old.uid == u.uid:
            # A deletionTimestamp is never taken back: this update was sent before the one that
            # said the pool is being deleted and overtook it (two bridge paths race).
            return
        if old is not None and old.generation != u.generation:
            self.state.unfit = []  # the user changed the pool: give those pods another look
        self.state.update = u
        if self.state.blocked:
            self.state.freed = True  # the budgets may have changed: the held nodes ask again
        self.dirty = True

    @workflow.signal
    def demand(self, d: Demand) -> None:
        """The pending GPU pods this pool should serve now."""
        self.state.demand = list(d.pods)
        self.state.pending_since = {pod: self.state.pending_since.get(pod, d.observed_at) for pod in d.pods}
        self.state.demand_at = d.observed_at
        self.state.demand_gpus = d.max_gpus
        self.state.pod_gpus = dict(d.pod_gpus)
        self.state.free_gpus = dict(d.free_gpus)
        self.state.bound_gpus = dict(d.bound_gpus)
        self.state.held_nodes = list(d.held_nodes)
        self.dirty = True

    @workflow.signal
    def node_phases(self, rs: NodeReports) -> None:
        """Several nodes' reports, sent together by a worker: each taken as `node_phase` takes it."""
        for r in rs.reports:
            self.node_phase(r)

    @workflow.signal
    def node_phase(self, r: NodeReport) -> None:
        """A node workflow moved to a new phase."""
        old = self.state.nodes.get(r.workflow_id)
        overtaken = old is not None and old.reported_at is not None and r.at < old.reported_at
        if overtaken or r.workflow_id in self.state.ended:
            return  # stale: separate signals are not kept in order
        node = PoolNode(
            workflow_id=r.workflow_id,
            node_name=r.node_name,
            phase=r.phase,
            provider=r.provider,
            gpu_type=r.gpu_type,
            hourly_price=r.hourly_price,
            created_at=old.created_at if old else r.at,
            phase_at=r.at if old is None or old.phase is not r.phase else old.phase_at,
            reason=r.reason,
            floor=old.floor if old else False,
            timeouts_sent=old.timeouts_sent if old else "",
            hold_ends_when_busy=old.hold_ends_when_busy if old else False,
            template_sent=old.template_sent if old else "",
            gpus=old.gpus if old else None,
            reported_at=r.at,
        )
        if old is not None:
            node = node.model_copy(update={k: getattr(old, k) for k in _REPLACEMENT_FIELDS})
        if r.drift_hash is not None:
            node = node.model_copy(update={"drift_hash": r.drift_hash})
        self.state.nodes[r.workflow_id] = node
        self.state.unsettled.pop(r.workflow_id, None)  # it reports: its workflow started
        if r.phase is not NodePhase.READY:
            self.state.granted.pop(r.workflow_id, None)  # draining now: counted as such
            self.state.blocked.pop(r.workflow_id, None)
        if self.state.blocked and old is not None and old.phase is NodePhase.DRAINING and r.phase is not NodePhase.DRAINING:
            self.state.freed = True  # a disruption ended: a held node may go now
        if old is None or old.phase is not r.phase:
            self._node_event(node, r.stages)
        for s in r.stages:
            if s.stage is Stage.DISRUPTION_HELD:  # reported while Ready: no phase change to hang it on
                self.events.append(self._event("Normal", s.stage.value, f"node {node.node_name} {s.reason}"))
                if (node.replace_reason == DisruptionReason.CHEAPER.value and node.disrupt_sent and node.replaced_by) or node.removing is not None:
                    # A re-shop never disrupts a node a do-not-disrupt pod (or the Node) holds:
                    # called off in the next pass (its replacement is let go).
                    self.state.nodes[r.workflow_id] = node = node.model_copy(update={"held": s.reason})
            elif s.stage is Stage.NODE_REPAIR:
                self.events.append(self._event("Warning", s.stage.value, f"node {node.node_name} is repaired: {s.reason.removeprefix('node repair: ')}"))
        ended_for_it = (r.reason or "").startswith(EndReason.UNDERUTILIZED.value)
        if old is not None and old.removing is not None and r.phase is NodePhase.TERMINATED and not old.phase.is_final and ended_for_it:
            self._consolidated(node.node_name, DisruptionReason.UNDERUTILIZED.value, old.removing)
        if r.phase is NodePhase.FAILED:
            # Nodes started before the last failure was reported are of the same wave: their
            # failures teach nothing new (a burst's batch failing under load doubled the back-off
            # per node: five failures held the pool 8 minutes, Ready True, pods unserved).
            same_wave = old is not None and self.state.failed_at is not None and old.created_at <= self.state.failed_at
            if not same_wave:
                self.state.failures += 1
                backoff = min(LAUNCH_BACKOFF * 2 ** (self.state.failures - 1), MAX_LAUNCH_BACKOFF)
                self.state.backoff_until = r.at + backoff
            self.state.failed_at = r.at
        elif r.phase is NodePhase.READY:
            self.state.failures = 0
            self.state.backoff_until = None
        self.dirty = True

    @workflow.update
    def may_disrupt(self, ask: DisruptionAsk) -> DisruptionAnswer:
        """A node asks whether it may begin a voluntary disruption now: the most restrictive of
        the pool's active budgets that cover the reason, over its nodes disrupting (draining, or
        let go and not yet draining). A refusal is a `DisruptionBlocked` Event, once per node and
        message; the node asks again later."""
        return self._may_disrupt(ask)

    @workflow.update
    def may_disrupt_many(self, batch: DisruptionAsks) -> DisruptionAnswers:
        """Many nodes' asks at once (a worker gathers those made meanwhile), answered in order:
        each one let go counts against the budgets for the asks after it."""
        return DisruptionAnswers(answers=[self._may_disrupt(ask) for ask in batch.asks])

    def _may_disrupt(self, ask: DisruptionAsk) -> DisruptionAnswer:
        if self.state.update is None or self.state.update.deleting:
            return DisruptionAnswer(allowed=True)
        now = workflow.now()
        self._forget_grants(now)
        try:
            reason = DisruptionReason(ask.reason)
        except ValueError:
            return DisruptionAnswer(allowed=True, message=f"unknown reason {ask.reason!r}: not limited")
        initialized = sum(1 for n in self.state.nodes.values() if n.phase in (NodePhase.READY, NodePhase.DRAINING))
        disrupting = self._disrupting(exclude=ask.workflow_id)
        verdict = allowed_disruptions(self.state.update.spec.disruption.budgets, now, reason, initialized, disrupting)
        if verdict.permits():
            self.state.granted[ask.workflow_id] = now
            self.state.blocked.pop(ask.workflow_id, None)
            self.dirty = True
            return DisruptionAnswer(allowed=True)
        if self._blocked(ask.workflow_id, ask.node_name, verdict.message):
            self.dirty = True
        return DisruptionAnswer(allowed=False, message=verdict.message)

    async def _tell_held_nodes(self) -> None:
        """A disruption ended or the budgets changed: the nodes a budget holds ask again now
        rather than at their next timer."""
        self.state.freed = False

        async def tell(wid: str) -> None:
            try:
                await workflow.get_external_workflow_handle(wid).signal("budget_freed")
            except Exception as exc:  # noqa: BLE001 - a node that just ended has nothing to ask
                workflow.logger.info("could not tell %s to ask its budget again: %s", wid, exc)

        # All at once (in a fixed order): one round trip per pass, not one per held node.
        await asyncio.gather(*(tell(wid) for wid in sorted(self.state.blocked)))

    def _disrupting(self, exclude: str = "") -> int:
        """The pool's nodes being disrupted: draining, or let go by a budget and not yet draining."""
        draining = {wid for wid, n in self.state.nodes.items() if n.phase is NodePhase.DRAINING}
        granted = {wid for wid in self.state.granted if (n := self.state.nodes.get(wid)) is not None and n.phase is NodePhase.READY}
        # A node being replaced (make-before-break) counts from when its replacement starts.
        replacing = {wid for wid, n in self.state.nodes.items() if n.replaced_by is not None and n.phase is NodePhase.READY}
        return len((draining | granted | replacing) - {exclude})

    def _forget_grants(self, now: datetime) -> None:
        """A grant counts until its node reports Draining (or anything but Ready), or for
        GRANT_COUNTS_FOR: a node that was let go but then found its drain called off."""
        for wid, at in list(self.state.granted.items()):
            n = self.state.nodes.get(wid)
            if n is None or n.phase is not NodePhase.READY or now - at > GRANT_COUNTS_FOR:
                del self.state.granted[wid]

    @workflow.query
    def status(self) -> GPUNodePoolStatus:
        """The pool's status as it would be written now."""
        return self._status()

    # --- the loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: PoolInput) -> None:
        while True:
            try:
                await workflow.wait_condition(lambda: self.dirty, timeout=self._next_wake())
            except TimeoutError:
                pass
            self.dirty = False
            if self.state.freed:
                await self._tell_held_nodes()
            if await self._reconcile():
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._flush_events()  # what the last handlers reported
                return
            if history_is_long(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._flush_events()
                # Events still unwritten travel in the state; none is lost.
                workflow.continue_as_new(self.inp.model_copy(update={"state": self.state}))

    def _next_wake(self) -> timedelta:
        wake = self.inp.resync_interval
        if self.state.unsettled:
            wake = min(wake, self.inp.start_retry)
        refusal = self.state.class_refusal
        for until in (self.state.backoff_until, refusal.until if refusal else None):
            if until is not None:
                remaining = until - workflow.now()
                if timedelta(0) < remaining < wake:
                    wake = remaining
        return wake

    async def _reconcile(self) -> bool:
        """One pass: returns True when the pool is deleted and its nodes are gone."""
        u = self.state.update
        if u is None:
            return False
        await self._see_running_nodes()
        if self.state.seen_running_at is None:
            # Not a single look at the running node workflows yet (a new run after a crash or
            # reset): buying now could duplicate a live node, and letting the finalizer go
            # could abandon one. Say so and look again next pass.
            await self._publish({"Ready": ("False", "ListingNodes", "could not list the running node workflows yet; retrying")})
            return False
        live = [n for n in self.state.nodes.values() if not n.phase.is_final]
        # Every pass, also one that plans nothing: a node may idle out before the next plan.
        self.state.nominations = note_ready(self.state.nominations, self._capacity_nodes(live))
        if u.deleting:
            return await self._tear_down(live)

        wanted: dict[str, tuple[str, str, str]] = {}
        klass = u.node_class
        if klass is None:
            name = u.spec.node_class_ref.name
            wanted["ClassReady"] = ("False", "ClassNotFound", f"GPUNodeClass {name} not found: create it or fix spec.nodeClassRef.name")
        else:
            # A node being replaced leaves its floor to its replacement (started with it).
            self._assign_floor([n for n in live if not self._being_replaced(n)], u.spec.min_nodes)
            wanted["ClassReady"] = ("True", "Found", "")
            wanted["OffersAvailable"] = await self._check_offers(u)
        ok = all(status == "True" for status, _, _ in wanted.values())
        at_max_nodes = False
        if ok:
            wanted["BudgetAvailable"] = await self._launch(u, live)
            # The pool at its own spec.maxNodes works as configured: BudgetAvailable and the
            # Warning name the limit, the pool stays Ready. A class limit makes it not Ready.
            at_max_nodes = wanted["BudgetAvailable"][1] == "MaxNodesReached"
            ok = wanted["BudgetAvailable"][0] == "True" or at_max_nodes
        live = [n for n in self.state.nodes.values() if not n.phase.is_final]
        ready = sum(1 for n in live if n.phase is NodePhase.READY)
        if ok:
            backing_off = self.state.backoff_until is not None and workflow.now() < self.state.backoff_until
            message = f"{ready}/{len(live)} nodes ready"
            if backing_off:
                message += f"; {self.state.failures} launch failure(s), next launch after {self.state.backoff_until:%H:%M:%S}"
            if at_max_nodes:
                message += "; at spec.maxNodes (see BudgetAvailable)"
            wanted["Ready"] = ("True", "Ready" if not backing_off else "LaunchBackoff", message)
        else:
            failing = next(f"{t}: {m}" for t, (s, _, m) in wanted.items() if s != "True")
            wanted["Ready"] = ("False", "NotReady", failing)
        wanted["PodsFit"] = self._pods_fit()
        wanted["InstancesReleased"] = self._instances_released(live)
        if ok and self._consolidation_due(u):
            await self._consolidate(self._look_for_consolidation(u, live))
        elif u.spec.disruption.consolidation is None and self.state.consolidation is not None and self.state.consolidation.candidates:
            # Turned off: nothing is found any more (what was made stays).
            self.state.consolidation = self.state.consolidation.model_copy(update={"savings_found_hourly": Decimal(0), "candidates": 0})
        if klass is not None:
            await self._replacements(u, live, offers=wanted.get("OffersAvailable", ("False",))[0] == "True")
        if not u.deleting and klass is not None:
            await self._sync_timeouts(u, live)
            await self._sync_template(u, live)
        await self._publish(wanted)
        # Ended nodes have been reported (status and Events); forget them.
        self._forget_ended()
        return False

    async def _see_running_nodes(self) -> None:
        """Reality check, once per resync: node workflows running for this pool that the state
        does not know (a new run after a crash or a reset) are adopted; known ones whose
        workflow closed without reporting (terminated by hand, timed out) are dropped."""
        now = workflow.now()
        if self.state.seen_running_at is not None and now - self.state.seen_running_at < self.inp.resync_interval:
            return
        pool = f"{self.inp.namespace}/{self.inp.name}"
        # Only the differences are recorded (ids in, changes out): a full listing of a 500-node
        # pool was ~130 KB of history a minute.
        live = [wid for wid, n in self.state.nodes.items() if not n.phase.is_final]
        changed = await running_nodes_changed(f"TgpPool = '{pool}'", node_workflow_id(self.inp.namespace, self.inp.name, ""), live)
        if not changed.ok:
            return
        self.state.seen_running_at = now
        if changed.value is None:
            return  # a server without visibility: nothing to rebuild from
        unknown: list[NodeSighting] = changed.value.unknown
        gone = changed.value.gone
        for s in unknown:
            wid = s.workflow_id
            if wid in self.state.ended:
                continue  # visibility lags: it ended after the listing
            if wid not in self.state.nodes:
                self.state.nodes[wid] = PoolNode(
                    workflow_id=wid,
                    node_name=s.node_name,
                    phase=s.phase or NodePhase.PENDING,
                    provider=s.provider,
                    gpu_type=s.gpu_type,
                    hourly_price=s.hourly_price,
                    created_at=s.started_at or now,
                    phase_at=now,
                    reason="adopted from its running workflow",
                )
        for wid in [w for w in self.state.unsettled if w not in gone]:
            del self.state.unsettled[wid]  # listed as running: its start happened
        missing = [
            n.workflow_id
            for n in self.state.nodes.values()
            if not n.phase.is_final and n.workflow_id in gone and now - n.created_at >= self.inp.visibility_lag and n.workflow_id not in self.state.unsettled
        ]
        if missing:
            closed = await best_effort(EntityActivities.closed_workflows, missing, summary="check closed nodes")
            for wid in closed.value or []:
                node = self.state.nodes[wid].model_copy(update={"phase": NodePhase.TERMINATED, "reason": "its workflow closed without cleanup (terminated by hand?); the sweeper removes what it left"})
                self.state.nodes[wid] = node
                self._node_event(node)

    async def _check_offers(self, u: PoolUpdate) -> tuple[str, str, str]:
        assert u.node_class is not None
        req = offer_requirements(u.spec, u.node_class)
        key = req.model_dump_json()
        stale = self.state.offer_checked_at is None or workflow.now() - self.state.offer_checked_at >= self.inp.offer_check_ttl
        if self.state.offer_check is None or self.state.offer_check_key != key or stale:
            checked = await best_effort(PoolActivities.check_offers, req, summary="check offers")
            if not checked.ok:
                # The cause may name the class's Secrets, which a tenant must not read: point
                # to the class (its admin sees the details in the worker's logs and the Web UI).
                workflow.logger.warning("offer check for pool %s/%s failed: %s", self.inp.namespace, self.inp.name, checked.error)
                return (
                    "False",
                    "OfferCheckFailed",
                    f"the offers of GPUNodeClass {u.spec.node_class_ref.name} could not be listed; retrying (the cluster admin sees why)",
                )
            self.state.offer_check = checked.value
            self.state.offer_check_key = key
            self.state.offer_checked_at = workflow.now()
        oc = self.state.offer_check
        assert oc is not None
        unreachable = "".join(f"; offers of {name} could not be listed" for name in sorted(oc.failed))
        if oc.matching:
            return ("True", "OffersFound", f"{oc.matching} matching offers from ${oc.cheapest}/h{unreachable}")
        if oc.cheapest_any_price is not None and req.max_hourly_price is not None:
            return (
                "False",
                "PriceTooLow",
                f"spec.maxHourlyPrice ${req.max_hourly_price}/h is below every matching offer; the cheapest is "
                f"${oc.cheapest_any_price}/h ({oc.cheapest_description}): raise maxHourlyPrice or relax the requirements",
            )
        wants = req.model_dump(mode="json", include={"gpu_types", "regions", "providers", "min_gpu_count", "allow_spot"})
        return ("False", "NoMatchingOffers", f"no offer matches {wants}: check the GPU types, regions and providers of the pool and class{unreachable}")

    async def _launch(self, u: PoolUpdate, live: list[PoolNode]) -> tuple[str, str, str]:
        assert u.node_class is not None
        if self.state.unsettled:
            await self._retry_unsettled(u, live)
            live = [n for n in self.state.nodes.values() if not n.phase.is_final]
        oc = self.state.offer_check
        plan = self._account(live, oc.sizes if oc is not None and oc.sizes else None)
        self._report_no_offer_fits(plan, oc)
        if self.state.backoff_until is not None and workflow.now() < self.state.backoff_until:
            return ("True", "WithinBudget", "")
        klass_min = offer_requirements(u.spec, u.node_class).min_gpu_count
        floor_live = sum(1 for n in self.state.nodes.values() if n.floor and not n.phase.is_final)
        wanted = list(plan.new_nodes)
        # minNodes counts live nodes: nodes bought for pods count toward it, the rest are empty.
        wanted += [NewNode(gpus=klass_min)] * max(0, u.spec.min_nodes - len(live) - len(wanted))
        room = len(wanted) if u.spec.max_nodes is None else max(0, u.spec.max_nodes - len(live))
        floor_missing = max(0, u.spec.min_nodes - floor_live)
        results: list[tuple[bool, str]] = []
        if wanted[:room]:
            refusal = self._class_refusal(u)
            if refusal is not None:
                return ("False", "BudgetExhausted", f"not launching more nodes: {refusal.reason}; {_asks_again(refusal)}")
            results = await self._start_nodes(u, wanted[: min(room, MAX_STARTS_PER_BATCH)], floor_missing)
        refused = [reason for started, reason in results if not started]
        if refused:
            # The class ledger's refusal names its limit (limits.maxNodes, limits.maxHourlyCost).
            refusal = self.state.class_refusal
            if refusal is not None:
                return ("False", "BudgetExhausted", f"not launching more nodes: {refusal.reason}; {_asks_again(refusal)}")
            return ("False", "BudgetExhausted", f"not launching more nodes: {refused[0]}")
        if len(wanted) > room:
            waiting = sum(len(n.pods) for n in wanted[room:])
            message = (
                f"{waiting} pending pod(s) wait for a node: the pool has {len(live)} node(s) and its spec.maxNodes is "
                f"{u.spec.max_nodes}; raise maxNodes, or they run when a node frees up"
            )
            return ("False", "MaxNodesReached", message)
        return ("True", "WithinBudget", "")

    def _report_no_offer_fits(self, plan: CapacityPlan, oc: OfferCheck | None) -> None:
        """A Warning per pod that asks for more GPUs than any offer has, once while it pends."""
        largest = max((s.gpu_count for s in oc.sizes), default=0) if oc is not None else 0
        warn, self.state.no_offer_fits = no_offer_fits_to_warn(
            self.state.no_offer_fits, plan.no_offer_fits, self.state.demand, sizes_known=oc is not None and bool(oc.sizes)
        )
        for pod in warn:
            gpus = self.state.pod_gpus.get(pod, 1)
            self.events.append(
                self._event(
                    "Warning",
                    "NoOfferFits",
                    f"pod {pod} asks for {gpus} nvidia.com/gpu; the largest offer matching the pool has {largest}: "
                    "no node is bought for it (the pool's other pods are served)",
                )
            )

    def _class_refusal(self, u: PoolUpdate) -> ClassRefusal | None:
        """The class's last refusal, while it holds: nothing that could change its answer
        happened (the pool's generation, the class spec, a node of the pool ending) and
        CLASS_REFUSAL_BACKOFF has not passed."""
        refusal = self.state.class_refusal
        if refusal is None:
            return None
        if (
            workflow.now() >= refusal.until
            or refusal.generation != u.generation
            or refusal.node_class != _class_key(u)
            or refusal.nodes_ended != self.state.nodes_ended
        ):
            self.state.class_refusal = None
            return None
        return refusal

    async def _start_nodes(self, u: PoolUpdate, starts: list[NewNode], floor_missing: int) -> list[tuple[bool, str]]:
        """Batched launches: one activity reserves the class budget for all of `starts` with one
        ledger call and starts the node workflows it granted, together. A refusal by the class
        holds further launches (`_class_refusal`); an error of the call does not (the next pass
        tries again)."""
        assert u.node_class is not None
        now = workflow.now()
        class_name = u.spec.node_class_ref.name
        template = self._batch_template(u)
        cheapest = self.state.offer_check.cheapest if self.state.offer_check else None
        # A node bought for one pod may end its hold itself at its first pod; one bought for
        # several keeps it until the pool says (the pool cannot tell which of them bound there).
        batch = []
        for i, n in enumerate(starts):
            since = [self.state.pending_since[pod] for pod in n.pods if pod in self.state.pending_since]
            batch.append(
                NodeStart(
                    node_name=f"{self.inp.name}-{workflow.uuid4().hex[:5]}",
                    floor=i < floor_missing,
                    min_gpus=n.gpus,
                    bind_grace=self.inp.bind_grace if n.pods else None,
                    demand_since=min(since) if since else None,
                    hourly_price=n.hourly_price if n.hourly_price is not None else cheapest,
                    hold_ends_when_busy=len(n.pods) == 1,
                )
            )
        pool = f"{self.inp.namespace}/{self.inp.name}"
        started = await best_effort(
            PoolActivities.reserve_and_start_nodes,
            StartNodesInput(class_name=template.class_workflow_id or class_name, pool=pool, template=template, starts=batch),
            summary=f"start {len(batch)} node(s)",
            timeout=START_NODES_TIMEOUT,
        )
        if not started.ok:
            # Some of them may have started: kept, and started again with the same ids.
            for start, n in zip(batch, starts, strict=True):
                self._unsettled(u, template, start, n.pods, now, started.error or "")
            return [(False, started.error or "")] * len(batch)
        results = []
        refused = ""
        for start, n, result in zip(batch, starts, started.value.results, strict=True):
            if result.started:
                self._started(u, request_for(template, start), floor=start.floor, pods=n.pods, now=now)
            elif result.unsettled:
                self._unsettled(u, template, start, n.pods, now, result.reason)
                results.append((True, ""))
                continue
            else:
                refused = refused or result.reason
            results.append((result.started, result.reason))
        if refused:
            self.state.class_refusal = ClassRefusal(
                reason=refused,
                until=now + self.inp.class_refusal_backoff,
                generation=u.generation,
                node_class=_class_key(u),
                nodes_ended=self.state.nodes_ended,
            )
        return results

    def _batch_template(self, u: PoolUpdate) -> NodeRequest:
        """The request a batch's starts are built from (`tgp.pools.request_for`)."""
        assert u.node_class is not None
        return node_request(
            namespace=self.inp.namespace,
            pool_name=self.inp.name,
            class_name=u.spec.node_class_ref.name,
            node_name="",
            pool=u.spec,
            klass=u.node_class,
            watch_interval=self.inp.watch_interval,
            unlimited=self._unlimited(u),
        )

    def _unsettled(self, u: PoolUpdate, template: NodeRequest, start: NodeStart, pods: list[str], now: datetime, error: str) -> None:
        """A start that failed and may have happened: its node is recorded as launching, its
        pods nominated to it (nothing else is bought for them), and it is started again, with
        the same workflow id, on the next passes (`_retry_unsettled`)."""
        req = request_for(template, start)
        self._started(u, req, floor=start.floor, pods=pods, now=now, note=f"; its start failed ({error[:200]}): started again with the same name")
        self.state.unsettled[req.workflow_id] = UnsettledStart(start=start, pods=list(pods), error=error[:300])

    async def _retry_unsettled(self, u: PoolUpdate, live: list[PoolNode]) -> None:
        """Start again, with the same names and workflow ids, the starts that may not have
        happened. One whose pods all left the demand (or a minNodes start the pool no longer
        needs) is not started again; like one the class now refuses, its node stays recorded
        until the look at the running workflows finds it running or never started (it may have
        started: nothing else is bought for its pods meanwhile)."""
        pending = set(self.state.demand)
        settled = sum(1 for n in live if n.workflow_id not in self.state.unsettled)
        for wid, us in sorted(self.state.unsettled.items()):
            if (us.pods and not pending.intersection(us.pods)) or (not us.pods and settled >= u.spec.min_nodes):
                self._abandon_start(wid, "its pods are gone" if us.pods else "minNodes is met")
        if not self.state.unsettled:
            return
        template = self._batch_template(u)
        retries = sorted(self.state.unsettled.items())
        started = await best_effort(
            PoolActivities.reserve_and_start_nodes,
            StartNodesInput(
                class_name=template.class_workflow_id or u.spec.node_class_ref.name,
                pool=f"{self.inp.namespace}/{self.inp.name}",
                template=template,
                starts=[us.start for _, us in retries],
            ),
            summary=f"start {len(retries)} node(s) again",
            timeout=START_NODES_TIMEOUT,
        )
        if not started.ok:
            return  # still unsettled: the next pass tries again
        for (wid, _), result in zip(retries, started.value.results, strict=True):
            if wid not in self.state.unsettled:
                continue  # it reported meanwhile
            if result.started:
                del self.state.unsettled[wid]
            elif not result.unsettled:
                self._abandon_start(wid, f"the class refused it: {result.reason}")

    def _abandon_start(self, wid: str, why: str) -> None:
        """Stop starting `wid` again. Its node stays recorded (Pending) until it reports or the
        look at the running workflows finds it closed or never started: it may have started."""
        del self.state.unsettled[wid]
        node = self.state.nodes.get(wid)
        if node is not None and node.reported_at is None:
            self.state.nodes[wid] = node.model_copy(update={"reason": f"its start failed and {why}: not started again"})

    def _started(self, u: PoolUpdate, req: NodeRequest, *, floor: bool, pods: list[str], now: datetime, note: str = "") -> None:
        """Record a node workflow just started for `pods`, and its NodeLaunched Event."""
        node_name = req.node_name
        # A report may already have arrived while the start was in flight: keep its phase, but
        # the floor flag, the GPUs and the settings sent are known only here.
        node = self.state.nodes.get(req.workflow_id) or PoolNode(workflow_id=req.workflow_id, node_name=node_name, created_at=now, phase_at=now)
        held = bool(pods)
        sent = _fingerprint(self._timeouts_for(u, floor=floor, held=held))
        self.state.nodes[req.workflow_id] = node.model_copy(
            update={
                "floor": floor,
                "timeouts_sent": sent,
                "gpus": req.requirements.min_gpu_count,
                "template_sent": _template_fingerprint(_template(u)),
                "hold_ends_when_busy": held and req.hold_ends_when_busy,
            }
        )
        for pod in pods:
            self.state.nominations[pod] = Nomination(workflow_id=req.workflow_id, since=now)
        if not pods:
            why = "to keep minNodes"
        elif len(pods) == 1:
            why = f"for pod {pods[0]}"
        else:
            why = f"for {len(pods)} pods ({', '.join(pods[:MAX_PODS_NAMED])}{' and more' if len(pods) > MAX_PODS_NAMED else ''})"
        why = f"with {req.requirements.min_gpu_count} GPU(s) {why}"
        self.events.append(self._event("Normal", "NodeLaunched", f"launching node {node_name} {why}{note}"))

    def _capacity_nodes(self, live: list[PoolNode]) -> list[CapacityNode]:
        return [self._capacity_node(n) for n in live]

    def _capacity_node(self, n: PoolNode) -> CapacityNode:
        if self._left_after_the_demand(n):
            # Draining since the bridge last looked: the pods nominated to it may be bound to it
            # (the drain evicts them) or gone, and the demand that lists them is older than the
            # drain. Its room is unknown: the nominations stay, none is added, nothing is bought
            # for them until a demand observed after the drain began still lists them (else a
            # bridge that is slow to report, or restarting, buys a node per drained pod).
            return CapacityNode(workflow_id=n.workflow_id, node_name=n.node_name, launching=True, gpus=None)
        return CapacityNode(
            workflow_id=n.workflow_id,
            node_name=n.node_name,
            ready_at=n.phase_at if n.phase is NodePhase.READY else None,
            launching=n.phase in _LAUNCHING,
            # Not reported by the bridge (not Ready there yet, or no GPUs registered): unknown.
            free_gpus=self.state.free_gpus.get(n.node_name),
            gpus=n.gpus,  # unknown: no new nominations, none voided
        )

    def _left_after_the_demand(self, n: PoolNode) -> bool:
        """The node is on its way out (draining, terminating) and the demand was observed before."""
        leaving = n.phase not in _LAUNCHING and n.phase is not NodePhase.READY
        return leaving and (self.state.demand_at is None or self.state.demand_at <= n.phase_at)

    def _account(self, live: list[PoolNode], sizes: list[OfferSize] | None) -> CapacityPlan:
        """Which pending pods the live nodes hold, and which new nodes the rest need; pods that
        did not fit the node bought for them are remembered (and reported) instead of buying more."""
        pending = {pod: self.state.pod_gpus.get(pod, 1) for pod in self.state.demand}
        unfit = set(self.state.unfit) & set(pending)
        no_borrow = set(self.state.no_borrow) & set(pending)
        nodes = self._capacity_nodes(live)
        plan = plan_capacity(pending, nodes, self.state.nominations, unfit, workflow.now(), self.inp.bind_grace, no_borrow, sizes)
        self._remember(plan.nominations, unfit, no_borrow, plan.newly_unfit, plan.borrow_failed)
        return plan

    def _remember(self, nominations: dict[str, Nomination], unfit: set[str], no_borrow: set[str], newly_unfit: list[str], borrow_failed: list[str]) -> None:
        self.state.nominations = dict(nominations)
        self.state.no_borrow = sorted(no_borrow | set(borrow_failed))
        self.state.unfit = sorted(unfit | set(newly_unfit))
        for pod in newly_unfit:
            self.events.append(
                self._event(
                    "Warning",
                    "PodDoesNotFit",
                    f"pod {pod} stayed pending on the Ready node bought for it, which had room for its GPUs: it asks for "
                    "something the pool's nodes do not have (memory, CPU, a volume's zone, anti-affinity...); no more "
                    "nodes are bought for it until it changes or the pool does",
                )
            )

    def _pods_fit(self) -> tuple[str, str, str]:
        unfit, too_big = self.state.unfit, self.state.no_offer_fits
        if unfit:
            return ("False", "PodDoesNotFit", f"{_named(unfit)} stayed pending on nodes bought for them; see the pool's Events for what does not fit")
        if too_big:
            return ("False", "NoOfferFits", f"{_named(too_big)} ask(s) for more GPUs than any offer of the pool has; see the pool's Events")
        return ("True", "AllPodsFit", "")

    def _instances_released(self, live: list[PoolNode]) -> tuple[str, str, str]:
        stuck = [n for n in live if n.phase is NodePhase.TERMINATION_STUCK]
        if not stuck:
            return ("True", "Released", "")
        detail = "; ".join(f"{n.node_name}: {n.reason}" for n in stuck)
        return ("False", "TerminationStuck", f"{len(stuck)} node(s) still billing while tgp retries termination: {detail}")

    def _assign_floor(self, live: list[PoolNode], min_nodes: int) -> None:
        """Exactly `min_nodes` live nodes carry the floor. Lowering minNodes releases the
        dearest floor nodes (they idle out like the rest); raising it adopts live nodes first."""
        floor = [n for n in live if n.floor and n.phase in _TUNABLE]
        if len(floor) > min_nodes:
            chosen = sorted(floor, key=lambda n: (-(n.hourly_price or 0), n.created_at, n.workflow_id))[: len(floor) - min_nodes]
            update = {"floor": False}
        else:
            spare = [n for n in live if not n.floor and n.phase in _TUNABLE]
            chosen = sorted(spare, key=lambda n: (n.phase is not NodePhase.READY, n.created_at, n.workflow_id))[: min_nodes - len(floor)]
            update = {"floor": True}
        for n in chosen:
            self.state.nodes[n.workflow_id] = n.model_copy(update=update)

    # --- make-before-break replacement (drift, re-shop) -------------------------------------

    def _being_replaced(self, n: PoolNode) -> bool:
        """`n` has a replacement under way that is still alive."""
        new = self.state.nodes.get(n.replaced_by) if n.replaced_by else None
        return new is not None and not new.phase.is_final and not n.phase.is_final

    def _replacing(self, n: PoolNode) -> bool:
        """`n` replaces a node that is still alive."""
        old = self.state.nodes.get(n.replaces) if n.replaces else None
        return old is not None and not old.phase.is_final

    def _mark_replacements(self, u: PoolUpdate, live: list[PoolNode]) -> list[EventSpec]:
        """Which Ready nodes should be replaced, and why: Drifted (the hash they were made with
        differs from their class and pool's now: status and a NodeDrifted Event, once), else
        Cheaper (consolidation on, an offer that fits them cheaper by cheaperBy for `after`).
        State only; returns the Events to write."""
        assert u.node_class is not None
        now = workflow.now()
        events: list[EventSpec] = []
        hashes: dict[str | None, str] = {}
        policy = u.spec.disruption.consolidation
        for n in sorted(live, key=lambda n: n.workflow_id):
            if n.phase is not NodePhase.READY:
                continue
            update: dict[str, object] = {}
            if n.provider not in hashes:
                hashes[n.provider] = drift_hash(u.node_class, u.spec, n.provider)
            current = hashes[n.provider]
            is_drifted = drifted(n.drift_hash, current)
            if is_drifted != n.drifted:
                update["drifted"] = is_drifted
                if is_drifted:
                    events.append(
                        self._event(
                            "Normal",
                            "NodeDrifted",
                            f"node {n.node_name} has drifted: its class or pool changed what made it (hash {n.drift_hash}, now {current}); "
                            "it is replaced make-before-break within the disruption budget",
                        )
                    )
            reason, key = "", ""
            if is_drifted:
                reason, key = DisruptionReason.DRIFTED.value, current
            else:
                cheaper = self._cheaper(n, policy, now)
                update["cheaper_since"] = cheaper
                if cheaper is not None and policy is not None and n.hourly_price is not None:
                    verdict = reshop(n.hourly_price, now - cheaper, self._best_price(n), policy)
                    if verdict.replace:
                        cap = (n.hourly_price * (1 - cheaper_by(policy))).quantize(Decimal("0.0001"))
                        reason, key = DisruptionReason.CHEAPER.value, f"under {cap}"
                        if n.replace_reason != reason:
                            events.append(self._event("Normal", "CheaperOfferFound", f"node {n.node_name}: {verdict.message}; it is replaced make-before-break"))
            if n.replaced_by is None and (reason, key) != (n.replace_reason, n.replace_key):
                update.update({"replace_reason": reason, "replace_key": key})
            update = {k: v for k, v in update.items() if getattr(n, k) != v}
            if update:
                self.state.nodes[n.workflow_id] = self.state.nodes[n.workflow_id].model_copy(update=update)
        return events

    def _size(self, n: PoolNode) -> int | None:
        """The GPUs `n` has, as the bridge reports its Node (free + bound to its pods), at least
        what it was bought for; None while the bridge has not reported it (a node adopted after
        the pool lost its state knows no size: sized by its request, an 8-GPU node would be
        re-shopped to a 1-GPU offer)."""
        if n.node_name not in self.state.free_gpus:
            return None
        return max(self.state.free_gpus[n.node_name] + sum(self.state.bound_gpus.get(n.node_name, [])), n.gpus or 1)

    def _best_price(self, n: PoolNode) -> Decimal | None:
        """The cheapest current offer (the pool's offer check) with at least the GPUs `n` has:
        its pods fit on it. None when there is none, or `n`'s size is not known yet."""
        oc = self.state.offer_check
        size = self._size(n)
        if oc is None or size is None:
            return None
        prices = [s.hourly_price for s in oc.sizes if s.gpu_count >= size]
        return min(prices, default=None)

    def _cheaper(self, n: PoolNode, policy: Consolidation | None, now: datetime) -> datetime | None:
        """Since when an offer cheaper by the pool's cheaperBy fits `n` (None: none does, or
        consolidation is off)."""
        if policy is None or n.hourly_price is None or n.hourly_price <= 0 or n.replaces is not None and self._replacing(n):
            return None
        best = self._best_price(n)
        if best is None or n.hourly_price - best < n.hourly_price * cheaper_by(policy):
            return None
        return n.cheaper_since or now

    async def _replacements(self, u: PoolUpdate, live: list[PoolNode], *, offers: bool) -> None:
        """One pass of make-before-break replacement (tgp.replace.replacement_steps): follow the
        replacement under way (tell the old node to end once its replacement is Ready; give up
        on one that ended before Ready), and start the next when none is under way, launches
        are not backing off, the offers are known and the budget allows."""
        events = self._mark_replacements(u, live)
        now = workflow.now()
        slots = {
            wid: Slot(
                workflow_id=wid,
                node_name=n.node_name,
                phase=n.phase,
                # A node consolidation told to go is no candidate for a replacement, nor one
                # do-not-disrupt holds.
                want=(n.replace_reason or None)
                if n.removing is None and (n.replace_after is None or now >= n.replace_after) and not self._held_from_replacement(wid, n)
                else None,
                key=n.replace_key,
                replaced_by=n.replaced_by,
                disrupt_sent=n.disrupt_sent,
                attempts=n.replace_attempts,
            )
            for wid, n in self.state.nodes.items()
        }
        held = any(n.held for n in self.state.nodes.values())  # a re-shop or a removal do-not-disrupt holds
        if not (events or in_progress(slots) or first_candidate(slots) or held):
            return
        self.events.extend(events)
        if held:
            await self._call_off_held_reshops(u)
            self.dirty = True  # the next pass starts from what is now known
            return
        backing_off = self.state.backoff_until is not None and now < self.state.backoff_until
        may_start = offers and not backing_off and not u.deleting and self._replacement_fits(u, live, slots) and self._replacement_budget(slots)
        prefix = node_workflow_id(self.inp.namespace, self.inp.name, "")
        steps = replacement_steps(slots, pool=self.inp.name, id_prefix=prefix, may_start=may_start)
        for step in steps:
            old = self.state.nodes[step.old]
            if step.kind is StepKind.ABANDON:
                new = self.state.nodes.get(step.new)
                why = f"{new.phase.value}: {new.reason}" if new is not None else "its workflow is gone"
                self.events.append(
                    self._event(
                        "Warning",
                        "ReplacementFailed",
                        f"the replacement {step.new.removeprefix(prefix)} of node {old.node_name} ({step.reason}) ended before Ready ({why}); "
                        f"{old.node_name} stays; another replacement is tried after {REPLACEMENT_BACKOFF}",
                    )
                )
                self._set(old, replaced_by=None, disrupt_sent=False, replace_attempts=old.replace_attempts + 1, replace_after=now + REPLACEMENT_BACKOFF)
            elif step.kind is StepKind.DISRUPT:
                new_name = step.new.removeprefix(prefix)
                try:
                    await workflow.get_external_workflow_handle(step.old).signal(
                        "disrupt", DisruptRequest(reason=step.reason, replacement=new_name, detail=f"{new_name} is Ready")
                    )
                except Exception as exc:  # noqa: BLE001 - told again next pass (the node keeps the first)
                    workflow.logger.info("could not tell %s to end: %s", step.old, exc)
                    continue
                self._set(old, disrupt_sent=True)
                new_node = self.state.nodes.get(step.new)
                if step.reason == DisruptionReason.CHEAPER.value and old.hourly_price is not None and new_node is not None and new_node.hourly_price is not None:
                    self._consolidated(old.node_name, step.reason, old.hourly_price - new_node.hourly_price)
                self.events.append(
                    self._event("Normal", "NodeReplaced", f"node {new_name} is Ready in place of {old.node_name} ({step.reason}): {old.node_name} is drained and terminated")
                )
            elif step.kind is StepKind.ADOPT:
                self._set(old, replaced_by=step.new, disrupt_sent=False)
                self._set(self.state.nodes[step.new], replaces=step.old, floor=old.floor)
            else:
                await self._replace(old, DisruptionReason(step.reason), name=step.new)

    async def _call_off_held_reshops(self, u: PoolUpdate) -> None:
        """A node told to end for a re-shop reported that do-not-disrupt holds it: the re-shop
        is called off (a re-shop is never worth a held node): the node is told to stay (a
        `disrupt` with no reason), its replacement is evicted, and the node is not re-shopped
        again for RESHOP_HELD_WAIT or consolidation's `after`, the longer (a ReshopHeld Event)."""
        now = workflow.now()
        policy = u.spec.disruption.consolidation
        wait = max(policy.after, RESHOP_HELD_WAIT) if policy is not None else RESHOP_HELD_WAIT
        for wid in sorted(w for w, n in self.state.nodes.items() if n.held):
            old = self.state.nodes[wid]
            if old.phase is not NodePhase.READY:
                # It reported the hold, then went on (the holder finished): too late to call off;
                # its replacement stays and takes its place.
                self._set(old, held="")
                continue
            new = self.state.nodes.get(old.replaced_by) if old.replaced_by else None
            try:
                await workflow.get_external_workflow_handle(wid).signal("disrupt", DisruptRequest(reason="", detail="re-shop called off"))
            except Exception as exc:  # noqa: BLE001 - a node that ended has nothing to stay for
                workflow.logger.info("could not call off the re-shop of %s: %s", wid, exc)
            if new is not None and not new.phase.is_final:
                try:
                    await workflow.get_external_workflow_handle(new.workflow_id).signal(
                        "evict", EvictRequest(reason=f"re-shop of {old.node_name} called off (do-not-disrupt)")
                    )
                except Exception as exc:  # noqa: BLE001 - it ended meanwhile
                    workflow.logger.info("could not evict the called-off replacement %s: %s", new.workflow_id, exc)
            if old.removing is not None:
                # A consolidation removal: nothing was bought for it; the next look plans again.
                self.events.append(self._event("Normal", "ConsolidationHeld", f"removal of node {old.node_name} called off: {old.held}"))
            else:
                self.events.append(
                    self._event(
                        "Normal",
                        "ReshopHeld",
                        f"re-shop of node {old.node_name} called off: {old.held}; its replacement {new.node_name if new else old.replaced_by} is let go",
                    )
                )
            self._set(
                old,
                replaced_by=None,
                disrupt_sent=False,
                held="",
                cheaper_since=None,
                replace_reason="",
                replace_key="",
                replace_after=now + wait,
                removing=None,
                # The evicted replacement's id is spent: the next re-shop names a new one.
                replace_attempts=old.replace_attempts + (1 if old.replaced_by else 0),
            )
            if new is not None:
                self._set(new, replaces=None)

    def _set(self, n: PoolNode, **update: object) -> None:
        self.state.nodes[n.workflow_id] = self.state.nodes[n.workflow_id].model_copy(update=update)

    def _held_from_replacement(self, wid: str, n: PoolNode) -> bool:
        """A Ready node that wants a replacement not yet bought, which a do-not-disrupt pod or
        the Node's annotation holds (the bridge's demand): no replacement is bought for it while
        the hold lasts (a DisruptionBlocked Event says so, once)."""
        if not (n.replace_reason and n.replaced_by is None and n.phase is NodePhase.READY and n.node_name in self.state.held_nodes):
            return False
        self._blocked(wid, n.node_name, f"{n.replace_reason}: do-not-disrupt holds it; its replacement is bought once nothing holds it")
        return True

    def _replacement_fits(self, u: PoolUpdate, live: list[PoolNode], slots: dict[str, Slot]) -> bool:
        """Whether the next replacement fits under spec.maxNodes beside every live node (the old
        node bills until its replacement is Ready). Past it, none is bought: a DisruptionBlocked
        Event says to raise maxNodes (replacement is make-before-break), once per candidate."""
        candidate = None if in_progress(slots) else first_candidate(slots)
        if candidate is None or u.spec.max_nodes is None or len(live) < u.spec.max_nodes:
            return True
        n = self.state.nodes[candidate]
        message = (
            f"{slots[candidate].want}: its replacement would be node {len(live) + 1} of spec.maxNodes {u.spec.max_nodes} "
            "(make-before-break buys it before the old node goes); raise maxNodes by one to let it through"
        )
        self._blocked(candidate, n.node_name, message)
        return False

    def _replacement_budget(self, slots: dict[str, Slot]) -> bool:
        """Whether the budgets let the next candidate's replacement begin (it counts as
        disrupting from its start). A refusal is a DisruptionBlocked Event, once per message."""
        u = self.state.update
        assert u is not None
        if in_progress(slots):
            return True  # nothing is started this pass anyway
        candidate = first_candidate(slots)
        if candidate is None:
            return False
        n = self.state.nodes[candidate]
        now = workflow.now()
        self._forget_grants(now)
        initialized = sum(1 for m in self.state.nodes.values() if m.phase in (NodePhase.READY, NodePhase.DRAINING))
        reason = DisruptionReason(slots[candidate].want or DisruptionReason.DRIFTED.value)
        verdict = allowed_disruptions(u.spec.disruption.budgets, now, reason, initialized, self._disrupting())
        if verdict.permits():
            self.state.blocked.pop(candidate, None)
            return True
        self._blocked(candidate, n.node_name, verdict.message)
        return False

    def _blocked(self, wid: str, node_name: str, message: str) -> bool:
        """Record why node `wid`'s disruption is blocked; a DisruptionBlocked Event when the
        reason is new for it (not again each pass or ask). Returns whether it was new."""
        if self.state.blocked.get(wid) == message:
            return False
        self.state.blocked[wid] = message
        self.events.append(self._event("Normal", "DisruptionBlocked", f"node {node_name}: {message}"))
        return True

    async def _replace(self, old: PoolNode, reason: DisruptionReason, offer: Decimal | None = None, *, name: str | None = None) -> bool:
        """Start the replacement of `old` for `reason` (make-before-break): a node workflow like
        `old` (its floor, at least its GPUs) made as the pool and class are now, named
        `name` (tgp.replace.replacement_name: the same step always names the same node).
        `offer`: the most it may cost per hour (re-shop; else the cap `old.replace_key` names,
        if any). The pool tells `old` to end once it is Ready (`_replacements`); `old` is never
        drained before. Returns whether it started; a refusal is a ReplacementFailed Event and
        the next try waits REPLACEMENT_BACKOFF.

        The contract for other callers (consolidation): `old` is a Ready node of this pool with
        no replacement under way (`old.replaced_by is None`); the caller has checked the budget
        for `reason` and, for one step at a time, that `tgp.replace.in_progress` of the pool is
        empty. From the start on, every pass's
        `_replacements` follows it: `disrupt` (with `reason`) to `old` once the replacement is
        Ready, ReplacementFailed and `old` kept if the replacement ends first."""
        u = self.state.update
        assert u is not None and u.node_class is not None
        now = workflow.now()
        node_name = name or replacement_name(self.inp.name, old.workflow_id, old.replace_key or reason.value, old.replace_attempts)
        req = node_request(
            namespace=self.inp.namespace,
            pool_name=self.inp.name,
            class_name=u.spec.node_class_ref.name,
            node_name=node_name,
            pool=u.spec,
            klass=u.node_class,
            watch_interval=self.inp.watch_interval,
            floor=True,  # no idling out while the old node lives (the pool sends its own settings after)
            min_gpus=self._size(old) or old.gpus or 1,
            unlimited=self._unlimited(u),
        )
        cap = offer if offer is not None else (Decimal(old.replace_key.removeprefix("under ")) if old.replace_key.startswith("under ") else None)
        if cap is not None:
            limit = cap if req.requirements.max_hourly_price is None else min(cap, req.requirements.max_hourly_price)
            req = req.model_copy(update={"requirements": req.requirements.model_copy(update={"max_hourly_price": limit})})
        price = self._best_price(old) if cap is not None else (self.state.offer_check.cheapest if self.state.offer_check else None)
        started = await best_effort(
            PoolActivities.reserve_and_start_node,
            StartNodeInput(
                class_name=req.class_workflow_id or u.spec.node_class_ref.name,
                reservation=Reservation(node_id=req.workflow_id, pool=f"{self.inp.namespace}/{self.inp.name}", hourly_price=price),
                request=req,
            ),
            summary=f"start replacement {node_name}",
        )
        refused = started.error if not started.ok else ("" if started.value.started else started.value.reason)
        if refused:
            self.events.append(
                self._event(
                    "Warning",
                    "ReplacementFailed",
                    f"could not start a replacement for node {old.node_name} ({reason.value}): {refused}; {old.node_name} stays; "
                    f"tried again after {REPLACEMENT_BACKOFF}",
                )
            )
            self._set(old, replace_after=now + REPLACEMENT_BACKOFF)  # the same name next time: nothing was started
            return False
        new = self.state.nodes.get(req.workflow_id) or PoolNode(workflow_id=req.workflow_id, node_name=node_name, created_at=now, phase_at=now)
        sent = _fingerprint(self._timeouts_for(u, floor=True, held=False))
        self.state.nodes[req.workflow_id] = new.model_copy(
            update={"floor": old.floor, "timeouts_sent": sent, "gpus": req.requirements.min_gpu_count, "replaces": old.workflow_id}
        )
        key = old.replace_key if old.replace_reason == reason.value else (f"under {cap}" if cap is not None else "")
        self._set(old, replaced_by=req.workflow_id, disrupt_sent=False, replace_reason=reason.value, replace_key=key)
        self.events.append(
            self._event(
                "Normal",
                "NodeReplacing",
                f"launching node {node_name} to replace {old.node_name} ({reason.value}); {old.node_name} is drained only once {node_name} is Ready",
            )
        )
        return True

    def _timeouts_for(self, u: PoolUpdate, *, floor: bool, held: bool) -> TimeoutsUpdate:
        """A node's disruption settings; with demand by fit also whether it holds nominated pods'
        place (bind grace) or not (released: it idles out as usual once its pods left)."""
        wanted = node_timeouts(u.spec, floor=floor)
        wanted = wanted.model_copy(update={"hold": self.inp.bind_grace if held else timedelta(0)})
        grace = u.spec.disruption.termination_grace_period
        if grace is not None:
            wanted = wanted.model_copy(update={"termination_grace": grace})
        unlimited = self._unlimited(u)
        if unlimited:  # sent only when there are some: pools with the default 10% send nothing new
            wanted = wanted.model_copy(update={"unlimited_reasons": unlimited})
        return wanted

    def _unlimited(self, u: PoolUpdate) -> list[str]:
        """The disruption reasons this run tells its nodes its budgets cannot refuse, in their
        start and in its settings signal alike: what a node holds is what the pool's record of
        its settings says (`timeouts_sent`), so a change of budgets reaches it."""
        return unlimited_reasons(u.spec.disruption.budgets)

    def _model_held_nodes(self, live: list[PoolNode]) -> None:
        """A node started with `hold_ends_when_busy` ends its bind-grace hold at the first pod on
        it, unless the pool sent it settings since: once the bridge shows GPU pods bound on it,
        the pool's record of what it has says so too (the settings last sent, with
        no hold). The pool then sends nothing when its pods' nominations end, and sends the hold
        again if some of its pods still wait (the node keeps what the pool sends from then on).
        Where the two views part (a pod the bridge counted came and went before the node heard
        of it), the node holds at most its bind grace, as before."""
        for n in live:
            # The bridge lists bound pods only on Ready Nodes, and the node's watch sees them
            # even when its own Ready report reaches the pool after the demand that shows them.
            if n.hold_ends_when_busy and self.state.bound_gpus.get(n.node_name):
                sent = TimeoutsUpdate.model_validate_json(n.timeouts_sent) if n.timeouts_sent else None
                dropped = _fingerprint(sent.model_copy(update={"hold": timedelta(0)})) if sent is not None and sent.hold else n.timeouts_sent
                self.state.nodes[n.workflow_id] = n.model_copy(update={"hold_ends_when_busy": False, "timeouts_sent": dropped})

    async def _sync_timeouts(self, u: PoolUpdate, live: list[PoolNode]) -> None:
        """Send each running node the pool's current disruption settings when they changed."""
        self._model_held_nodes(live)
        held = {nom.workflow_id for nom in self.state.nominations.values() if nom.bought}
        failed = "could not update the timeouts of %s: %s"
        sends: list[tuple[str, Any, str]] = []
        for wid in sorted(n.workflow_id for n in live):
            node = self.state.nodes[wid]  # read again after each send when one by one: reports land meanwhile
            if node.phase not in _TUNABLE:
                continue
            # A replacement keeps like a floor node (never idles) until the node it replaces is gone.
            wanted: TimeoutsUpdate = self._timeouts_for(u, floor=node.floor or self._replacing(node), held=wid in held)
            fingerprint = _fingerprint(wanted)
            if node.timeouts_sent == fingerprint:
                continue
            if node.hold_ends_when_busy:  # the pool speaks: from now on the node keeps what it is sent
                self.state.nodes[wid] = node.model_copy(update={"hold_ends_when_busy": False})
            sends.append((wid, wanted, fingerprint))
        await self._signal_nodes("update_timeouts", sends, "timeouts_sent", failed)

    async def _sync_template(self, u: PoolUpdate, live: list[PoolNode]) -> None:
        """Send each running node the pool's template labels and taints when they changed since
        it last got them (or since it was started with them): it applies them to its Node in
        place. A node the pool knows nothing of (adopted after a restart) gets them once; it
        applies only a difference."""
        wanted = _template(u)
        fingerprint = _template_fingerprint(wanted)
        failed = "could not update the labels and taints of %s: %s"
        sends: list[tuple[str, Any, str]] = []
        for wid in sorted(n.workflow_id for n in live):
            node = self.state.nodes[wid]
            if node.phase not in _TUNABLE or node.template_sent == fingerprint:
                continue
            sends.append((wid, wanted, fingerprint))
        await self._signal_nodes("update_template", sends, "template_sent", failed)

    async def _signal_node(self, wid: str, signal: str, arg: Any, fingerprint: str, sent_field: str, failed: str) -> None:
        """Signal one node and record the fingerprint as sent (a node that just ended has
        nothing to update)."""
        try:
            await workflow.get_external_workflow_handle(wid).signal(signal, arg)
        except Exception as exc:  # noqa: BLE001 - a node that just ended has nothing to update
            workflow.logger.info(failed, wid, exc)
        self.state.nodes[wid] = self.state.nodes[wid].model_copy(update={sent_field: fingerprint})

    async def _signal_nodes(self, signal: str, sends: list[tuple[str, Any, str]], sent_field: str, failed: str) -> None:
        """The signals SIGNALS_AT_ONCE at a time in one workflow task, in a fixed order."""
        for i in range(0, len(sends), SIGNALS_AT_ONCE):
            await asyncio.gather(*(self._signal_node(wid, signal, arg, fp, sent_field, failed) for wid, arg, fp in sends[i : i + SIGNALS_AT_ONCE]))

    async def _tear_down(self, live: list[PoolNode]) -> bool:
        """Pool deleted: evict every node, and let the finalizer go once none is left."""
        if live:
            # Signalling again is harmless (the first reason wins); a workflow that closed
            # without reporting (terminated by hand) is counted as gone.
            evicted = await best_effort(PoolActivities.evict_nodes, [n.workflow_id for n in live], summary="evict nodes")
            closed = evicted.value or []
            for wid in closed:
                node = self.state.nodes[wid]
                self.state.nodes[wid] = node.model_copy(update={"phase": NodePhase.TERMINATED, "reason": "its workflow is closed"})
            live = [n for n in live if n.workflow_id not in closed]
        if live:
            await self._publish({"Ready": ("False", "Deleting", f"draining and terminating {len(live)} node(s) before the pool is deleted")})
            self._forget_ended()
            return False
        await self._flush_events()
        released = await best_effort(PoolActivities.remove_finalizer, self._ref(), summary="remove the finalizer")
        if not released.ok:
            await self._publish({"Ready": ("False", "Deleting", f"nodes are gone; {released.error}; retrying")})
            return False
        return True

    # --- consolidation (issue 21 item 4) ---------------------------------------------------------

    def _consolidation_due(self, u: PoolUpdate) -> bool:
        """Consolidation is on and was not planned this resync (planning is O(nodes²) at worst:
        not on every pass of a burst)."""
        looked = self.state.consolidation_looked_at
        return u.spec.disruption.consolidation is not None and (looked is None or workflow.now() - looked >= self.inp.resync_interval)

    def _look_for_consolidation(self, u: PoolUpdate, live: list[PoolNode]) -> ConsolidationPlan:
        """Plan consolidation on this look (pure: no command) and record the savings it found.

        Each Ready node with its GPUs registered is taken as the bridge reports it: its free
        GPUs, the GPU requests of its bound pods and whether do-not-disrupt holds it (the node
        checks its own holders again when it is told to go: the report may lag)."""
        assert u.node_class is not None
        now = workflow.now()
        self.state.consolidation_looked_at = now
        # Pending pods nominated to the free GPUs of a Ready node (they will bind there), per node.
        nominated: dict[str, dict[str, int]] = {}
        for pod, nom in sorted(self.state.nominations.items()):
            if not nom.bought and pod in self.state.demand:
                nominated.setdefault(nom.workflow_id, {})[pod] = self.state.pod_gpus.get(pod, 1)
        ready = [
            PoolMember(name=n.node_name, workflow_id=n.workflow_id, hourly_price=n.hourly_price, running_for=now - n.phase_at, leaving=self._leaving(n))
            for n in live
            if n.phase is NodePhase.READY
        ]
        nodes = look_at(ready, self.state.free_gpus, self.state.bound_gpus, self.state.held_nodes, nominated)
        oc = self.state.offer_check
        initialized = sum(1 for n in live if n.phase in (NodePhase.READY, NodePhase.DRAINING))
        plan = plan_consolidation(
            nodes,
            oc.sizes if oc is not None and oc.sizes else None,
            u.spec.disruption.consolidation,
            u.spec.disruption.budgets,
            now,
            pool_nodes=initialized,
            disrupting=self._disrupting(),
            min_nodes=u.spec.min_nodes,
            min_gpus=offer_requirements(u.spec, u.node_class).min_gpu_count,
        )
        old = self.state.consolidation or ConsolidationStatus()
        self.state.consolidation = old.model_copy(update={"savings_found_hourly": plan.savings, "candidates": len(plan.actions)})
        return plan

    @staticmethod
    def _leaving(n: PoolNode) -> bool:
        """A Ready node on its way out: told to end by consolidation, or being replaced."""
        return n.removing is not None or n.disrupt_sent or n.replaced_by is not None

    async def _consolidate(self, plan: ConsolidationPlan) -> None:
        """Carry out `plan`'s removals: each underutilized node (its pods fit on the free GPUs of
        nodes that stay) is told to end (`disrupt`, reason Underutilized); the node checks its
        do-not-disrupt holders again, asks the budget, drains and terminates, and the saving counts
        as made when it reports Terminated (`node_phase`). A node told so that reports itself held
        is called off like a re-shop (`_call_off_held_reshops`). Re-shops and drift are the
        replacement step's (`_replacements`, make-before-break): the plan only shows them."""
        now = workflow.now()
        by_name = {n.node_name: n for n in self.state.nodes.values()}
        removals = []
        for action in plan.actions:
            n = by_name.get(action.node)
            if action.kind is not ActionKind.REMOVE or n is None or n.phase is not NodePhase.READY:
                continue
            if n.removing is not None or n.replace_reason or n.replaced_by or n.replaces or n.disrupt_sent or (n.replace_after is not None and now < n.replace_after):
                continue  # already told, drifted or cheaper (the replacement step's), or called off lately
            removals.append((n, action))
        if not removals:
            return
        for n, action in removals:
            try:
                await workflow.get_external_workflow_handle(n.workflow_id).signal(
                    "disrupt", DisruptRequest(reason=DisruptionReason.UNDERUTILIZED.value, detail=action.message)
                )
            except Exception as exc:  # noqa: BLE001 - it ended meanwhile: nothing to remove
                workflow.logger.info("could not tell %s to end: %s", n.workflow_id, exc)
                continue
            self._set(n, removing=action.saving)
            self.events.append(self._event("Normal", "NodeConsolidating", f"node {n.node_name}: {action.message}"))

    def _consolidated(self, node_name: str, reason: str, saving: Decimal) -> None:
        """A consolidation was done: add what it saves to savingsMadeHourly and name it."""
        old = self.state.consolidation or ConsolidationStatus()
        self.state.consolidation = old.model_copy(
            update={"savings_made_hourly": old.savings_made_hourly + saving, "last_action": f"node {node_name}: {reason}, saving ${saving}/h"}
        )
        self.events.append(self._event("Normal", "Consolidated", f"node {node_name}: {reason}, saving ${saving}/h"))
        self.dirty = True

    def _forget_ended(self) -> None:
        ended = [k for k, n in self.state.nodes.items() if n.phase.is_final]
        if ended:
            self.state.nodes_ended += len(ended)
            self.state.ended = [*self.state.ended, *ended][-ENDED_REMEMBERED:]
            self.state.nodes = {k: n for k, n in self.state.nodes.items() if not n.phase.is_final}

    # --- status and Events -----------------------------------------------------------------

    def _ref(self) -> ObjectRef:
        uid = self.state.update.uid if self.state.update else None
        return ObjectRef(kind="GPUNodePool", name=self.inp.name, namespace=self.inp.namespace, uid=uid)

    def _status(self) -> GPUNodePoolStatus:
        live = [n for n in self.state.nodes.values() if not n.phase.is_final]
        u = self.state.update
        return GPUNodePoolStatus(
            observed_generation=u.generation if u else None,
            conditions=list(self.state.conditions.values()),
            ready_nodes=sum(1 for n in live if n.phase is NodePhase.READY),
            desired_nodes=len(live),
            disrupting=self._disrupting(),
            consolidation=self.state.consolidation,
            hourly_cost=sum((n.hourly_price or 0 for n in live if n.phase is not NodePhase.PENDING), start=0),  # type: ignore[arg-type]
            nodes=[self._node_status(n) for n in sorted(live, key=lambda n: n.created_at)],
        )

    def _node_status(self, n: PoolNode) -> PoolNodeStatus:
        status = PoolNodeStatus.of(n, created_at=n.created_at)
        new = self.state.nodes.get(n.replaced_by) if n.replaced_by else None
        return status.model_copy(update={"drift_hash": n.drift_hash, "drifted": n.drifted or None, "replaced_by": new.node_name if new else None})

    async def _publish(self, wanted: dict[str, tuple[str, str, str]]) -> None:
        generation = self.state.update.generation if self.state.update else None
        conditions = condition_list(wanted, generation, workflow.now(), self.state.conditions)
        for c in conditions:
            old = self.state.conditions.get(c.type)
            # A problem the user must fix is also an Event, once, when it appears.
            if c.status == "False" and c.type not in ("Ready", "PodsFit", "InstancesReleased") and (old is None or old.status != "False" or old.reason != c.reason):
                self.events.append(self._event("Warning", c.reason, c.message))
        self.state.conditions = {c.type: c for c in conditions}
        # The activity reads the status through the `status` query: the history records a
        # reference on each change, not the whole status (~110 KB at 500 nodes).
        fingerprint = self._status().model_dump_json(by_alias=True)
        if fingerprint != self.state.written:
            write = PoolStatusWrite(ref=self._ref(), workflow_id=workflow.info().workflow_id)
            if (await best_effort(EntityActivities.write_pool_status, write, summary="write the pool status")).ok:
                self.state.written = fingerprint
        # Once a pass: Events reported meanwhile wait for the next (a burst's reports kept a
        # pass writing, and a deleted pool evicted its nodes late).
        await self._write_events()

    async def _write_events(self) -> bool:
        """Write the Events so far, once; those appended meanwhile wait (in the state, which
        continue-as-new carries). A failed write is retried on the next pass, and a backlog is
        capped so a broken API cannot grow it. Returns whether the write went through."""
        if not self.state.events:
            return True
        batch = list(self.state.events)
        emitted = await best_effort(EntityActivities.emit_events, batch, summary="write Events")
        if not emitted.ok:
            self.state.events = self.state.events[-MAX_PENDING_EVENTS:]
            return False
        self.state.events = self.state.events[len(batch) :]
        return True

    async def _flush_events(self) -> None:
        """The last write of a run that ends: every Event, also those appended while a write is
        in flight, until none is left or a write fails."""
        while self.state.events and await self._write_events():
            pass

    def _event(self, type: str, reason: str, message: str) -> EventSpec:
        return EventSpec(ref=self._ref(), type=type, reason=reason, message=message)

    def _node_event(self, n: PoolNode, stages: list[StageRecord] | None = None) -> None:
        where = f"{n.gpu_type} on {n.provider} at ${n.hourly_price}/h" if n.provider else ""
        for s in stages or []:
            if s.stage is Stage.DRAIN_TIMED_OUT:  # the pods it names were killed, not evicted
                self.events.append(self._event("Warning", s.stage.value, f"node {n.node_name} drain {s.reason}"))
        if n.phase is NodePhase.READY:
            self.events.append(self._event("Normal", "NodeReady", f"node {n.node_name} is Ready ({where})"))
        elif n.phase is NodePhase.FAILED:
            self.events.append(self._event("Warning", "LaunchFailed", f"node {n.node_name} could not be launched: {n.reason}"))
        elif n.phase is NodePhase.TERMINATION_STUCK:
            self.events.append(self._event("Warning", "TerminationStuck", f"node {n.node_name} is still billing: {n.reason}"))
        elif n.phase is NodePhase.INTERRUPTED:
            self.events.append(self._event("Warning", "NodeInterrupted", f"node {n.node_name} was lost: {n.reason}"))
        elif n.phase in (NodePhase.TERMINATED, NodePhase.CANCELLED):
            self.events.append(self._event("Normal", "NodeTerminated", f"node {n.node_name} terminated: {n.reason}"))


def _named(pods: list[str]) -> str:
    return ", ".join(pods[:MAX_PODS_NAMED]) + (f" and {len(pods) - MAX_PODS_NAMED} more" if len(pods) > MAX_PODS_NAMED else "")


def _class_key(u: PoolUpdate) -> str:
    return u.node_class.model_dump_json() if u.node_class is not None else ""


def _asks_again(refusal: ClassRefusal) -> str:
    return f"asking the class again when a node of the pool ends, the pool or class changes, or at {refusal.until:%H:%M:%S}"


def _template(u: PoolUpdate) -> TemplateUpdate:
    """The labels and taints the pool's template puts on its Nodes."""
    return TemplateUpdate(labels=dict(u.spec.template.metadata.labels), taints=list(u.spec.template.spec.taints))


def _template_fingerprint(template: TemplateUpdate) -> str:
    """A short hash of the labels and taints a node was sent: the pool keeps one per node, and
    64 labels and 32 taints as JSON per node would swell its state at a few hundred nodes."""
    return hashlib.sha256(template.model_dump_json().encode()).hexdigest()[:16]


def _fingerprint(timeouts: TimeoutsUpdate) -> str:
    """The settings as sent to a node, compared on each pass: a change sends them again."""
    return timeouts.model_dump_json(exclude_none=True)
