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
    InstanceSighting,
    LaunchAttempt,
    LifecycleTimeouts,
    NodeFacts,
    NodePhase,
    NodeRequest,
    Offer,
    StageRecord,
    TemplateUpdate,
)


class NodeState(BaseModel):
    """Everything a node's life knows; one object, carried across continue-as-new."""

    model_config = ConfigDict(extra="forbid")
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
    model_config = ConfigDict(extra="forbid")
    request: NodeRequest
    state: NodeState | None = None
