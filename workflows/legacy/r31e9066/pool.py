"""GPUNodePoolWorkflow: one per GPUNodePool, keeping `max(minNodes, demand)` nodes within limits.

The bridge sends it the pool (and its class) and the pending pods it should serve; node
workflows report their phases to it. It starts top-level node workflows (after the class ledger
grants a slot), writes the pool's status and Events, and on deletion drains and terminates its
nodes before it lets the finalizer go. Scale to zero happens through the nodes' idle timeout.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.legacy.r31e9066.activities import EventSpec, FleetActivities, StatusWrite
    from workflows.legacy.r31e9066.conditions import condition_list
    from workflows.legacy.r31e9066.crds import Condition, GPUNodePoolStatus, PoolNodeStatus
    from workflows.legacy.r31e9066.demand import nodes_to_launch
    from workflows.legacy.r31e9066.messages import (
        NOMINATION_WINDOW,
        Demand,
        NodeReport,
        ObjectRef,
        OfferCheck,
        PoolNode,
        PoolUpdate,
        Reservation,
        StartNodeInput,
    )
    from workflows.legacy.r31e9066.pools import node_request, offer_requirements
    from workflows.legacy.r31e9066.types import NodePhase
    from workflows.legacy.r31e9066.handover import hand_over, pool_input  # handover: not in 31e9066

# Even with no news the pool looks again this often (a lost signal cannot stall it).
RESYNC_INTERVAL = timedelta(minutes=1)
# After a node fails to come up, wait before launching again; doubles per failure.
LAUNCH_BACKOFF = timedelta(seconds=30)
MAX_LAUNCH_BACKOFF = timedelta(minutes=15)
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 2000
# Offers come and go; "no offer" and the price used for reservations are re-checked this often.
OFFER_CHECK_TTL = timedelta(minutes=5)
ACTIVITY_TIMEOUT = timedelta(seconds=60)

_LAUNCHING = {NodePhase.PENDING, NodePhase.LAUNCHING, NodePhase.JOINING}


class PoolState(BaseModel):
    """Everything the pool knows; carried across continue-as-new."""

    model_config = ConfigDict(extra="ignore")
    update: PoolUpdate | None = None
    demand: list[str] = []
    demand_gpus: int = 1
    nodes: dict[str, PoolNode] = {}
    offer_check: OfferCheck | None = None
    offer_check_key: str = ""
    offer_checked_at: datetime | None = None
    conditions: dict[str, Condition] = {}
    failures: int = 0
    backoff_until: datetime | None = None
    written: str = ""


class PoolInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    namespace: str
    name: str
    watch_interval: timedelta | None = None
    state: PoolState = PoolState()


@workflow.defn(name="GPUNodePoolWorkflow")
class GPUNodePoolWorkflow:
    @workflow.init
    def __init__(self, inp: PoolInput) -> None:
        self.inp = inp
        self.state = inp.state
        self.dirty = True
        self.events: list[EventSpec] = []

    # --- messages ------------------------------------------------------------------------

    @workflow.signal
    def update(self, u: PoolUpdate) -> None:
        """The pool (and its class) as the bridge sees them now."""
        self.state.update = u
        self.dirty = True

    @workflow.signal
    def demand(self, d: Demand) -> None:
        """The pending GPU pods this pool should serve now."""
        self.state.demand = list(d.pods)
        self.state.demand_gpus = d.max_gpus
        self.dirty = True

    @workflow.signal
    def node_phase(self, r: NodeReport) -> None:
        """A node workflow moved to a new phase."""
        old = self.state.nodes.get(r.workflow_id)
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
        )
        self.state.nodes[r.workflow_id] = node
        if old is None or old.phase is not r.phase:
            self._node_event(node)
        if r.phase is NodePhase.FAILED:
            self.state.failures += 1
            backoff = min(LAUNCH_BACKOFF * 2 ** (self.state.failures - 1), MAX_LAUNCH_BACKOFF)
            self.state.backoff_until = r.at + backoff
        elif r.phase is NodePhase.READY:
            self.state.failures = 0
            self.state.backoff_until = None
        self.dirty = True

    @workflow.query
    def status(self) -> GPUNodePoolStatus:
        return self._status()

    # --- the loop ------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: PoolInput) -> None:
        while True:
            hand_over(self, pool_input)  # handover: not in 31e9066
            try:
                await workflow.wait_condition(lambda: self.dirty, timeout=self._next_wake())
            except TimeoutError:
                pass
            hand_over(self, pool_input)  # handover: not in 31e9066
            self.dirty = False
            if await self._reconcile():
                await workflow.wait_condition(workflow.all_handlers_finished)
                return
            info = workflow.info()
            if info.is_continue_as_new_suggested() or info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW:
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._flush_events()
                workflow.continue_as_new(self.inp.model_copy(update={"state": self.state}))

    def _next_wake(self) -> timedelta:
        if self.state.backoff_until is not None:
            remaining = self.state.backoff_until - workflow.now()
            if timedelta(0) < remaining < RESYNC_INTERVAL:
                return remaining
        return RESYNC_INTERVAL

    async def _reconcile(self) -> bool:
        """One pass: returns True when the pool is deleted and its nodes are gone."""
        u = self.state.update
        if u is None:
            return False
        live = [n for n in self.state.nodes.values() if not n.phase.is_final]
        if u.deleting:
            return await self._tear_down(live)

        wanted: dict[str, tuple[str, str, str]] = {}
        klass = u.node_class
        if klass is None:
            name = u.spec.node_class_ref.name
            wanted["ClassReady"] = ("False", "ClassNotFound", f"GPUNodeClass {name} not found: create it or fix spec.nodeClassRef.name")
        else:
            wanted["ClassReady"] = ("True", "Found", "")
            wanted["OffersAvailable"] = await self._check_offers(u)
        ok = all(status == "True" for status, _, _ in wanted.values())
        if ok:
            wanted["BudgetAvailable"] = await self._launch(u, live)
            ok = wanted["BudgetAvailable"][0] == "True"
        live = [n for n in self.state.nodes.values() if not n.phase.is_final]
        ready = sum(1 for n in live if n.phase is NodePhase.READY)
        if ok:
            backing_off = self.state.backoff_until is not None and workflow.now() < self.state.backoff_until
            message = f"{ready}/{len(live)} nodes ready"
            if backing_off:
                message += f"; {self.state.failures} launch failure(s), next launch after {self.state.backoff_until:%H:%M:%S}"
            wanted["Ready"] = ("True", "Ready" if not backing_off else "LaunchBackoff", message)
        else:
            failing = next(f"{t}: {m}" for t, (s, _, m) in wanted.items() if s != "True")
            wanted["Ready"] = ("False", "NotReady", failing)
        await self._publish(wanted)
        # Ended nodes have been reported (status and Events); forget them.
        self.state.nodes = {k: n for k, n in self.state.nodes.items() if not n.phase.is_final}
        return False

    async def _check_offers(self, u: PoolUpdate) -> tuple[str, str, str]:
        assert u.node_class is not None
        req = offer_requirements(u.spec, u.node_class)
        key = req.model_dump_json()
        stale = self.state.offer_checked_at is None or workflow.now() - self.state.offer_checked_at >= OFFER_CHECK_TTL
        if self.state.offer_check is None or self.state.offer_check_key != key or stale:
            self.state.offer_check = await workflow.execute_activity_method(
                FleetActivities.check_offers, req, start_to_close_timeout=ACTIVITY_TIMEOUT, summary="check offers"
            )
            self.state.offer_check_key = key
            self.state.offer_checked_at = workflow.now()
        oc = self.state.offer_check
        if oc.matching:
            return ("True", "OffersFound", f"{oc.matching} matching offers from ${oc.cheapest}/h")
        if oc.cheapest_any_price is not None and req.max_hourly_price is not None:
            return (
                "False",
                "PriceTooLow",
                f"spec.maxHourlyPrice ${req.max_hourly_price}/h is below every matching offer; the cheapest is "
                f"${oc.cheapest_any_price}/h ({oc.cheapest_description}): raise maxHourlyPrice or relax the requirements",
            )
        wants = req.model_dump(mode="json", include={"gpu_types", "regions", "providers", "min_gpu_count", "allow_spot"})
        return ("False", "NoMatchingOffers", f"no offer matches {wants}: check the GPU types, regions and providers of the pool and class")

    async def _launch(self, u: PoolUpdate, live: list[PoolNode]) -> tuple[str, str, str]:
        assert u.node_class is not None
        if self.state.backoff_until is not None and workflow.now() < self.state.backoff_until:
            return ("True", "WithinBudget", "")
        now = workflow.now()
        launching = sum(1 for n in live if n.phase in _LAUNCHING or (n.phase is NodePhase.READY and now - n.phase_at < NOMINATION_WINDOW))
        count = nodes_to_launch(
            pending_pods=len(self.state.demand), launching=launching, live=len(live), min_nodes=u.spec.min_nodes, max_nodes=u.spec.max_nodes
        )
        class_name = u.spec.node_class_ref.name
        floor_missing = max(0, u.spec.min_nodes - sum(1 for n in live if n.floor))
        for i in range(count):
            floor = i < floor_missing
            node_name = f"{self.inp.name}-{workflow.uuid4().hex[:5]}"
            req = node_request(
                namespace=self.inp.namespace,
                pool_name=self.inp.name,
                class_name=class_name,
                node_name=node_name,
                pool=u.spec,
                klass=u.node_class,
                watch_interval=self.inp.watch_interval,
                floor=floor,
                min_gpus=self.state.demand_gpus,
            )
            price = self.state.offer_check.cheapest if self.state.offer_check else None
            result = await workflow.execute_activity_method(
                FleetActivities.reserve_and_start_node,
                StartNodeInput(
                    class_name=req.class_workflow_id or class_name,
                    reservation=Reservation(node_id=req.workflow_id, pool=f"{self.inp.namespace}/{self.inp.name}", hourly_price=price),
                    request_json=req.model_dump_json(),
                ),
                start_to_close_timeout=ACTIVITY_TIMEOUT,
                summary=f"start node {node_name}",
            )
            if not result.started:
                return ("False", "BudgetExhausted", f"not launching more nodes: {result.reason}")
            # A report may already have arrived while the start was in flight: keep it.
            self.state.nodes.setdefault(
                req.workflow_id, PoolNode(workflow_id=req.workflow_id, node_name=node_name, created_at=now, phase_at=now, floor=floor)
            )
            self.events.append(self._event("Normal", "NodeLaunched", f"launching node {node_name} for {len(self.state.demand)} pending pod(s)"))
        return ("True", "WithinBudget", "")

    async def _tear_down(self, live: list[PoolNode]) -> bool:
        """Pool deleted: evict every node, and let the finalizer go once none is left."""
        if live:
            # Signalling again is harmless (the first reason wins); a workflow that closed
            # without reporting (terminated by hand) is counted as gone.
            closed = await workflow.execute_activity_method(
                FleetActivities.evict_nodes, [n.workflow_id for n in live], start_to_close_timeout=ACTIVITY_TIMEOUT
            )
            for wid in closed:
                node = self.state.nodes[wid]
                self.state.nodes[wid] = node.model_copy(update={"phase": NodePhase.TERMINATED, "reason": "its workflow is closed"})
            live = [n for n in live if n.workflow_id not in closed]
        if live:
            await self._publish({"Ready": ("False", "Deleting", f"draining and terminating {len(live)} node(s) before the pool is deleted")})
            self.state.nodes = {k: n for k, n in self.state.nodes.items() if not n.phase.is_final}
            return False
        await self._flush_events()
        await workflow.execute_activity_method(FleetActivities.remove_finalizer, self._ref(), start_to_close_timeout=ACTIVITY_TIMEOUT)
        return True

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
            hourly_cost=sum((n.hourly_price or 0 for n in live if n.phase is not NodePhase.PENDING), start=0),  # type: ignore[arg-type]
            nodes=[
                PoolNodeStatus(
                    name=n.node_name,
                    phase=n.phase.value,
                    provider=n.provider,
                    gpu_type=n.gpu_type,
                    hourly_price=n.hourly_price,
                    created_at=n.created_at,
                    workflow_id=n.workflow_id,
                )
                for n in sorted(live, key=lambda n: n.created_at)
            ],
        )

    async def _publish(self, wanted: dict[str, tuple[str, str, str]]) -> None:
        generation = self.state.update.generation if self.state.update else None
        conditions = condition_list(wanted, generation, workflow.now(), self.state.conditions)
        for c in conditions:
            old = self.state.conditions.get(c.type)
            # A problem the user must fix is also an Event, once, when it appears.
            if c.status == "False" and c.type != "Ready" and (old is None or old.status != "False" or old.reason != c.reason):
                self.events.append(self._event("Warning", c.reason, c.message))
        self.state.conditions = {c.type: c for c in conditions}
        status = self._status()
        body = status.model_dump(mode="json", by_alias=True)
        fingerprint = repr(body)
        if fingerprint != self.state.written:
            self.state.written = fingerprint
            await workflow.execute_activity_method(
                FleetActivities.write_status, StatusWrite(ref=self._ref(), status=body), start_to_close_timeout=ACTIVITY_TIMEOUT
            )
        await self._flush_events()

    async def _flush_events(self) -> None:
        if self.events:
            events, self.events = self.events, []
            await workflow.execute_activity_method(FleetActivities.emit_events, events, start_to_close_timeout=ACTIVITY_TIMEOUT)

    def _event(self, type: str, reason: str, message: str) -> EventSpec:
        return EventSpec(ref=self._ref(), type=type, reason=reason, message=message)

    def _node_event(self, n: PoolNode) -> None:
        where = f"{n.gpu_type} on {n.provider} at ${n.hourly_price}/h" if n.provider else ""
        if n.phase is NodePhase.READY:
            self.events.append(self._event("Normal", "NodeReady", f"node {n.node_name} is Ready ({where})"))
        elif n.phase is NodePhase.FAILED:
            self.events.append(self._event("Warning", "LaunchFailed", f"node {n.node_name} could not be launched: {n.reason}"))
        elif n.phase is NodePhase.INTERRUPTED:
            self.events.append(self._event("Warning", "NodeInterrupted", f"node {n.node_name} was lost: {n.reason}"))
        elif n.phase in (NodePhase.TERMINATED, NodePhase.CANCELLED):
            self.events.append(self._event("Normal", "NodeTerminated", f"node {n.node_name} terminated: {n.reason}"))
