"""The pool's answers about voluntary disruption: the budgets' answer to a node's ask
(tgp.pool_plan.answer_ask), telling held nodes to ask again, and consolidation (tgp.consolidation
plans, tgp.pool_disruption chooses the removals; this part tells the nodes)."""

from __future__ import annotations

import asyncio
from decimal import Decimal

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from tgp.consolidation import ConsolidationPlan, look_at, plan_consolidation
    from tgp.crds import ConsolidationStatus
    from tgp.disruption import DisruptionReason
    from tgp.merge import start_merge
    from tgp.messages import DisruptionAnswer, DisruptionAsk, PoolUpdate
    from tgp.pool_disruption import consolidation_view, removals
    from tgp.pool_plan import Note, answer_ask, initialized
    from tgp.pools import offer_requirements
    from tgp.types import DisruptRequest
    from workflows.pool.base import PoolBase


class Disruption(PoolBase):
    """Budgets and consolidation."""

    def _may_disrupt(self, ask: DisruptionAsk) -> DisruptionAnswer:
        """The budgets' answer to one node's ask; a node let go counts as disrupting from now,
        and a refusal is a DisruptionBlocked Event, once per node and message."""
        u = self.state.update
        if u is None or u.deleting:
            return DisruptionAnswer(allowed=True)
        now = workflow.now()
        self._forget_grants(now)
        asked = answer_ask(u.spec.disruption.budgets, now, ask.reason, ask.workflow_id, self.state.nodes, self.state.granted)
        if asked.grant:
            self.state.granted[ask.workflow_id] = now
            self.state.blocked.pop(ask.workflow_id, None)
            self.dirty = True
        elif not asked.answer.allowed and self._blocked(ask.workflow_id, ask.node_name, asked.answer.message):
            self.dirty = True
        return asked.answer

    async def _tell_held_nodes(self) -> None:
        """A disruption ended or the budgets changed: the nodes a budget holds ask again now
        rather than at their next timer. All at once, in a fixed order: one round trip a pass."""
        self.state.freed = False

        async def tell(wid: str) -> None:
            try:
                await workflow.get_external_workflow_handle(wid).signal("budget_freed")
            except Exception as exc:  # noqa: BLE001 - a node that just ended has nothing to ask
                workflow.logger.info("could not tell %s to ask its budget again: %s", wid, exc)

        await asyncio.gather(*(tell(wid) for wid in sorted(self.state.blocked)))

    def _consolidation_due(self, u: PoolUpdate) -> bool:
        """Consolidation is on and was not planned this resync (planning is O(nodes²) at worst:
        not on every pass of a burst)."""
        looked = self.state.consolidation_looked_at
        return u.spec.disruption.consolidation_policy is not None and (looked is None or workflow.now() - looked >= self.inp.resync_interval)

    async def _consolidation(self, u: PoolUpdate, ok: bool) -> None:
        """The pass's consolidation: planned and carried out when due, its findings cleared when
        it was turned off (what was made stays)."""
        if ok and self._consolidation_due(u):
            await self._consolidate(self._look_for_consolidation(u))
        elif u.spec.disruption.consolidation_policy is None and self.state.consolidation is not None and self.state.consolidation.candidates:
            self.state.consolidation = self.state.consolidation.model_copy(update={"savings_found_hourly": Decimal(0), "candidates": 0})

    def _look_for_consolidation(self, u: PoolUpdate) -> ConsolidationPlan:
        """Plan consolidation on this look and record the savings it found. Each Ready node with
        its GPUs registered is taken as the bridge reports it (the node checks its own holders
        again when it is told to go: the report may lag)."""
        assert u.node_class is not None
        now = workflow.now()
        self.state.consolidation_looked_at = now
        live = self._live()
        members, nominated = consolidation_view(live, self.state.nominations, self.state.demand, self.state.pod_gpus, now)
        nodes = look_at(members, self.state.free_gpus, self.state.bound_gpus, self.state.held_nodes, nominated)
        oc = self.state.offer_check
        plan = plan_consolidation(
            nodes,
            oc.sizes if oc is not None and oc.sizes else None,
            u.spec.disruption.consolidation_policy,
            u.spec.disruption.budgets,
            now,
            pool_nodes=initialized(live),
            disrupting=self._disrupting(),
            min_nodes=u.spec.min_nodes,
            min_gpus=offer_requirements(u.spec, u.node_class).min_gpu_count,
        )
        old = self.state.consolidation or ConsolidationStatus()
        self.state.consolidation = old.model_copy(update={"savings_found_hourly": plan.savings, "candidates": plan.candidates})
        return plan

    async def _consolidate(self, plan: ConsolidationPlan) -> None:
        """Carry out `plan`'s removals: each underutilized node is told to end (`disrupt`, reason
        Underutilized); it checks its do-not-disrupt holders again, asks the budget, drains and
        terminates, and the saving counts as made when it reports Terminated. Re-shops and drift
        are the replacement step's: the plan only shows them."""
        for n, action in removals(plan.actions, self.state.nodes.values(), workflow.now()):
            try:
                await workflow.get_external_workflow_handle(n.workflow_id).signal(
                    "disrupt", DisruptRequest(reason=DisruptionReason.UNDERUTILIZED.value, detail=action.message)
                )
            except Exception as exc:  # noqa: BLE001 - it ended meanwhile: nothing to remove
                workflow.logger.info("could not tell %s to end: %s", n.workflow_id, exc)
                continue
            self._set(n, removing=action.saving)
            self._note(Note("Normal", "NodeConsolidating", f"node {n.node_name}: {action.message}"))
        if self.state.merging is None and (merging := start_merge(plan.merge, self.state.nodes)) is not None:
            self.state.merging = merging  # the replacement step buys the new node, then drains the set
            self._note(Note("Normal", "NodesConsolidating", f"{merging.message}; the nodes are drained once the new node is Ready"))
