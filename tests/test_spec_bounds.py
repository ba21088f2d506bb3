"""Whatever a tenant writes in a GPUNodePool or a GPUNodeClass, the carried state of the pool and
of the class, and the pool's status, stay far below Temporal's 2 MiB payload limit (issue 35):
every list and string of both schemas is bounded, and a condition quotes a list's first items
"… and N more". Before, a 508 kB requirement list
made a 1.0 MB status (OffersAvailable and Ready both quoted it) and the pool's continue-as-new
was refused (3.05 MB)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import ValidationError

from tgp.conditions import MAX_MESSAGE_LENGTH, condition_list
from tgp.crds import (
    LOGIN_SERVER_MAX_LENGTH,
    MAX_BUDGETS,
    MAX_CLASS_LIST,
    MAX_CLASS_PROVIDERS,
    MAX_IMAGE_LENGTH,
    MAX_SCALAR_LENGTH,
    MAX_SECRET_KEY_LENGTH,
    MAX_TAG_LENGTH,
    MAX_TAILSCALE_TAGS,
    MAX_TEMPLATE_LENGTH,
    MAX_POOL_LABELS,
    MAX_POOL_REQUIREMENTS,
    MAX_POOL_TAINTS,
    MAX_REQUIREMENT_VALUES,
    GPUNodeClass,
    GPUNodeClassSpec,
    GPUNodePool,
    GPUNodePoolStatus,
)
from tgp.labels import DNS_SUBDOMAIN_MAX_LENGTH, LABEL_VALUE_MAX_LENGTH, NAME_MAX_LENGTH
from tgp.messages import ClassInput, Demand, Ledger, OfferCheck, PoolUpdate
from tgp.pool_plan import offers_available, ready
from tgp.pools import offer_requirements
from tests.test_pool_flood import bridge_demand, flood
from tgp.capacity import CapacityNode, plan_capacity
from workers import crdgen
from workers.temporal import DATA_CONVERTER
from workflows.pool import GPUNodePoolWorkflow, PoolInput, PoolState

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
# Far below 2 MiB: what the largest spec may cost the pool's carried state and its status.
CARRIED_BOUND = 512 * 1024
# The worst case of all (the largest class, the largest pool of it and a flood of pending pods):
# half the limit. It measured 0.9 MB (the templates 256 KiB, the pool 140 kB, the flood 490 kB).
WORST_CARRIED_BOUND = 1024 * 1024
STATUS_BOUND = 16 * 1024


def unbounded(node: dict[str, Any], path: str = "spec") -> list[str]:
    """Every string, array or map of a schema without a bound (enums are bounded)."""
    found = []
    kind = node.get("type")
    if kind == "string" and "maxLength" not in node and "enum" not in node:
        found.append(path)
    if kind == "array":
        if "maxItems" not in node:
            found.append(f"{path}[]")
        found += unbounded(node.get("items") or {}, f"{path}[]")
    if kind == "object":
        for name, prop in (node.get("properties") or {}).items():
            found += unbounded(prop, f"{path}.{name}")
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            if "maxProperties" not in node:
                found.append(f"{path}{{}}")
            found += unbounded(extra, f"{path}{{}}")
    return found


def spec_schema(crd: str) -> dict[str, Any]:
    return crdgen.manifests()[crd]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_every_list_and_string_a_tenant_writes_in_a_pool_is_bounded_by_the_schema() -> None:
    assert unbounded(spec_schema("gpunodepools.tgp.io.yaml")) == []


def test_every_list_and_string_a_tenant_writes_in_a_class_is_bounded_by_the_schema() -> None:
    assert unbounded(spec_schema("gpunodeclasses.tgp.io.yaml")) == []


def name(i: int, length: int) -> str:
    """A valid label value / name part of exactly `length` characters, distinct per `i`."""
    return f"v{i:04d}".ljust(length - 1, "x") + "z"


PREFIX = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * (DNS_SUBDOMAIN_MAX_LENGTH - 3 * 64)])


def largest_pool() -> dict[str, Any]:
    """The largest GPUNodePool the schema allows (every list at its maxItems, every string at its
    maxLength where a pattern allows it), GPU types and regions included."""
    keys = ["tgp.io/gpu-type", "tgp.io/region", "tgp.io/provider"]
    keys += [f"{PREFIX}/{name(i, NAME_MAX_LENGTH)}" for i in range(MAX_POOL_REQUIREMENTS - len(keys))]
    requirements = [
        {"key": key, "operator": "In", "values": [name(j, LABEL_VALUE_MAX_LENGTH) for j in range(MAX_REQUIREMENT_VALUES)]}
        for key in keys
    ]
    labels = {f"{PREFIX}/{name(i, NAME_MAX_LENGTH)}": name(i, LABEL_VALUE_MAX_LENGTH) for i in range(MAX_POOL_LABELS)}
    taints = [{"key": f"{PREFIX}/{name(i, NAME_MAX_LENGTH)}", "value": name(i, LABEL_VALUE_MAX_LENGTH), "effect": "NoSchedule"} for i in range(MAX_POOL_TAINTS)]
    budgets = [
        {"nodes": "100%", "schedule": "0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 0,1,2,3,4,5,6,7,8,9 1,2,3,4,5,6,7 * mon-fri", "duration": "8h59m59s",
         "reasons": ["Empty", "Expired", "Drifted", "Underutilized", "Cheaper"]}
        for _ in range(MAX_BUDGETS)
    ]  # fmt: skip
    return {
        "apiVersion": "tgp.io/v1",
        "kind": "GPUNodePool",
        "metadata": {"name": "big", "namespace": "team"},
        "spec": {
            "nodeClassRef": {"name": "c" * DNS_SUBDOMAIN_MAX_LENGTH},
            "template": {"metadata": {"labels": labels}, "spec": {"requirements": requirements, "taints": taints}},
            "maxHourlyPrice": "9" * 16 + "." + "9" * 15,
            "disruption": {"budgets": budgets},
        },
    }


def test_the_largest_pool_keeps_its_carried_state_and_status_small() -> None:
    pool = GPUNodePool.admit(largest_pool())  # the bridge admits it: it is within every bound
    klass = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}]})
    req = offer_requirements(pool.spec, klass)
    assert len(req.gpu_types) == MAX_REQUIREMENT_VALUES
    # No offer matches: OffersAvailable names what was asked, and Ready repeats it.
    offers = offers_available(OfferCheck(matching=0), req)
    assert offers[1] == "NoMatchingOffers" and "… and" in offers[2], offers[2]
    wanted = {"OffersAvailable": offers}
    wanted["Ready"] = ready(wanted, ok=False, ready_nodes=0, live=0, failures=0, backoff_until=None, now=NOW, at_max_nodes=False)
    conditions = condition_list(wanted, 1, NOW)
    assert all(len(c.message) <= MAX_MESSAGE_LENGTH for c in conditions)
    status = GPUNodePoolStatus(conditions=conditions)
    written = status.model_dump_json(by_alias=True)
    assert len(written) < STATUS_BOUND, len(written)

    state = PoolState(
        update=PoolUpdate(spec=pool.spec, generation=1, uid="u", node_class=klass),
        offer_check=OfferCheck(matching=0),
        offer_check_key=req.model_dump_json(),
        offer_checked_at=NOW,
        conditions={c.type: c for c in conditions},
        written=written,
    )
    carried = DATA_CONVERTER.payload_converter.to_payloads([PoolInput(namespace="team", name="big", state=state)])[0]
    assert len(carried.data) < CARRIED_BOUND, len(carried.data)


def test_a_condition_quotes_a_long_list_as_its_first_items_and_how_many_more() -> None:
    from tgp.types import OfferRequirements

    req = OfferRequirements(gpu_types=[f"GPU{i}" for i in range(500)], regions=["us-east"], providers=["simulated"])
    status, reason, message = offers_available(OfferCheck(matching=0), req)
    assert (status, reason) == ("False", "NoMatchingOffers")
    assert "GPU types [GPU0, GPU1" in message and "GPU9 … and 490 more]" in message and "GPU10," not in message
    assert "regions [us-east]" in message
    long = condition_list({"Ready": ("False", "NotReady", "x" * 100_000)}, 1, NOW)[0].message
    assert len(long) == MAX_MESSAGE_LENGTH and long.endswith("more characters")
    json.dumps(long)


# Each template character at its widest in the carried JSON: a 4-byte UTF-8 character (the
# schema's maxLength counts characters, and the payload converter writes UTF-8 unescaped).
WIDE = "\U0001f600"


def largest_class(template_char: str = "x") -> dict[str, Any]:
    """The largest GPUNodeClass the schema allows: every list at its maxItems, every string at its
    maxLength, both templates included."""
    providers = [
        {"name": "runpod", "priority": 1000, "credentialsRef": {
            "name": name(i, DNS_SUBDOMAIN_MAX_LENGTH), "key": name(i, MAX_SECRET_KEY_LENGTH), "namespace": name(i, LABEL_VALUE_MAX_LENGTH)}}
        for i in range(MAX_CLASS_PROVIDERS)
    ]  # fmt: skip
    # Both templates, as large as they may be together (the bridge admits no more bytes).
    template = template_char * (MAX_TEMPLATE_LENGTH // 2 // len(template_char.encode()))
    return {
        "apiVersion": "tgp.io/v1",
        "kind": "GPUNodeClass",
        "metadata": {"name": "c" * DNS_SUBDOMAIN_MAX_LENGTH},
        "spec": {
            "providers": providers,
            "kubernetesVersion": "1." + "3" * (MAX_SCALAR_LENGTH - 4) + ".1",
            "talosConfig": {"image": "i" * MAX_IMAGE_LENGTH, "machineConfigTemplate": template},
            "bootstrapTemplate": template,
            "joinSecretRef": name(1, DNS_SUBDOMAIN_MAX_LENGTH),
            "tailscaleConfig": {
                "tags": ["tag:" + name(i, MAX_TAG_LENGTH - 4) for i in range(MAX_TAILSCALE_TAGS)],
                "loginServer": "https://" + "h" * (LOGIN_SERVER_MAX_LENGTH - 8),
                "oauthSecretRef": name(2, DNS_SUBDOMAIN_MAX_LENGTH),
            },
            "instanceRequirements": {
                "gpuTypes": [name(i, LABEL_VALUE_MAX_LENGTH) for i in range(MAX_CLASS_LIST)],
                "regions": [name(i, LABEL_VALUE_MAX_LENGTH) for i in range(MAX_CLASS_LIST)],
                "minGpuCount": 16,
            },
            "limits": {"maxNodes": 1000, "maxHourlyCost": "99999." + "9" * (MAX_SCALAR_LENGTH - 6)},
        },
    }


def carried_bytes(value: Any) -> int:
    """The size of what continue-as-new carries: the payload Temporal stores."""
    return len(DATA_CONVERTER.payload_converter.to_payloads([value])[0].data)


@pytest.mark.parametrize("template_char", ["x", WIDE])
def test_the_largest_class_with_the_largest_pool_and_a_flood_keeps_both_carried_states_far_below_2_mib(template_char: str) -> None:
    """The worst case a tenant can write: the largest class, the largest pool of it and a flood of
    pending pods, each tracked pod nominated to a launching node."""
    klass = GPUNodeClass.admit(largest_class(template_char))  # the bridge admits it: it is within every bound
    pool = GPUNodePool.admit(largest_pool())
    update = PoolUpdate(spec=pool.spec, generation=1, uid="u" * 36, node_class=klass.spec)
    assert carried_bytes(update) < CARRIED_BOUND, "the pool update signal"

    workflow = GPUNodePoolWorkflow(PoolInput(namespace="n" * LABEL_VALUE_MAX_LENGTH, name="p" * 57))
    workflow.state.update = update
    d = bridge_demand(flood(50_000, "j{i:05d}-" + "x" * 240))
    workflow.demand(d)  # the pool's own signal handler
    state = workflow.state
    nodes = [CapacityNode(workflow_id=f"gpunode/{'n' * 63}/{'p' * 57}/{'p' * 57}-{i:05d}", node_name=f"{'p' * 57}-{i:05d}", launching=True, gpus=8) for i in range(len(d.pods))]
    state.nominations = dict(plan_capacity({pod: state.pod_gpus.get(pod, 1) for pod in state.demand}, nodes, {}, set(), NOW).nominations)
    assert len(state.nominations) == len(d.pods)
    pool_carried = carried_bytes(PoolInput(namespace="n" * LABEL_VALUE_MAX_LENGTH, name="p" * 57, state=state))
    assert pool_carried < WORST_CARRIED_BOUND, f"{pool_carried} bytes carried by the pool across continue-as-new"

    ledger = Ledger(limits=klass.spec.limits)
    class_carried = carried_bytes(ClassInput(name=klass.metadata.name, spec=klass.spec, generation=1, uid="u" * 36, ledger=ledger))
    assert class_carried < CARRIED_BOUND, f"{class_carried} bytes carried by the class across continue-as-new"


def test_the_bridge_refuses_a_class_over_a_bound_naming_the_field() -> None:
    """An API server that skipped the schema's bounds (or a class stored before them): the bridge's
    admission refuses it and says which field, as for a pool."""
    for path, change in {
        "spec.providers has 17 items; at most 16": lambda s: s["providers"].append({"name": "simulated"}),
        "spec.tailscaleConfig.tags has 33 items": lambda s: s["tailscaleConfig"]["tags"].append("tag:more"),
        "spec.tailscaleConfig.tags[0] is 68 characters": lambda s: s["tailscaleConfig"]["tags"].__setitem__(0, "tag:" + "t" * 64),
        "spec.providers[3].credentialsRef.name is 254 characters": lambda s: s["providers"][3]["credentialsRef"].__setitem__("name", "s" * 254),
        "spec.providers[0].credentialsRef.namespace is 64": lambda s: s["providers"][0]["credentialsRef"].__setitem__("namespace", "s" * 64),
        "spec.joinSecretRef is 254 characters": lambda s: s.__setitem__("joinSecretRef", "s" * 254),
        "spec.tailscaleConfig.oauthSecretRef is 254": lambda s: s["tailscaleConfig"].__setitem__("oauthSecretRef", "s" * 254),
        "spec.talosConfig.image is 1025 characters": lambda s: s["talosConfig"].__setitem__("image", "i" * 1025),
        "spec.bootstrapTemplate is 262145 characters": lambda s: s.__setitem__("bootstrapTemplate", "#" * (MAX_TEMPLATE_LENGTH + 1)),
        # Within the schema's maxLength (characters), over the bytes both templates may carry.
        "spec.bootstrapTemplate and spec.talosConfig.machineConfigTemplate weigh 262148 bytes (UTF-8); at most 262144 together":
            lambda s: s.__setitem__("bootstrapTemplate", s["bootstrapTemplate"] + WIDE),
        "spec.bootstrapTemplate weighs 1048576 bytes": lambda s: (s.__setitem__("bootstrapTemplate", WIDE * MAX_TEMPLATE_LENGTH), s.pop("talosConfig")),
        "spec.instanceRequirements.regions has 65 items": lambda s: s["instanceRequirements"]["regions"].append("r"),
    }.items():
        obj = largest_class()
        change(obj["spec"])
        with pytest.raises(ValidationError) as refused:
            GPUNodeClass.admit(obj)
        assert path in str(refused.value), (path, str(refused.value)[:300])
        GPUNodeClass.model_validate(obj)  # a class carried in a workflow message still decodes
