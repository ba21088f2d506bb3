"""Messages between the CRD bridge, the pool and class workflows, and the node workflows.
Small serializable types so they can grow compatibly; no secrets."""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tgp.capacity import OfferSize
from tgp.crds import ClassLimits, Condition, GPUNodeClassSpec, GPUNodePoolSpec
from tgp.types import DisruptionAnswer, DisruptionAsk, NodeOverview, NodePhase, NodeRequest, PoolAsk, StageRecord


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


def pool_workflow_id(namespace: str, name: str) -> str:
    return f"gpunodepool/{namespace}/{name}"


def class_workflow_id(name: str) -> str:
    return f"gpunodeclass/{name}"


class ObjectRef(Msg):
    """Enough of a Kubernetes object to patch its status and attach Events to it."""

    kind: str
    name: str
    namespace: str | None = None
    uid: str | None = None


# --- class ledger ---------------------------------------------------------------------------


class Reservation(Msg):
    node_id: str = Field(description="The node workflow id.")
    pool: str
    hourly_price: Decimal | None = Field(None, description="Known once an offer is chosen.")
    reserved_at: datetime | None = Field(None, description="When the ledger granted it (set by the ledger).")


class Grant(Msg):
    granted: bool
    reason: str = ""


class Reservations(Msg):
    """Input of the class ledger's batch updates (`reserve_many`, `settle_many`): one call for
    many reservations, so a burst does not queue behind Temporal's limit of 10 updates in
    flight per workflow. Decided in this order."""

    reservations: list[Reservation]


class Grants(Msg):
    """One grant per reservation of a batch, in its order."""

    grants: list[Grant]


class Releases(Msg):
    """Input of the class ledger's `release_many` update: node workflow ids whose budget goes back."""

    node_ids: list[str]


class Ledger(Msg):
    limits: ClassLimits = ClassLimits()
    reservations: dict[str, Reservation] = {}
    released: list[str] = Field([], description="Recently released node ids: a late reserve or settle for one is refused.")

    @property
    def hourly_cost(self) -> Decimal:
        return sum((r.hourly_price or Decimal(0) for r in self.reservations.values()), Decimal(0))


class ClassInput(Msg):
    name: str
    spec: GPUNodeClassSpec | None = None
    generation: int | None = None
    uid: str | None = None
    ledger: Ledger = Ledger()
    problems: list[str] | None = Field(None, description="What validation found; None until the class was validated once.")
    resync_interval: timedelta = Field(timedelta(minutes=1), description="How often the ledger is checked against running nodes.")
    reservation_grace: timedelta = Field(
        timedelta(minutes=2), description="A reservation younger than this is never taken for an orphan (its node may not be started yet)."
    )
    # What a run carries into the next (continue-as-new), so the new run neither re-validates,
    # re-lists nor re-writes what the old one had just done, and no reservation waits for it.
    conditions: list[Condition] = Field(default_factory=list, description="The class's status conditions as last computed.")
    written: str = Field("", description="Fingerprint of the status last written.")
    seen_at: datetime | None = Field(None, description="When the running node workflows were last listed.")
    validated_at: datetime | None = Field(None, description="When the class was last validated.")


class ClassUpdate(Msg):
    spec: GPUNodeClassSpec | None = Field(None, description="None: the GPUNodeClass is gone.")
    generation: int | None = None
    uid: str | None = None


# --- pool -----------------------------------------------------------------------------------


class PoolUpdate(Msg):
    """The pool as the bridge sees it; sent on every change (signal-with-start)."""

    spec: GPUNodePoolSpec
    generation: int | None = None
    uid: str | None = None
    node_class: GPUNodeClassSpec | None = Field(None, description="The referenced class, None when it does not exist.")
    deleting: bool = False


class Demand(Msg):
    """Pending GPU pods this pool should serve (keys namespace/name), from one batch."""

    pods: list[str]
    observed_at: datetime
    max_gpus: int = Field(1, description="The most GPUs one of these pods asks for (read only by pool passes recorded before demand by fit; nodes are sized from their own pods).")
    pod_gpus: dict[str, int] = Field({}, description="GPUs each pod asks for (absent: 1).")
    free_gpus: dict[str, int] = Field(
        {}, description="Free GPUs (allocatable minus bound pods' requests) of each Ready node of the pool whose GPUs are registered, by Node name."
    )
    bound_gpus: dict[str, list[int]] = Field(
        {}, description="The GPU requests of the pods bound to each node of free_gpus, largest first (consolidation: where they would fit)."
    )
    held_nodes: list[str] = Field([], description="The nodes of free_gpus that do-not-disrupt holds (the Node or a pod on it): consolidation leaves them.")
    unsold: dict[str, int] = Field(
        {}, description="GPU resources tgp does not sell that pending pods fitting the pool ask for, with how many pods ask (at most MAX_QUOTED names; the pods are not in `pods`)."
    )
    untracked: int = Field(0, description="Pending pods of the pool beyond the MAX_PODS_TRACKED in `pods` (oldest first): planned in a later batch.")


class NodeReport(NodeOverview):
    """A node workflow telling its pool where it is."""

    reason: str | None = None
    at: datetime
    stages: list[StageRecord] = Field([], description="The stage records the node entered since its previous report, oldest first.")
    drift_hash: str | None = Field(None, description="The drift hash the node was made with (its request's, for its provider).")
    region: str | None = Field(None, description="Its offer's region (tgp.io/region): drift compares it with the requirements.")
    spot: bool | None = Field(None, description="Whether its offer is spot (None: no offer yet, or a sender before it existed).")


class PoolNode(NodeOverview):
    """The pool's record of one of its nodes; carried across continue-as-new. Frozen: a change
    is a new record (`model_copy`), so what the pool derives from one record can be kept with it
    (workflows.pool.base.Kept: its status lines and capacity)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    phase: NodePhase = NodePhase.PENDING
    created_at: datetime
    phase_at: datetime
    reason: str | None = None
    floor: bool = Field(False, description="Keeps the pool at minNodes; does not idle out.")
    timeouts_sent: str = Field("", description="The disruption settings the node last got (JSON), to send changes once.")
    template_sent: str = Field("", description="A hash of the template labels and taints the node last got, to send changes once; \"\": unknown.")
    hold_ends_when_busy: bool = Field(
        False, description="It holds its pods' place (bind grace) until the first pod on it, then ends the hold itself; the pool has sent it no settings since."
    )
    gpus: int | None = Field(None, description="The GPUs it was bought with (at least): the room its nominations may take while it launches.")
    reported_at: datetime | None = Field(None, description="`at` of the newest report taken from the node: an older one arriving later is stale.")
    # Make-before-break replacement (tgp.replace); carried from report to report.
    drift_hash: str | None = Field(None, description="The drift hash it was made with, as it reported it (None: not known, never drifted).")
    region: str | None = Field(None, description="Its offer's region, as it reported it (None: not known).")
    spot: bool | None = Field(None, description="Whether its offer is spot, as it reported it (None: not known).")
    drifted: bool = Field(False, description="Its hash differs from its class and pool's now, or it no longer meets their requirements (a NodeDrifted Event was written).")
    replace_reason: str = Field("", description="Why it should be replaced (Drifted, Cheaper), '' when it should not.")
    replace_key: str = Field("", description="What it is replaced for (the drift hash, the re-shop's price cap): part of the replacement's id.")
    replaced_by: str | None = Field(None, description="The workflow id of its replacement under way.")
    replaces: str | None = Field(None, description="The workflow id of the node this one replaces.")
    disrupt_sent: bool = Field(False, description="It was told to end (`disrupt`): its replacement is Ready.")
    replace_attempts: int = Field(0, description="Replacements of it that ended before Ready.")
    replace_after: datetime | None = Field(None, description="No replacement is started for it before then (after a failed one).")
    cheaper_since: datetime | None = Field(None, description="Since when an offer cheaper by the pool's cheaperBy fits it (re-shop).")
    held: str = Field("", description="do-not-disrupt holds it against the re-shop it was told of: the re-shop is called off (its message).")
    removing: Decimal | None = Field(None, description="Consolidation told it to end (Underutilized: its pods fit on the others): what that saves, US$/h.")


class NodeSighting(NodeOverview):
    """A running node workflow as Temporal's visibility sees it (its search attributes): what
    pools and classes rebuild from, `tgp status` lists and the fleet metrics count."""

    node_name: str = ""
    phase: NodePhase | None = None  # None: not yet upserted, or unknown to this version
    pool: str = ""
    started_at: datetime | None = None


class RunningNodesQuery(Msg):
    """What a pool or class already knows of its running node workflows, to hear only what
    differs. Ids are sent without their common `prefix` (gpunode/<namespace>/<pool>/ for a pool,
    gpunode/ for a class): a few bytes per node."""

    query: str = Field(description="Visibility filter on tgp's search attributes, e.g. TgpPool = 'ml/rtx'.")
    prefix: str
    known: list[str] = Field([], description="Node ids without the prefix that the caller counts as live.")


class RunningNodesChanges(Msg):
    """The running node workflows the caller does not know (sightings), and the ones it knows
    that are not listed (ids without the prefix). `listed`: False when the server has no visibility."""

    listed: bool = True
    unknown: list[NodeSighting] = []
    missing: list[str] = []


class StartNodeInput(Msg):
    class_name: str
    reservation: Reservation
    request: NodeRequest

    @model_validator(mode="before")
    @classmethod
    def _earlier_shape(cls, data: Any) -> Any:
        """Inputs scheduled by a pool before 0.2 (the request as JSON text, an unused summary)
        still run on a newer worker during a rolling deploy."""
        if isinstance(data, dict) and "request_json" in data:
            earlier = {k: v for k, v in data.items() if k not in ("request_json", "static_summary")}
            return {**earlier, "request": NodeRequest.model_validate_json(data["request_json"])}
        return data


class StartNodeResult(Msg):
    started: bool
    reason: str = ""
    unsettled: bool = Field(
        False,
        description="Granted, but starting its workflow failed (it may have started anyway): the pool retries it with the same workflow id.",
    )


class NodeStart(Msg):
    """One node of a pool's batch: what differs from the batch's template request."""

    node_name: str
    floor: bool = False
    min_gpus: int = 1
    bind_grace: timedelta | None = None
    demand_since: datetime | None = None
    hourly_price: Decimal | None = Field(None, description="The price reserved for it (the offer its pods are sized for).")
    hold_ends_when_busy: bool = Field(False, description="Bought for one pod: it ends its bind-grace hold itself at its first pod (NodeRequest.hold_ends_when_busy).")


class StartNodesInput(Msg):
    """A pool's launches of one pass: one class ledger call for all of them, then their node
    workflows started together. The request is sent once (`template`, node_name empty); each
    start says only what differs (`tgp.pools.request_for`), so the input grows by a few hundred
    bytes per node, not by a request (boot template included) per node."""

    class_name: str = Field(description="The class ledger's workflow id.")
    pool: str = Field(description="namespace/name")
    template: NodeRequest
    starts: list[NodeStart]


class EvictNodesInput(Msg):
    """A deleted pool's nodes to end: those known started by id, and those whose start may still
    happen (an unsettled start: the server may take it after its caller gave up) by request."""

    workflow_ids: list[str] = []
    may_start: list[NodeRequest] = Field([], description="Started with the evict, if not running, so a late start finds it taken.")


class StartNodesResult(Msg):
    """One result per start, in order."""

    results: list[StartNodeResult]


class OfferCheck(Msg):
    matching: int
    cheapest: Decimal | None = None
    cheapest_any_price: Decimal | None = None
    cheapest_description: str = ""
    failed: dict[str, str] = Field({}, description="Providers whose offers could not be listed, with why.")
    stale: dict[str, str] = Field(
        {}, description="Providers whose offers came from an earlier listing because listing them again failed, with its age and why."
    )
    sizes: list[OfferSize] = Field([], description="The cheapest matching offer per GPU count (what demand by fit buys from).")



class DisruptionAsks(Msg):
    """Many nodes' asks at once (update `may_disrupt_many`: the worker gathers the asks made
    meanwhile, activities.batching), answered in order."""

    asks: list[DisruptionAsk]


class DisruptionAnswers(Msg):
    answers: list[DisruptionAnswer]


class NodeReports(Msg):
    """Input of the pool's `node_phases` signal: several nodes' reports that one worker had to
    send to the pool at once, in the order they were made (activities.node.ReportBatcher)."""

    reports: list[NodeReport]


class PoolReport(Msg):
    """Input of the node's `report_to_pool` activity (a life under the `life-v2` patch): the
    report a node signals its pool (`node_phase`) from a local activity."""

    pool_workflow_id: str
    report: NodeReport
