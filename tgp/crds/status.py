"""What the pool and class workflows write to a CR's status: conditions, the pool's nodes and
cost, consolidation's savings; and the metadata tgp reads of either object."""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tgp.types import NodeOverview
from tgp.crds.common import Price, Spec


class Condition(Spec):
    type: str = Field(description="Ready, ClassReady, BudgetAvailable, ...")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase machine-readable reason.")
    message: str = Field("", description="What happened and what to fix.")
    last_transition_time: datetime | None = None
    observed_generation: int | None = None


class PoolNodeStatus(Spec):
    """A node of the pool: its Node name, phase, provider, GPU type, $/h, creation time and Temporal workflow id."""

    # The wire form of a tgp.types.NodeOverview (`of`), camelCase like the rest of the CR.

    name: str
    phase: str
    provider: str | None = None
    gpu_type: str | None = None
    hourly_price: Price | None = None
    created_at: datetime | None = None
    workflow_id: str = ""
    drift_hash: str | None = Field(None, description="The drift hash of what made the node (its class's boot, tailnet, credentials and requirements, the pool's requirements).")
    drifted: bool | None = Field(None, description="True when the class or pool has changed what made the node: it is replaced make-before-break within the disruption budget.")
    replaced_by: str | None = Field(None, description="The node replacing this one (drift, re-shop): this one is drained only once that one is Ready.")

    @classmethod
    def of(
        cls, node: NodeOverview, created_at: datetime | None = None, *, drift_hash: str | None = None, drifted: bool | None = None, replaced_by: str | None = None
    ) -> PoolNodeStatus:
        return cls(
            name=node.node_name,
            phase=node.phase.value,
            provider=node.provider,
            gpu_type=node.gpu_type,
            hourly_price=node.hourly_price,
            created_at=created_at,
            workflow_id=node.workflow_id,
            drift_hash=drift_hash,
            drifted=drifted,
            replaced_by=replaced_by,
        )


class ConsolidationStatus(Spec):
    """Savings of consolidation: re-shopping to cheaper offers and removing underutilized nodes."""

    savings_found_hourly: Price = Field(
        Decimal("0"),
        description="US$ per hour the actions consolidation may take now would save (each removed node's price, or a "
        "replaced node's price minus its replacement's), as of the pool's last look; `tgp plan` lists them and what blocks the rest.",
    )
    savings_made_hourly: Price = Field(
        Decimal("0"), description="US$ per hour saved by the consolidations done so far, in all (what each saved when it was done)."
    )
    candidates: int = Field(0, description="Nodes consolidation would remove or replace now (within the budgets).")
    last_action: str = Field("", description="The last consolidation done: which node, why and what it saved.")
    consolidating: str = Field(
        "",
        description="The merge under way, if any: several nodes whose pods fit one cheaper new node, which is bought first; "
        "they are drained and terminated once it is Ready (e.g. 'Consolidating 3 nodes into 1, saving $0.22/h: ...').",
    )


class GPUNodePoolStatus(Spec):
    observed_generation: int | None = None
    conditions: list[Condition] = []
    ready_nodes: int = 0
    desired_nodes: int = 0
    hourly_cost: Price = Decimal("0")
    nodes: list[PoolNodeStatus] = []
    disrupting: int = Field(0, description="Nodes of the pool being disrupted (drained or replaced) now.")
    consolidation: ConsolidationStatus | None = Field(
        None, description="What consolidation (spec.disruption.consolidation) found and did; unset while it is off and never acted."
    )


class GPUNodeClassStatus(Spec):
    observed_generation: int | None = None
    conditions: list[Condition] = []
    nodes: int = 0
    hourly_cost: Price = Decimal("0")


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    namespace: str | None = None
    generation: int | None = None
    uid: str | None = None
    resourceVersion: str | None = None
    deletionTimestamp: str | None = None
    finalizers: list[str] = []
