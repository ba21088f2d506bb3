"""GPUNodeClass and GPUNodePool (`tgp.io/v1`): the one model of each CRD.

The CRD YAML in `deploy/crds/` is generated from these models (`tgp.crdgen`), so every field's
description, default and validation lives here. Field names are camelCase on the wire, as
Kubernetes users expect; Python code uses snake_case.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import AliasGenerator, BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema
from pydantic.alias_generators import to_camel

from workflows.legacy.r31e9066.types import LABEL_GPU_TYPE, LABEL_REGION, Taint

GROUP = "tgp.io"
VERSION = "v1"
PROVIDER_NAMES = ("runpod", "lambdalabs", "paperspace", "vastai", "simulated")

_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
DURATION_PATTERN = r"^([0-9]+h)?([0-9]+m)?([0-9]+s)?$"
PRICE_PATTERN = r"^[0-9]+(\.[0-9]+)?$"


def parse_duration(value: Any) -> Any:
    """'90s', '10m', '1h30m', '720h' -> timedelta (the Go duration subset Kubernetes users write)."""
    if isinstance(value, str):
        match = _DURATION.match(value.strip())
        if not match or not value.strip():
            raise ValueError(f"{value!r} is not a duration like 90s, 10m or 1h30m")
        h, m, s = (int(g) if g else 0 for g in match.groups())
        return timedelta(hours=h, minutes=m, seconds=s)
    return value


def format_duration(value: timedelta) -> str:
    total = int(value.total_seconds())
    h, rest = divmod(total, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{n}{unit}" for n, unit in ((h, "h"), (m, "m"), (s, "s")) if n) or "0s"


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN}),
]
# Prices are decimal strings ("2.0") in YAML so that no float rounding touches money.
Price = Annotated[
    Decimal,
    BeforeValidator(lambda v: str(v) if isinstance(v, (int, float)) else v),
    PlainSerializer(lambda d: str(d), return_type=str),
    WithJsonSchema({"type": "string", "pattern": PRICE_PATTERN}),
]


class Spec(BaseModel):
    """Base of every CRD part: camelCase on the wire, unknown fields rejected in Python."""

    model_config = ConfigDict(alias_generator=AliasGenerator(alias=to_camel), populate_by_name=True, extra="ignore")


# --- GPUNodeClass ---------------------------------------------------------------------------


class SecretKeyRef(Spec):
    name: str = Field(description="Name of the Secret.", min_length=1)
    key: str = Field(description="Key inside the Secret.", min_length=1)
    namespace: str | None = Field(None, description="Namespace of the Secret; defaults to the operator's namespace.")


class ProviderSpec(Spec):
    name: Literal["runpod", "lambdalabs", "paperspace", "vastai", "simulated"] = Field(description="Cloud provider.")
    priority: int = Field(1, ge=1, le=1000, description="Tie-break between equally priced offers; 1 is preferred.")
    enabled: bool = Field(True, description="Offers from a disabled provider are never used.")
    credentials_ref: SecretKeyRef | None = Field(None, description="Secret key holding the provider's API key.")


class TalosConfig(Spec):
    image: str = Field(description="Talos installer image, e.g. ghcr.io/siderolabs/talos:v1.10.5 (or an Image Factory image with the tailscale and NVIDIA extensions).")
    machine_config_template: str = Field(
        description="Talos machine config template (Jinja2, or Go-template placeholders like {{.MachineToken}}); see docs/bootstrap.md for the variables."
    )


class TailscaleConfig(Spec):
    tags: list[str] = Field(["tag:tgp-node"], description="ACL tags for node auth keys; the OAuth client must own them (tagOwners).")
    ephemeral: bool = Field(True, description="Nodes leave the tailnet automatically once offline.")
    accept_routes: bool = Field(False, description="Pass --accept-routes to tailscale up.")
    login_server: str | None = Field(None, description="Headscale URL; unset means Tailscale's control plane.")
    oauth_secret_ref: str | None = Field(
        None, description="Secret with keys client-id and client-secret (Tailscale OAuth client) or api-key (Headscale)."
    )


class InstanceRequirements(Spec):
    gpu_types: list[str] = Field([], description="Allowed tgp.io/gpu-type values, e.g. RTX4090, A100-80GB; empty = any.")
    regions: list[str] = Field([], description="Allowed tgp.io/region values; empty = any.")
    min_gpu_count: int = Field(1, ge=1, le=16, description="GPUs per node.")
    spot_allowed: bool = Field(False, description="Allow interruptible (spot/bid) offers.")


class ClassLimits(Spec):
    max_nodes: int | None = Field(None, ge=0, description="Most nodes alive at once across every pool of this class.")
    max_hourly_cost: Price | None = Field(None, description="Most US$ per hour across every node of this class, e.g. \"50.0\".")


class GPUNodeClassSpec(Spec):
    providers: list[ProviderSpec] = Field(min_length=1, description="Providers to buy from, with credentials.")
    talos_config: TalosConfig | None = Field(None, description="Boot Talos (providers that cannot will be reported).")
    bootstrap_template: str | None = Field(
        None, description="A cloud-init / startup-script template for Ubuntu GPU VMs instead of Talos; see docs/bootstrap.md."
    )
    join_secret_ref: str | None = Field(
        None, description="Secret with the cluster join material (Talos secrets bundle or bootstrap token and CA); see docs/bootstrap.md."
    )
    tailscale_config: TailscaleConfig = Field(TailscaleConfig(), description="How nodes join the tailnet.")
    instance_requirements: InstanceRequirements = Field(InstanceRequirements(), description="What every node of this class needs.")
    limits: ClassLimits = Field(ClassLimits(), description="Budget across all pools of this class.")


# --- GPUNodePool ----------------------------------------------------------------------------


class NodeClassRef(Spec):
    kind: Literal["GPUNodeClass"] = Field("GPUNodeClass", description="Always GPUNodeClass.")
    name: str = Field(min_length=1, description="Name of the GPUNodeClass.")


class NodeSelectorRequirement(Spec):
    key: str = Field(min_length=1, description="Node label key, e.g. tgp.io/gpu-type or tgp.io/region.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How values apply.")
    values: list[str] = Field([], description="Values for In / NotIn.")


class PoolTemplateSpec(Spec):
    requirements: list[NodeSelectorRequirement] = Field([], description="Constraints on the pool's nodes (tgp.io/gpu-type, tgp.io/region).")
    taints: list[Taint] = Field([], description="Taints put on every node of the pool; pods must tolerate them.")


class PoolTemplateMetadata(Spec):
    labels: dict[str, str] = Field({}, description="Labels put on every node of the pool.")


class PoolTemplate(Spec):
    metadata: PoolTemplateMetadata = Field(PoolTemplateMetadata(), description="Node metadata.")
    spec: PoolTemplateSpec = Field(PoolTemplateSpec(), description="Node constraints and taints.")


class Disruption(Spec):
    idle_timeout: Duration = Field(timedelta(minutes=10), description="Drain and terminate a node with no workload pods for this long.")
    expire_after: Duration | None = Field(None, description="Replace nodes older than this (e.g. 720h); unset = never.")
    drain_timeout: Duration = Field(timedelta(minutes=10), description="Give up waiting for evictions after this and terminate anyway.")


class GPUNodePoolSpec(Spec):
    node_class_ref: NodeClassRef = Field(description="The GPUNodeClass that supplies providers, boot config and budget.")
    template: PoolTemplate = Field(PoolTemplate(), description="What the pool's nodes look like.")
    max_hourly_price: Price | None = Field(None, description="Most US$ per hour for one node, e.g. \"2.0\".")
    weight: int = Field(0, ge=0, le=100, description="Among pools that fit a pod, the highest weight gets it.")
    min_nodes: int = Field(0, ge=0, description="Nodes kept even without demand.")
    max_nodes: int | None = Field(None, ge=0, description="Most nodes of this pool at once.")
    disruption: Disruption = Field(Disruption(), description="When nodes are drained and terminated.")

    def allowed(self, key: str) -> list[str] | None:
        """Values an `In` requirement on `key` allows (None = unconstrained)."""
        allowed: list[str] | None = None
        for r in self.template.spec.requirements:
            if r.key == key and r.operator == "In":
                allowed = [v for v in r.values if allowed is None or v in allowed]
        return allowed

    def excluded(self, key: str) -> set[str]:
        return {v for r in self.template.spec.requirements if r.key == key and r.operator == "NotIn" for v in r.values}

    @property
    def gpu_types(self) -> list[str] | None:
        return self.allowed(LABEL_GPU_TYPE)

    @property
    def regions(self) -> list[str] | None:
        return self.allowed(LABEL_REGION)


# --- Status -----------------------------------------------------------------------------------


class Condition(Spec):
    type: str = Field(description="Ready, ClassReady, BudgetAvailable, ...")
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase machine-readable reason.")
    message: str = Field("", description="What happened and what to fix.")
    last_transition_time: datetime | None = None
    observed_generation: int | None = None


class PoolNodeStatus(Spec):
    name: str
    phase: str
    provider: str | None = None
    gpu_type: str | None = None
    hourly_price: Price | None = None
    created_at: datetime | None = None
    workflow_id: str = ""


class GPUNodePoolStatus(Spec):
    observed_generation: int | None = None
    conditions: list[Condition] = []
    ready_nodes: int = 0
    desired_nodes: int = 0
    hourly_cost: Price = Decimal("0")
    nodes: list[PoolNodeStatus] = []


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


class GPUNodeClass(BaseModel):
    """Cluster-scoped infrastructure template: providers, boot config, tailnet, budget."""

    model_config = ConfigDict(extra="ignore")
    apiVersion: Literal["tgp.io/v1"] = "tgp.io/v1"
    kind: Literal["GPUNodeClass"] = "GPUNodeClass"
    metadata: ObjectMeta
    spec: GPUNodeClassSpec
    status: GPUNodeClassStatus | None = None


class GPUNodePool(BaseModel):
    """Namespaced provisioning request: which nodes, how many, at what price."""

    model_config = ConfigDict(extra="ignore")
    apiVersion: Literal["tgp.io/v1"] = "tgp.io/v1"
    kind: Literal["GPUNodePool"] = "GPUNodePool"
    metadata: ObjectMeta
    spec: GPUNodePoolSpec
    status: GPUNodePoolStatus | None = None
