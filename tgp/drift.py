"""Drift (issue 21 item 3, issue 35 item 7): a node has drifted when what made it no longer
matches its class and pool; it is then replaced (make-before-break, within the budget).

Two checks, as in Karpenter. *Requirements* are compared, not hashed (Karpenter's
RequirementsDrifted): a node drifts only when its labels no longer satisfy the pool's
requirements on what a node's offer decides (tgp.io/gpu-type, tgp.io/region), or its offer no
longer meets the class's instanceRequirements (gpuTypes, regions, minGpuCount, spotAllowed).
Widening a GPU-type list, or turning `In` into `Exists`, drifts no node. *What cannot be
compared* is hashed, like Karpenter's NodePool and NodeClass hashes: the class's boot
(template, Talos image, kubelet version, join secret), tailnet (tags, ephemeral, routes, login
server, OAuth secret), the node's provider's credentials ref and the pool's class. A node
records the hash it was made with; a different hash now is drift. What is applied in place is
neither: the pool's labels and taints, its timeouts and budgets, weights, counts, price caps and
the class's limits.

The hash is sha256 over canonical JSON (sorted keys, lists that are sets sorted), so it is the
same in every process and for every dict order. `DRIFT_HASH_VERSION` prefixes it: when what is
hashed changes, the version changes, and a node whose hash has another version is not drifted
(the workflow re-stamps it), as Karpenter's NodePoolHashVersion does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec, NodeSelectorRequirement
from tgp.types import LABEL_GPU_TYPE, LABEL_REGION, Taint

# v2: the class's and pool's requirements left the hash (they are compared, `unmet_requirements`).
DRIFT_HASH_VERSION = "v2"
# Where a node records the hash it was made with (on its Node), like karpenter.sh/nodepool-hash.
DRIFT_HASH_ANNOTATION = "tgp.io/drift-hash"


def _sorted(values: list[str]) -> list[str]:
    return sorted(set(values))


def replacement_fields(klass: GPUNodeClassSpec, pool: GPUNodePoolSpec, provider: str | None = None) -> dict[str, Any]:
    """What made a node of `pool` (of class `klass`, bought from `provider`), in canonical form:
    the fields whose change needs a new node and that cannot be compared with a running node
    (requirements are: `unmet_requirements`)."""
    tailnet = klass.tailscale_config
    providers = [p for p in klass.providers if provider is None or p.name == provider]
    return {
        "class": {
            "kubernetesVersion": klass.kubernetes_version,
            "talos": klass.talos_config.model_dump(mode="json", by_alias=True) if klass.talos_config else None,
            "bootstrapTemplate": klass.bootstrap_template,
            "joinSecretRef": klass.join_secret_ref,
            "tailnet": {
                "tags": _sorted(tailnet.tags),
                "ephemeral": tailnet.ephemeral,
                "acceptRoutes": tailnet.accept_routes,
                "loginServer": tailnet.login_server,
                "oauthSecretRef": tailnet.oauth_secret_ref,
            },
            "credentials": sorted(
                ([p.name, p.credentials_ref.model_dump(mode="json", by_alias=True) if p.credentials_ref else None] for p in providers),
                key=lambda pair: json.dumps(pair, sort_keys=True),
            ),
        },
        "pool": {"nodeClass": pool.node_class_ref.name},
    }


def drift_hash(klass: GPUNodeClassSpec, pool: GPUNodePoolSpec, provider: str | None = None) -> str:
    """`v1-<16 hex>`: the hash of what made a node (see `replacement_fields`)."""
    canonical = json.dumps(replacement_fields(klass, pool, provider), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{DRIFT_HASH_VERSION}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


def drifted(recorded: str | None, current: str) -> bool:
    """Whether a node made with hash `recorded` has drifted from `current`. A node with no
    recorded hash, or one of another version, is not drifted: it is re-stamped, not replaced."""
    if recorded is None or recorded.partition("-")[0] != current.partition("-")[0]:
        return False
    return recorded != current


# --- requirements: compared with each node ------------------------------------------------------

# The labels a node's offer decides and that offer selection honours for a new node
# (tgp.pools.offer_requirements): the pool's requirements on them are judged against each node.
# A requirement on another key is met, or not, alike by every node of the pool, a new one too
# (those labels are the pool's own, applied in place): replacing a node would not change it.
COMPARED_KEYS = (LABEL_GPU_TYPE, LABEL_REGION)


class NodeFacts(BaseModel):
    """What a running node is, as far as its pool knows: the compared labels it carries, its
    GPUs and whether it is spot. What is not known (a key absent, None) is never drift."""

    model_config = ConfigDict(frozen=True)
    labels: dict[str, str] = {}
    gpus: int | None = None
    spot: bool | None = None


def requirement_met(value: str | None, r: NodeSelectorRequirement) -> bool:
    """Kubernetes' node-selector semantics: whether a Node whose label `r.key` has `value`
    (None: it has no such label) satisfies `r`."""
    if r.operator == "In":
        return value is not None and value in r.values
    if r.operator == "NotIn":
        return value is None or value not in r.values
    if r.operator == "Exists":
        return value is not None
    return value is None  # DoesNotExist


def meetable(r: NodeSelectorRequirement) -> bool:
    """Whether a node bought now could satisfy `r` on a compared key. Every node carries those
    labels, so `DoesNotExist` (and an `In` of nothing) no node meets: replacing a node for it
    would buy one that fails it too, again and again."""
    return r.operator != "DoesNotExist" and not (r.operator == "In" and not r.values)


def unmet_requirements(facts: NodeFacts, klass: GPUNodeClassSpec, pool: GPUNodePoolSpec) -> list[str]:
    """What of its pool's and class's requirements a node no longer meets, in words; empty when
    it meets them all (or what it would miss is not known). Karpenter's requirement drift: a
    node drifts when its labels no longer satisfy the requirements, never because they changed."""
    unmet = []
    for r in pool.template.spec.requirements:
        value = facts.labels.get(r.key)
        if r.key in COMPARED_KEYS and value is not None and meetable(r) and not requirement_met(value, r):
            shown = f" [{', '.join(r.values)}]" if r.operator in ("In", "NotIn") else ""
            unmet.append(f"{r.key}={value} does not satisfy the pool's requirement {r.operator}{shown}")
    ir = klass.instance_requirements
    for key, allowed, field in ((LABEL_GPU_TYPE, ir.gpu_types, "gpuTypes"), (LABEL_REGION, ir.regions, "regions")):
        value = facts.labels.get(key)
        if allowed and value is not None and value not in allowed:
            unmet.append(f"{key}={value} is not in the class's instanceRequirements.{field} [{', '.join(allowed)}]")
    if facts.gpus is not None and facts.gpus < ir.min_gpu_count:
        unmet.append(f"{facts.gpus} GPU(s), fewer than the class's instanceRequirements.minGpuCount {ir.min_gpu_count}")
    if facts.spot and not ir.spot_allowed:
        unmet.append("a spot offer, and the class's instanceRequirements.spotAllowed is false")
    return unmet


def requirements_digest(klass: GPUNodeClassSpec, pool: GPUNodePoolSpec) -> str:
    """A short stable digest of the requirements `unmet_requirements` compares: with the hash,
    what a requirement-drifted node is replaced for (part of its replacement's id)."""
    ir = klass.instance_requirements
    fields = {
        "pool": sorted({(r.key, r.operator, tuple(_sorted(r.values))) for r in pool.template.spec.requirements if r.key in COMPARED_KEYS}),
        "class": [_sorted(ir.gpu_types), _sorted(ir.regions), ir.min_gpu_count, ir.spot_allowed],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:8]


IN_PLACE_FIELDS = ("labels", "taints", "timeouts")


def in_place_changes(old: GPUNodePoolSpec, new: GPUNodePoolSpec) -> frozenset[str]:
    """What of a pool's change is applied to its running nodes in place: `labels`, `taints`,
    `timeouts` (idleTimeout, expireAfter, drainTimeout, terminationGracePeriod). Order does
    not count (taints are a set on a Node). Budgets, consolidation, counts and prices are the
    pool's own (whether its budgets can refuse at all reaches its nodes with their settings:
    tgp.disruption.unlimited_reasons); what needs a new node is `drift_hash`'s."""
    changed = set()
    if old.template.metadata.labels != new.template.metadata.labels:
        changed.add("labels")
    if _taints(old) != _taints(new):
        changed.add("taints")
    timeouts = ("idle_timeout", "expire_after", "consolidate_after", "drain_timeout", "termination_grace_period")
    if any(getattr(old.disruption, t) != getattr(new.disruption, t) for t in timeouts):
        changed.add("timeouts")
    return frozenset(changed)


def _taints(pool: GPUNodePoolSpec) -> set[tuple[str, str | None, str]]:
    return {(t.key, t.value, t.effect) for t in pool.template.spec.taints}


# --- in place: the pool's labels and taints on its running Nodes --------------------------------
#
# A running node holds what tgp last put on its Node (the pool's labels and taints at that
# time). A change of the pool's template is applied as a patch of the difference: new and
# changed labels and taints are set, and those tgp had set that the pool no longer lists are
# removed, but only while the Node still carries them as tgp set them. A label or taint the
# user, or another controller, put on the Node is never removed, nor one whose value someone
# changed since; tgp's own labels (tgp.io/...) are never removed and always win.


def label_removals(applied: Mapping[str, str], wanted: Mapping[str, str], own: Mapping[str, str]) -> dict[str, str]:
    """The labels tgp had set (`applied`) that neither the pool (`wanted`) nor tgp itself (`own`)
    lists any more, with the value tgp set: each is removed from the Node only while it still
    has that value."""
    return {k: v for k, v in applied.items() if k not in wanted and k not in own}


def taint_removals(applied: Sequence[Taint], wanted: Sequence[Taint]) -> list[Taint]:
    """The taints tgp had set that the pool no longer lists (a taint is its key and effect: a new
    value for the same pair replaces it, it is not removed)."""
    kept = {(t.key, t.effect) for t in wanted}
    return [t for t in applied if (t.key, t.effect) not in kept]


def patch_labels(current: Mapping[str, str], labels: Mapping[str, str], remove: Mapping[str, str]) -> dict[str, str | None]:
    """The merge patch of a Node's labels (None removes a key): set `labels` where they differ,
    remove each of `remove` only while the Node's value is the one tgp set. `labels` win over
    `remove` (a key both set and removed is set)."""
    patch: dict[str, str | None] = {k: v for k, v in labels.items() if current.get(k) != v}
    patch.update({k: None for k, v in remove.items() if k not in labels and current.get(k) == v})
    return patch


def patch_taints(current: Sequence[Mapping[str, str]], wanted: Sequence[Taint], remove: Sequence[Taint] = ()) -> list[dict[str, str]]:
    """A Node's taints (the API's dicts, `timeAdded` kept) after adding the `wanted` it lacks,
    replacing the value of a wanted key and effect, and removing each of `remove` that is still
    there with the value tgp set. Taints of others are left as they are, in their order."""
    gone = {(t.key, t.effect, t.value) for t in remove} - {(t.key, t.effect, t.value) for t in wanted}
    merged = [dict(t) for t in current if (t.get("key"), t.get("effect"), t.get("value", "")) not in gone]
    for taint in wanted:
        entry = {"key": taint.key, "effect": taint.effect, **({"value": taint.value} if taint.value else {})}
        same = next((t for t in merged if t.get("key") == taint.key and t.get("effect") == taint.effect), None)
        if same is None:
            merged.append(entry)
        elif same.get("value", "") != taint.value:
            merged[merged.index(same)] = entry
    return merged
