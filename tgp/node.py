"""The node workflow's input and carried state: what a GPUNodeWorkflow run starts from and
carries across continue-as-new. Here, not beside the workflow, so the activity that starts node
workflows (activities.pool) needs nothing of workflows/.

The schema only grows: a run continued as new on a newer build (Worker Versioning) reads the
state an older build wrote, so a field is added with a default and never renamed or removed
within a minor release (tests/test_carried_state.py holds one state of the previous release)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from tgp.lifecycle import WatchState
from tgp.types import (
    DisruptRequest,
    InstanceRef,
    NodeStatus,
    InstanceSighting,
    LaunchAttempt,
    LifecycleTimeouts,
    NodeFacts,
    NodePhase,
    NodeRequest,
    Offer,
    OfferBlock,
    StageRecord,
    TemplateUpdate,
)


class NodeState(BaseModel):
    """Everything a node's life knows; one object, carried across continue-as-new. Fields it does
    not know are ignored: a build rolled back to reads what a newer one carried."""

    model_config = ConfigDict(extra="ignore")
    phase: NodePhase = NodePhase.PENDING
    attempts: list[LaunchAttempt] = []
    offer: Offer | None = None
    instance: InstanceRef | None = None
    # Every launch attempt's name with every instance id ever seen under it (the current
    # attempt's included): each is terminated and verified on every way out (money by ids).
    seen: list[InstanceRef] = []
    key_ids: list[str] = []
    watch: WatchState | None = None
    # The bridge's latest facts about the Node (signal `node_facts`), kept from the first one,
    # even during bring-up: the join and the watch start from them.
    facts: NodeFacts | None = None
    facts_sources: list[str] = Field([], description="The bridge incarnations heard from, oldest first (tgp.facts_order).")
    stages: list[StageRecord] = []
    evict_reason: str | None = None
    last_error: str | None = None
    end_reason: str | None = None
    blocked: list[OfferBlock] = Field(
        [], description="What the node's failed launch attempts blocked, by cause (an offer, a GPU type, an account): never tried again by this node."
    )
    # Signals not yet acted on live here, so continue-as-new carries one received just before it.
    sighting: InstanceSighting | None = Field(None, description="The provider's listing asks for a look (signal `instance_seen`).")
    budget_freed: bool = Field(False, description="The pool says a held node may ask its budget again (signal `budget_freed`).")
    # The pool replaced the node (make-before-break) and its replacement is Ready: end
    # voluntarily (signal `disrupt`); the first request wins. `disrupt_held`: what do-not-disrupt
    # holds it with, as last recorded.
    disrupt: DisruptRequest | None = None
    disrupt_held: str = ""
    # The node's settings now: the request's, then as the pool's `update_timeouts` and
    # `update_template` change them (the request itself is never changed).
    timeouts: LifecycleTimeouts | None = None
    template: TemplateUpdate | None = None
    # The pool sent settings since the start: from then on the pool says when the bind-grace
    # hold ends, not the node's first pod.
    settings_from_pool: bool = False
    # The labels and taints as tgp last put them on the Node (None: as bring-up put them), and
    # when a failed attempt to apply a change is tried again.
    template_applied: TemplateUpdate | None = None
    template_retry_at: datetime | None = None


class NodeWorkflowInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    request: NodeRequest
    state: NodeState | None = None


def remembered(seen: list[InstanceRef], current: InstanceRef | None, ref: InstanceRef) -> tuple[list[InstanceRef], InstanceRef | None]:
    """Money by ids: `seen` with `ref` (a launch attempt's name and every id seen under it)
    merged into its name's one entry, and the current instance with that entry's ids when it is
    that name's. Ids are only ever added."""
    known = next((k for k in seen if k.instance_name == ref.instance_name), None)
    merged = ref
    if known is not None:
        update = {
            "known_ids": sorted(set(known.known_ids) | set(ref.known_ids)),
            "created_by": ref.created_by or known.created_by,
            "instance_id": ref.instance_id or known.instance_id,
        }
        merged = ref.model_copy(update=update)
    out = [merged if k is known else k for k in seen] if known is not None else [*seen, ref]
    if current is not None and current.instance_name == ref.instance_name:
        current = current.model_copy(update={"known_ids": merged.known_ids, "created_by": merged.created_by, "instance_id": current.instance_id or merged.instance_id})
    return out, current


def node_status(req: NodeRequest, state: NodeState, asking: str = "") -> NodeStatus:
    """The node's `status` query answer (`tgp status`, the demo)."""
    offer, inst = state.offer, state.instance
    return NodeStatus(
        workflow_id=req.workflow_id,
        phase=state.phase,
        node_name=req.node_name,
        pool=req.pool,
        provider=offer.provider if offer else None,
        gpu_type=offer.gpu_type if offer else None,
        region=offer.region if offer else None,
        instance_id=inst.instance_id if inst else None,
        hourly_price=offer.hourly_price if offer else None,
        stages=state.stages,
        attempts=state.attempts,
        last_error=state.last_error,
        end_reason=state.end_reason,
        asking=asking,
    )


def node_details(req: NodeRequest, state: NodeState) -> str:
    """Markdown shown as Current Details in the Web UI, with the command that evicts the node."""
    offer = state.offer
    lines = [f"**{req.node_name}** in pool `{req.namespace}/{req.pool}` — **{state.phase.value}**"]
    if offer:
        lines.append(f"- offer: {offer.gpu_type} × {offer.gpu_count} on {offer.provider} ({offer.region}) at ${offer.hourly_price}/h")
    if state.instance and state.instance.instance_id:
        lines.append(f"- instance: `{state.instance.instance_id}`")
    if state.end_reason:
        lines.append(f"- end: {state.end_reason}")
    if state.watch is not None and state.watch.held:
        lines.append(f"- held: {state.watch.held}")
    if state.last_error:
        lines.append(f"- last error: {state.last_error}")
    lines.append(f"- evict: `temporal workflow signal --workflow-id {req.workflow_id} --name evict --input '{{\"reason\":\"manual\"}}'`")
    return "\n".join(lines)


def phase_reason(state: NodeState, phase: NodePhase) -> str:
    """The reason recorded with a phase: why the node drains or ended, or what failed."""
    if phase in (NodePhase.FAILED, NodePhase.TERMINATION_STUCK):
        return state.last_error or ""
    if phase in (NodePhase.DRAINING, NodePhase.TERMINATED, NodePhase.INTERRUPTED, NodePhase.CANCELLED):
        return state.end_reason or ""
    return ""
