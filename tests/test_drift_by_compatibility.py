"""Drift by compatibility, not by hash (issue 35 item 7): a change of a pool's or class's
requirements drifts only the nodes that no longer satisfy them, as Karpenter's requirement
drift does (a NodeClaim drifts when its labels no longer satisfy its NodePool's requirements).
Widening a GPU-type list, or turning `In` into `Exists`, replaces nothing."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
from tgp.drift import drift_hash
from tgp.messages import PoolNode
from tgp.pool_disruption import Fleet, mark_replacements
from tgp.types import NodePhase

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
GPU, REGION, OTHER = "tgp.io/gpu-type", "tgp.io/region", "example.com/team"
VALUES = ["a", "b", "c", "d"]

REQUIREMENT = st.builds(
    lambda key, op, values: {"key": key, "operator": op, "values": values if op in ("In", "NotIn") else []},
    st.sampled_from([GPU, REGION, OTHER]),
    st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
    st.lists(st.sampled_from(VALUES), min_size=1, max_size=3, unique=True),
)
REQUIREMENTS = st.lists(REQUIREMENT, max_size=4)
CLASS_REQUIREMENTS = st.fixed_dictionaries(
    {},
    optional={
        "gpuTypes": st.lists(st.sampled_from(VALUES), max_size=3, unique=True),
        "regions": st.lists(st.sampled_from(VALUES), max_size=3, unique=True),
        "minGpuCount": st.integers(1, 4),
        "spotAllowed": st.booleans(),
    },
)


def klass(requirements: dict[str, Any]) -> GPUNodeClassSpec:
    return GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "instanceRequirements": requirements})


def pool(requirements: list[dict[str, Any]]) -> GPUNodePoolSpec:
    return GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}, "template": {"spec": {"requirements": requirements}}})


def satisfies(labels: dict[str, str], r: dict[str, Any]) -> bool:
    """Kubernetes' node-selector semantics, written out for the test."""
    present = r["key"] in labels
    return {
        "In": present and labels.get(r["key"]) in r["values"],
        "NotIn": not present or labels.get(r["key"]) not in r["values"],
        "Exists": present,
        "DoesNotExist": not present,
    }[r["operator"]]


def should_drift(gpu: str, region: str, gpus: int, spot: bool, reqs: list[dict[str, Any]], ir: dict[str, Any]) -> bool:
    """The promise: the node drifts iff it no longer satisfies the requirements on what its
    offer decides (GPU type, region: a requirement on another key is the pool's own label, the
    same on every node, a new one too) or the class's instanceRequirements. DoesNotExist on a
    label every node carries no node could meet: not drift (a replacement would fail it too)."""
    labels = {GPU: gpu, REGION: region}
    pool_unmet = any(r["key"] in labels and r["operator"] != "DoesNotExist" and not satisfies(labels, r) for r in reqs)
    class_unmet = (
        (bool(ir.get("gpuTypes")) and gpu not in ir["gpuTypes"])
        or (bool(ir.get("regions")) and region not in ir["regions"])
        or gpus < ir.get("minGpuCount", 1)
        or (spot and not ir.get("spotAllowed", False))
    )
    return pool_unmet or class_unmet


def ready_node(made_with: str, gpu: str, region: str | None, gpus: int, spot: bool | None) -> dict[str, PoolNode]:
    n = PoolNode(
        workflow_id="gpunode/ml/p/n0",
        node_name="n0",
        phase=NodePhase.READY,
        created_at=T0 - timedelta(hours=1),
        phase_at=T0 - timedelta(hours=1),
        provider="simulated",
        gpu_type=gpu,
        region=region,
        spot=spot,
        gpus=gpus,
        hourly_price=Decimal("1.0"),
        drift_hash=made_with,
    )
    return {n.workflow_id: n}


def marked(nodes: dict[str, PoolNode], k: GPUNodeClassSpec, p: GPUNodePoolSpec) -> bool:
    marks = mark_replacements(nodes, k, p, Fleet(), T0)
    update = marks.updates.get("gpunode/ml/p/n0", {})
    return bool(update.get("drifted")) and update.get("replace_reason") == "Drifted"


@given(
    REQUIREMENTS, REQUIREMENTS, CLASS_REQUIREMENTS, CLASS_REQUIREMENTS,
    st.sampled_from(VALUES), st.sampled_from(VALUES), st.integers(1, 4), st.booleans(),
)  # fmt: skip
def test_a_node_drifts_iff_it_no_longer_satisfies_the_requirements(
    old_reqs: list[dict[str, Any]], new_reqs: list[dict[str, Any]], old_ir: dict[str, Any], new_ir: dict[str, Any],
    gpu: str, region: str, gpus: int, spot: bool,
) -> None:  # fmt: skip
    """Over any change of the pool's and class's requirements and any node: the hash of what
    cannot be compared stays, and the node drifts exactly when it fails the new requirements
    (whether it met the old ones or not does not count)."""
    made_with = drift_hash(klass(old_ir), pool(old_reqs), "simulated")
    assert drift_hash(klass(new_ir), pool(new_reqs), "simulated") == made_with, "requirements are compared, not hashed"
    nodes = ready_node(made_with, gpu, region, gpus, spot)
    assert marked(nodes, klass(new_ir), pool(new_reqs)) == should_drift(gpu, region, gpus, spot, new_reqs, new_ir)


@given(REQUIREMENTS, st.sampled_from(VALUES), st.integers(1, 4))
def test_what_is_not_known_of_a_node_is_never_drift(reqs: list[dict[str, Any]], gpu: str, gpus: int) -> None:
    """A node whose region (or spot-ness) its pool does not know (a node of an older build, or
    adopted after a restart) drifts only for what is known of it."""
    k = klass({})
    nodes = ready_node(drift_hash(k, pool([]), "simulated"), gpu, None, gpus, None)
    known = [r for r in reqs if r["key"] == GPU]
    assert marked(nodes, k, pool(reqs)) == should_drift(gpu, "unknown", gpus, False, known, {})


def test_widening_the_gpu_types_or_in_to_exists_drifts_no_node_and_narrowing_drifts_only_the_excluded() -> None:
    """The issue's examples."""
    k = klass({})
    before = pool([{"key": GPU, "operator": "In", "values": ["RTX4090"]}])
    made_with = drift_hash(k, before, "simulated")
    rtx = ready_node(made_with, "RTX4090", "eu", 1, False)
    widened = pool([{"key": GPU, "operator": "In", "values": ["RTX4090", "A100"]}])
    exists = pool([{"key": GPU, "operator": "Exists"}])
    assert not marked(rtx, k, widened) and not marked(rtx, k, exists)
    narrowed = pool([{"key": GPU, "operator": "In", "values": ["A100"]}])
    assert marked(rtx, k, narrowed)
    note = mark_replacements(rtx, k, narrowed, Fleet(), T0).notes[0]
    assert note.reason == "NodeDrifted" and "tgp.io/gpu-type=RTX4090 does not satisfy the pool's requirement In [A100]" in note.message, note
    assert not marked(ready_node(made_with, "A100", "eu", 1, False), k, narrowed)


def test_a_class_template_change_still_drifts_by_hash() -> None:
    before = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "bootstrapTemplate": "#cloud-config\nv1"})
    after = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "bootstrapTemplate": "#cloud-config\nv2"})
    p = pool([])
    assert marked(ready_node(drift_hash(before, p, "simulated"), "A100", "eu", 1, False), after, p)
