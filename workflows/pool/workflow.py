"""GPUNodePoolWorkflow: one per GPUNodePool, keeping `max(minNodes, demand)` nodes within limits.

The bridge sends it the pool (and its class) and the pending pods it should serve; node
workflows report their phases to it. Each pass (on news, else once a resync) it looks at its
running nodes, starts what the demand needs (after the class ledger grants it), replaces drifted
or re-shopped nodes make-before-break, consolidates, keeps its nodes' settings current, and
writes its status and Events; on deletion it drains and terminates its nodes before it lets the
finalizer go. Scale to zero happens through the nodes' idle timeout. The decisions are pure
functions in tgp/ (pool_plan, pool_disruption, capacity, consolidation, replace); an activity
error never ends the pool: it becomes a condition or an Event, and the next pass tries again.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from tgp.capacity import note_ready
    from tgp.crds import GPUNodePoolStatus
    from tgp.demand import MAX_PODS_TRACKED
    from tgp.messages import Demand, DisruptionAnswer, DisruptionAnswers, DisruptionAsk, DisruptionAsks, NodeReport, NodeReports, PoolUpdate
    from tgp.pool_disruption import being_replaced
    from tgp.pool_plan import Wanted, floor_changes, instances_released, pods_fit, pods_tracked, ready
    from tgp.types import NodePhase
    from workflows.continuation import continue_as_new, continue_as_new_due
    from workflows.pool.base import Kept
    from workflows.pool.disruption import Disruption
    from workflows.pool.publish import Publishing
    from workflows.pool.replacement import Replacements
    from workflows.pool.reports import Reports
    from workflows.pool.settings import Settings
    from workflows.pool.starts import Starts
    from workflows.pool.state import HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW, PoolInput


@workflow.defn(name="GPUNodePoolWorkflow")
class GPUNodePoolWorkflow(Reports, Starts, Replacements, Disruption, Settings, Publishing):
    """The pool's spine: its messages, and the pass that applies tgp's answers."""

    @workflow.init
    def __init__(self, inp: PoolInput) -> None:
        self.inp = inp
        self.state = inp.state
        self.dirty = True
        self.node_statuses, self.capacities = Kept(), Kept()

    # --- messages (node workflows and the bridge send these: their names and types stay) ---------

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
        """The pending GPU pods this pool should serve now, and the bridge's view of its nodes."""
        self.state.demand = list(d.pods)
        self.state.pending_since = {pod: self.state.pending_since.get(pod, d.observed_at) for pod in d.pods}
        self.state.demand_at = d.observed_at
        self.state.pod_gpus = dict(d.pod_gpus)
        self.state.free_gpus = dict(d.free_gpus)
        self.state.bound_gpus = dict(d.bound_gpus)
        self.state.held_nodes = list(d.held_nodes)
        self.state.unsold, self.state.untracked = dict(d.unsold), d.untracked
        self.dirty = True

    @workflow.signal
    def node_phases(self, rs: NodeReports) -> None:
        """Several nodes' reports, sent together by a worker: each taken as `node_phase` takes it."""
        for r in rs.reports:
            self._take_report(r)

    @workflow.signal
    def node_phase(self, r: NodeReport) -> None:
        """A node workflow moved to a new phase."""
        self._take_report(r)

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

    @workflow.query
    def status(self) -> GPUNodePoolStatus:
        """The pool's status as it is written now."""
        return self._status()

    # --- the loop ----------------------------------------------------------------------------

    @workflow.run
    async def run(self, inp: PoolInput) -> None:
        """Passes until the pool is deleted and its nodes are gone; continues as new, carrying
        its state (Events not yet written included), when its history grows long."""
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
            if continue_as_new_due(HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW):
                await workflow.wait_condition(workflow.all_handlers_finished)
                await self._flush_events()
                continue_as_new(self.inp.model_copy(update={"state": self.state}))

    def _next_wake(self) -> timedelta:
        """The next pass without news: a resync, sooner for a start to retry, a launch back-off
        or a class refusal that ends."""
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
        # Every pass, also one that plans nothing: a node may idle out before the next plan.
        self.state.nominations = note_ready(self.state.nominations, self._capacity(self._live()))
        if u.deleting:
            return await self._tear_down()
        wanted, ok = await self._serve(u)
        wanted["PodsFit"] = pods_fit(self.state.unfit, self.state.no_offer_fits, self.state.unsold)
        wanted["PodsTracked"] = pods_tracked(self.state.untracked, MAX_PODS_TRACKED)
        wanted["InstancesReleased"] = instances_released(self._live())
        await self._consolidation(u, ok)
        if u.node_class is not None:
            await self._replacements(u, offers=wanted.get("OffersAvailable", ("False",))[0] == "True")
            await self._sync_timeouts(u)
            await self._sync_template(u)
        await self._publish(wanted)
        self._forget_ended()  # reported now (status and Events)
        return False

    async def _serve(self, u: PoolUpdate) -> tuple[dict[str, Wanted], bool]:
        """The class, the offers and the pass's starts: their conditions and Ready, and whether
        the pool works (at its own spec.maxNodes it does, and says so)."""
        wanted: dict[str, Wanted] = {}
        if u.node_class is None:
            name = u.spec.node_class_ref.name
            wanted["ClassReady"] = ("False", "ClassNotFound", f"GPUNodeClass {name} not found: create it or fix spec.nodeClassRef.name")
        else:
            # A node being replaced leaves its floor to its replacement (started with it).
            kept = [n for n in self._live() if not being_replaced(n, self.state.nodes)]
            for wid, floor in floor_changes(kept, u.spec.min_nodes).items():
                self._set(self.state.nodes[wid], floor=floor)
            wanted["ClassReady"] = ("True", "Found", "")
            wanted["OffersAvailable"] = await self._check_offers(u)
        ok = all(status == "True" for status, _, _ in wanted.values())
        at_max_nodes = False
        if ok:
            wanted["BudgetAvailable"] = await self._launch(u)
            at_max_nodes = wanted["BudgetAvailable"][1] == "MaxNodesReached"
            ok = wanted["BudgetAvailable"][0] == "True" or at_max_nodes
        live = self._live()
        wanted["Ready"] = ready(
            wanted,
            ok=ok,
            ready_nodes=sum(1 for n in live if n.phase is NodePhase.READY),
            live=len(live),
            failures=self.state.failures,
            backoff_until=self.state.backoff_until,
            now=workflow.now(),
            at_max_nodes=at_max_nodes,
        )
        return wanted, ok
