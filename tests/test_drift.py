"""tgp.drift: the hash of what made a node (issue 21 item 3)."""

import copy
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
from tgp.drift import DRIFT_HASH_VERSION, IN_PLACE_FIELDS, drift_hash, drifted, in_place_changes

Obj = dict[str, Any]
NAMES = st.text("abcdefgh", min_size=1, max_size=6)
PROVIDERS = ("runpod", "lambdalabs", "paperspace", "vastai", "simulated")
SECRET_REF = st.builds(lambda n, k: {"name": n, "key": k}, NAMES, NAMES)


@st.composite
def classes(draw: st.DrawFn) -> Obj:
    names = draw(st.lists(st.sampled_from(PROVIDERS), min_size=1, max_size=3, unique=True))
    providers = [{"name": n, **({"credentialsRef": draw(SECRET_REF)} if draw(st.booleans()) else {})} for n in names]
    spec: Obj = {
        "providers": providers,
        "tailscaleConfig": {"tags": draw(st.lists(NAMES.map("tag:{}".format), min_size=1, max_size=3, unique=True))},
        "instanceRequirements": {"gpuTypes": draw(st.lists(NAMES, max_size=3, unique=True)), "regions": draw(st.lists(NAMES, max_size=2, unique=True))},
    }
    boot = draw(st.sampled_from(["talos", "cloud-init", "none"]))
    if boot == "talos":
        spec["talosConfig"] = {"image": f"ghcr.io/siderolabs/talos:{draw(NAMES)}", "machineConfigTemplate": draw(NAMES)}
    elif boot == "cloud-init":
        spec["bootstrapTemplate"] = draw(NAMES)
    if draw(st.booleans()):
        spec["kubernetesVersion"] = "1.34.1"
    if draw(st.booleans()):
        spec["joinSecretRef"] = draw(NAMES)
    return spec


REQUIREMENT = st.builds(
    lambda k, op, vs: {"key": k, "operator": op, "values": vs},
    st.sampled_from(["tgp.io/gpu-type", "tgp.io/region", "example.com/x"]),
    st.sampled_from(["In", "NotIn"]),
    st.lists(NAMES, min_size=1, max_size=3, unique=True),
)
POOLS = st.builds(
    lambda reqs, labels: {"nodeClassRef": {"name": "c"}, "template": {"metadata": {"labels": labels}, "spec": {"requirements": reqs}}},
    st.lists(REQUIREMENT, max_size=3),
    st.dictionaries(NAMES, NAMES, max_size=3),
)

Mutation = Callable[[Obj, Obj, str], None]


def _talos(c: Obj) -> Obj:
    return c.setdefault("talosConfig", {"image": "i", "machineConfigTemplate": "t"})


def _first_provider(c: Obj) -> Obj:
    return c["providers"][0]


# Each changes one field that cannot change on a running node to a value it did not have.
REPLACEMENT: dict[str, Mutation] = {
    "talos image": lambda c, p, t: _talos(c).update(image=_talos(c)["image"] + f"-{t}"),
    "talos template": lambda c, p, t: _talos(c).update(machineConfigTemplate=_talos(c)["machineConfigTemplate"] + f" {t}"),
    "bootstrap template": lambda c, p, t: c.update(bootstrapTemplate=(c.get("bootstrapTemplate") or "") + f"#{t}"),
    "kubelet version": lambda c, p, t: c.update(kubernetesVersion="1.35.0" if c.get("kubernetesVersion") else "1.34.1"),
    "join secret": lambda c, p, t: c.update(joinSecretRef=(c.get("joinSecretRef") or "") + f"-{t}"),
    "tailnet tag": lambda c, p, t: c["tailscaleConfig"]["tags"].append(f"tag:new-{t}"),
    "ephemeral": lambda c, p, t: c["tailscaleConfig"].update(ephemeral=False),
    "accept routes": lambda c, p, t: c["tailscaleConfig"].update(acceptRoutes=True),
    "login server": lambda c, p, t: c["tailscaleConfig"].update(loginServer=f"https://{t}.example.com"),
    "oauth secret": lambda c, p, t: c["tailscaleConfig"].update(oauthSecretRef=f"oauth-{t}"),
    "credentials": lambda c, p, t: _first_provider(c).update(credentialsRef={"name": f"new-{t}", "key": "k"}),
    "pool class": lambda c, p, t: p["nodeClassRef"].update(name=f"other-{t}"),
}

# Each changes what is applied in place, or only the order of what is a set.
IN_PLACE: dict[str, Mutation] = {
    "labels": lambda c, p, t: p["template"]["metadata"]["labels"].update({f"new-{t}": t}),
    "taints": lambda c, p, t: p["template"]["spec"].setdefault("taints", []).append({"key": f"example.com/{t}", "effect": "NoSchedule"}),
    "timeouts": lambda c, p, t: p.update(disruption={"idleTimeout": "31m", "expireAfter": "720h", "drainTimeout": "1h"}),
    "budgets": lambda c, p, t: p.setdefault("disruption", {}).update(budgets=[{"nodes": "0", "schedule": "@daily", "duration": "1h"}]),
    "consolidation": lambda c, p, t: p.setdefault("disruption", {}).update(consolidation={}, terminationGracePeriod="24h"),
    "counts and price": lambda c, p, t: p.update(weight=7, minNodes=1, maxNodes=9, maxHourlyPrice="1.5"),
    "class limits": lambda c, p, t: c.update(limits={"maxNodes": 3, "maxHourlyCost": "9.5"}),
    "provider priority": lambda c, p, t: _first_provider(c).update(priority=5, enabled=False),
    "tag order": lambda c, p, t: c["tailscaleConfig"]["tags"].reverse(),
    "requirement order": lambda c, p, t: (p["template"]["spec"]["requirements"].reverse(), [r["values"].reverse() for r in p["template"]["spec"]["requirements"]]),
    "gpu type order": lambda c, p, t: c["instanceRequirements"]["gpuTypes"].reverse(),
    # Requirements are compared with each node (test_drift_by_compatibility.py), not hashed.
    "class gpu types": lambda c, p, t: c["instanceRequirements"]["gpuTypes"].append(f"NEW{t}"),
    "class regions": lambda c, p, t: c["instanceRequirements"]["regions"].append(f"new-{t}"),
    "gpu count": lambda c, p, t: c["instanceRequirements"].update(minGpuCount=2),
    "spot": lambda c, p, t: c["instanceRequirements"].update(spotAllowed=True),
    "pool requirement": lambda c, p, t: p["template"]["spec"]["requirements"].append({"key": "tgp.io/region", "operator": "In", "values": [f"new-{t}"]}),
}


# What each in-place change applies to running nodes (the rest touch no node: the pool's own
# budgets, counts and prices, the class's limits, or only an order).
APPLIED = {
    "labels": frozenset({"labels"}),
    "taints": frozenset({"taints"}),
    "timeouts": frozenset({"timeouts"}),
    "consolidation": frozenset({"timeouts"}),  # terminationGracePeriod rides along
}


def _hash(c: Obj, p: Obj) -> str:
    klass, pool = GPUNodeClassSpec.model_validate(c), GPUNodePoolSpec.model_validate(p)
    return drift_hash(klass, pool, klass.providers[0].name)


@settings(max_examples=50)
@given(classes(), POOLS, st.sampled_from(sorted(REPLACEMENT)), NAMES)
def test_changing_what_made_a_node_changes_its_hash(klass: Obj, pool: Obj, change: str, token: str) -> None:
    before = _hash(klass, pool)
    c, p = copy.deepcopy(klass), copy.deepcopy(pool)
    REPLACEMENT[change](c, p, token)
    after = _hash(c, p)
    assert after != before and drifted(before, after), change


@settings(max_examples=50)
@given(classes(), POOLS, st.sampled_from(sorted(IN_PLACE)), NAMES)
def test_changing_what_is_applied_in_place_keeps_the_hash(klass: Obj, pool: Obj, change: str, token: str) -> None:
    before = _hash(klass, pool)
    c, p = copy.deepcopy(klass), copy.deepcopy(pool)
    IN_PLACE[change](c, p, token)
    assert _hash(c, p) == before and not drifted(before, _hash(c, p)), change
    applied = in_place_changes(GPUNodePoolSpec.model_validate(pool), GPUNodePoolSpec.model_validate(p))
    assert applied == APPLIED.get(change, frozenset()) and applied <= set(IN_PLACE_FIELDS), change


@settings(max_examples=50)
@given(classes(), POOLS)
def test_another_providers_credentials_do_not_drift_this_node(klass: Obj, pool: Obj) -> None:
    before = _hash(klass, pool)
    c = copy.deepcopy(klass)
    others = [x for x in PROVIDERS if all(x != p["name"] for p in c["providers"])]
    c["providers"].append({"name": others[0], "credentialsRef": {"name": "theirs", "key": "k"}})
    assert _hash(c, pool) == before


def test_the_hash_is_the_same_in_every_process() -> None:
    """A fixed spec's hash, pinned: sha256 over canonical JSON, no Python hash(), no dict order."""
    klass = {"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:b", "tag:a"]}, "bootstrapTemplate": "#cloud-config"}
    pool = {"nodeClassRef": {"name": "c"}, "template": {"spec": {"requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}]}}}
    assert _hash(klass, pool) == f"{DRIFT_HASH_VERSION}-fea5d7ce4ac88ec0"
    reordered = {**klass, "tailscaleConfig": {"tags": ["tag:a", "tag:b"]}}
    assert _hash(dict(reversed(reordered.items())), pool) == _hash(klass, pool)


def test_a_hash_of_another_version_or_none_is_not_drift() -> None:
    v = DRIFT_HASH_VERSION
    assert not drifted(None, f"{v}-abc") and not drifted("v0-abc", f"{v}-def") and drifted(f"{v}-abc", f"{v}-def") and not drifted(f"{v}-abc", f"{v}-abc")


def test_a_class_template_change_drifts_a_node_and_a_pool_label_change_does_not() -> None:
    """The issue's examples: a new boot template replaces nodes; a new label is applied in place."""
    klass = {"providers": [{"name": "simulated"}], "bootstrapTemplate": "#cloud-config\nv1"}
    pool = {"nodeClassRef": {"name": "c"}, "template": {"metadata": {"labels": {"team": "a"}}}}
    made_with = _hash(klass, pool)
    assert drifted(made_with, _hash({**klass, "bootstrapTemplate": "#cloud-config\nv2"}, pool))
    assert not drifted(made_with, _hash(klass, {**pool, "template": {"metadata": {"labels": {"team": "b"}}}}))
