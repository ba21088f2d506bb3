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

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.entity import EntityActivities, EventSpec, PoolStatusWrite, StatusWrite
    from activities.pool import PoolActivities
    from tgp.capacity import POD_BIND_GRACE, CapacityNode, CapacityPlan, NewNode, Nomination, OfferSize, no_offer_fits_to_warn, note_ready, plan_capacity
    from tgp.capacity_v1 import plan_capacity_v1
    from tgp.conditions import condition_list
    from tgp.crds import Condition, GPUNodePoolStatus, PoolNodeStatus
    from tgp.demand import nodes_to_launch
    from tgp.disruption import DisruptionReason, allowed_disruptions
    from tgp.messages import (
        Demand,
        DisruptionAnswer,
        DisruptionAsk,
        NodeReport,
        NodeSighting,
        NodeStart,
        ObjectRef,
        OfferCheck,
        PoolNode,
        PoolUpdate,
        Reservation,
        RunningNodesQuery,
        StartNodeInput,
        StartNodesInput,
    )
    from tgp.pools import node_request, node_timeouts, offer_requirements, request_for
    from tgp.types import NodePhase, NodeRequest, Stage, StageRecord, TemplateUpdate, TimeoutsUpdate, node_workflow_id
    from workflows.entity import best_effort, history_is_long, write_status_once
    from workflows.legacy.r31e9066.frozen import frozen_pool

# Even with no news the pool looks again this often (a lost signal cannot stall it).
RESYNC_INTERVAL = timedelta(minutes=1)
# After a node fails to come up, wait before launching again; doubles per failure.
LAUNCH_BACKOFF = timedelta(seconds=30)
MAX_LAUNCH_BACKOFF = timedelta(minutes=15)
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 2000
# Offers come and go; "no offer" and the price used for reservations are re-checked this often.
OFFER_CHECK_TTL = timedelta(minutes=5)
# Node workflows started in one pass, at once; the next pass (after the class ledger and the
# deletion flag are looked at again) starts more. Bounds what one typo can buy before it is seen.
# (Passes recorded before BATCHED_LAUNCHES_PATCH.)
MAX_STARTS_PER_PASS = 10
# Batched launches: a pass starts every node its batch of pending pods needs, with one class
# ledger call (the class grants what fits its budget, and its limits.maxNodes, 10 unless set,
# is what bounds a typo) and one activity. This cap only bounds that activity: ~0.3 KB of input
# per node (far under Temporal's 2 MB payload limit) and 25 starts at a time take seconds, well
# within START_NODES_TIMEOUT; a 500-pod burst starts in one pass.
MAX_STARTS_PER_BATCH = 500
START_NODES_TIMEOUT = timedelta(minutes=3)
BATCHED_LAUNCHES_PATCH = "batched-launches"
# A pool its class refused asks again when something that could change the answer happened (the
# pool or its class changed, a node of the pool ended), else after this long: a node of another
# pool of the class may have ended meanwhile, which this pool does not hear of. (A refused pool
# used to ask every pass: 220 refusals in 6 minutes.)
CLASS_REFUSAL_BACKOFF = timedelta(seconds=30)
# Pods named in a PodDoesNotFit message (the rest are counted).
MAX_PODS_NAMED = 5
# Events kept for a later write while the API refuses them (newest kept).
MAX_PENDING_EVENTS = 100
# Visibility is eventually consistent: a node workflow started this recently may not be listed
# yet, so it is not taken for closed.
VISIBILITY_LAG = timedelta(minutes=1)

# A node's phase reports are separate signals, and Temporal does not keep separate signals in
# order (a delivery that is retried is overtaken by the next one; seen under load): a report
# older than the one already taken, or about a node that has ended, is stale and ignored.
REPORT_ORDER_PATCH = "node-report-order"
# A pool being deleted stays deleted: an older update that overtook the deletion is ignored.
DELETION_IS_FINAL_PATCH = "pool-deletion-is-final"
# Ended node workflows remembered for that (their late reports would bring them back as ghosts).
ENDED_REMEMBERED = 500
# Demand by fit (tgp.capacity): nodes sized from their own pods and packed, nominations void
# once their node is full or gone, pods no offer fits reported, limits reported. Passes before
# the patch replay through tgp.capacity_v1 with the commands they recorded.
DEMAND_BY_FIT_PATCH = "demand-by-fit"
# The pool's look at its running node workflows (once a resync) records only the differences
# from what it knows (ids in, changes out): a full listing of a 500-node pool was ~130 KB of
# history a minute.
RUNNING_NODES_CHANGES_PATCH = "running-nodes-changes"
# The status is written by an activity that reads it through the pool's `status` query: the
# history records a reference on each change, not the whole status (~110 KB at 500 nodes).
STATUS_BY_QUERY_PATCH = "status-by-query"
# A launch failure doubles the back-off only for a node started after the previous failure:
# the nodes of one batch failing together count as one failure.
FAILURE_WAVES_PATCH = "failure-waves"
# A node let go by a budget counts as disrupting until it reports Draining, at most this long
# (it reports within seconds; one whose drain was called off is Ready again and asks anew).
GRANT_COUNTS_FOR = timedelta(minutes=2)
# Marks runs that send their nodes the pool's terminationGracePeriod with the other settings
# (a pool that had one before would otherwise send every node a changed-settings signal on replay).
TERMINATION_GRACE_PATCH = "termination-grace-to-nodes"
# Marks runs that send their nodes the pool's template labels and taints when they change
# (`update_template`), to be applied to the running Nodes in place rather than by replacement.
IN_PLACE_TEMPLATE_PATCH = "in-place-template"

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


class PoolInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    namespace: str
    name: str
    watch_interval: timedelta | None = None
    resync_interval: timedelta = RESYNC_INTERVAL
    bind_grace: timedelta = POD_BIND_GRACE
    visibility_lag: timedelta = VISIBILITY_LAG
    class_refusal_backoff: timedelta = CLASS_REFUSAL_BACKOFF
    state: PoolState = PoolState()


@workflow.defn(name="GPUNodePoolWorkflow")
class GPUNodePoolWorkflow:
    @workflow.init
    def __init__(self, inp: PoolInput) -> None:
        self.legacy = frozen_pool(inp)  # a run of release 31e9066 ends in its own code
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
        if self.legacy:
            return self.legacy.handle("update", u)
        old = self.state.update
        if old is not None and old.deleting and not u.deleting and old.uid == u.uid and workflow.patched(DELETION_IS_FINAL_PATCH):
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
        if self.legacy:
            return self.legacy.handle("demand", d)
        self.state.demand = list(d.pods)
        self.state.pending_since = {pod: self.state.pending_since.get(pod, d.observed_at) for pod in d.pods}
        self.state.demand_at = d.observed_at
        self.state.demand_gpus = d.max_gpus
        self.state.pod_gpus = dict(d.pod_gpus)
        self.state.free_gpus = dict(d.free_gpus)
        self.dirty = True

    @workflow.signal
    def node_phase(self, r: NodeReport) -> None:
        """A node workflow moved to a new phase."""
        if self.legacy:
            return self.legacy.handle("node_phase", r)
        old = self.state.nodes.get(r.workflow_id)
        overtaken = old is not None and old.reported_at is not None and r.at < old.reported_at
        if (overtaken or r.workflow_id in self.state.ended) and workflow.patched(REPORT_ORDER_PATCH):
            return
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
            template_sent=old.template_sent if old else "",
            gpus=old.gpus if old else None,
            reported_at=r.at,
        )
        self.state.nodes[r.workflow_id] = node
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
            elif s.stage is Stage.NODE_REPAIR:
                self.events.append(self._event("Warning", s.stage.value, f"node {node.node_name} is repaired: {s.reason.removeprefix('node repair: ')}"))
        if r.phase is NodePhase.FAILED:
            # Nodes started before the last failure was reported are of the same wave: their
            # failures teach nothing new (a burst's batch failing under load doubled the back-off
            # per node: five failures held the pool 8 minutes, Ready True, pods unserved).
            same_wave = old is not None and self.state.failed_at is not None and old.created_at <= self.state.failed_at
            if not (same_wave and workflow.patched(FAILURE_WAVES_PATCH)):
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
        if self.legacy or self.state.update is None or self.state.update.deleting:
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
        if self.state.blocked.get(ask.workflow_id) != verdict.message:
            self.state.blocked[ask.workflow_id] = verdict.message
            self.events.append(self._event("Normal", "DisruptionBlocked", f"node {ask.node_name}: {verdict.message}"))
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
        return len((draining | granted) - {exclude})

    def _forget_grants(self, now: datetime) -> None:
        """A grant counts until its node reports Draining (or anything but Ready), or for
        GRANT_COUNTS_FOR: a node that was let go but then found its drain called off."""
        for wid, at in list(self.state.granted.items()):
            n = self.state.nodes.get(wid)
            if n is None or n.phase is not NodePhase.READY or now - at > GRANT_COUNTS_FOR:
                del self.state.granted[wid]

    @workflow.query
    def status(self) -> GPUNodePoolStatus:
        return self.legacy.query("status") if self.legacy else self._status()

    # --- the loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: PoolInput) -> None:
        if self.legacy:
            return await self.legacy.run()
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
        # (State only, no command; the planning before demand by fit does not read it.)
        self.state.nominations = note_ready(self.state.nominations, self._capacity_nodes(live, fit=True))
        if u.deleting:
            return await self._tear_down(live)

        wanted: dict[str, tuple[str, str, str]] = {}
        klass = u.node_class
        if klass is None:
            name = u.spec.node_class_ref.name
            wanted["ClassReady"] = ("False", "ClassNotFound", f"GPUNodeClass {name} not found: create it or fix spec.nodeClassRef.name")
        else:
            self._assign_floor(live, u.spec.min_nodes)
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
        if workflow.patched(RUNNING_NODES_CHANGES_PATCH):
            prefix = node_workflow_id(self.inp.namespace, self.inp.name, "")
            known = sorted(wid.removeprefix(prefix) for wid, n in self.state.nodes.items() if not n.phase.is_final)
            changed = await best_effort(
                EntityActivities.running_nodes_changed,
                RunningNodesQuery(query=f"TgpPool = '{pool}'", prefix=prefix, known=known),
                summary="list running nodes (changes)",
            )
            if not changed.ok:
                return
            self.state.seen_running_at = now
            if not changed.value.listed:
                return  # a server without visibility: nothing to rebuild from
            unknown: list[NodeSighting] = changed.value.unknown
            gone = {prefix + name for name in changed.value.missing}
        else:
            seen = await best_effort(EntityActivities.running_nodes, f"TgpPool = '{pool}'", summary="list running nodes")
            if not seen.ok:
                return
            self.state.seen_running_at = now
            if seen.value is None:
                return  # a server without visibility: nothing to rebuild from
            unknown = seen.value
            listed = {s.workflow_id for s in seen.value}
            gone = {n.workflow_id for n in self.state.nodes.values() if not n.phase.is_final and n.workflow_id not in listed}
        for s in unknown:
            wid = s.workflow_id
            if wid in self.state.ended and workflow.patched(REPORT_ORDER_PATCH):
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
        missing = [
            n.workflow_id for n in self.state.nodes.values() if not n.phase.is_final and n.workflow_id in gone and now - n.created_at >= self.inp.visibility_lag
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
        stale = self.state.offer_checked_at is None or workflow.now() - self.state.offer_checked_at >= OFFER_CHECK_TTL
        oc = self.state.offer_check
        if oc is not None and oc.matching and not oc.sizes and workflow.patched(DEMAND_BY_FIT_PATCH):
            stale = True  # checked by an older release: nodes are sized from the offers per GPU count
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
        if not workflow.patched(DEMAND_BY_FIT_PATCH):
            return await self._launch_v1(u, live)
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
        batched = bool(wanted[:room]) and workflow.patched(BATCHED_LAUNCHES_PATCH)
        if batched:
            refusal = self._class_refusal(u)
            if refusal is not None:
                return ("False", "BudgetExhausted", f"not launching more nodes: {refusal.reason}; {_asks_again(refusal)}")
            starts = wanted[: min(room, MAX_STARTS_PER_BATCH)]
            results = await self._start_nodes(u, starts, floor_missing)
        else:
            starts = wanted[: min(room, MAX_STARTS_PER_PASS)]
            results = await asyncio.gather(
                *(self._start_node(u, floor=i < floor_missing, pods=n.pods, gpus=n.gpus, price=n.hourly_price) for i, n in enumerate(starts))
            )
        refused = [reason for started, reason in results if not started]
        if refused:
            # The class ledger's refusal names its limit (limits.maxNodes, limits.maxHourlyCost).
            refusal = self.state.class_refusal
            if batched and refusal is not None:
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
        template = node_request(
            namespace=self.inp.namespace,
            pool_name=self.inp.name,
            class_name=class_name,
            node_name="",
            pool=u.spec,
            klass=u.node_class,
            watch_interval=self.inp.watch_interval,
        )
        cheapest = self.state.offer_check.cheapest if self.state.offer_check else None
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
            return [(False, started.error or "")] * len(batch)
        results = []
        refused = ""
        for start, n, result in zip(batch, starts, started.value.results, strict=True):
            if result.started:
                self._started(u, request_for(template, start), floor=start.floor, pods=n.pods, now=now)
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

    async def _start_node(self, u: PoolUpdate, *, floor: bool, pods: list[str], gpus: int, price: Decimal | None = None) -> tuple[bool, str]:
        """Reserve a class slot and start one node workflow with at least `gpus` GPUs, bought
        for `pods`."""
        assert u.node_class is not None
        now = workflow.now()
        node_name = f"{self.inp.name}-{workflow.uuid4().hex[:5]}"
        fit = workflow.patched(DEMAND_BY_FIT_PATCH)
        req = node_request(
            namespace=self.inp.namespace,
            pool_name=self.inp.name,
            class_name=u.spec.node_class_ref.name,
            node_name=node_name,
            pool=u.spec,
            klass=u.node_class,
            watch_interval=self.inp.watch_interval,
            floor=floor,
            min_gpus=gpus,
            bind_grace=self.inp.bind_grace if fit and pods else None,
        )
        since = [self.state.pending_since[pod] for pod in pods if pod in self.state.pending_since]
        if since:
            req = req.model_copy(update={"demand_since": min(since)})  # tgp_demand_to_launch_seconds starts here
        if price is None:
            price = self.state.offer_check.cheapest if self.state.offer_check else None
        started = await best_effort(
            PoolActivities.reserve_and_start_node,
            StartNodeInput(
                class_name=req.class_workflow_id or u.spec.node_class_ref.name,
                reservation=Reservation(node_id=req.workflow_id, pool=f"{self.inp.namespace}/{self.inp.name}", hourly_price=price),
                request=req,
            ),
            summary=f"start node {node_name}",
        )
        if not started.ok:
            return False, started.error or ""
        if not started.value.started:
            return False, started.value.reason
        self._started(u, req, floor=floor, pods=pods, now=now, fit=fit)
        return True, ""

    def _started(self, u: PoolUpdate, req: NodeRequest, *, floor: bool, pods: list[str], now: datetime, fit: bool = True) -> None:
        """Record a node workflow just started for `pods`, and its NodeLaunched Event."""
        node_name = req.node_name
        # A report may already have arrived while the start was in flight: keep its phase, but
        # the floor flag, the GPUs and the settings sent are known only here.
        node = self.state.nodes.get(req.workflow_id) or PoolNode(workflow_id=req.workflow_id, node_name=node_name, created_at=now, phase_at=now)
        sent = _fingerprint(self._timeouts_for(u, floor=floor, held=fit and bool(pods)))
        self.state.nodes[req.workflow_id] = node.model_copy(
            update={"floor": floor, "timeouts_sent": sent, "gpus": req.requirements.min_gpu_count, "template_sent": _template_fingerprint(_template(u))}
        )
        for pod in pods:
            self.state.nominations[pod] = Nomination(workflow_id=req.workflow_id, since=now)
        if not pods:
            why = "to keep minNodes"
        elif len(pods) == 1:
            why = f"for pod {pods[0]}"
        else:
            why = f"for {len(pods)} pods ({', '.join(pods[:MAX_PODS_NAMED])}{' and more' if len(pods) > MAX_PODS_NAMED else ''})"
        if fit:
            why = f"with {req.requirements.min_gpu_count} GPU(s) {why}"
        self.events.append(self._event("Normal", "NodeLaunched", f"launching node {node_name} {why}"))

    def _capacity_nodes(self, live: list[PoolNode], *, fit: bool) -> list[CapacityNode]:
        return [self._capacity_node(n, fit=fit) for n in live]

    def _capacity_node(self, n: PoolNode, *, fit: bool) -> CapacityNode:
        if fit and self._left_after_the_demand(n):
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
            free_gpus=self.state.free_gpus.get(n.node_name) if fit else self.state.free_gpus.get(n.node_name, 0),
            gpus=n.gpus if fit else n.gpus or 1,  # unknown: no new nominations, none voided
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
        nodes = self._capacity_nodes(live, fit=True)
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

    async def _launch_v1(self, u: PoolUpdate, live: list[PoolNode]) -> tuple[str, str, str]:
        """Before demand by fit (histories recorded before DEMAND_BY_FIT_PATCH replay here)."""
        pending = {pod: self.state.pod_gpus.get(pod, 1) for pod in self.state.demand}
        unfit = set(self.state.unfit) & set(pending)
        no_borrow = set(self.state.no_borrow) & set(pending)
        nodes = self._capacity_nodes(live, fit=False)
        kept, newly_unfit, uncovered, borrow_failed = plan_capacity_v1(
            pending, nodes, self.state.nominations, unfit, workflow.now(), self.inp.bind_grace, no_borrow
        )
        self._remember(kept, unfit, no_borrow, newly_unfit, borrow_failed)
        if self.state.backoff_until is not None and workflow.now() < self.state.backoff_until:
            return ("True", "WithinBudget", "")
        count = nodes_to_launch(pending_pods=len(uncovered), launching=0, live=len(live), min_nodes=u.spec.min_nodes, max_nodes=u.spec.max_nodes)
        count = min(count, MAX_STARTS_PER_PASS)
        floor_missing = max(0, u.spec.min_nodes - sum(1 for n in self.state.nodes.values() if n.floor and not n.phase.is_final))
        starts = [self._start_node(u, floor=i < floor_missing, pods=uncovered[i : i + 1], gpus=self.state.demand_gpus) for i in range(count)]
        refused = [reason for started, reason in await asyncio.gather(*starts) if not started]
        if refused:
            return ("False", "BudgetExhausted", f"not launching more nodes: {refused[0]}")
        return ("True", "WithinBudget", "")

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

    def _timeouts_for(self, u: PoolUpdate, *, floor: bool, held: bool) -> TimeoutsUpdate:
        """A node's disruption settings; with demand by fit also whether it holds nominated pods'
        place (bind grace) or not (released: it idles out as usual once its pods left)."""
        wanted = node_timeouts(u.spec, floor=floor)
        if workflow.patched(DEMAND_BY_FIT_PATCH):
            wanted = wanted.model_copy(update={"hold": self.inp.bind_grace if held else timedelta(0)})
        grace = u.spec.disruption.termination_grace_period
        if grace is not None and workflow.patched(TERMINATION_GRACE_PATCH):
            wanted = wanted.model_copy(update={"termination_grace": grace})
        return wanted

    async def _sync_timeouts(self, u: PoolUpdate, live: list[PoolNode]) -> None:
        """Send each running node the pool's current disruption settings when they changed."""
        held = {nom.workflow_id for nom in self.state.nominations.values() if nom.bought}
        for wid in sorted(n.workflow_id for n in live):
            node = self.state.nodes[wid]
            if node.phase not in _TUNABLE:
                continue
            wanted: TimeoutsUpdate = self._timeouts_for(u, floor=node.floor, held=wid in held)
            fingerprint = _fingerprint(wanted)
            if node.timeouts_sent == fingerprint:
                continue
            try:
                await workflow.get_external_workflow_handle(wid).signal("update_timeouts", wanted)
            except Exception as exc:  # noqa: BLE001 - a node that just ended has nothing to update
                workflow.logger.info("could not update the timeouts of %s: %s", wid, exc)
            self.state.nodes[wid] = self.state.nodes[wid].model_copy(update={"timeouts_sent": fingerprint})

    async def _sync_template(self, u: PoolUpdate, live: list[PoolNode]) -> None:
        """Send each running node the pool's template labels and taints when they changed since
        it last got them (or since it was started with them): it applies them to its Node in
        place. A node the pool knows nothing of (adopted after a restart) gets them once; it
        applies only a difference."""
        if not workflow.patched(IN_PLACE_TEMPLATE_PATCH):
            return
        wanted = _template(u)
        fingerprint = _template_fingerprint(wanted)
        for wid in sorted(n.workflow_id for n in live):
            node = self.state.nodes[wid]
            if node.phase not in _TUNABLE or node.template_sent == fingerprint:
                continue
            try:
                await workflow.get_external_workflow_handle(wid).signal("update_template", wanted)
            except Exception as exc:  # noqa: BLE001 - a node that just ended has nothing to update
                workflow.logger.info("could not update the labels and taints of %s: %s", wid, exc)
            self.state.nodes[wid] = self.state.nodes[wid].model_copy(update={"template_sent": fingerprint})

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
            hourly_cost=sum((n.hourly_price or 0 for n in live if n.phase is not NodePhase.PENDING), start=0),  # type: ignore[arg-type]
            nodes=[
                PoolNodeStatus.of(n, created_at=n.created_at)
                for n in sorted(live, key=lambda n: n.created_at)
            ],
        )

    async def _publish(self, wanted: dict[str, tuple[str, str, str]]) -> None:
        generation = self.state.update.generation if self.state.update else None
        conditions = condition_list(wanted, generation, workflow.now(), self.state.conditions)
        for c in conditions:
            old = self.state.conditions.get(c.type)
            # A problem the user must fix is also an Event, once, when it appears.
            if c.status == "False" and c.type not in ("Ready", "PodsFit", "InstancesReleased") and (old is None or old.status != "False" or old.reason != c.reason):
                self.events.append(self._event("Warning", c.reason, c.message))
        self.state.conditions = {c.type: c for c in conditions}
        status = self._status()
        body = status.model_dump(mode="json", by_alias=True)
        if not body.get("disrupting"):
            # No node disrupting: the status compares as it did before the count existed, so a
            # pool continued as new by an older release (its last write's fingerprint in its
            # state) does not write again on replay, a command its history does not hold.
            body.pop("disrupting", None)
        fingerprint = repr(body)
        if fingerprint != self.state.written and workflow.patched(STATUS_BY_QUERY_PATCH):
            write = PoolStatusWrite(ref=self._ref(), workflow_id=workflow.info().workflow_id)
            if (await best_effort(EntityActivities.write_pool_status, write, summary="write the pool status")).ok:
                self.state.written = fingerprint
        else:
            self.state.written = await write_status_once(
                StatusWrite(ref=self._ref(), status=body), fingerprint=fingerprint, written=self.state.written, summary="write the pool status"
            )
        await self._flush_events()

    async def _flush_events(self) -> None:
        """Write the Events so far. Events appended while a write is in flight stay for the
        next write (they are in the state, so continue-as-new carries them); a failed write is
        retried on the next pass, and a backlog is capped so a broken API cannot grow it."""
        while self.state.events:
            batch = list(self.state.events)
            emitted = await best_effort(EntityActivities.emit_events, batch, summary="write Events")
            if not emitted.ok:
                self.state.events = self.state.events[-MAX_PENDING_EVENTS:]
                return
            self.state.events = self.state.events[len(batch) :]

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
    """The settings as last sent, in the form releases before the hold wrote them when there is
    no hold (a changed fingerprint sends a signal: replayed histories must not see one)."""
    exclude = {"hold"} if timeouts.hold is None else set()
    if timeouts.termination_grace is None:
        exclude.add("termination_grace")  # nor the grace, when there is none
    return timeouts.model_dump_json(exclude=exclude or None)
