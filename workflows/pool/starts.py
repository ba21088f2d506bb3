"""Starting nodes for the demand: the offer check, demand by fit (tgp.capacity), the pass's
starts (tgp.pool_plan.plan_starts) reserved and started in one activity, and the starts whose
outcome is unknown, started again with the same ids before anything new is bought."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.pool import PoolActivities
    from tgp.capacity import CapacityPlan, NewNode, Nomination, no_offer_fits_to_warn, plan_capacity
    from tgp.messages import NodeStart, OfferCheck, PoolNode, PoolUpdate, StartNodeResult, StartNodesInput
    from tgp.pool_plan import (
        ClassRefusal,
        Note,
        UnsettledStart,
        Wanted,
        launched_why,
        max_nodes_reached,
        no_offer_fits_notes,
        offers_available,
        plan_starts,
        settings_fingerprint,
        starts_to_abandon,
        template_fingerprint,
        template_of,
        unfit_notes,
    )
    from tgp.pools import node_request, offer_requirements, request_for
    from tgp.types import NodeRequest
    from workflows.entity import best_effort
    from workflows.pool.base import PoolBase
    from workflows.pool.state import MAX_STARTS_PER_BATCH, START_NODES_TIMEOUT

class Starts(PoolBase):
    """The demand's side of a pass."""

    async def _check_offers(self, u: PoolUpdate) -> Wanted:
        """The OffersAvailable condition, from an offer check at most offer_check_ttl old."""
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
                why = f"the offers of GPUNodeClass {u.spec.node_class_ref.name} could not be listed; retrying (the cluster admin sees why)"
                return ("False", "OfferCheckFailed", why)
            self.state.offer_check, self.state.offer_check_key, self.state.offer_checked_at = checked.value, key, workflow.now()
        assert self.state.offer_check is not None
        return offers_available(self.state.offer_check, req)

    async def _launch(self, u: PoolUpdate) -> Wanted:
        """The pass's starts for the demand and minNodes; the BudgetAvailable condition."""
        assert u.node_class is not None
        if self.state.unsettled:
            await self._retry_unsettled(u)
        live = self._live()
        oc = self.state.offer_check
        plan = self._account(live, oc)
        if self.state.backoff_until is not None and workflow.now() < self.state.backoff_until:
            return ("True", "WithinBudget", "")
        launches = plan_starts(
            plan.new_nodes,
            live=len(live),
            floor_live=sum(1 for n in live if n.floor),
            min_nodes=u.spec.min_nodes,
            max_nodes=u.spec.max_nodes,
            min_gpus=offer_requirements(u.spec, u.node_class).min_gpu_count,
            cap=MAX_STARTS_PER_BATCH,
        )
        if launches.starts:
            failed = await self._start_nodes(u, launches.starts, launches.floor_missing) if self._class_refusal(u) is None else ""
            refusal = self._class_refusal(u)
            if refusal is not None:
                # The class ledger's refusal names its limit (limits.maxNodes, limits.maxHourlyCost).
                return ("False", "BudgetExhausted", f"not launching more nodes: {refusal.reason}; {refusal.asks_again()}")
            if failed:
                return ("False", "BudgetExhausted", f"not launching more nodes: {failed}")
        if launches.waiting:
            return max_nodes_reached(launches.waiting, self._live(), u.spec.max_nodes)  # the nodes just started count
        return ("True", "WithinBudget", "")

    def _account(self, live: list[PoolNode], oc: OfferCheck | None) -> CapacityPlan:
        """Which pending pods the live nodes hold, and which new nodes the rest need; pods that
        did not fit the node bought for them are remembered (and reported) instead of buying
        more, and pods larger than every offer are reported once."""
        sizes = oc.sizes if oc is not None and oc.sizes else None
        pending = {pod: self.state.pod_gpus.get(pod, 1) for pod in self.state.demand}
        unfit = set(self.state.unfit) & set(pending)
        no_borrow = set(self.state.no_borrow) & set(pending)
        nodes = self._capacity(live)
        plan = plan_capacity(pending, nodes, self.state.nominations, unfit, workflow.now(), self.inp.bind_grace, no_borrow, sizes)
        self.state.nominations = dict(plan.nominations)
        self.state.no_borrow = sorted(no_borrow | set(plan.borrow_failed))
        self.state.unfit = sorted(unfit | set(plan.newly_unfit))
        self._note(*unfit_notes(plan.newly_unfit))
        largest = max((s.gpu_count for s in sizes or []), default=0)
        warn, self.state.no_offer_fits = no_offer_fits_to_warn(self.state.no_offer_fits, plan.no_offer_fits, self.state.demand, sizes_known=sizes is not None)
        self._note(*no_offer_fits_notes(warn, self.state.pod_gpus, largest))
        return plan

    def _class_refusal(self, u: PoolUpdate) -> ClassRefusal | None:
        """The class's last refusal, while it holds (ClassRefusal.holds)."""
        refusal = self.state.class_refusal
        if refusal is not None and not refusal.holds(workflow.now(), u.generation, _class_key(u), self.state.nodes_ended):
            self.state.class_refusal = refusal = None
        return refusal

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

    async def _reserve_and_start(self, u: PoolUpdate, template: NodeRequest, starts: list[NodeStart], summary: str) -> list[StartNodeResult] | str:
        """One activity: the class ledger reserves for all of `starts` in one call and the node
        workflows it granted start together. The results, or the activity's error."""
        started = await best_effort(
            PoolActivities.reserve_and_start_nodes,
            StartNodesInput(
                class_name=template.class_workflow_id or u.spec.node_class_ref.name,
                pool=f"{self.inp.namespace}/{self.inp.name}",
                template=template,
                starts=starts,
            ),
            summary=summary,
            timeout=START_NODES_TIMEOUT,
        )
        return started.value.results if started.ok else started.error or ""

    async def _start_nodes(self, u: PoolUpdate, new: list[NewNode], floor_missing: int) -> str:
        """Start `new`. A refusal by the class holds further launches (`_class_refusal`); a start
        whose outcome is unknown (the activity failed, or one start did) is kept and started
        again with the same id (`_retry_unsettled`): nothing else is bought for its pods.
        Returns the activity's error, if it failed as a whole."""
        now = workflow.now()
        template = self._batch_template(u)
        cheapest = self.state.offer_check.cheapest if self.state.offer_check else None
        batch = []
        for i, n in enumerate(new):
            since = [self.state.pending_since[pod] for pod in n.pods if pod in self.state.pending_since]
            batch.append(
                NodeStart(
                    node_name=f"{self.inp.name}-{workflow.uuid4().hex[:5]}",
                    floor=i < floor_missing,
                    min_gpus=n.gpus,
                    bind_grace=self.inp.bind_grace if n.pods else None,
                    demand_since=min(since) if since else None,
                    hourly_price=n.hourly_price if n.hourly_price is not None else cheapest,
                    # One pod: the node ends its hold at its first pod. Several: the pool cannot
                    # tell which of them bound there, and keeps the say.
                    hold_ends_when_busy=len(n.pods) == 1,
                )
            )
        results = await self._reserve_and_start(u, template, batch, f"start {len(batch)} node(s)")
        refused = ""
        for i, (start, n) in enumerate(zip(batch, new, strict=True)):
            result = results[i] if isinstance(results, list) else StartNodeResult(started=False, reason=results, unsettled=True)
            if result.started:
                self._started(u, request_for(template, start), floor=start.floor, pods=n.pods, now=now)
            elif result.unsettled:
                self._unsettled(u, template, start, n.pods, now, result.reason)
            else:
                refused = refused or result.reason
        if refused:
            self.state.class_refusal = ClassRefusal(
                reason=refused, until=now + self.inp.class_refusal_backoff, generation=u.generation, node_class=_class_key(u), nodes_ended=self.state.nodes_ended
            )
        return results if isinstance(results, str) else ""

    def _unsettled(self, u: PoolUpdate, template: NodeRequest, start: NodeStart, pods: list[str], now: datetime, error: str) -> None:
        """A start that may have happened: its node is recorded as launching, its pods nominated
        to it, and it is started again, with the same workflow id, on the next passes."""
        req = request_for(template, start)
        self._started(u, req, floor=start.floor, pods=pods, now=now, note=f"; its start failed ({error[:200]}): started again with the same name")
        self.state.unsettled[req.workflow_id] = UnsettledStart(start=start, pods=list(pods), error=error[:300])

    async def _retry_unsettled(self, u: PoolUpdate) -> None:
        """Start again, with the same names and workflow ids, the starts that may not have
        happened. One whose pods all left the demand (or a minNodes start no longer needed) is
        not; like one the class now refuses, its node stays recorded until the look at the
        running workflows finds it running or never started."""
        settled = sum(1 for n in self._live() if n.workflow_id not in self.state.unsettled)
        for wid, why in starts_to_abandon(self.state.unsettled, self.state.demand, settled, u.spec.min_nodes).items():
            self._abandon_start(wid, why)
        if not self.state.unsettled:
            return
        retries = sorted(self.state.unsettled.items())
        results = await self._reserve_and_start(u, self._batch_template(u), [us.start for _, us in retries], f"start {len(retries)} node(s) again")
        if not isinstance(results, list):
            return  # still unsettled: the next pass tries again
        for (wid, _), result in zip(retries, results, strict=True):
            if wid not in self.state.unsettled:
                continue  # it reported meanwhile
            if result.started:
                del self.state.unsettled[wid]
            elif not result.unsettled:
                self._abandon_start(wid, f"the class refused it: {result.reason}")

    def _unsettled_requests(self) -> list[NodeRequest]:
        """The requests of the starts that may still happen (`state.unsettled`)."""
        u = self.state.update
        if u is None or u.node_class is None:  # the class is gone: a bare request takes the same id
            return [NodeRequest(namespace=self.inp.namespace, pool=self.inp.name, node_name=us.start.node_name) for us in self.state.unsettled.values()]
        template = self._batch_template(u)
        return [request_for(template, us.start) for us in self.state.unsettled.values()]

    def _abandon_start(self, wid: str, why: str) -> None:
        """Stop starting `wid` again. Its node stays recorded (Pending) until it reports or the
        look at the running workflows finds it closed or never started: it may have started."""
        del self.state.unsettled[wid]
        node = self.state.nodes.get(wid)
        if node is not None and node.reported_at is None:
            self._set(node, reason=f"its start failed and {why}: not started again")

    def _started(self, u: PoolUpdate, req: NodeRequest, *, floor: bool, pods: list[str], now: datetime, note: str = "") -> None:
        """Record a node workflow just started for `pods`, and its NodeLaunched Event. A report may
        have arrived while the start was in flight: its phase is kept, but the floor, the GPUs and
        the settings sent are known only here."""
        node = self.state.nodes.get(req.workflow_id) or PoolNode(workflow_id=req.workflow_id, node_name=req.node_name, created_at=now, phase_at=now)
        held = bool(pods)
        self.state.nodes[req.workflow_id] = node.model_copy(
            update={
                "floor": floor,
                "timeouts_sent": settings_fingerprint(self._timeouts_for(u, floor=floor, held=held)),
                "gpus": req.requirements.min_gpu_count,
                "template_sent": template_fingerprint(template_of(u.spec)),
                "hold_ends_when_busy": held and req.hold_ends_when_busy,
            }
        )
        for pod in pods:
            self.state.nominations[pod] = Nomination(workflow_id=req.workflow_id, since=now)
        self._note(Note("Normal", "NodeLaunched", f"launching node {req.node_name} {launched_why(pods, req.requirements.min_gpu_count)}{note}"))


def _class_key(u: PoolUpdate) -> str:
    return u.node_class.model_dump_json() if u.node_class is not None else ""
