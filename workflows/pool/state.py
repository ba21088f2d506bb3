"""What a pool workflow knows (`PoolState`, carried whole across continue-as-new) and is started
with (`PoolInput`), and the named intervals and limits of its passes."""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from tgp.capacity import POD_BIND_GRACE, Nomination
    from tgp.crds import Condition, ConsolidationStatus
    from tgp.events import EventSpec
    from tgp.merge import Merging
    from tgp.messages import OfferCheck, PoolNode, PoolUpdate
    from tgp.pool_plan import ClassRefusal, UnsettledStart

# Even with no news the pool looks again this often (a lost signal cannot stall it).
RESYNC_INTERVAL = timedelta(minutes=1)
HISTORY_EVENTS_BEFORE_CONTINUE_AS_NEW = 2000
# Offers come and go; "no offer" and the price used for reservations are re-checked this often.
OFFER_CHECK_TTL = timedelta(minutes=5)
# A pass starts every node its batch of pending pods needs, with one class ledger call (the
# class grants what fits its budget; its limits.maxNodes, 10 unless set, bounds a typo) and one
# activity. This cap only bounds that activity: ~0.3 KB of input per node, far under Temporal's
# 2 MB payload limit; a 500-pod burst starts in one pass.
MAX_STARTS_PER_BATCH = 500
START_NODES_TIMEOUT = timedelta(minutes=3)
# A pool its class refused asks again when something that could change the answer happened (the
# pool or its class changed, a node of the pool ended), else after this long: a node of another
# pool of the class may have ended meanwhile, which this pool does not hear of.
CLASS_REFUSAL_BACKOFF = timedelta(seconds=30)
# Events kept for a later write while the API refuses them (newest kept).
MAX_PENDING_EVENTS = 100
# Visibility is eventually consistent: a node workflow started this recently may not be listed
# yet, so it is not taken for closed.
VISIBILITY_LAG = timedelta(minutes=1)
# Ended node workflows remembered: Temporal does not keep separate signals in order, and a late
# report about an ended node would bring it back as a ghost.
ENDED_REMEMBERED = 500
# A node let go by a budget counts as disrupting until it reports Draining, at most this long
# (it reports within seconds; one whose drain was called off is Ready again and asks anew).
GRANT_COUNTS_FOR = timedelta(minutes=2)
# Changed settings and labels go to the nodes this many at a time in one workflow task (a pool
# adopting 1,000 nodes one by one recorded ~165,000 events an hour).
SIGNALS_AT_ONCE = 100
# A start whose activity failed may have happened: its node is kept (Pending, its pods nominated
# to it) and started again with the same workflow id this soon, before anything new is bought.
START_RETRY = timedelta(seconds=5)
# A replacement that ended before Ready (or a class that refused it): the next one for the same
# node waits this long.
REPLACEMENT_BACKOFF = timedelta(minutes=5)
# A re-shop called off because do-not-disrupt holds the node is not tried again for this long
# (or consolidation's `after`, if longer): each try buys a replacement for a few minutes.
RESHOP_HELD_WAIT = timedelta(hours=1)


class PoolState(BaseModel):
    """Everything the pool knows, in one object: a run continued as new starts from it alone.

    Its schema only grows (tests/test_pool_state.py holds it to the fields recorded there): a
    run continued onto a newer build reads the state an older one carried. Fields it does not
    know (a rollback to an older build) are ignored, not refused."""

    model_config = ConfigDict(extra="ignore")
    update: PoolUpdate | None = None
    demand: list[str] = []
    pending_since: dict[str, datetime] = Field({}, description="When each pod of the demand was first reported pending (metrics).")
    demand_at: datetime | None = Field(None, description="When the bridge observed the demand last sent (its observed_at).")
    pod_gpus: dict[str, int] = {}
    free_gpus: dict[str, int] = {}
    nominations: dict[str, Nomination] = {}
    unfit: list[str] = []
    no_borrow: list[str] = Field([], description="Pods that did not bind on a node they borrowed GPUs from.")
    no_offer_fits: list[str] = Field([], description="Pending pods larger than every offer, already warned about.")
    nodes: dict[str, PoolNode] = {}
    offer_check: OfferCheck | None = None
    offer_check_key: str = ""
    offer_checked_at: datetime | None = None
    conditions: dict[str, Condition] = {}
    failures: int = 0
    backoff_until: datetime | None = None
    written: str = Field("", description="The status last written (its JSON): an unchanged status is not written again.")
    events: list[EventSpec] = Field([], description="Events not yet written; kept across continue-as-new.")
    seen_running_at: datetime | None = Field(None, description="Last time the running node workflows were listed.")
    ended: list[str] = Field([], description="Node workflows that ended lately (newest last): late reports about them are stale.")
    failed_at: datetime | None = Field(None, description="When the last launch failure was reported (later failures of nodes started before it are of its wave).")
    nodes_ended: int = Field(0, description="Node workflows of this pool that ended, ever (a count: a class refusal waits for it to change).")
    class_refusal: ClassRefusal | None = Field(None, description="The class's last refusal while it holds.")
    granted: dict[str, datetime] = Field({}, description="Nodes let begin a voluntary disruption (budgets), until they report Draining.")
    blocked: dict[str, str] = Field({}, description="Nodes a budget holds back, with the message of their DisruptionBlocked Event.")
    freed: bool = Field(False, description="A disruption ended or the spec changed since the held nodes last asked: tell them to ask again.")
    bound_gpus: dict[str, list[int]] = Field({}, description="GPU requests of the pods bound to each Ready node, from the demand (consolidation).")
    held_nodes: list[str] = Field([], description="Ready nodes do-not-disrupt holds, from the demand (consolidation leaves them).")
    consolidation: ConsolidationStatus | None = Field(None, description="The savings consolidation found and made (status.consolidation).")
    consolidation_looked_at: datetime | None = Field(None, description="When consolidation was last planned (once a resync).")
    unsettled: dict[str, UnsettledStart] = Field({}, description="Node starts that failed and may have happened, by workflow id: started again with the same id.")
    unsold: dict[str, int] = Field({}, description="GPU resources tgp does not sell that pending pods of the pool ask for, with how many pods (from the demand).")
    untracked: int = Field(0, description="Pending pods beyond the MAX_PODS_TRACKED of the demand, planned in a later batch (from the demand).")
    merging: Merging | None = Field(None, description="The merge of several nodes into one under way (tgp.merge).")


class PoolInput(BaseModel):
    """How the bridge starts a pool workflow (its intervals are shortened by tests), and the
    state a continued run carries (unknown fields ignored, as PoolState's)."""

    model_config = ConfigDict(extra="ignore")
    namespace: str
    name: str
    watch_interval: timedelta | None = None
    resync_interval: timedelta = RESYNC_INTERVAL
    bind_grace: timedelta = POD_BIND_GRACE
    visibility_lag: timedelta = VISIBILITY_LAG
    class_refusal_backoff: timedelta = CLASS_REFUSAL_BACKOFF
    start_retry: timedelta = START_RETRY
    offer_check_ttl: timedelta = OFFER_CHECK_TTL
    state: PoolState = PoolState()
