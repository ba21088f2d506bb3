"""The node workflow's input and state: what a GPUNodeWorkflow run starts from and carries
across continue-as-new. Here, not beside the workflow, so the activity that starts node
workflows (activities.pool) needs nothing of workflows/."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tgp.lifecycle import WatchState
from tgp.types import DisruptRequest, InstanceRef, InstanceSighting, LaunchAttempt, NodeFacts, NodePhase, NodeRequest, Offer, StageRecord, TemplateUpdate, stage_times_to_records


class NodeState(BaseModel):
    """Everything the workflow knows; carried across continue-as-new."""

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
    # even during bring-up: the event-driven watch starts from them.
    facts: NodeFacts | None = None
    stages: list[StageRecord] = []
    evict_reason: str | None = None
    last_error: str | None = None
    end_reason: str | None = None
    # What the `instance_seen` and `budget_freed` signals asked of the watch, not yet acted on:
    # in the state so that continue-as-new carries a signal received just before it.
    sighting: InstanceSighting | None = Field(None, description="The provider's listing asks for a look (signal `instance_seen`).")
    facts_sources: list[str] = Field([], description="The bridge incarnations heard from, oldest first (tgp.facts_order).")
    budget_freed: bool = Field(False, description="The pool says a held node may ask its budget again (signal `budget_freed`).")
    # The pool replaced the node (make-before-break) and its replacement is Ready: end
    # voluntarily (signal `disrupt`); the first request wins. `disrupt_held`: what do-not-disrupt
    # holds it with, as last recorded.
    disrupt: DisruptRequest | None = None
    disrupt_held: str = ""
    # A life begun under the `life-v2` patch (workflows/node.py): short calls as local
    # activities, the join by the bridge's facts, fewer reports. Carried across continue-as-new
    # so a continued run neither asks the patch again nor changes its ways mid-life.
    life_v2: bool = False
    # A life begun under the `life-v3` patch: a v2 life with every node patch after `life-v2`
    # taken as applied without asking (the ledger's calls as activities, reports carried).
    life_v3: bool = False
    # A life begun under the `life-v4` patch: a v3 life whose launch settles the price with the
    # class ledger and whose release terminates, cleans up and gives the place back in one
    # activity each, and whose start's search attributes are the pool's (no upsert of its own).
    life_v4: bool = False
    # A life begun under the `life-v5` patch: a v4 life whose voluntary drains ask the budgets
    # themselves, whose watch keeps a timer that is early, and which ends its bind-grace hold
    # itself at its first workload pod (`NodeRequest.hold_ends_when_busy`).
    life_v5: bool = False
    # The pool sent settings (`update_timeouts`) since the start: from then on the pool says
    # when the bind-grace hold ends, not the node's first pod.
    settings_from_pool: bool = False
    # The pool's labels and taints as tgp last put them on the Node (set when the pool first
    # sends a change; None: as the request had them at bring-up), and when a failed attempt to
    # apply a change is tried again.
    template_applied: TemplateUpdate | None = None
    template_retry_at: datetime | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_stage_times(cls, data: object) -> object:
        """A run continued as new before the records were typed carries `stage_times`."""
        return stage_times_to_records(data)


class NodeWorkflowInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    request: NodeRequest
    state: NodeState | None = None
