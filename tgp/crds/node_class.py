"""GPUNodeClass: the cluster-scoped infrastructure template (providers and their credentials,
the boot configuration, the tailnet, limits), its length bounds at admission (`class_problems`)
and the object."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator

from tgp.labels import DNS_SUBDOMAIN_MAX_LENGTH, LABEL_VALUE_MAX_LENGTH
from tgp.crds.common import (
    ADMISSION,
    DEFAULT_CLASS_MAX_NODES,
    LOGIN_SERVER_MAX_LENGTH,
    LOGIN_SERVER_PATTERN,
    MAX_CLASS_LIST,
    MAX_CLASS_PROVIDERS,
    MAX_HOURLY_COST_DIGITS,
    MAX_IMAGE_LENGTH,
    MAX_NODES,
    MAX_SCALAR_LENGTH,
    MAX_SECRET_KEY_LENGTH,
    MAX_TAG_LENGTH,
    MAX_TAILSCALE_TAGS,
    MAX_TEMPLATE_LENGTH,
    DisruptionBounds,
    HourlyCostLimit,
    Spec,
    _admitting,
    _default_max_nodes,
)
from tgp.crds.status import GPUNodeClassStatus, ObjectMeta


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
