"""The shared vocabulary of tgp: what flows between workflows, activities, adapters and the bridge.

Every type here is a pydantic model so that Temporal's pydantic data converter carries
`timedelta`, `Decimal` and `datetime` exactly. Nothing in this module may hold a secret:
these values end up in workflow history.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

# Search attributes a node workflow keeps current, so the Web UI can filter by them.
SEARCH_ATTRIBUTES: dict[str, str] = {
    "TgpPool": "Keyword",
    "TgpPhase": "Keyword",
    "TgpProvider": "Keyword",
    "TgpGpuType": "Keyword",
    "TgpHourlyPrice": "Double",
    "TgpNodeName": "Keyword",
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


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class NodePhase(StrEnum):
    """Where a node is in its life. The last four are end states."""

    PENDING = "Pending"  # choosing an offer
    LAUNCHING = "Launching"  # tailnet key minted, instance bought, waiting for it to run
    JOINING = "Joining"  # waiting for the tailnet device, then for the Node to be Ready
    READY = "Ready"  # labelled and tainted, serving pods, watched until idle/expired/evicted
    DRAINING = "Draining"  # cordoned, pods evicted through the Eviction API
    TERMINATING = "Terminating"  # instance, tailnet device, key and Node object being removed
    TERMINATED = "Terminated"  # ended as planned (idle, expired, evicted)
    INTERRUPTED = "Interrupted"  # the provider took the instance away (preemption, host loss)
    FAILED = "Failed"  # could not bring a node up; see lastError
    CANCELLED = "Cancelled"  # the workflow was cancelled; everything bought was released

    @property
    def is_final(self) -> bool:
        return self in _FINAL_PHASES


_FINAL_PHASES = {NodePhase.TERMINATED, NodePhase.INTERRUPTED, NodePhase.FAILED, NodePhase.CANCELLED}


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
    key: str
    value: str = ""
    effect: str = Field("NoSchedule", pattern="^(NoSchedule|PreferNoSchedule|NoExecute)$")


class OfferRequirements(Model):
    """What a node needs from an offer. Empty lists mean 'any'."""

    gpu_types: list[str] = []
    regions: list[str] = []
    providers: list[str] = []
    min_gpu_count: int = 1
    max_hourly_price: Decimal | None = None
    allow_spot: bool = True


# Named defaults for the lifecycle's timeouts, each with the reason for its value.
# A GPU VM on these clouds typically reaches running in 1-5 minutes; 10 covers slow hosts.
LAUNCH_TIMEOUT = timedelta(minutes=10)
# Tailscale registration follows boot within a minute or two; longer means the payload failed.
TAILNET_JOIN_TIMEOUT = timedelta(minutes=5)
# Kubelet registration plus NVIDIA driver load and Ready: Talos/Ubuntu images take 3-8 minutes.
NODE_READY_TIMEOUT = timedelta(minutes=10)
# Long enough for a graceful pod shutdown, short enough that a stuck PDB does not keep paying.
DRAIN_TIMEOUT = timedelta(minutes=10)
# Karpenter's consolidateAfter-style grace: a node idle this long is drained and terminated.
IDLE_TIMEOUT = timedelta(minutes=10)
# How often a Ready node is looked at; each look is a timer and a short activity in history.
WATCH_INTERVAL = timedelta(seconds=30)
# A capacity error or join failure takes an offer out of rotation this long (Karpenter: 3 min).
UNAVAILABLE_OFFER_TTL = timedelta(minutes=3)
# One attempt of a short API call (create, describe, label, terminate). A worker that dies
# mid-call is noticed after this long, and the call is retried on another worker.
API_CALL_TIMEOUT = timedelta(minutes=2)
# Offers tried before a node gives up and ends Failed.
MAX_LAUNCH_ATTEMPTS = 3
# Tailnet auth keys are single-use and expire soon after the boot that should consume them.
AUTH_KEY_EXPIRY = timedelta(hours=1)


class LifecycleTimeouts(Model):
    launch: timedelta = LAUNCH_TIMEOUT
    tailnet_join: timedelta = TAILNET_JOIN_TIMEOUT
    node_ready: timedelta = NODE_READY_TIMEOUT
    drain: timedelta = DRAIN_TIMEOUT
    idle: timedelta | None = Field(IDLE_TIMEOUT, description="None: never idle out (a pool's minNodes floor).")
    watch_interval: timedelta = WATCH_INTERVAL
    api_call: timedelta = API_CALL_TIMEOUT
    expire_after: timedelta | None = Field(None, description="Replace the node after this age.")


class BootConfig(Model):
    """How a node boots, from its class: a template and references, never secret values."""

    template: str | None = Field(None, description="The class's machine config / cloud-init template; None = the provider's default.")
    join_secret: str | None = Field(None, description="namespace/name of the Secret with the cluster join material.")
    login_server: str | None = Field(None, description="Headscale URL; None for Tailscale.")
    talos_image: str = ""
    kubernetes_version: str | None = None


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
    boot: BootConfig = BootConfig()
    timeouts: LifecycleTimeouts = LifecycleTimeouts()
    max_launch_attempts: int = MAX_LAUNCH_ATTEMPTS
    unavailable_offer_ttl: timedelta = UNAVAILABLE_OFFER_TTL
    pool_workflow_id: str | None = Field(None, description="Pool workflow to report phases to.")
    class_workflow_id: str | None = Field(None, description="Class ledger that holds this node's budget.")

    @property
    def workflow_id(self) -> str:
        return node_workflow_id(self.namespace, self.pool, self.node_name)


def node_workflow_id(namespace: str, pool: str, node_name: str) -> str:
    return f"gpunode/{namespace}/{pool}/{node_name}"


def instance_name(node_name: str, attempt: int) -> str:
    """The provider-side name of a launch attempt: derived from the workflow, so a retried or
    crashed launch finds and adopts what it already bought instead of buying twice."""
    return f"tgp-{node_name}-{attempt}"


class EvictRequest(Model):
    """Input of the `evict` signal: `--input '{"reason": "manual"}'`."""

    reason: str = "manual"


class LaunchAttempt(Model):
    attempt: int
    offer: Offer
    instance_id: str | None = None
    outcome: str = ""


class NodeStatus(Model):
    """Answer of the `status` query; mirrored into the pool status by the bridge."""

    phase: NodePhase
    node_name: str
    pool: str
    provider: str | None = None
    gpu_type: str | None = None
    region: str | None = None
    instance_id: str | None = None
    hourly_price: Decimal | None = None
    stage_times: dict[str, datetime] = {}
    attempts: list[LaunchAttempt] = []
    last_error: str | None = None
    end_reason: str | None = None


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
    phase: str = "Running"
    owner_kind: str | None = None
    is_mirror: bool = False
    requests_gpu: bool = False
    deleting: bool = False


class NodeSummary(Model):
    name: str
    ready: bool
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    unschedulable: bool = False


class NodeObservation(Model):
    """One look at a Ready node during the watch stage."""

    instance: Instance | None
    node: NodeSummary | None
    busy_pods: int = Field(description="Pods that keep the node from being idle.")


class DrainResult(Model):
    evicted: int
    remaining: list[str] = Field([], description="namespace/name of pods still there at the deadline.")


class CleanupReport(Model):
    instance_terminated: bool = False
    keys_revoked: int = 0
    devices_deleted: int = 0
    node_deleted: bool = False


# --- Activity inputs and results ----------------------------------------------------------


class SelectOfferInput(Model):
    requirements: OfferRequirements
    exclude: list[str] = Field([], description="Offer keys this node already tried.")


class OfferChoice(Model):
    offer: Offer | None
    seen: int = Field(description="Offers the providers listed.")
    matching: int = Field(description="Offers that satisfy the requirements.")
    unavailable: int = Field(0, description="Matching offers skipped as recently failed or already tried.")


class LaunchInput(Model):
    node_name: str
    attempt: int
    offer: Offer
    tailnet_tags: list[str]
    tailnet: str = "tailscale"
    boot: BootConfig = BootConfig()
    pool: str = ""
    labels: dict[str, str] = {}
    taints: list[Taint] = []
    key_expiry: timedelta = AUTH_KEY_EXPIRY
    unavailable_offer_ttl: timedelta = UNAVAILABLE_OFFER_TTL


class LaunchResult(Model):
    instance: Instance
    key_id: str | None = Field(None, description="Id (never the secret) of the minted tailnet key.")
    adopted: bool = Field(False, description="An instance of this name already existed and was adopted.")


class InstanceRef(Model):
    provider: str
    instance_name: str
    instance_id: str | None = None


class DeviceQuery(Model):
    hostname: str
    tags: list[str]
    tailnet: str = "tailscale"


class LabelInput(Model):
    node_name: str
    labels: dict[str, str]
    taints: list[Taint]


class ObserveInput(Model):
    instance: InstanceRef
    node_name: str


class DrainInput(Model):
    node_name: str
    timeout: timedelta


class TailnetCleanupInput(Model):
    hostname: str
    tags: list[str]
    tailnet: str = "tailscale"
    key_ids: list[str] = []


class TailnetCleanupResult(Model):
    keys_revoked: int = 0
    devices_deleted: int = 0


class MarkUnavailableInput(Model):
    offer_key: str
    ttl: timedelta
