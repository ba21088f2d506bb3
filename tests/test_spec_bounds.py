"""Whatever a tenant writes in a GPUNodePool, the pool's carried state and status stay far below
Temporal's 2 MiB payload limit (issue 35): every list and string of the pool's schema is bounded,
and a condition quotes a list's first items "… and N more". Before, a 508 kB requirement list
made a 1.0 MB status (OffersAvailable and Ready both quoted it) and the pool's continue-as-new
was refused (3.05 MB)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from tgp.conditions import MAX_MESSAGE_LENGTH, condition_list
from tgp.crds import (
    MAX_BUDGETS,
    MAX_POOL_LABELS,
    MAX_POOL_REQUIREMENTS,
    MAX_POOL_TAINTS,
    MAX_REQUIREMENT_VALUES,
    GPUNodeClassSpec,
    GPUNodePool,
    GPUNodePoolStatus,
)
from tgp.labels import DNS_SUBDOMAIN_MAX_LENGTH, LABEL_VALUE_MAX_LENGTH, NAME_MAX_LENGTH
from tgp.messages import OfferCheck, PoolUpdate
from tgp.pool_plan import offers_available, ready
from tgp.pools import offer_requirements
from workers import crdgen
from workers.temporal import DATA_CONVERTER
from workflows.pool import PoolInput, PoolState

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
# Far below 2 MiB: what the largest spec may cost the pool's carried state and its status.
CARRIED_BOUND = 512 * 1024
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


def test_every_list_and_string_a_tenant_writes_in_a_pool_is_bounded_by_the_schema() -> None:
    schema = crdgen.manifests()["gpunodepools.tgp.io.yaml"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert unbounded(schema["properties"]["spec"]) == []


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
