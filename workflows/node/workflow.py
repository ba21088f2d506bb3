"""GPUNodeWorkflow: one GPU node's whole life, read top to bottom.

    offer and launch (launch.py) -> join (join.py) -> labels and taints (labels.py)
    -> watch until idle, expired, gone, replaced or evicted (watch.py) -> drain (drain.py)
    -> release what was bought (release.py), on every way out

Failover: a capacity error, a launch failure or a join timeout releases what that attempt
bought, takes the offer out of rotation and tries the next offer, up to max_launch_attempts.

Worker Versioning: a run is pinned to the build that started it (the worker's deployment
default, workers/versioning.py) and continues as new, onto the deployment's current build, at the
watch's safe points (entering it, each wake, at the latest each backstop look). No
`workflow.patched`: docs/workflow-versioning.md."""

# No `from __future__ import annotations`: each new run executes this module, and evaluated the handlers' string annotations (~1 ms a run, issue 37).
import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from tgp.facts_order import take_facts
    from tgp.lifecycle import DISRUPT_ENDS, EndReason
    from tgp.node import NodeWorkflowInput
    from tgp.types import DisruptRequest, EvictRequest, InstanceSighting, NodeFacts, NodePhase, NodeStatus, TemplateUpdate, TimeoutsUpdate
    from workflows.node.drain import drain, drain_before_ready
    from workflows.node.launch import bring_up
    from workflows.node.life import LaunchAttemptFailed, Life, NodeEvicted
    from workflows.node.release import finish
    from workflows.node.watch import watch


@workflow.defn(name="GPUNodeWorkflow")
class GPUNodeWorkflow:
    @workflow.init
    def __init__(self, inp: NodeWorkflowInput) -> None:
        self.life = Life(inp)

    @workflow.run
    async def run(self, inp: NodeWorkflowInput) -> NodeStatus:
        """Bring the node up, watch it, drain it; whatever happens, release what was bought."""
        life = self.life
        try:
            final = await self._live()
        except asyncio.CancelledError:
            life.state.end_reason = life.state.end_reason or "cancelled"
            final = NodePhase.CANCELLED
        if await finish(life, final) is NodePhase.CANCELLED:
            raise asyncio.CancelledError()
        return life.status()

    async def _live(self) -> NodePhase:
        """The life up to its release: the phase it ends in."""
        life = self.life
        try:
            if life.state.watch is None:  # a run continued as new is past bring-up
                await bring_up(life)
            while True:
                end = await watch(life)
                if end in (EndReason.INTERRUPTED, EndReason.LOST):
                    return NodePhase.INTERRUPTED  # the instance is gone: nothing left to drain
                if end is EndReason.NOT_READY:
                    # Its kubelet is gone: an eviction would be accepted but its pods never leave.
                    # Terminated at once (Karpenter's repair); deleting the Node lets the pod
                    # garbage collector remove its pods for their owners to recreate.
                    return NodePhase.TERMINATED
                if await drain(life, end):
                    return NodePhase.TERMINATED
        except NodeEvicted:
            await drain_before_ready(life)
            return NodePhase.TERMINATED
        except (LaunchAttemptFailed, ApplicationError, ActivityError) as exc:
            if life.cancel_requested():  # the cancel reached an activity in flight: still a cancel
                raise asyncio.CancelledError() from None
            return life.failed(exc)

    # --- messages --------------------------------------------------------------------------

    @workflow.signal
    def evict(self, request: EvictRequest) -> None:
        """Drain and terminate this node now. The first reason wins."""
        if self.life.state.evict_reason is None:
            self.life.state.evict_reason = request.reason or "manual"

    @workflow.signal
    def update_timeouts(self, u: TimeoutsUpdate) -> None:
        """The pool's new idle, drain, expiry and hold settings; they apply from the next look."""
        state = self.life.state
        change: dict[str, object] = {"idle": u.idle, "drain": u.drain, "expire_after": u.expire_after, "unlimited_reasons": u.unlimited_reasons or []}
        if u.hold is not None:  # the pool's nominations: hold the pods' place, or no more
            change["bind_grace"] = u.hold or None
        if "termination_grace" in u.model_fields_set:
            change["termination_grace"] = u.termination_grace
        state.timeouts = self.life.timeouts.model_copy(update=change)
        state.settings_from_pool = True  # the pool says when the hold ends from now on

    @workflow.signal
    def update_template(self, u: TemplateUpdate) -> None:
        """The pool's template labels and taints changed: the watch applies the difference to the
        Node in place (only what tgp had set is removed; tgp's own labels stay)."""
        state = self.life.state
        if state.template_applied is None:  # what bring-up put (or will put) on the Node
            state.template_applied = state.template
        state.template_retry_at = None
        state.template = TemplateUpdate(labels=dict(u.labels), taints=list(u.taints))

    @workflow.signal
    def node_facts(self, facts: NodeFacts) -> None:
        """The bridge's facts about the Node, kept unless older than those already kept (by the
        bridge's incarnation and sequence, tgp.facts_order, not its clock)."""
        state = self.life.state
        take, state.facts_sources = take_facts(state.facts, state.facts_sources, facts)
        if take:
            state.facts = facts

    @workflow.signal
    def disrupt(self, request: DisruptRequest) -> None:
        """The pool: this node has been replaced (make-before-break) and its replacement is Ready,
        or consolidation removes it; end voluntarily within the budget and not while
        do-not-disrupt holds it. The first request wins; an empty reason calls it off."""
        state = self.life.state
        if state.disrupt is None and request.reason in DISRUPT_ENDS:
            state.disrupt = request
        elif not request.reason and state.phase is NodePhase.READY:
            state.disrupt, state.disrupt_held = None, ""

    @workflow.signal
    def budget_freed(self) -> None:
        """The pool: a disruption ended or its budgets changed; a node a budget holds asks again now."""
        self.life.state.budget_freed = True

    @workflow.signal
    def instance_seen(self, sighting: InstanceSighting) -> None:
        """The provider's bulk listing shows the instance not plainly running (or not at all): the
        watch looks for itself before acting, since lists lag behind the truth."""
        self.life.state.sighting = sighting

    @workflow.query
    def status(self) -> NodeStatus:
        return self.life.status()
