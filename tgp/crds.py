"""GPUNodeClass and GPUNodePool (`tgp.io/v1`): the one model of each CRD.

The CRD YAML in `deploy/crds/` is generated from these models (`workers.crdgen`), so every field's
description, default and validation lives here. Field names are camelCase on the wire, as
Kubernetes users expect; Python code uses snake_case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    AliasGenerator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from tgp.cron import MAX_SCHEDULE_LENGTH, SCHEDULE_MESSAGE, SCHEDULE_PATTERN, schedule_problems
from tgp.labels import (
    DNS_SUBDOMAIN_MAX_LENGTH,
    LABEL_VALUE_MAX_LENGTH,
    LABEL_VALUE_PATTERN,
    QUALIFIED_NAME_MAX_LENGTH,
    TENANT_LABEL_KEY_MESSAGE,
    TENANT_LABEL_KEY_RULE,
    label_problems,
    taint_problems,
)
from tgp.types import LABEL_GPU_TYPE, LABEL_REGION, NodeOverview, Taint

GROUP = "tgp.io"
VERSION = "v1"
# On every GPUNodePool: Kubernetes deletes the pool only once its nodes are terminated.
FINALIZER = "tgp.io/nodes-terminated"

_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
# One duration convention everywhere (schema, defaults, docs, Python): Kubernetes/Go style
# `90s`, `10m`, `1h30m`, with at least one component, so `""` is refused by the API server and
# not silently dropped later. RE2 has no lookahead, hence the alternation.
DURATION_PATTERN = r"^([0-9]+h([0-9]+m)?([0-9]+s)?|[0-9]+m([0-9]+s)?|[0-9]+s)$"
PRICE_PATTERN = r"^[0-9]+(\.[0-9]+)?$"

# Bounds that keep a typo from buying without end (a `minNodes: 1000000000` once did). The API
# server refuses larger values (422 naming the field); ask for more in several pools or classes.
MAX_MIN_NODES = 100  # a pool's floor: nodes kept (and paid for) even without demand
MAX_NODES = 1000  # a pool's or a class's maxNodes
# limits.maxHourlyCost below 10^5 US$/h (about 3000 top-end GPU nodes): the pattern allows at
# most 5 integer digits, since a decimal string cannot carry a schema `maximum`.
MAX_HOURLY_COST_DIGITS = 5
HOURLY_COST_LIMIT_PATTERN = rf"^[0-9]{{1,{MAX_HOURLY_COST_DIGITS}}}(\.[0-9]+)?$"
# A class that gives no limits.maxNodes still caps its nodes here, so a pool's typo or a demand
# storm buys at most this many; a class that needs more says so explicitly (up to MAX_NODES).
DEFAULT_CLASS_MAX_NODES = 10

# Durations that would churn buy -> terminate, or hold a node hostage: a node idle for less than
# MIN_IDLE_TIMEOUT is often only waiting for its GPU device plugin or the scheduler; expiring it
# sooner than MIN_EXPIRE_AFTER replaces it about as fast as it boots; a drain longer than
# MAX_DRAIN_TIMEOUT keeps paying for a node that is leaving. A pattern cannot express these and
# CEL rules are not checked by every API server tgp supports, so the bridge checks them at
# admission (`DisruptionBounds`) and reports a refused pool as a condition and a Warning Event.
MIN_IDLE_TIMEOUT = timedelta(seconds=30)
MIN_EXPIRE_AFTER = timedelta(minutes=10)
MAX_DRAIN_TIMEOUT = timedelta(hours=24)

# Tenant input that reaches boot payloads and Nodes, bounded in the schema. Label values and
# taints are checked by the API server (pattern, maxLength, enum); label *keys* cannot be: a
# structural schema has no propertyNames, and CEL is not checked by every API server tgp
# supports. The bridge checks keys, and refuses tgp's own and role prefixes, at admission
# (tgp/labels.py), reporting a refused pool like a churning one. Like the disruption bounds,
# these are checked at admission and by the API server, not on every decode: a spec admitted
# before them and carried in a workflow message must still decode.
MAX_POOL_LABELS = 64
MAX_POOL_TAINTS = 32
# A pool's spec is carried in its workflow's state and quoted in its status (Temporal refuses a
# payload over 2 MiB): every list and string a tenant writes in it is bounded, so the largest spec
# the schema allows stays far below that (a 508 kB requirement list once made a 1 MB status and
# a refused continue-as-new). Karpenter bounds a NodePool's requirements at 100; tgp's nodes know
# a handful of keys (tgp.io/gpu-type, tgp.io/region, tgp.io/provider, the template's labels).
MAX_POOL_REQUIREMENTS = 16
MAX_REQUIREMENT_VALUES = 64  # per requirement; a value is a label value (63 characters)
MAX_CLASS_LIST = 64  # a class's gpuTypes and regions
MAX_SCALAR_LENGTH = 32  # durations and prices ("1h30m", "2.50")
# A class's boot template; provider user data is smaller still (Lambda: 1 MB, most: 16-64 KiB).
MAX_TEMPLATE_LENGTH = 256 * 1024
# A class's spec is carried in its own workflow's state and in each of its pools' (PoolUpdate.
# node_class): every other list and string of it is bounded too, at what real use needs, so its
# templates are nearly all a class can weigh (tests/test_spec_bounds.py adds up the worst case).
MAX_CLASS_PROVIDERS = 16  # five providers, each perhaps with a few accounts
MAX_TAILSCALE_TAGS = 32
MAX_TAG_LENGTH = 4 + LABEL_VALUE_MAX_LENGTH  # "tag:" and a name
MAX_SECRET_KEY_LENGTH = DNS_SUBDOMAIN_MAX_LENGTH  # a Secret's data key (Kubernetes: 253)
MAX_IMAGE_LENGTH = 1024  # an image reference: registry, repository, tag and digest


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


def _below_cost_limit(value: Decimal) -> Decimal:
    if value >= 10**MAX_HOURLY_COST_DIGITS:
        raise ValueError(f"must be below {10**MAX_HOURLY_COST_DIGITS} US$/h")
    return value


def _default_max_nodes(value: Any) -> Any:
    """No maxNodes (null, as ledgers written before the default cap carry it) is the default cap."""
    return DEFAULT_CLASS_MAX_NODES if value is None else value


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]
# Prices are decimal strings ("2.0") in YAML so that no float rounding touches money.
Price = Annotated[
    Decimal,
    BeforeValidator(lambda v: str(v) if isinstance(v, (int, float)) else v),
    PlainSerializer(lambda d: str(d), return_type=str),
    WithJsonSchema({"type": "string", "pattern": PRICE_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]
HourlyCostLimit = Annotated[
    Price,
    AfterValidator(_below_cost_limit),
    WithJsonSchema({"type": "string", "pattern": HOURLY_COST_LIMIT_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]


@dataclass(frozen=True)
class DisruptionBounds:
    """The disruption durations the bridge admits (see MIN_IDLE_TIMEOUT). Tests that need
    nodes to idle out within seconds pass smaller ones to their bridge."""

    min_idle_timeout: timedelta = MIN_IDLE_TIMEOUT
    min_expire_after: timedelta = MIN_EXPIRE_AFTER
    max_drain_timeout: timedelta = MAX_DRAIN_TIMEOUT


# Validation-context key holding the DisruptionBounds to enforce. Only admission (the bridge)
# sets it: a spec already admitted and carried in a workflow message must always decode, even
# after the bounds changed.
ADMISSION = "tgp.admission"


def _at_least(value: timedelta, minimum: timedelta, why: str) -> None:
    """An admission bound on a duration: below `minimum`, an error saying the minimum and `why`."""
    if value < minimum:
        raise ValueError(f"{format_duration(value)} is below the minimum of {format_duration(minimum)}: {why}")


def _admission_bounds(info: ValidationInfo) -> DisruptionBounds | None:
    bounds = info.context.get(ADMISSION) if isinstance(info.context, dict) else None
    return bounds if isinstance(bounds, DisruptionBounds) else None


# A pool's nodes are named `<pool>-<5 hex>`, and a Node's name is its `kubernetes.io/hostname`
# label, a label value of at most 63 characters: a longer pool name passes the API server's
# own name rule but no node of it could ever register. In the CRD (a CEL rule on the root) and
# at admission.
MAX_POOL_NAME_LENGTH = 57
POOL_NAME_RULE = f"self.metadata.name.size() <= {MAX_POOL_NAME_LENGTH}"
POOL_NAME_MESSAGE = (
    f"a GPUNodePool's name may be at most {MAX_POOL_NAME_LENGTH} characters: its nodes are named <pool>-<5 characters>, "
    "and a Node's name is its kubernetes.io/hostname label (at most 63)"
)

# A Headscale login server: what `tailscale up --login-server` and tgp's Headscale adapter take.
# In the schema (RE2); `login_server_problems` says what is wrong in words.
LOGIN_SERVER_MAX_LENGTH = 2048
LOGIN_SERVER_PATTERN = (
    r"^https?://([A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]*[A-Za-z0-9])?)*|\[[0-9A-Fa-f:.]+\])"
    r"(:[0-9]{1,5})?(/[-A-Za-z0-9._~%/]*)?$"
)


def login_server_problems(url: str) -> list[str]:
    """What is wrong with `url` as a Headscale login server; empty when it is fine (the same
    verdict as LOGIN_SERVER_PATTERN and LOGIN_SERVER_MAX_LENGTH, in words)."""
    shown = repr(url[:80])
    if len(url) > LOGIN_SERVER_MAX_LENGTH:
        return [f"must be at most {LOGIN_SERVER_MAX_LENGTH} characters"]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return [f"{shown} is not a URL: its host or port cannot be read"]
    if parts.scheme not in ("http", "https") or not url.startswith(f"{parts.scheme}://"):
        return [f"{shown} must start with https:// (or http://)"]
    if "@" in parts.netloc:
        return [f"{shown} must not carry a user or password"]
    if "?" in url or "#" in url:
        return [f"{shown} must not have a query or fragment"]
    if port == 0 or not re.fullmatch(LOGIN_SERVER_PATTERN[1:-1], url):
        return [f"{shown} is not a URL of the form https://host[:port][/path]"]
    return []


def _admitting(info: ValidationInfo) -> bool:
    return isinstance(info.context, dict) and ADMISSION in info.context


class Spec(BaseModel):
    """Base of every CRD part: camelCase on the wire, unknown fields rejected in Python."""

    model_config = ConfigDict(alias_generator=AliasGenerator(alias=to_camel), populate_by_name=True, extra="forbid")


# --- GPUNodeClass ---------------------------------------------------------------------------


# The class's bounds are the schema's (the API server's) and the bridge's admission
# (`class_problems`), not every decode: a spec admitted before them and carried in a workflow
# message must still decode.
def _max_length(n: int) -> dict[str, Any]:
    return {"maxLength": n}


class SecretKeyRef(Spec):
    name: str = Field(description="Name of the Secret.", min_length=1, json_schema_extra=_max_length(DNS_SUBDOMAIN_MAX_LENGTH))
    key: str = Field(description="Key inside the Secret.", min_length=1, json_schema_extra=_max_length(MAX_SECRET_KEY_LENGTH))
    namespace: str | None = Field(
        None, description="Namespace of the Secret; defaults to the operator's namespace.", json_schema_extra=_max_length(LABEL_VALUE_MAX_LENGTH)
    )


class ProviderSpec(Spec):
    name: Literal["runpod", "lambdalabs", "paperspace", "vastai", "simulated"] = Field(description="Cloud provider.")
    priority: int = Field(1, ge=1, le=1000, description="Tie-break between equally priced offers; 1 is preferred.")
    enabled: bool = Field(True, description="Offers from a disabled provider are never used.")
    credentials_ref: SecretKeyRef | None = Field(
        None,
        description="Secret key holding the provider's API key: this class's nodes are bought (and billed) with it, read when "
        "used, so a rotated key is picked up. Unset = the worker's own key (its environment, e.g. RUNPOD_API_KEY).",
    )


class TalosConfig(Spec):
    image: str = Field(json_schema_extra=_max_length(MAX_IMAGE_LENGTH), description="Talos installer image, e.g. ghcr.io/siderolabs/talos:v1.10.5 (or an Image Factory image with the tailscale and NVIDIA extensions).")
    machine_config_template: str = Field(
        json_schema_extra={"maxLength": MAX_TEMPLATE_LENGTH},  # checked again by check_template
        description="Talos machine config template (Jinja2, or Go-template placeholders like {{.MachineToken}}); see docs/bootstrap.md "
        f"for the variables. At most {MAX_TEMPLATE_LENGTH // 1024} KiB (UTF-8, with bootstrapTemplate); it must render within the bounds in docs/bootstrap.md.",
    )


class TailscaleConfig(Spec):
    tags: list[Annotated[str, Field(pattern=r"^tag:[A-Za-z0-9][A-Za-z0-9-]*$", json_schema_extra=_max_length(MAX_TAG_LENGTH))]] = Field(
        ["tag:tgp-node"],
        min_length=1,
        json_schema_extra={"maxItems": MAX_TAILSCALE_TAGS},
        description="ACL tags for node auth keys, at least one (untagged nodes would belong to the OAuth client's owner); "
        f"the OAuth client must own them (tagOwners). At most {MAX_TAILSCALE_TAGS}, each tag: and up to {LABEL_VALUE_MAX_LENGTH} characters.",
    )
    ephemeral: bool = Field(
        True, description="Auth keys register ephemeral devices: nodes leave the tailnet automatically once offline."
    )
    accept_routes: bool = Field(
        False, description="Pass --accept-routes to tailscale up (the TailscaleAcceptRoutes template variable; the shipped templates honour it)."
    )
    login_server: str | None = Field(
        None,
        description="Headscale URL (http:// or https://, a host, an optional port and path; no user, query or fragment); "
        "unset means Tailscale's control plane. The worker needs Headscale credentials for it (HEADSCALE_URL/HEADSCALE_API_KEY) "
        "unless oauthSecretRef gives the class its own; a class whose nodes could join no tailnet is not Ready. With "
        "oauthSecretRef, it must be the server that Secret's login-server key names, and not an internal address (loopback, "
        "private, link-local, a cluster name) unless the worker sets TGP_TAILNET_ALLOW_INTERNAL=true.",
        json_schema_extra={"maxLength": LOGIN_SERVER_MAX_LENGTH, "pattern": LOGIN_SERVER_PATTERN},
    )
    oauth_secret_ref: str | None = Field(
        None,
        json_schema_extra=_max_length(DNS_SUBDOMAIN_MAX_LENGTH),
        description="Secret in the operator's namespace with keys client-id and client-secret (Tailscale OAuth client) or "
        "api-key and login-server (Headscale: the key is sent only to the server login-server names, which must be loginServer): "
        "this class's nodes join with it, read when used, so a rotated credential is picked up. Not one of tgp's own Secrets "
        "(named tgp-...). Unset = the worker's own tailnet credentials.",
    )


class InstanceRequirements(Spec):
    gpu_types: list[str] = Field(
        [],
        json_schema_extra={"maxItems": MAX_CLASS_LIST, "items": {"type": "string", "maxLength": LABEL_VALUE_MAX_LENGTH}},
        description=f"Allowed tgp.io/gpu-type values, e.g. RTX4090, A100-80GB; empty = any. At most {MAX_CLASS_LIST}.",
    )
    regions: list[str] = Field(
        [],
        json_schema_extra={"maxItems": MAX_CLASS_LIST, "items": {"type": "string", "maxLength": LABEL_VALUE_MAX_LENGTH}},
        description=f"Allowed tgp.io/region values; empty = any. At most {MAX_CLASS_LIST}.",
    )
    min_gpu_count: int = Field(1, ge=1, le=16, description="GPUs per node.")
    spot_allowed: bool = Field(False, description="Allow interruptible (spot/bid) offers.")


class ClassLimits(Spec):
    max_nodes: Annotated[int, BeforeValidator(_default_max_nodes)] = Field(
        DEFAULT_CLASS_MAX_NODES,
        ge=0,
        le=MAX_NODES,
        description=f"Most nodes alive at once across every pool of this class; at most {MAX_NODES}. "
        f"Unset means {DEFAULT_CLASS_MAX_NODES}, so that a typo in a pool cannot buy without end.",
    )
    max_hourly_cost: HourlyCostLimit | None = Field(
        None,
        description=f"Most US$ per hour across every node of this class, e.g. \"50.0\"; below {10**MAX_HOURLY_COST_DIGITS}. "
        "Unset = only maxNodes bounds the spend.",
    )


KUBERNETES_VERSION_PATTERN = r"^v?[0-9]+\.[0-9]+\.[0-9]+$"


class GPUNodeClassSpec(Spec):
    providers: list[ProviderSpec] = Field(
        min_length=1,
        json_schema_extra={"maxItems": MAX_CLASS_PROVIDERS},
        description=f"Providers to buy from, with credentials; at most {MAX_CLASS_PROVIDERS}.",
    )
    kubernetes_version: str | None = Field(
        None,
        pattern=KUBERNETES_VERSION_PATTERN,
        json_schema_extra=_max_length(MAX_SCALAR_LENGTH),
        description="Kubelet version x.y.z (e.g. 1.34.1), matching the control plane: the KubernetesVersion template "
        "variable. The default Ubuntu cloud-init template (providers booting cloud-init without a bootstrapTemplate) needs it.",
    )
    talos_config: TalosConfig | None = Field(None, description="Boot Talos (providers that cannot will be reported).")
    bootstrap_template: str | None = Field(
        None,
        json_schema_extra={"maxLength": MAX_TEMPLATE_LENGTH},  # checked again by check_template
        description="A cloud-init / startup-script template for Ubuntu GPU VMs instead of Talos; see docs/bootstrap.md. "
        f"At most {MAX_TEMPLATE_LENGTH // 1024} KiB (UTF-8, with talosConfig.machineConfigTemplate); it must render within the "
        "bounds in docs/bootstrap.md, to what each "
        "provider boots: for cloud-init a first line #cloud-config (or #! for a script, or another cloud-init format), for a "
        "startup script or onstart #! (e.g. #!/bin/bash), for an env payload KEY=VALUE lines; else the class is not Ready.",
    )
    join_secret_ref: str | None = Field(
        None,
        json_schema_extra=_max_length(DNS_SUBDOMAIN_MAX_LENGTH),
        description="Secret with the cluster join material (Talos secrets bundle or bootstrap token and CA); see docs/bootstrap.md."
    )
    tailscale_config: TailscaleConfig = Field(TailscaleConfig(), description="How nodes join the tailnet.")
    instance_requirements: InstanceRequirements = Field(InstanceRequirements(), description="What every node of this class needs.")
    limits: ClassLimits = Field(ClassLimits(), description="Budget across all pools of this class.")


# --- GPUNodePool ----------------------------------------------------------------------------


class NodeClassRef(Spec):
    kind: Literal["GPUNodeClass"] = Field("GPUNodeClass", description="Always GPUNodeClass.")
    name: str = Field(min_length=1, json_schema_extra={"maxLength": DNS_SUBDOMAIN_MAX_LENGTH}, description="Name of the GPUNodeClass.")


class NodeSelectorRequirement(Spec):
    # The bounds are the schema's (the API server's) and the bridge's admission, not every decode:
    # demand builds these from pods' node selectors too, which the API server bounds itself.
    key: str = Field(
        min_length=1, json_schema_extra={"maxLength": QUALIFIED_NAME_MAX_LENGTH}, description="Node label key, e.g. tgp.io/gpu-type or tgp.io/region."
    )
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(description="How values apply.")
    values: list[str] = Field(
        [],
        json_schema_extra={"maxItems": MAX_REQUIREMENT_VALUES, "items": {"type": "string", "maxLength": LABEL_VALUE_MAX_LENGTH}},
        description=f"Values for In / NotIn: at most {MAX_REQUIREMENT_VALUES}, each a label value (up to 63 characters).",
    )


def requirement_problems(requirements: list[NodeSelectorRequirement]) -> list[str]:
    """What a pool's requirements break of the schema's bounds (the bridge's admission)."""
    problems = [f"{len(requirements)} requirements; at most {MAX_POOL_REQUIREMENTS}"] if len(requirements) > MAX_POOL_REQUIREMENTS else []
    for i, r in enumerate(requirements):
        if len(r.key) > QUALIFIED_NAME_MAX_LENGTH:
            problems.append(f"requirements[{i}].key is {len(r.key)} characters; at most {QUALIFIED_NAME_MAX_LENGTH}")
        if len(r.values) > MAX_REQUIREMENT_VALUES:
            problems.append(f"requirements[{i}] has {len(r.values)} values; at most {MAX_REQUIREMENT_VALUES}")
        if any(len(v) > LABEL_VALUE_MAX_LENGTH for v in r.values):
            problems.append(f"requirements[{i}] has a value over {LABEL_VALUE_MAX_LENGTH} characters")
    return problems


class PoolTemplateSpec(Spec):
    requirements: list[NodeSelectorRequirement] = Field(
        [],
        json_schema_extra={"maxItems": MAX_POOL_REQUIREMENTS},
        description=f"Constraints on the pool's nodes (tgp.io/gpu-type, tgp.io/region); at most {MAX_POOL_REQUIREMENTS}.",
    )

    @field_validator("requirements")
    @classmethod
    def _bounded_requirements(cls, value: list[NodeSelectorRequirement], info: ValidationInfo) -> list[NodeSelectorRequirement]:
        if _admitting(info) and (problems := requirement_problems(value)):
            raise ValueError("; ".join(problems))
        return value

    taints: list[Taint] = Field(
        [],
        json_schema_extra={"maxItems": MAX_POOL_TAINTS},
        description=f"Taints put on every node of the pool (at registration); pods must tolerate them. A change is applied to running "
        "nodes in place (taints tgp set that are no longer listed are removed; others' are kept). At most {MAX_POOL_TAINTS}; "
        "keys and values in Kubernetes label syntax, keys not under tgp.io/ or node-role.kubernetes.io/.",
    )

    @field_validator("taints")
    @classmethod
    def _tenant_taints(cls, value: list[Taint], info: ValidationInfo) -> list[Taint]:
        if _admitting(info):
            problems = taint_problems([t.model_dump() for t in value], tenant=True)
            if len(value) > MAX_POOL_TAINTS:
                problems.append(f"{len(value)} taints; at most {MAX_POOL_TAINTS}")
            if problems:
                raise ValueError("; ".join(problems))
        return value


class PoolTemplateMetadata(Spec):
    labels: dict[str, str] = Field(
        {},
        description=f"Labels put on every node of the pool (also passed to the kubelet at registration); a change is applied to "
        "running nodes in place (labels tgp set that are no longer listed are removed; the user's own are kept). At most {MAX_POOL_LABELS}. "
        "Keys are Kubernetes qualified names (optional DNS-subdomain prefix and '/', then up to 63 of A-Z a-z 0-9 - _ .) and "
        "may not be under tgp.io/ (tgp's own labels always win), the GPU-discovery namespaces nvidia.com/ and "
        "feature.node.kubernetes.io/ (what the node reports about its GPUs), or the kubernetes.io and k8s.io namespaces "
        "(a Node's identity, topology and role: kubernetes.io/hostname, topology.kubernetes.io/zone, "
        "node-role.kubernetes.io/...), except node.kubernetes.io/ and kubelet.kubernetes.io/ keys other than "
        "node.kubernetes.io/instance-type. The API server refuses such keys at apply (422) and the bridge refuses such a "
        "pool (Ready=False, InvalidSpec). Values: empty or up to 63 of A-Z a-z 0-9 - _ . (alphanumeric at both ends).",
        json_schema_extra={
            "maxProperties": MAX_POOL_LABELS,
            "additionalProperties": {"type": "string", "maxLength": LABEL_VALUE_MAX_LENGTH, "pattern": LABEL_VALUE_PATTERN},
            "x-kubernetes-validations": [{"rule": TENANT_LABEL_KEY_RULE, "message": TENANT_LABEL_KEY_MESSAGE}],
        },
    )

    @field_validator("labels")
    @classmethod
    def _tenant_labels(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        if _admitting(info):
            problems = label_problems(value, tenant=True)
            if len(value) > MAX_POOL_LABELS:
                problems.append(f"{len(value)} labels; at most {MAX_POOL_LABELS}")
            if problems:
                raise ValueError("; ".join(problems))
        return value


class PoolTemplate(Spec):
    metadata: PoolTemplateMetadata = Field(PoolTemplateMetadata(), description="Node metadata.")
    spec: PoolTemplateSpec = Field(PoolTemplateSpec(), description="Node constraints and taints.")


# --- Disruption budgets, consolidation, termination grace (issue 21) ---------------------------

# Karpenter's reasons (Empty, Drifted, Underutilized) plus tgp's: Expired waits for the budget
# here (as in Karpenter before v1), Cheaper is a re-shop to a cheaper offer.
BUDGET_REASONS = ("Empty", "Expired", "Drifted", "Underutilized", "Cheaper")
BudgetReason = Literal["Empty", "Expired", "Drifted", "Underutilized", "Cheaper"]
MAX_BUDGETS = 50
# A budget's window is at most a year: a budget active for longer needs no schedule, and the
# check walks the window's days. Checked by the model (the bridge), as a pattern cannot bound it.
MAX_BUDGET_DURATION = timedelta(days=366)
BUDGET_NODES_PATTERN = r"^((100|[0-9]{1,2})%|[0-9]{1,4})$"
BUDGET_NODES_MESSAGE = (
    "nodes must be a count of nodes from 0 to 9999 (e.g. 2; 0 blocks) or a percentage of the pool's nodes from 0% "
    "to 100%, rounded up (e.g. 10%)"
)
BUDGET_WINDOW_RULE = "has(self.schedule) == has(self.duration)"
BUDGET_WINDOW_MESSAGE = (
    "schedule and duration go together: give both (the budget is active for duration from each time the schedule "
    "fires) or neither (always active)"
)
CHEAPER_BY_PATTERN = r"^[1-9][0-9]?%$"
CHEAPER_BY_MESSAGE = "cheaperBy must be a percentage from 1% to 99% (e.g. 20%): how much cheaper the best offer must be"


def _cel_matches(pattern: str, message: str) -> dict[str, str]:
    quoted = pattern.replace("\\", "\\\\").replace("'", "\\'")
    return {"rule": f"self.matches('{quoted}')", "message": message}


def _check_pattern(value: str, pattern: str, message: str) -> str:
    if re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is None:
        raise ValueError(f"{value[:40]!r}: {message}")
    return value


def _check_schedule(value: str | None) -> str | None:
    if value is not None and (problems := schedule_problems(value)):
        raise ValueError(problems[0])
    return value


BudgetNodes = Annotated[
    str,
    BeforeValidator(lambda v: str(v) if isinstance(v, int) and not isinstance(v, bool) else v),
    AfterValidator(lambda v: _check_pattern(v, BUDGET_NODES_PATTERN, BUDGET_NODES_MESSAGE)),
    WithJsonSchema(
        {"type": "string", "maxLength": 5, "x-kubernetes-validations": [_cel_matches(BUDGET_NODES_PATTERN, BUDGET_NODES_MESSAGE)]}
    ),
]
# Optional strings and durations written without `nullable`: a null the API server drops, so a
# CEL `has()` sees an absent field, never a present null.
Schedule = Annotated[
    str | None,
    AfterValidator(_check_schedule),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": MAX_SCHEDULE_LENGTH,
            "x-kubernetes-validations": [_cel_matches(SCHEDULE_PATTERN, SCHEDULE_MESSAGE)],
        }
    ),
]
OptionalDuration = Annotated[Duration | None, WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN, "maxLength": MAX_SCALAR_LENGTH})]
# Karpenter writes "Never" where a duration may be switched off (expireAfter, consolidateAfter):
# its manifests apply unchanged. "Never" is kept as written, so the spec reads back the same.
NEVER = "Never"
NEVER_OR_DURATION_PATTERN = f"^({DURATION_PATTERN[1:-1]}|{NEVER})$"


def _never_or_duration(value: Any) -> Any:
    return value if value == NEVER else parse_duration(value)


NeverOrDuration = Annotated[
    timedelta | Literal["Never"] | None,
    BeforeValidator(_never_or_duration),
    PlainSerializer(lambda v: v if v is None or v == NEVER else format_duration(v), return_type=str | None),
    WithJsonSchema({"type": "string", "pattern": NEVER_OR_DURATION_PATTERN, "maxLength": MAX_SCALAR_LENGTH}),
]


class DisruptionBudget(Spec):
    """How many of the pool's nodes tgp may disrupt at once, when, and for which reasons."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{"rule": BUDGET_WINDOW_RULE, "message": BUDGET_WINDOW_MESSAGE}]})

    nodes: BudgetNodes = Field(
        "10%",
        description="How many of the pool's nodes may be disrupting at once: a count (\"2\"; \"0\" blocks every disruption "
        "this budget covers) or a percentage of the pool's nodes (\"10%\", rounded up: 10% of 3 nodes is 1). Nodes "
        "already disrupting count against it.",
    )
    schedule: Schedule = Field(
        None,
        description="When the budget becomes active: a cron expression in UTC (\"0 9 * * mon-fri\"; minute hour "
        "day-of-month month day-of-week) or @yearly, @monthly, @weekly, @daily, @hourly. Needs duration. Unset = always active.",
    )
    duration: OptionalDuration = Field(
        None,
        description=f"How long the budget stays active each time its schedule fires, e.g. 8h; at most {format_duration(MAX_BUDGET_DURATION)} "
        "(the bridge refuses more). Needs schedule.",
    )
    reasons: list[BudgetReason] | None = Field(
        None,
        min_length=1,
        max_length=len(BUDGET_REASONS),
        description="The disruptions this budget limits: Empty (idle), Expired, Drifted, Underutilized, Cheaper (a re-shop "
        "to a cheaper offer). Unset = all of them. A manual evict, an interruption and a lost node are never limited.",
    )

    @model_validator(mode="after")
    def _window_needs_both(self) -> DisruptionBudget:
        if (self.schedule is None) != (self.duration is None):
            raise ValueError(BUDGET_WINDOW_MESSAGE)
        if self.duration is not None and self.duration > MAX_BUDGET_DURATION:
            raise ValueError(
                f"duration {format_duration(self.duration)} is longer than {format_duration(MAX_BUDGET_DURATION)}: "
                "a budget active for longer needs no schedule"
            )
        return self

    def describe(self) -> str:
        """The budget as a user wrote it, for messages and Events: `nodes: 0, schedule '0 9 * * mon-fri' for 8h, reasons Drifted`."""
        parts = [f"nodes: {self.nodes}"]
        if self.schedule is not None and self.duration is not None:
            parts.append(f"schedule '{self.schedule}' for {format_duration(self.duration)}")
        if self.reasons is not None:
            parts.append(f"reasons {', '.join(self.reasons)}")
        return ", ".join(parts)


class Consolidation(Spec):
    """Re-shopping: replace a node by a cheaper current offer that fits its pods."""

    cheaper_by: Annotated[
        str,
        AfterValidator(lambda v: _check_pattern(v, CHEAPER_BY_PATTERN, CHEAPER_BY_MESSAGE)),
        WithJsonSchema({"type": "string", "maxLength": 4, "x-kubernetes-validations": [_cel_matches(CHEAPER_BY_PATTERN, CHEAPER_BY_MESSAGE)]}),
    ] = Field(
        "20%",
        description="Replace a node when the best current offer that fits its pods costs at least this much less per hour "
        "than the node's own offer, as a percentage of the node's price (\"20%\": $1.00/h is replaced by $0.80/h or less).",
    )
    after: Duration = Field(
        timedelta(minutes=30),
        description="Re-shop a node only once the cheaper offer has lasted this long (so never a node that has run for less), "
        "e.g. 30m: a replacement costs a boot and a drain, and a price that dips for minutes is not worth one. The replacement "
        "is bought and Ready before the node drains (make-before-break), within the disruption budgets; a node a "
        "do-not-disrupt pod or Node holds is never re-shopped.",
    )
    policy: Literal["WhenEmpty", "WhenEmptyOrUnderutilized"] = Field(
        "WhenEmptyOrUnderutilized",
        description="Karpenter's consolidationPolicy. WhenEmptyOrUnderutilized: also remove a node whose pods fit on the "
        "free GPUs of the pool's other Ready nodes (GPUs are whole-node: a pod's GPUs all sit on one node), once it has "
        "run `after`. WhenEmpty: never remove a node that runs pods (empty nodes go by idleTimeout); re-shopping "
        "(cheaperBy) works with either.",
    )


class Disruption(Spec):
    idle_timeout: Duration = Field(
        timedelta(minutes=10),
        description=f"Drain and terminate a node with no workload pods for this long, e.g. 10m; at least {format_duration(MIN_IDLE_TIMEOUT)} (the bridge refuses less).",
    )
    expire_after: NeverOrDuration = Field(
        None,
        description=f"Replace nodes older than this, e.g. 720h; at least {format_duration(MIN_EXPIRE_AFTER)} (the bridge refuses less); "
        "unset or Never (Karpenter's spelling) = never.",
    )
    consolidate_after: NeverOrDuration = Field(
        None,
        description="Karpenter's consolidateAfter, so its manifests apply unchanged. Never: tgp never disrupts a node of this "
        "pool for being empty or underutilized, nor re-shops it (consolidation and idleTimeout are off). A duration: how long "
        f"a node must be empty before it goes, in place of idleTimeout (at least {format_duration(MIN_IDLE_TIMEOUT)}, the bridge "
        "refuses less); underutilized nodes and re-shops keep consolidation.after. Unset: idleTimeout and consolidation as given.",
    )
    drain_timeout: Duration = Field(
        timedelta(minutes=10),
        description=f"Give up waiting for evictions after this and terminate anyway, e.g. 10m; at most {format_duration(MAX_DRAIN_TIMEOUT)} (the bridge refuses more).",
    )

    @field_validator("idle_timeout")
    @classmethod
    def _idle_timeout_bound(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        bounds = _admission_bounds(info)
        if bounds is not None:
            _at_least(value, bounds.min_idle_timeout, "nodes would be terminated before pods reach them, then bought again")
        return value

    @field_validator("expire_after")
    @classmethod
    def _expire_after_bound(cls, value: timedelta | str | None, info: ValidationInfo) -> timedelta | str | None:
        bounds = _admission_bounds(info)
        if bounds is not None and isinstance(value, timedelta):
            _at_least(value, bounds.min_expire_after, "nodes would be replaced about as fast as they boot")
        return value

    @field_validator("consolidate_after")
    @classmethod
    def _consolidate_after_bound(cls, value: timedelta | str | None, info: ValidationInfo) -> timedelta | str | None:
        bounds = _admission_bounds(info)
        if bounds is not None and isinstance(value, timedelta):
            why = "it is how long a node must be empty before it goes, and nodes would be terminated before pods reach them, then bought again"
            _at_least(value, bounds.min_idle_timeout, why)
        return value

    @property
    def expiry(self) -> timedelta | None:
        """How old a node may get (None: never, for unset and Never alike)."""
        return self.expire_after if isinstance(self.expire_after, timedelta) else None

    @property
    def consolidates(self) -> bool:
        """False under `consolidateAfter: Never`: no node goes for being empty or underutilized, none is re-shopped."""
        return self.consolidate_after != NEVER

    @property
    def idle(self) -> timedelta | None:
        """How long a node may be empty before it goes: consolidateAfter when a duration, else
        idleTimeout; None under consolidateAfter: Never."""
        if not self.consolidates:
            return None
        return self.consolidate_after if isinstance(self.consolidate_after, timedelta) else self.idle_timeout

    @property
    def consolidation_policy(self) -> Consolidation | None:
        """The consolidation in force: spec.disruption.consolidation, None when off or under consolidateAfter: Never."""
        return self.consolidation if self.consolidates else None

    @field_validator("drain_timeout")
    @classmethod
    def _drain_timeout_bound(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        bounds = _admission_bounds(info)
        if bounds is not None and value > bounds.max_drain_timeout:
            raise ValueError(f"{format_duration(value)} is above the maximum of {format_duration(bounds.max_drain_timeout)}")
        return value

    budgets: list[DisruptionBudget] = Field(
        [DisruptionBudget()],
        max_length=MAX_BUDGETS,
        description="Disruption budgets (Karpenter's): how many nodes tgp may disrupt at once for voluntary reasons "
        "(Empty, Expired, Drifted, Underutilized, Cheaper). When several are active the most restrictive wins. "
        f"Unset = one budget of nodes: 10%; an empty list = no limit. At most {MAX_BUDGETS}.",
    )
    consolidation: Consolidation | None = Field(
        None,
        description="Re-shopping to cheaper offers (cheaperBy, after); unset = off. \"consolidation: {}\" turns it on "
        "with cheaperBy 20% and after 30m.",
    )
    termination_grace_period: OptionalDuration = Field(
        None,
        description="Karpenter's terminationGracePeriod: the longest a node's drain may take once it began, e.g. 24h. "
        "At it the instance is terminated anyway, overriding PodDisruptionBudgets and do-not-disrupt pods; a pod the drain "
        "cannot evict is deleted at the deadline minus its own terminationGracePeriodSeconds, so it gets its grace first. "
        "drainTimeout bounds the drain too, and the shorter wins. With expireAfter it bounds a node's life: do-not-disrupt "
        "holds an expired node at most this long past its expiry, drain included (expireAfter + terminationGracePeriod, as in "
        "Karpenter v1). It makes drift eventual: do-not-disrupt holds a drifted node whose replacement is Ready at most this long. "
        "It does not bound how long do-not-disrupt holds an idle node (a manual evict does not wait).",
    )


class GPUNodePoolSpec(Spec):
    node_class_ref: NodeClassRef = Field(description="The GPUNodeClass that supplies providers, boot config and budget.")
    template: PoolTemplate = Field(PoolTemplate(), description="What the pool's nodes look like.")
    max_hourly_price: Price | None = Field(None, description="Most US$ per hour for one node, e.g. \"2.0\".")
    weight: int = Field(0, ge=0, le=100, description="Among pools that fit a pod, the highest weight gets it.")
    min_nodes: int = Field(0, ge=0, le=MAX_MIN_NODES, description=f"Nodes kept even without demand; at most {MAX_MIN_NODES}.")
    max_nodes: int | None = Field(
        None, ge=0, le=MAX_NODES, description=f"Most nodes of this pool at once; at most {MAX_NODES}; unset = only the class's limits."
    )
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


def class_problems(spec: GPUNodeClassSpec) -> list[str]:
    """What a class's spec breaks of the schema's length bounds (the bridge's admission), each
    naming its field as the API server would."""
    problems = []

    def longer(path: str, value: str | None, most: int) -> None:
        if value is not None and len(value) > most:
            problems.append(f"{path} is {len(value)} characters; at most {most}")

    def more(path: str, items: list[Any], most: int) -> None:
        if len(items) > most:
            problems.append(f"{path} has {len(items)} items; at most {most}")

    more("spec.providers", spec.providers, MAX_CLASS_PROVIDERS)
    for i, provider in enumerate(spec.providers):
        if ref := provider.credentials_ref:
            longer(f"spec.providers[{i}].credentialsRef.name", ref.name, DNS_SUBDOMAIN_MAX_LENGTH)
            longer(f"spec.providers[{i}].credentialsRef.key", ref.key, MAX_SECRET_KEY_LENGTH)
            longer(f"spec.providers[{i}].credentialsRef.namespace", ref.namespace, LABEL_VALUE_MAX_LENGTH)
    longer("spec.kubernetesVersion", spec.kubernetes_version, MAX_SCALAR_LENGTH)
    templates = {"spec.bootstrapTemplate": spec.bootstrap_template}
    if talos := spec.talos_config:
        longer("spec.talosConfig.image", talos.image, MAX_IMAGE_LENGTH)
        templates["spec.talosConfig.machineConfigTemplate"] = talos.machine_config_template
    for path, template in templates.items():
        longer(path, template, MAX_TEMPLATE_LENGTH)
    # The schema counts characters, a payload bytes: 256 Ki 4-byte characters in each template
    # would carry 2 MiB. Together, in UTF-8, they weigh at most what one template may.
    given = {path: len(template.encode()) for path, template in templates.items() if template}
    if sum(given.values()) > MAX_TEMPLATE_LENGTH:
        weigh = "weigh" if len(given) > 1 else "weighs"
        problems.append(f"{' and '.join(given)} {weigh} {sum(given.values())} bytes (UTF-8); at most {MAX_TEMPLATE_LENGTH} together")
    longer("spec.joinSecretRef", spec.join_secret_ref, DNS_SUBDOMAIN_MAX_LENGTH)
    tailnet = spec.tailscale_config
    more("spec.tailscaleConfig.tags", tailnet.tags, MAX_TAILSCALE_TAGS)
    for i, tag in enumerate(tailnet.tags):
        longer(f"spec.tailscaleConfig.tags[{i}]", tag, MAX_TAG_LENGTH)
    longer("spec.tailscaleConfig.loginServer", tailnet.login_server, LOGIN_SERVER_MAX_LENGTH)
    longer("spec.tailscaleConfig.oauthSecretRef", tailnet.oauth_secret_ref, DNS_SUBDOMAIN_MAX_LENGTH)
    wanted = spec.instance_requirements
    for path, values in (("spec.instanceRequirements.gpuTypes", wanted.gpu_types), ("spec.instanceRequirements.regions", wanted.regions)):
        more(path, values, MAX_CLASS_LIST)
        for i, value in enumerate(values):
            longer(f"{path}[{i}]", value, LABEL_VALUE_MAX_LENGTH)
    return problems


class GPUNodeClass(BaseModel):
    """Cluster-scoped infrastructure template: providers, boot config, tailnet, budget."""

    model_config = ConfigDict(extra="ignore")
    apiVersion: Literal["tgp.io/v1"] = "tgp.io/v1"
    kind: Literal["GPUNodeClass"] = "GPUNodeClass"
    metadata: ObjectMeta
    spec: GPUNodeClassSpec
    status: GPUNodeClassStatus | None = None

    @field_validator("spec")
    @classmethod
    def _bounded(cls, value: GPUNodeClassSpec, info: ValidationInfo) -> GPUNodeClassSpec:
        if _admitting(info) and (problems := class_problems(value)):
            raise ValueError("; ".join(problems))
        return value

    @classmethod
    def admit(cls, obj: Any) -> GPUNodeClass:
        """Validate a class as the bridge admits it: the schema's model plus its length bounds
        (which an API server that skipped them, or a class stored before them, may hold)."""
        return cls.model_validate(obj, context={ADMISSION: DisruptionBounds()})


class GPUNodePool(BaseModel):
    """Namespaced provisioning request: which nodes, how many, at what price."""

    model_config = ConfigDict(extra="ignore")
    apiVersion: Literal["tgp.io/v1"] = "tgp.io/v1"
    kind: Literal["GPUNodePool"] = "GPUNodePool"
    metadata: ObjectMeta
    spec: GPUNodePoolSpec
    status: GPUNodePoolStatus | None = None

    @field_validator("metadata")
    @classmethod
    def _node_name_fits(cls, value: ObjectMeta, info: ValidationInfo) -> ObjectMeta:
        if _admitting(info) and len(value.name) > MAX_POOL_NAME_LENGTH:
            raise ValueError(POOL_NAME_MESSAGE)
        return value

    @classmethod
    def admit(cls, obj: Any, bounds: DisruptionBounds | None = None) -> GPUNodePool:
        """Validate a pool as the bridge admits it: the schema plus the disruption bounds."""
        return cls.model_validate(obj, context={ADMISSION: bounds or DisruptionBounds()})
