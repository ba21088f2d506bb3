"""Make-before-break replacement (drift, re-shop): the choices are tgp.pool_disruption's and the
steps tgp.replace's; this part applies them (starts, `disrupt` signals, Events)."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.pool import PoolActivities
    from tgp.disruption import DisruptionReason
    from tgp.merge import followers, merge_in_force, replacement_size, saving_made
    from tgp.messages import PoolNode, PoolUpdate, Reservation, StartNodeInput
    from tgp.pool_disruption import Fleet, best_price, called_off, held_from_replacement, mark_replacements, may_replace, replacement_cap, replacement_slots
    from tgp.pool_plan import Note, initialized, settings_fingerprint
    from tgp.pools import node_request
    from tgp.replace import Slot, Step, StepKind, first_candidate, in_progress, replacement_name, replacement_steps
    from tgp.types import DisruptRequest, EvictRequest, NodePhase, node_workflow_id
    from workflows.entity import best_effort
    from workflows.pool.base import PoolBase
    from workflows.pool.state import REPLACEMENT_BACKOFF, RESHOP_HELD_WAIT


class Replacements(PoolBase):
    """The replacement step of a pass."""

    def _fleet(self) -> Fleet:
        oc = self.state.offer_check
        return Fleet(free_gpus=self.state.free_gpus, bound_gpus=self.state.bound_gpus, held_nodes=self.state.held_nodes, sizes=oc.sizes if oc else None)

    async def _replacements(self, u: PoolUpdate, *, offers: bool) -> None:
        """One pass of make-before-break replacement: follow the replacement under way (tell the
        old node to end once its replacement is Ready; give up on one that ended before Ready),
        and start the next when none is under way, launches are not backing off, the offers are
        known and spec.maxNodes and the budget allow."""
        assert u.node_class is not None
        now = workflow.now()
        marks = mark_replacements(self.state.nodes, u.node_class, u.spec, self._fleet(), now)
        for wid, update in marks.updates.items():
            self._set(self.state.nodes[wid], **update)
        self.state.merging = merge_in_force(self.state.merging, self.state.nodes, self.state.held_nodes)
        slots = replacement_slots(self.state.nodes, self.state.held_nodes, now, self.state.merging)
        for wid, n in sorted(self.state.nodes.items()):
            waiting = n.removing is None and (n.replace_after is None or now >= n.replace_after)
            if waiting and held_from_replacement(n, self.state.held_nodes):
                self._blocked(wid, n.node_name, f"{n.replace_reason}: do-not-disrupt holds it; its replacement is bought once nothing holds it")
        held = any(n.held for n in self.state.nodes.values())  # a re-shop or a removal do-not-disrupt holds
        if not (marks.notes or in_progress(slots) or first_candidate(slots) or held):
            return
        self._note(*marks.notes)
        if held:
            await self._call_off_held_reshops(u)
            self.dirty = True  # the next pass starts from what is now known
            return
        backing_off = self.state.backoff_until is not None and now < self.state.backoff_until
        may_start = offers and not backing_off and not u.deleting and self._replacement_allowed(u, slots)
        prefix = node_workflow_id(self.inp.namespace, self.inp.name, "")
        for step in replacement_steps(slots, pool=self.inp.name, id_prefix=prefix, may_start=may_start):
            await self._take_step(step, prefix, now)

    async def _take_step(self, step: Step, prefix: str, now: datetime) -> None:
        old = self.state.nodes[step.old]
        if step.kind is StepKind.ABANDON:
            new = self.state.nodes.get(step.new)
            why = f"{new.phase.value}: {new.reason}" if new is not None else "its workflow is gone"
            message = (
                f"the replacement {step.new.removeprefix(prefix)} of node {old.node_name} ({step.reason}) ended before Ready ({why}); "
                f"{old.node_name} stays; another replacement is tried after {REPLACEMENT_BACKOFF}"
            )
            self._note(Note("Warning", "ReplacementFailed", message))
            self._set(old, replaced_by=None, disrupt_sent=False, replace_attempts=old.replace_attempts + 1, replace_after=now + REPLACEMENT_BACKOFF)
        elif step.kind is StepKind.DISRUPT:
            new_name = step.new.removeprefix(prefix)
            request = DisruptRequest(reason=step.reason, replacement=new_name, detail=f"{new_name} is Ready", at=workflow.now())
            try:
                await workflow.get_external_workflow_handle(step.old).signal("disrupt", request)
            except Exception as exc:  # noqa: BLE001 - told again next pass (the node keeps the first)
                workflow.logger.info("could not tell %s to end: %s", step.old, exc)
                return
            self._set(old, disrupt_sent=True)
            if (made := saving_made(old, step.reason, self.state.nodes.get(step.new), self.state.merging)) is not None:
                self._consolidated(made[0], step.reason, made[1])
            self._note(Note("Normal", "NodeReplaced", f"node {new_name} is Ready in place of {old.node_name} ({step.reason}): {old.node_name} is drained and terminated"))
        elif step.kind is StepKind.ADOPT:
            self._set(old, replaced_by=step.new, disrupt_sent=False)
            self._set(self.state.nodes[step.new], replaces=step.old, floor=old.floor)
        else:
            await self._replace(old, DisruptionReason(step.reason), name=step.new)

    def _replacement_allowed(self, u: PoolUpdate, slots: dict[str, Slot]) -> bool:
        """Whether the next candidate's replacement may begin: under spec.maxNodes beside every
        live node (the old node bills until its replacement is Ready), and within the budgets (it
        counts as disrupting from its start). A refusal is a DisruptionBlocked Event, once per
        message."""
        if in_progress(slots):
            return True  # nothing is started this pass anyway
        self._forget_grants(workflow.now())
        counts = (initialized(self.state.nodes.values()), self._disrupting())
        candidate, why = may_replace(slots, len(self._live()), u.spec, workflow.now(), counts, self.state.merging)
        if candidate is not None and why:
            self._blocked(candidate, self.state.nodes[candidate].node_name, why)
        elif candidate is not None:
            self.state.blocked.pop(candidate, None)
        return candidate is not None and not why

    async def _call_off_held_reshops(self, u: PoolUpdate) -> None:
        """A node told to end for a re-shop (or a removal) reported that do-not-disrupt holds it:
        it is called off (never worth a held node): the node is told to stay (a `disrupt` with
        no reason), its replacement is evicted, and it is not re-shopped again for
        RESHOP_HELD_WAIT or consolidation's `after`, the longer."""
        now = workflow.now()
        policy = u.spec.disruption.consolidation_policy
        wait = max(policy.after, RESHOP_HELD_WAIT) if policy is not None else RESHOP_HELD_WAIT
        for wid in sorted(w for w, n in self.state.nodes.items() if n.held):
            old = self.state.nodes[wid]
            if old.phase is not NodePhase.READY:
                # It reported the hold, then went on (the holder finished): too late to call off;
                # its replacement stays and takes its place.
                self._set(old, held="")
                continue
            new = self.state.nodes.get(old.replaced_by) if old.replaced_by else None
            await self._signal(wid, "disrupt", DisruptRequest(reason="", detail="re-shop called off"))
            if new is not None and not new.phase.is_final:
                await self._signal(new.workflow_id, "evict", EvictRequest(reason=f"re-shop of {old.node_name} called off (do-not-disrupt)"))
            if old.removing is not None:
                # A consolidation removal: nothing was bought for it; the next look plans again.
                self._note(Note("Normal", "ConsolidationHeld", f"removal of node {old.node_name} called off: {old.held}"))
            else:
                replacement = new.node_name if new else old.replaced_by
                self._note(Note("Normal", "ReshopHeld", f"re-shop of node {old.node_name} called off: {old.held}; its replacement {replacement} is let go"))
            self._set(old, **called_off(old, now, wait))
            if new is not None:
                self._set(new, replaces=None)

    async def _signal(self, wid: str, signal: str, arg: object) -> None:
        try:
            await workflow.get_external_workflow_handle(wid).signal(signal, arg)
        except Exception as exc:  # noqa: BLE001 - a node that ended has nothing to be told
            workflow.logger.info("could not send %s to %s: %s", signal, wid, exc)

    async def _replace(self, old: PoolNode, reason: DisruptionReason, *, name: str | None = None) -> bool:
        """Start the replacement of `old` for `reason` (make-before-break): a node workflow like
        `old` (its floor, at least its GPUs) made as the pool and class are now, named `name`
        (tgp.replace.replacement_name: the same step always names the same node), at most the
        re-shop's cap if `old.replace_key` names one. `old` is told to end once it is Ready
        (`_replacements`), never before. Returns whether it started; a refusal is a
        ReplacementFailed Event and the next try waits REPLACEMENT_BACKOFF."""
        u = self.state.update
        assert u is not None and u.node_class is not None
        now = workflow.now()
        node_name = name or replacement_name(self.inp.name, old.workflow_id, old.replace_key or reason.value, old.replace_attempts)
        fleet = self._fleet()
        min_gpus, cap = replacement_size(old, fleet.size(old), replacement_cap(old, None), self.state.merging)
        req = node_request(
            namespace=self.inp.namespace,
            pool_name=self.inp.name,
            class_name=u.spec.node_class_ref.name,
            node_name=node_name,
            pool=u.spec,
            klass=u.node_class,
            watch_interval=self.inp.watch_interval,
            floor=True,  # no idling out while the old node lives (the pool sends its own settings after)
            min_gpus=min_gpus,
            unlimited=self._unlimited(u),
        )
        if cap is not None:
            limit = cap if req.requirements.max_hourly_price is None else min(cap, req.requirements.max_hourly_price)
            req = req.model_copy(update={"requirements": req.requirements.model_copy(update={"max_hourly_price": limit})})
        price = best_price(min_gpus, fleet.sizes) if cap is not None else (self.state.offer_check.cheapest if self.state.offer_check else None)
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
            message = f"could not start a replacement for node {old.node_name} ({reason.value}): {refused}; {old.node_name} stays; tried again after {REPLACEMENT_BACKOFF}"
            self._note(Note("Warning", "ReplacementFailed", message))
            self._set(old, replace_after=now + REPLACEMENT_BACKOFF)  # the same name next time: nothing was started
            return False
        self._replacing(u, old, req.workflow_id, node_name, req.requirements.min_gpu_count, reason, cap, now)
        return True

    def _replacing(self, u: PoolUpdate, old: PoolNode, wid: str, node_name: str, gpus: int, reason: DisruptionReason, cap: Decimal | None, now: datetime) -> None:
        """Record the replacement `wid` of `old` just started, and its NodeReplacing Event."""
        new = self.state.nodes.get(wid) or PoolNode(workflow_id=wid, node_name=node_name, created_at=now, phase_at=now)
        sent = settings_fingerprint(self._timeouts_for(u, floor=True, held=False))
        self.state.nodes[wid] = new.model_copy(update={"floor": old.floor, "timeouts_sent": sent, "gpus": gpus, "replaces": old.workflow_id})
        key = old.replace_key if old.replace_reason == reason.value else (f"under {cap}" if cap is not None else "")
        self._set(old, replaced_by=wid, disrupt_sent=False, replace_reason=reason.value, replace_key=key)
        for other, update in followers(self.state.merging, old.workflow_id, wid).items():
            self._set(self.state.nodes[other], **update)
        message = f"launching node {node_name} to replace {old.node_name} ({reason.value}); {old.node_name} is drained only once {node_name} is Ready"
        self._note(Note("Normal", "NodeReplacing", message))
