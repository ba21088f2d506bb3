"""Drift (issue 21 item 3): a stable hash of what made a node, like Karpenter's NodePool and
NodeClass hashes. A node records the hash it was made with; when the hash of its class and
pool now differs, the node has drifted and is replaced (make-before-break, within the budget).

What is hashed is what cannot change on a running node: the class's boot (template, Talos
image, kubelet version, join secret), tailnet (tags, ephemeral, routes, login server, OAuth
secret), the node's provider's credentials ref and the class's instance requirements, and the
pool's requirements. What is applied in place is not hashed: the pool's labels and taints,
its timeouts and budgets, weights, counts, price caps and the class's limits.

The hash is sha256 over canonical JSON (sorted keys, lists that are sets sorted), so it is the
same in every process and for every dict order. `DRIFT_HASH_VERSION` prefixes it: when what is
hashed changes, the version changes, and a node whose hash has another version is not drifted
(the workflow re-stamps it), as Karpenter's NodePoolHashVersion does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec

DRIFT_HASH_VERSION = "v1"
# Where a node records the hash it was made with (on its Node), like karpenter.sh/nodepool-hash.
DRIFT_HASH_ANNOTATION = "tgp.io/drift-hash"


def _sorted(values: list[str]) -> list[str]:
    return sorted(set(values))


def replacement_fields(klass: GPUNodeClassSpec, pool: GPUNodePoolSpec, provider: str | None = None) -> dict[str, Any]:
    """What made a node of `pool` (of class `klass`, bought from `provider`), in canonical form:
    the fields whose change needs a new node."""
    tailnet = klass.tailscale_config
    requirements = klass.instance_requirements
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
            "requirements": {
                "gpuTypes": _sorted(requirements.gpu_types),
                "regions": _sorted(requirements.regions),
                "minGpuCount": requirements.min_gpu_count,
                "spotAllowed": requirements.spot_allowed,
            },
        },
        "pool": {
            "nodeClass": pool.node_class_ref.name,
            "requirements": sorted(
                {(r.key, r.operator, tuple(_sorted(r.values))) for r in pool.template.spec.requirements}
            ),
        },
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


IN_PLACE_FIELDS = ("labels", "taints", "timeouts")


def in_place_changes(old: GPUNodePoolSpec, new: GPUNodePoolSpec) -> frozenset[str]:
    """What of a pool's change is applied to its running nodes in place: `labels`, `taints`,
    `timeouts` (idleTimeout, expireAfter, drainTimeout, terminationGracePeriod). Order does
    not count (taints are a set on a Node). Budgets, consolidation, counts and prices are the
    pool's own and touch no node; what needs a new node is `drift_hash`'s."""
    changed = set()
    if old.template.metadata.labels != new.template.metadata.labels:
        changed.add("labels")
    if _taints(old) != _taints(new):
        changed.add("taints")
    timeouts = ("idle_timeout", "expire_after", "drain_timeout", "termination_grace_period")
    if any(getattr(old.disruption, t) != getattr(new.disruption, t) for t in timeouts):
        changed.add("timeouts")
    return frozenset(changed)


def _taints(pool: GPUNodePoolSpec) -> set[tuple[str, str | None, str]]:
    return {(t.key, t.value, t.effect) for t in pool.template.spec.taints}
