"""GPUNodePool: the namespaced provisioning request (which class, how many nodes, the nodes'
requirements, labels and taints, its disruption settings) and the object."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

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
from tgp.types import LABEL_GPU_TYPE, LABEL_REGION, Taint
from tgp.crds.common import (
    ADMISSION,
    MAX_MIN_NODES,
    MAX_NODES,
    MAX_POOL_LABELS,
    MAX_POOL_NAME_LENGTH,
    MAX_POOL_REQUIREMENTS,
    MAX_POOL_TAINTS,
    MAX_REQUIREMENT_VALUES,
    POOL_NAME_MESSAGE,
    DisruptionBounds,
    Price,
    Spec,
    _admitting,
)
from tgp.crds.disruption import Disruption
from tgp.crds.status import GPUNodePoolStatus, ObjectMeta


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
