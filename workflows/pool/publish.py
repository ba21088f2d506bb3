"""What the pool tells the world about itself: its status (read by the activity that writes it,
through the `status` query), its conditions and Events, and its tear-down once deleted."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.entity import EntityActivities, PoolStatusWrite
    from activities.pool import PoolActivities
    from tgp.conditions import condition_list
    from tgp.crds import GPUNodePoolStatus, PoolNodeStatus
    from tgp.events import folded
    from tgp.merge import with_merging
    from tgp.messages import EvictNodesInput, PoolNode
    from tgp.pool_plan import Note, Wanted, instances_released
    from tgp.types import NodePhase
    from workflows.entity import best_effort
    from workflows.pool.base import PoolBase
    from workflows.pool.state import MAX_PENDING_EVENTS

# Conditions whose problems are not also Warning Events (their own Events say more).
_NO_WARNING = ("Ready", "PodsFit", "InstancesReleased")


class Publishing(PoolBase):
    """Status, conditions, Events and the pool's end."""

    def _status(self) -> GPUNodePoolStatus:
        live = self._live()
        u = self.state.update
        return GPUNodePoolStatus(
            observed_generation=u.generation if u else None,
            conditions=list(self.state.conditions.values()),
            ready_nodes=sum(1 for n in live if n.phase is NodePhase.READY),
            desired_nodes=len(live),
            disrupting=self._disrupting(),
            consolidation=with_merging(self.state.consolidation, self.state.merging),
            hourly_cost=sum((n.hourly_price or 0 for n in live if n.phase is not NodePhase.PENDING), start=0),  # type: ignore[arg-type]
            nodes=[self._node_status(n) for n in sorted(live, key=lambda n: n.created_at)],
        )

    def _node_status(self, n: PoolNode) -> PoolNodeStatus:
        new = self.state.nodes.get(n.replaced_by) if n.replaced_by else None
        replaced_by = new.node_name if new else None
        return self.node_statuses.of(
            n, replaced_by, lambda: PoolNodeStatus.of(n, created_at=n.created_at, drift_hash=n.drift_hash, drifted=n.drifted or None, replaced_by=replaced_by)
        )

    async def _publish(self, wanted: dict[str, Wanted]) -> None:
        """Set the conditions (a problem the user must fix is also a Warning Event, once, when
        it appears), write the status when it changed, and the Events so far."""
        generation = self.state.update.generation if self.state.update else None
        conditions = condition_list(wanted, generation, workflow.now(), self.state.conditions)
        for c in conditions:
            old = self.state.conditions.get(c.type)
            if c.status == "False" and c.type not in _NO_WARNING and (old is None or old.status != "False" or old.reason != c.reason):
                self._note(Note("Warning", c.reason, c.message))
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
        """Write the Events so far, once, those of one reason as one (`folded`); those appended
        meanwhile wait (in the state, which continue-as-new carries). A failed write is retried on
        the next pass, and a backlog is capped so a broken API cannot grow it. Returns whether the
        write went through."""
        if not self.state.events:
            return True
        batch = list(self.state.events)
        emitted = await best_effort(EntityActivities.emit_events, folded(batch), summary="write Events")
        if not emitted.ok:
            self.state.events = self.state.events[-MAX_PENDING_EVENTS:]
            return False
        self.state.events = self.state.events[len(batch) :]
        return True

    async def _flush_events(self) -> None:
        """The last write of a run: every Event, also those appended while a write is in
        flight, until none is left or a write fails."""
        while self.state.events and await self._write_events():
            pass

    async def _tear_down(self) -> bool:
        """Pool deleted: evict every node, and let the finalizer go once none is left. Returns
        whether the pool is gone."""
        live = self._live()
        if live:
            # Signalling again is harmless (the first reason wins); a workflow that closed
            # without reporting (terminated by hand) is counted as gone. A start that may still
            # happen is started with the evict, so it cannot buy after the finalizer goes.
            may_start = self._unsettled_requests()
            known = [n.workflow_id for n in live if n.workflow_id not in {r.workflow_id for r in may_start}]
            evict = EvictNodesInput(workflow_ids=known, may_start=may_start)
            evicted = await best_effort(PoolActivities.evict_nodes, evict, summary="evict nodes")
            for wid in evicted.value or []:
                self._set(self.state.nodes[wid], phase=NodePhase.TERMINATED, reason="its workflow is closed")
            live = self._live()
        if live:
            # A release the provider (or a missing Secret) holds up shows while the pool waits.
            deleting = f"draining and terminating {len(live)} node(s) before the pool is deleted"
            await self._publish({"Ready": ("False", "Deleting", deleting), "InstancesReleased": instances_released(live)})
            self._forget_ended()
            return False
        await self._flush_events()
        released = await best_effort(PoolActivities.remove_finalizer, self._ref(), summary="remove the finalizer")
        if not released.ok:
            await self._publish({"Ready": ("False", "Deleting", f"nodes are gone; {released.error}; retrying")})
            return False
        return True
