"""What the pool hears of its nodes: their phase reports, and once a resync a look at the node
workflows actually running (a new run after a crash or reset adopts them)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from activities.entity import EntityActivities
    from tgp.disruption import DisruptionReason
    from tgp.lifecycle import EndReason
    from tgp.messages import NodeReport, NodeSighting, PoolNode
    from tgp.pool_plan import Note, launch_backoff
    from tgp.types import NodePhase, Stage, StageRecord, node_workflow_id
    from workflows.entity import best_effort, running_nodes_changed
    from workflows.pool.base import PoolBase

# What the pool's record of a node carries from report to report (the node does not report them).
_CARRIED = (
    "floor", "timeouts_sent", "hold_ends_when_busy", "template_sent", "gpus", "drift_hash", "drifted", "replace_reason", "replace_key",
    "replaced_by", "replaces", "disrupt_sent", "replace_attempts", "replace_after", "cheaper_since", "held", "removing",
)  # fmt: skip


class Reports(PoolBase):
    """Taking the nodes' reports and looking at the running node workflows."""

    def _take_report(self, r: NodeReport) -> None:
        """A node workflow moved to a new phase. A report older than the one already taken, or
        about a node that has ended, is stale (separate signals are not kept in order)."""
        old = self.state.nodes.get(r.workflow_id)
        if (old is not None and old.reported_at is not None and r.at < old.reported_at) or r.workflow_id in self.state.ended:
            return
        node = PoolNode(
            workflow_id=r.workflow_id,
            node_name=r.node_name,
            phase=r.phase,
            provider=r.provider,
            gpu_type=r.gpu_type,
            hourly_price=r.hourly_price,
            region=r.region if r.region is not None or old is None else old.region,
            spot=r.spot if r.spot is not None or old is None else old.spot,
            created_at=old.created_at if old else r.at,
            phase_at=r.at if old is None or old.phase is not r.phase else old.phase_at,
            reason=r.reason,
            reported_at=r.at,
        )
        if old is not None:
            node = node.model_copy(update={k: getattr(old, k) for k in _CARRIED})
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
        self._take_stages(node, r.stages)
        ended_for_it = (r.reason or "").startswith(EndReason.UNDERUTILIZED.value)
        if old is not None and old.removing is not None and r.phase is NodePhase.TERMINATED and not old.phase.is_final and ended_for_it:
            self._consolidated(node.node_name, DisruptionReason.UNDERUTILIZED.value, old.removing)
        self._count_failure(old, r)
        self.dirty = True

    def _take_stages(self, node: PoolNode, stages: list[StageRecord]) -> None:
        """Records reported while Ready (no phase change to hang them on)."""
        for s in stages:
            if s.stage is Stage.DISRUPTION_HELD:
                self._note(Note("Normal", s.stage.value, f"node {node.node_name} {s.reason}"))
                if (node.replace_reason == DisruptionReason.CHEAPER.value and node.disrupt_sent and node.replaced_by) or node.removing is not None:
                    # A re-shop never disrupts a node a do-not-disrupt pod (or the Node) holds:
                    # called off in the next pass (its replacement is let go).
                    self._set(node, held=s.reason)
            elif s.stage is Stage.NODE_REPAIR:
                self._note(Note("Warning", s.stage.value, f"node {node.node_name} is repaired: {s.reason.removeprefix('node repair: ')}"))

    def _count_failure(self, old: PoolNode | None, r: NodeReport) -> None:
        """A launch failure backs launches off, doubling per failure; a Ready node ends that.
        Nodes started before the last failure was reported are of its wave: their failures teach
        nothing new (a burst's batch failing under load held the pool 8 minutes, pods unserved)."""
        if r.phase is NodePhase.FAILED:
            same_wave = old is not None and self.state.failed_at is not None and old.created_at <= self.state.failed_at
            if not same_wave:
                self.state.failures += 1
                self.state.backoff_until = r.at + launch_backoff(self.state.failures)
            self.state.failed_at = r.at
        elif r.phase is NodePhase.READY:
            self.state.failures = 0
            self.state.backoff_until = None

    async def _see_running_nodes(self) -> None:
        """Reality check, once per resync: node workflows running for this pool that the state
        does not know (a new run after a crash or a reset) are adopted; known ones whose
        workflow closed without reporting (terminated by hand, timed out) are dropped. Only the
        differences are recorded (ids in, changes out): a full listing of a 500-node pool was
        ~130 KB of history a minute."""
        now = workflow.now()
        if self.state.seen_running_at is not None and now - self.state.seen_running_at < self.inp.resync_interval:
            return
        pool = f"{self.inp.namespace}/{self.inp.name}"
        live = [n.workflow_id for n in self._live()]
        changed = await running_nodes_changed(f"TgpPool = '{pool}'", node_workflow_id(self.inp.namespace, self.inp.name, ""), live)
        if not changed.ok:
            return
        self.state.seen_running_at = now
        if changed.value is None:
            return  # a server without visibility: nothing to rebuild from
        self._adopt(changed.value.unknown)
        gone = changed.value.gone
        for wid in [w for w in self.state.unsettled if w not in gone]:
            del self.state.unsettled[wid]  # listed as running: its start happened
        missing = [
            n.workflow_id
            for n in self._live()
            if n.workflow_id in gone and now - n.created_at >= self.inp.visibility_lag and n.workflow_id not in self.state.unsettled
        ]
        if missing:
            closed = await best_effort(EntityActivities.closed_workflows, missing, summary="check closed nodes")
            for wid in closed.value or []:
                why = "its workflow closed without cleanup (terminated by hand?); the sweeper removes what it left"
                self._set(self.state.nodes[wid], phase=NodePhase.TERMINATED, reason=why)
                self._node_event(self.state.nodes[wid])

    def _adopt(self, sighted: list[NodeSighting]) -> None:
        """Running node workflows the pool did not know: recorded as they are listed."""
        now = workflow.now()
        for s in sighted:
            if s.workflow_id in self.state.ended or s.workflow_id in self.state.nodes:
                continue  # visibility lags: it ended after the listing
            self.state.nodes[s.workflow_id] = PoolNode(
                workflow_id=s.workflow_id,
                node_name=s.node_name,
                phase=s.phase or NodePhase.PENDING,
                provider=s.provider,
                gpu_type=s.gpu_type,
                hourly_price=s.hourly_price,
                created_at=s.started_at or now,
                phase_at=now,
                reason="adopted from its running workflow",
            )
