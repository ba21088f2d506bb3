"""The shared vocabulary of tgp: what flows between workflows, activities, adapters and the bridge.

Every type here is a pydantic model so that Temporal's pydantic data converter carries
`timedelta`, `Decimal` and `datetime` exactly. Nothing in this module may hold a secret:
these values end up in workflow history.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tgp.labels import LABEL_VALUE_MAX_LENGTH, LABEL_VALUE_PATTERN, QUALIFIED_NAME_MAX_LENGTH, QUALIFIED_NAME_PATTERN

# Search attributes a node workflow keeps current, so the Web UI can filter by them.
SEARCH_ATTRIBUTES: dict[str, str] = {
    "TgpPool": "Keyword",
    "TgpPhase": "Keyword",
    "TgpProvider": "Keyword",
    "TgpGpuType": "Keyword",
    "TgpHourlyPrice": "Double",
    "TgpNodeName": "Keyword",
    "TgpClass": "Keyword",
    # The instance a node recorded (after its launch): the fleet look and the sweeper read it
    # from the listing instead of asking every node workflow (a query replays an uncached one).
    "TgpInstanceId": "Keyword",
    # When the node last became Ready (with its Ready phase): the fleet look's consistency window
    # for an instance missing from a list runs from here, also after a worker restart.
    "TgpReadySince": "Datetime",
}

DEFAULT_TASK_QUEUE = "tgp"
# Where the operator's Secrets live (provider keys, tailnet credentials, join material).
OPERATOR_NAMESPACE = "tgp-system"

GPU_RESOURCE = "nvidia.com/gpu"
LABEL_GPU_TYPE = "tgp.io/gpu-type"
LABEL_REGION = "tgp.io/region"
LABEL_POOL = "tgp.io/pool"
LABEL_POOL_NAMESPACE = "tgp.io/pool-namespace"
LABEL_PROVIDER = "tgp.io/provider"
LABEL_MANAGED = "tgp.io/managed"
# Set on a Node by its node workflow just before it deletes it (`delete_node`): the bridge then
# knows the workflow released its own Node and sends it no `node_facts` about the deletion (a
# signal that would land as the workflow completes, and have its last task retried).
ANNOTATION_RELEASED = "tgp.io/released"
# Put on a Node when tgp labels it (Karpenter's termination finalizer): `kubectl delete node` then
# only marks it deleting, and its node workflow drains it, terminates the instance and removes
# the finalizer as it deletes the Node (`delete_node`, on every way out). Without it the Node
# would go at once while the machine bills on (and a kubelet that re-registers brings it back).
FINALIZER_TERMINATION = "tgp.io/termination"


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NodePhase(StrEnum):
    """Where a node is in its life. The last four are end states."""

    PENDING = "Pending"  # choosing an offer
    LAUNCHING = "Launching"  # tailnet key minted, instance bought, waiting for it to run
    JOINING = "Joining"  # waiting for the tailnet device, then for the Node to be Ready
    READY = "Ready"  # labelled and tainted, serving pods, watched until idle/expired/evicted
    DRAINING = "Draining"  # cordoned, pods evicted through the Eviction API
    TERMINATING = "Terminating"  # instance, tailnet device, key and Node object being removed
    TERMINATION_STUCK = "TerminationStuck"  # the provider has not confirmed termination for a while; still retrying
    TERMINATED = "Terminated"  # ended as planned (idle, expired, evicted)
    INTERRUPTED = "Interrupted"  # the provider took the instance away (preemption, host loss)
    FAILED = "Failed"  # could not bring a node up; see lastError
    CANCELLED = "Cancelled"  # the workflow was cancelled; everything bought was released

    @property
    def is_final(self) -> bool:
        return self in _FINAL_PHASES


_FINAL_PHASES = {NodePhase.TERMINATED, NodePhase.INTERRUPTED, NodePhase.FAILED, NodePhase.CANCELLED}
# A node is paid for from the launch (the instance is bought) until its termination is confirmed.
BILLING_PHASES = frozenset(
    {NodePhase.LAUNCHING, NodePhase.JOINING, NodePhase.READY, NodePhase.DRAINING, NodePhase.TERMINATING, NodePhase.TERMINATION_STUCK}
)


class Stage(StrEnum):
    """A step of a node's life that is recorded with its time and reason (`StageRecord`): every
    phase, plus the steps inside one (the join's three waits, the drain's outcomes, the release)."""

    PENDING = "Pending"
    LAUNCHING = "Launching"
    JOINING = "Joining"
    TAILNET_JOINED = "TailnetJoined"  # the tailnet device is there
    NODE_READY = "NodeReady"  # the Node reports Ready (its GPUs may not be registered yet)
    GPUS_REGISTERED = "GpusRegistered"  # allocatable nvidia.com/gpu reached the offer's count
    READY = "Ready"
    DRAINING = "Draining"
    DRAIN_CALLED_OFF = "DrainCalledOff"  # a workload pod was found after the cordon: back to Ready
    DISRUPTION_HELD = "DisruptionHeld"  # a voluntary end (expiry, idle) is held by do-not-disrupt pods or Node
    DISRUPTION_BLOCKED = "DisruptionBlocked"  # a voluntary end waits for the pool's disruption budget
    DRAIN_TIMED_OUT = "DrainTimedOut"  # pods were still on the node at the drain timeout
    NODE_REPAIR = "NodeRepair"  # repaired: GPUs gone or NotReady too long (the reason says which and for how long)
    NODE_DELETED = "NodeDeleted"  # its Node was deleted by hand (kubectl delete node): drained and terminated
    TERMINATING = "Terminating"
    TERMINATION_STUCK = "TerminationStuck"
    RELEASED = "Released"  # instance, tailnet device and key, Node object all gone
    TERMINATED = "Terminated"
    INTERRUPTED = "Interrupted"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def warning(self) -> bool:
        """A stage an operator should hear about as a Warning Event."""
        return self in (Stage.DRAIN_TIMED_OUT, Stage.TERMINATION_STUCK, Stage.INTERRUPTED, Stage.FAILED, Stage.NODE_REPAIR, Stage.NODE_DELETED)


class StageRecord(Model):
    """When a node last entered a stage, and why (Karpenter's typed conditions are the model)."""

    stage: Stage
    at: datetime
    reason: str = ""

    def describe(self) -> str:
        """One line, as `tgp status NODE` prints it and the pool's Events say it."""
        return f"{self.stage.value}: {self.reason}" if self.reason else self.stage.value


def upsert_stage(records: list[StageRecord], record: StageRecord) -> list[StageRecord]:
    """`records` with `record` as its stage's one entry, last: a stage entered again (a second
    launch attempt, Ready after a called-off drain) keeps its latest time and reason."""
    return [*(r for r in records if r.stage is not record.stage), record]


class Offer(Model):
    """One thing a provider will sell right now, normalised to tgp's labels and units."""

    provider: str
    offer_id: str = Field(description="The provider's id for this offer (instance type, ask id, ...).")
    gpu_type: str = Field(description="Normalised GPU model, the value of the tgp.io/gpu-type label.")
    gpu_count: int = 1
    region: str = Field(description="Normalised region, the value of the tgp.io/region label.")
    hourly_price: Decimal = Field(description="US dollars per hour for the whole instance.")
    spot: bool = False

    @property
    def key(self) -> str:
        """Identity used by the unavailable-offer cache."""
        return f"{self.provider}/{self.offer_id}/{self.region}" + ("/spot" if self.spot else "")


class InstanceState(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    STOPPED = "Stopped"
    FAILED = "Failed"
    TERMINATED = "Terminated"


class Instance(Model):
    provider: str
    instance_id: str
    name: str
    state: InstanceState
    offer_id: str = ""
    hourly_price: Decimal | None = None
    interrupted: bool = Field(False, description="The provider ended it (preemption, host loss).")


class BootPayload(Model):
    """What an instance runs at first boot. Built and consumed inside one activity, never
    returned from it: it carries the tailnet auth key."""

    kind: str = Field(description="cloud-init, talos, script or env")
    content: str
    hostname: str


class Taint(Model):
    # The patterns are for the CRD schema (the API server checks them at apply); a pool's keys are
    # also checked at the bridge's admission (tgp/labels.py), not on every decode of history.
    key: str = Field(
        description="Taint key: a Kubernetes qualified name, e.g. example.com/gpu; not under tgp.io/ or node-role.kubernetes.io/.",
        json_schema_extra={"maxLength": QUALIFIED_NAME_MAX_LENGTH, "pattern": QUALIFIED_NAME_PATTERN},
    )
    value: str = Field(
        "",
        description="Taint value: empty, or up to 63 of A-Z a-z 0-9 - _ . (alphanumeric at both ends).",
        json_schema_extra={"maxLength": LABEL_VALUE_MAX_LENGTH, "pattern": LABEL_VALUE_PATTERN},
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = Field("NoSchedule", description="What the taint does to pods that do not tolerate it.")



# The taint a node of a v2 life registers with (like Karpenter's karpenter.sh/unregistered): its
# Node carries the pool's labels from registration (so the bridge follows it during the join),
# and no pod may land on it before tgp has labelled it and called it Ready (label_and_taint takes
# the taint off); an evict before Ready ends a node without a drain.
TAINT_JOINING = Taint(key="tgp.io/joining", value="", effect="NoSchedule")

class CredentialsRef(Model):
    """Where a provider's API key lives: one key of one Secret. A reference, never the key:
    the activities read the Secret when they need the key (activities/accounts.py)."""

    namespace: str = OPERATOR_NAMESPACE
    name: str
    key: str

    def __str__(self) -> str:
        return f"key {self.key!r} of Secret {self.namespace}/{self.name}"


class TailnetRef(Model):
    """The class's own tailnet credentials (tailscaleConfig.oauthSecretRef): a reference, never
    the values. Keys client-id and client-secret (Tailscale OAuth client) or api-key (Headscale)."""

    namespace: str = OPERATOR_NAMESPACE
    name: str
    login_server: str | None = Field(None, description="Headscale URL; None for Tailscale.")


class OfferRequirements(Model):
    """What a node needs from an offer. Empty lists mean 'any'."""

    gpu_types: list[str] = []
    regions: list[str] = []
    providers: list[str] = []
    min_gpu_count: int = 1
    max_hourly_price: Decimal | None = None
    allow_spot: bool = True
    # The class's providers[].priority: the tie-break between equally priced offers (lower wins).
    provider_priority: dict[str, int] = {}
    # The class's providers[].credentialsRef: whose account each provider bills. A provider not
    # named here uses the worker's own key (its environment).
    credentials: dict[str, CredentialsRef] = {}


# Named defaults for the lifecycle's timeouts, each with the reason for its value.
# A GPU VM on these clouds typically reaches running in 1-5 minutes; 10 covers slow hosts.
LAUNCH_TIMEOUT = timedelta(minutes=10)
# Tailscale registration follows boot within a minute or two; longer means the payload failed.
TAILNET_JOIN_TIMEOUT = timedelta(minutes=5)
# Kubelet registration plus NVIDIA driver load and Ready: Talos/Ubuntu images take 3-8 minutes.
NODE_READY_TIMEOUT = timedelta(minutes=10)
# The NVIDIA device plugin (a DaemonSet) must start on the Ready node, find the driver and
# register `nvidia.com/gpu` with the kubelet: 1-3 minutes after Ready with a cached image; 10
# covers a slow image pull. Past it the driver is broken: the node cannot run GPU pods at all
# (Karpenter's RequestedResourcesRegistered has the same role, inside its 15-minute limit).
GPU_REGISTRATION_TIMEOUT = timedelta(minutes=10)
# Long enough for a graceful pod shutdown, short enough that a stuck PDB does not keep paying.
DRAIN_TIMEOUT = timedelta(minutes=10)
# Karpenter's consolidateAfter-style grace: a node idle this long is drained and terminated.
IDLE_TIMEOUT = timedelta(minutes=10)
# How often a Ready node is looked at without a reason: the watch's backstop look (a lost signal,
# an interruption the provider's bulk listing missed). Also a safe point for Worker Versioning.
WATCH_INTERVAL = timedelta(minutes=45)
# A capacity error or join failure takes an offer out of rotation this long (Karpenter: 3 min).
UNAVAILABLE_OFFER_TTL = timedelta(minutes=3)
# One attempt of a short API call (create, describe, label, terminate). A worker that dies
# mid-call is noticed after this long, and the call is retried on another worker.
API_CALL_TIMEOUT = timedelta(minutes=2)
# Offers tried before a node gives up and ends Failed.
MAX_LAUNCH_ATTEMPTS = 3
# The do-not-disrupt pods a node's facts name (the count says how many more): a node with a
# thousand such pods must not send a thousand names in every signal, status and Event.
MAX_HOLDERS_NAMED = 5
# Tailnet auth keys are single-use and expire soon after the boot that should consume them.
AUTH_KEY_EXPIRY = timedelta(hours=1)
# A terminate the provider has not confirmed after this long is shown as TerminationStuck (it is
# still retried for ever): long enough for a provider's usual API hiccups, short enough that a
# human looks before an hour of GPU time is billed.
TERMINATION_STUCK_AFTER = timedelta(minutes=10)


class LifecycleTimeouts(Model):
    launch: timedelta = LAUNCH_TIMEOUT
    tailnet_join: timedelta = TAILNET_JOIN_TIMEOUT
    node_ready: timedelta = NODE_READY_TIMEOUT
    gpu_registration: timedelta = Field(GPU_REGISTRATION_TIMEOUT, description="From Node Ready until its allocatable nvidia.com/gpu reaches the offer's count.")
    drain: timedelta = DRAIN_TIMEOUT
    idle: timedelta | None = Field(IDLE_TIMEOUT, description="None: never idle out (a pool's minNodes floor).")
    watch_interval: timedelta = Field(WATCH_INTERVAL, description="How often a Ready node is looked at without a reason (the event-driven watch's backstop look).")
    api_call: timedelta = API_CALL_TIMEOUT
    expire_after: timedelta | None = Field(None, description="Replace the node after this age.")
    termination_stuck: timedelta = Field(TERMINATION_STUCK_AFTER, description="Report TerminationStuck after this long.")
    termination_grace: timedelta | None = Field(
        None,
        description="The pool's terminationGracePeriod: the longest the drain may take once the node's disruption began; "
        "at it the instance is terminated whatever PodDisruptionBudgets and do-not-disrupt pods say (None: only `drain` bounds it).",
    )
    bind_grace: timedelta | None = Field(
        None,
        description="The pool's bind grace: after Ready the node holds the place of the pods bought for it this long, "
        "and its idle timeout cannot end it before (None: no hold, as nodes started by hand).",
    )
    unlimited_reasons: list[str] = Field(
        [],
        description="The disruption reasons the pool's budgets can never refuse (tgp.disruption.unlimited_reasons): a "
        "drain for one of them begins without asking the pool (do-not-disrupt still holds the node).",
    )


class TimeoutsUpdate(Model):
    """Input of the node's `update_timeouts` signal: the pool's disruption settings changed, or
    the node joined or left the pool's minNodes floor (a floor node has no idle timeout)."""

    idle: timedelta | None
    drain: timedelta
    expire_after: timedelta | None
    hold: timedelta | None = Field(
        None,
        description="The pool's bind grace while pods are nominated to the node (it holds their place, not idling out "
        "within that long of Ready), 0 once none is: the hold is released. None: no change (senders before it existed).",
    )
    termination_grace: timedelta | None = Field(
        None,
        description="The pool's terminationGracePeriod (None: none). Absent from the message (senders before it existed): no change.",
    )
    unlimited_reasons: list[str] | None = Field(
        None,
        description="The disruption reasons the pool's budgets can never refuse: the node's drain for them does not ask the pool. "
        "None: none, and from senders before it existed.",
    )


class BootConfig(Model):
    """How a node boots, from its class: a template and references, never secret values."""

    template: str | None = Field(None, description="The class's machine config / cloud-init template; None = the provider's default.")
    join_secret: str | None = Field(None, description="namespace/name of the Secret with the cluster join material.")
    login_server: str | None = Field(None, description="Headscale URL; None for Tailscale.")
    talos_image: str = ""
    kubernetes_version: str | None = Field(None, description="The class's kubernetesVersion: the kubelet version x.y.z.")
    accept_routes: bool = Field(False, description="tailscaleConfig.acceptRoutes: `tailscale up --accept-routes`.")
    ephemeral: bool = Field(True, description="tailscaleConfig.ephemeral: the auth key registers ephemeral devices.")
    node_class: str = Field("", description="The GPUNodeClass this comes from: a template that fails at launch is reported on it.")


class NodeRequest(Model):
    """Everything a node workflow needs to live its life. No secrets: references only."""

    namespace: str
    pool: str
    node_name: str = Field(description="Kubernetes Node name and tailnet hostname.")
    node_class: str = ""
    requirements: OfferRequirements = OfferRequirements()
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    tailnet_tags: list[str] = ["tag:tgp-node"]
    tailnet: str = Field("tailscale", description="Tailnet backend: tailscale or headscale.")
    tailnet_ref: TailnetRef | None = Field(None, description="The class's tailnet credentials; None: the worker's own.")
    boot: BootConfig = BootConfig()
    timeouts: LifecycleTimeouts = LifecycleTimeouts()
    max_launch_attempts: int = MAX_LAUNCH_ATTEMPTS
    unavailable_offer_ttl: timedelta = UNAVAILABLE_OFFER_TTL
    pool_workflow_id: str | None = Field(None, description="Pool workflow to report phases to.")
    class_workflow_id: str | None = Field(None, description="Class ledger that holds this node's budget.")
    demand_since: datetime | None = Field(
        None, description="When the pool first heard of the pending pod this node is bought for (for tgp_demand_to_launch_seconds)."
    )
    drift_hashes: dict[str, str] = Field(
        {}, description="The drift hash (tgp.drift) of what made the node, per provider it may be bought from: it reports its provider's."
    )
    reserved_price: Decimal | None = Field(
        None,
        description="The $/h the pool reserved for the node with the class ledger (the offer its pods were sized for): a launch at that "
        "price has nothing to settle (None: unknown, every launch settles).",
    )
    offer: Offer | None = Field(
        None,
        description="The first launch's offer, chosen when the pool started the node (the run starts Launching, its search "
        "attributes set by the start); None: the node chooses it. A failed attempt's next offer is always the node's choice.",
    )
    hold_ends_when_busy: bool = Field(
        False,
        description="The node ends its bind-grace hold itself when the bridge first shows a workload pod on it, "
        "unless the pool has sent it settings since its start: the pool, which models the same rule, then sends no settings "
        "to release a node whose pods bound on it.",
    )

    @property
    def workflow_id(self) -> str:
        return node_workflow_id(self.namespace, self.pool, self.node_name)


# Every node workflow's id starts with this.
NODE_WORKFLOW_PREFIX = "gpunode/"


def node_workflow_id(namespace: str, pool: str, node_name: str) -> str:
    return f"{NODE_WORKFLOW_PREFIX}{namespace}/{pool}/{node_name}"


def instance_name(node_name: str, attempt: int) -> str:
    """The provider-side name of a launch attempt: derived from the workflow, so a retried or
    crashed launch finds and adopts what it already bought instead of buying twice."""
    return f"tgp-{node_name}-{attempt}"


class EvictRequest(Model):
    """Input of the `evict` signal: `--input '{"reason": "manual"}'`."""

    reason: str = "manual"


class DisruptRequest(Model):
    """Input of the `disrupt` signal: the pool replaced this node (make-before-break) and its
    replacement is Ready; the node ends voluntarily (budget, do-not-disrupt, drain)."""

    reason: str = Field(description="The voluntary reason (tgp.disruption.DisruptionReason): Drifted or Cheaper.")
    replacement: str = Field("", description="The replacement's Node name.")
    detail: str = ""
    at: datetime | None = Field(
        None,
        description="When the pool asked (its workflow time): a drifted node that do-not-disrupt holds goes at this plus the "
        "pool's terminationGracePeriod at the latest (tgp.disruption.eventual_end). None: senders before it existed, no bound.",
    )


class LaunchAttempt(Model):
    attempt: int
    offer: Offer
    instance_id: str | None = None
    outcome: str = ""
    started_at: datetime | None = None


class NodeOverview(BaseModel):
    """A node in one line: which workflow, which Node, where in its life, what it runs on and
    costs. The one shape the node's `status` answer, its reports to the pool, the pool's
    record of it and the pool's CR status (`tgp.crds.PoolNodeStatus.of`) share."""

    model_config = ConfigDict(extra="forbid")
    workflow_id: str
    node_name: str
    phase: NodePhase
    provider: str | None = None
    gpu_type: str | None = None
    hourly_price: Decimal | None = None


class NodeStatus(NodeOverview):
    """Answer of the node workflow's `status` query (`tgp status`, the demo)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    workflow_id: str = ""  # answers of runs from before it was part of the summary
    pool: str
    region: str | None = None
    instance_id: str | None = None
    stages: list[StageRecord] = Field([], description="When the node last entered each stage and why, oldest first.")
    attempts: list[LaunchAttempt] = []
    last_error: str | None = None
    end_reason: str | None = None
    asking: str = Field("", description="The voluntary end (tgp.disruption reason) the node is asking its pool's budget for, while the ask is in flight.")

    @property
    def stage_times(self) -> dict[str, datetime]:
        """When each stage was last entered, by name."""
        return {r.stage.value: r.at for r in self.stages}


# --- What the activities observe -------------------------------------------------------


class TailnetDevice(Model):
    device_id: str
    hostname: str
    addresses: list[str] = []
    tags: list[str] = []
    connected: bool = False


class PodSummary(Model):
    namespace: str
    name: str
    uid: str = ""
    phase: str = "Running"
    owner_kind: str | None = None
    is_mirror: bool = False
    requests_gpu: bool = False
    deleting: bool = False
    do_not_disrupt: bool = Field(False, description="Annotated tgp.io/do-not-disrupt or karpenter.sh/do-not-disrupt: \"true\".")
    grace_period: timedelta = Field(timedelta(seconds=30), description="spec.terminationGracePeriodSeconds (Kubernetes' default: 30 s).")


class NodeSummary(Model):
    name: str
    ready: bool
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    unschedulable: bool = False
    gpus: int = Field(0, description="Allocatable nvidia.com/gpu: what the device plugin has registered.")
    do_not_disrupt: bool = Field(False, description="The Node is annotated tgp.io/do-not-disrupt or karpenter.sh/do-not-disrupt: \"true\".")
    deleting: bool = Field(False, description="The Node has a deletionTimestamp (`kubectl delete node`): tgp's finalizer holds it until the node is released.")


class NodeObservation(Model):
    """One look at a Ready node during the watch stage."""

    instance: Instance | None
    node: NodeSummary | None
    busy_pods: int = Field(description="Pods that keep the node from being idle.")
    holders: list[str] = Field([], description="namespace/name of the first pods that hold the node (tgp.lifecycle.pod_holds_node), at most MAX_HOLDERS_NAMED.")
    holding: int = Field(0, description="How many pods hold the node against voluntary disruption (`holders` names the first).")


class NodeFacts(Model):
    """What the cluster says about a managed Node, sent by the bridge to its node workflow
    (signal `node_facts`) when it changes, and again for every node after the bridge restarts
    (level-triggered: a lost signal heals). The node's watch acts on these instead of polling."""

    node_name: str
    present: bool = Field(description="Whether the Node object exists.")
    ready: bool = False
    gpus: int = Field(0, description="Allocatable nvidia.com/gpu.")
    busy_pods: int = Field(0, description="Pods that keep the node from being idle (tgp.lifecycle.pod_keeps_node_busy).")
    do_not_disrupt: bool = Field(False, description="The Node itself is annotated do-not-disrupt.")
    deleting: bool = Field(False, description="The Node has a deletionTimestamp: someone deleted it (`kubectl delete node`); tgp's finalizer keeps it until the node is drained and released.")
    holders: list[str] = Field([], description="namespace/name of the first pods that hold the node against voluntary disruption (at most MAX_HOLDERS_NAMED).")
    holding: int = Field(0, description="How many pods hold the node (tgp.lifecycle.pod_holds_node); `holders` names the first.")
    at: datetime = Field(description="When the bridge saw this (its clock).")
    source: str = Field("", description="The sending bridge process (an incarnation id); facts sent by hand may leave it empty.")
    seq: int = Field(0, description="The sending bridge's number for these facts, increasing: orders the facts of one source (tgp.facts_order).")


class InstanceSighting(Model):
    """What a provider's bulk listing (one list per account per interval) says about a node's
    instance, sent (signal `instance_seen`) only when it is not plainly running: the node then
    looks for itself (one describe) before acting, since lists lag behind the truth."""

    instance_id: str | None = Field(None, description="The id listed under the node's instance name; None when none was listed.")
    state: InstanceState | None = Field(None, description="None: the listing did not show the instance at all.")
    interrupted: bool = False
    at: datetime = Field(description="When the listing was taken.")


class DisruptionAsk(Model):
    """A node asks its pool (update `may_disrupt`) whether it may begin a voluntary disruption
    now, within the pool's disruption budgets."""

    workflow_id: str
    node_name: str
    reason: str = Field(description="The voluntary reason, as a budget's `reasons` names it (tgp.disruption.DisruptionReason): Empty, Expired, ...")


class DisruptionAnswer(Model):
    allowed: bool
    message: str = Field("", description="Why not (the blocking budget and the counts), or why it went ahead unasked.")
    unasked: bool = Field(
        False,
        description="Not a refusal: the pool could not take the ask now (its updates in flight at Temporal's limit); ask again soon.",
    )


class PoolAsk(Model):
    """Input of the node's `ask_pool_to_disrupt` activity."""

    pool_workflow_id: str
    ask: DisruptionAsk


class DrainResult(Model):
    evicted: int
    answer: DisruptionAnswer | None = Field(
        None, description="With `ask`: the pool's answer. Not allowed: nothing was cordoned or evicted (the node stays Ready)."
    )
    held: list[str] = Field(
        [], description="With `holds`: what do-not-disrupt held the node right after the cordon (the Node, or namespace/name of pods); it was uncordoned and nothing evicted."
    )
    remaining: list[str] = Field([], description="namespace/name of pods not evicted by the deadline (e.g. blocked by a PodDisruptionBudget).")
    terminating: list[str] = Field([], description="namespace/name of pods evicted or deleted but still shutting down at the deadline.")
    called_off: list[str] = Field(
        [], description="With revalidate: namespace/name of workload pods found right after the cordon; the Node was uncordoned and nothing evicted."
    )
    deleted: list[str] = Field(
        [], description="With delete_at_deadline: namespace/name of pods deleted over their PodDisruptionBudget at the deadline minus their grace."
    )


# --- Activity inputs and results ----------------------------------------------------------


class BlockScope(StrEnum):
    """What a launch failure takes out of rotation (SkyPilot's failover by cause)."""

    OFFER = "offer"  # capacity, a refusal of this one offer, a failed boot or join
    GPU_TYPE = "gpu_type"  # a quota for the GPU type: every region of the provider
    ACCOUNT = "account"  # credentials rejected or not allowed: the provider account


class OfferBlock(Model):
    """Offers taken out of rotation for one account: one offer, one GPU type of a provider, or
    a whole provider account. `account` is the class's CredentialsRef for the provider (None:
    the worker's own key); a block never covers an offer bought with another account."""

    scope: BlockScope
    provider: str
    account: CredentialsRef | None = None
    gpu_type: str = Field("", description="With scope gpu_type: the GPU type blocked in every region of the provider.")
    offer_key: str = Field("", description="With scope offer: the Offer.key blocked.")
    cause: str = Field("", description="The error type that blocked it (CapacityError, QuotaExceeded, AuthError, ...).")

    def covers(self, offer: Offer, account: CredentialsRef | None) -> bool:
        """Whether `offer`, bought with `account`, is taken out of rotation by this block."""
        if offer.provider != self.provider or account != self.account:
            return False
        if self.scope is BlockScope.OFFER:
            return offer.key == self.offer_key
        if self.scope is BlockScope.GPU_TYPE:
            return offer.gpu_type == self.gpu_type
        return True

    def describe(self) -> str:
        """The block in words, for logs, Events and the node's last error."""
        whose = f"account {self.account}" if self.account is not None else "the worker's own account"
        if self.scope is BlockScope.OFFER:
            return f"offer {self.offer_key} ({whose})"
        if self.scope is BlockScope.GPU_TYPE:
            return f"{self.gpu_type} in every region of {self.provider} ({whose})"
        return f"{self.provider} with {whose}"


class SelectOfferInput(Model):
    requirements: OfferRequirements
    exclude: list[str] = Field([], description="Offer keys this node already tried.")
    blocked: list[OfferBlock] = Field(
        [], description="What this node's failed attempts blocked (their causes): excluded for the node's whole life, whatever the cache's TTL."
    )


class OfferChoice(Model):
    offer: Offer | None
    seen: int = Field(description="Offers the providers listed.")
    matching: int = Field(description="Offers that satisfy the requirements.")
    unavailable: int = Field(0, description="Matching offers skipped as recently failed or already tried.")
    stale: dict[str, str] = Field(
        {}, description="Providers whose offers came from an earlier listing because listing them again failed, with its age and why."
    )


class LaunchInput(Model):
    node_name: str
    attempt: int
    offer: Offer
    credentials: CredentialsRef | None = Field(None, description="The class's Secret key for the offer's provider; None: the worker's own.")
    tailnet_tags: list[str]
    tailnet: str = "tailscale"
    tailnet_ref: TailnetRef | None = None
    boot: BootConfig = BootConfig()
    pool: str = ""
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    key_expiry: timedelta = AUTH_KEY_EXPIRY
    unavailable_offer_ttl: timedelta = UNAVAILABLE_OFFER_TTL
    demand_since: datetime | None = Field(None, description="NodeRequest.demand_since, for tgp_demand_to_launch_seconds.")


class LaunchResult(Model):
    instance: Instance
    key_id: str | None = Field(None, description="Id (never the secret) of the minted tailnet key.")
    adopted: bool = Field(False, description="An instance of this name already existed and was adopted.")
    account: str | None = Field(None, description="Fingerprint of the class key it was bought with (None: the worker's own).")
    seen_ids: list[str] = Field([], description="Every instance id the launch saw under its name (twins it ended included).")
    joining_at: datetime | None = Field(None, description="With a join plan: when the buy ended and the join's wait began.")
    join: JoinResult | None = Field(None, description="With a join plan: the join's outcome; None: a cancel cut its wait short.")


class JoinPlan(Model):
    """The join `launch_instance` waits for once it has bought (one activity and one workflow
    task for both, issue 37): the instance running and its device in the tailnet, then a first
    look at the Node, within `within` of the buy; the twin watch runs beside it."""

    seen: list[InstanceRef] = Field(description="The names the node's launches used, this attempt's included: what the twin watch ends twins under.")
    device: DeviceQuery
    node_name: str
    gpus: int
    within: timedelta = Field(description="The join's deadline after the buy; at it, one last look keeps what is up.")
    timeout_error: str = Field(description="The message of a join that missed its deadline (the attempt fails over).")
    label: LabelInput | None = Field(None, description="The Node's labels and taints, put on (the joining taint off) when it is up at the join's end.")


class JoinResult(Model):
    """What the join's wait saw: the joined device, and the twin watch's names with every id seen
    under them (None: the watch was not done when the device joined, or failed); or why the join
    failed."""

    device: TailnetDevice | None = Field(None, description="The joined device; None: the last look at the deadline kept the stage, or the join failed.")
    twins: list[InstanceRef] | None = None
    node: StageLook | None = Field(None, description="The look at the Node after the device joined.")
    error: str | None = Field(None, description="Why the join failed (a deadline passed, the instance failed while it booted): the attempt fails over.")
    labelled: bool = Field(False, description="The Node was up: its labels and taints are on (the joining taint off), and the pool was told Ready.")


class InstanceRef(Model):
    provider: str
    instance_name: str
    instance_id: str | None = None
    credentials: CredentialsRef | None = Field(None, description="The account the instance was bought with (None: the worker's own).")
    account: str | None = Field(
        None, description="Fingerprint of the key it was bought with: it is reached with that key until it ends, whatever the Secret holds since."
    )
    created_by: datetime | None = Field(
        None,
        description="The latest moment a create under this name may have been sent (the end of its launch): the "
        "provider's lists may lag, and a late create may land, until its consistency window after this.",
    )
    known_ids: list[str] = Field([], description="Every instance id ever seen under this name: each is terminated and verified.")

    def bought(self, result: LaunchResult, at: datetime) -> InstanceRef:
        """This name once `result` bought (or adopted) its instance, known `at`: its id and key,
        and every id seen under the name."""
        ids = sorted({*self.known_ids, *result.seen_ids, result.instance.instance_id})
        return self.model_copy(update={"instance_id": result.instance.instance_id, "account": result.account, "created_by": at, "known_ids": ids})


class TwinWatchInput(Model):
    """The names a node's launches used, with what is known of each, and the one instance
    the node recorded: every other instance under those names is ended."""

    instances: list[InstanceRef]
    keep: str | None = None


class DeviceQuery(Model):
    hostname: str
    tags: list[str]
    tailnet: str = "tailscale"
    tailnet_ref: TailnetRef | None = None


class StageCheck(Model):
    """What a join stage waits for (`wait_for_join`) or looks at (`check_stage`: a backstop
    look, or the last one at the stage's deadline before the attempt is failed over). Every
    part given must be up: the instance running, the device in the tailnet, the Node Ready."""

    instance: InstanceRef | None = None
    device: DeviceQuery | None = None
    node_name: str | None = None
    gpus: int | None = Field(None, description="With node_name: the allocatable nvidia.com/gpu the Node must have.")


class StageLook(Model):
    """What `check_stage` saw: `up` when everything asked about is there; `seen` says what."""

    up: bool
    seen: str
    instance: Instance | None = Field(None, description="The instance looked at, when asked by name (no id): the one kept under it.")
    account: str | None = Field(None, description="With `instance`: the fingerprint of the key it was looked at with.")


class LabelInput(Model):
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]
    launched_at: datetime | None = Field(None, description="Start of the launch attempt that worked, for tgp_launch_to_ready_seconds.")
    remove_labels: dict[str, str] = Field(
        {}, description="Labels tgp had set that the pool no longer lists, with the value tgp set: removed while the Node still has it."
    )
    remove_taints: list[Taint] = Field([], description="Taints tgp had set that the pool no longer lists: removed while the Node still has them.")


class TemplateUpdate(Model):
    """Input of the node's `update_template` signal: the pool's template labels and taints now.
    The node applies the difference to what it last put on its Node, in place."""

    labels: dict[str, str] = {}
    taints: list[Taint] = []


class ObserveInput(Model):
    instance: InstanceRef
    node_name: str


class DrainInput(Model):
    node_name: str
    timeout: timedelta
    revalidate: bool = Field(
        False,
        description="The drain is for an idle node: right after the cordon, look again, and if a workload pod arrived "
        "since the idle verdict, uncordon and evict nothing (Karpenter re-validates a disruption the same way).",
    )
    bound: str = Field("", description="What set `timeout`, when not the drain timeout: named in the pods' DrainTimedOut Events.")
    ask: PoolAsk | None = Field(
        None, description="A voluntary end: ask the pool's disruption budgets first, and drain only if allowed."
    )
    holds: bool = Field(
        False,
        description="A voluntary end: right after the cordon, look again, and if do-not-disrupt holds the node (the Node's annotation "
        "or a pod's), uncordon and evict nothing.",
    )
    delete_at_deadline: bool = Field(
        False,
        description="The pool's terminationGracePeriod sets `timeout`: a pod still on the node at the deadline minus its own "
        "terminationGracePeriodSeconds is deleted (over its PodDisruptionBudget and do-not-disrupt), so it gets its grace before the instance goes.",
    )
    terminate: InstanceRef | None = Field(
        None,
        description="The instance the node bought: once the drain is done and the node is to go (not refused, held or called off), "
        "one terminate call for it, so that billing stops before the workflow's next task. The release that follows terminates "
        "until the provider confirms and does the rest, as without it.",
    )


class TailnetCleanupInput(Model):
    hostname: str
    tags: list[str]
    tailnet: str = "tailscale"
    tailnet_ref: TailnetRef | None = None
    key_ids: list[str] = []


class TailnetCleanupResult(Model):
    keys_revoked: int = 0
    devices_deleted: int = 0


class MarkUnavailableInput(Model):
    offer_key: str
    ttl: timedelta
    block: OfferBlock | None = Field(
        None, description="What the failure blocks (offer, GPU type or account, for the class's account); None: the offer, for the worker's own key."
    )
    node_class: str = Field("", description="The node's GPUNodeClass: told by a Warning Event when its provider account is blocked.")
    node_name: str = ""
    error: str = Field("", description="What failed, for the class's Event.")


# Models whose fields name models defined further down: complete now, at import. Built lazily,
# at their first use, they would be built inside a workflow's sandbox, which does not show this
# module to pydantic (`JoinPlan` is not fully defined).
for _model in (LaunchResult, JoinPlan, JoinResult):
    _model.model_rebuild()
del _model
