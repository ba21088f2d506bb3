"""Karpenter manifests apply unchanged where the meaning is the same (issue 35 item 10):
`expireAfter: Never`, `consolidateAfter: Never` (or a duration), and a do-not-disrupt value that
is a duration, which is never silently ignored."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crd_bridge.bridge import Bridge
from tgp.crds import ADMISSION, DisruptionBounds, GPUNodePoolSpec
from tgp.disruption import DO_NOT_DISRUPT_ANNOTATIONS, do_not_disrupt, do_not_disrupt_problem, holds
from tgp.drift import in_place_changes
from tgp.pools import node_timeouts
from workers.crdgen import manifests


def pool(**disruption: Any) -> GPUNodePoolSpec:
    return GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}, "disruption": disruption}, context={ADMISSION: DisruptionBounds()})


def _schema_pattern(field: str) -> str:
    crd = next(c for c in manifests().values() if c["spec"]["names"]["kind"] == "GPUNodePool")
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["disruption"]["properties"]
    return props[field]["pattern"]


@pytest.mark.parametrize("field", ["expireAfter", "consolidateAfter"])
def test_never_is_admitted_by_the_schema_and_the_model(field: str) -> None:
    assert re.match(_schema_pattern(field), "Never") and re.match(_schema_pattern(field), "720h")
    assert not re.match(_schema_pattern(field), "never") and not re.match(_schema_pattern(field), "")
    spec = pool(**{field: "Never"})
    assert spec.model_dump(mode="json", by_alias=True)["disruption"][field] == "Never", "it reads back as written"


def test_expire_after_never_is_no_expiry() -> None:
    assert node_timeouts(pool(expireAfter="Never"), floor=False).expire_after is None
    assert node_timeouts(pool(expireAfter="720h"), floor=False).expire_after == timedelta(hours=720)
    with pytest.raises(ValueError, match="below the minimum"):
        pool(expireAfter="1m")


def test_consolidate_after_never_turns_idle_out_and_consolidation_off() -> None:
    spec = pool(consolidateAfter="Never", consolidation={"cheaperBy": "20%"})
    assert node_timeouts(spec, floor=False).idle is None, "an empty node is never disrupted"
    assert spec.disruption.consolidation_policy is None, "no removal, no re-shop"
    assert pool(consolidation={}).disruption.consolidation_policy is not None


def test_consolidate_after_a_duration_is_how_long_a_node_may_be_empty() -> None:
    assert node_timeouts(pool(consolidateAfter="1m", idleTimeout="10m"), floor=False).idle == timedelta(minutes=1)
    assert node_timeouts(pool(idleTimeout="10m"), floor=False).idle == timedelta(minutes=10)
    with pytest.raises(ValueError, match="below the minimum"):
        pool(consolidateAfter="5s")
    assert "timeouts" in in_place_changes(pool(), pool(consolidateAfter="Never")), "it reaches running nodes"


# --- do-not-disrupt values ----------------------------------------------------------------------

GO_DURATIONS = st.builds(lambda n, unit: f"{n}{unit}", st.integers(1, 500), st.sampled_from(["s", "m", "h", "ms"]))
VALUES = st.one_of(st.sampled_from(["true", "false", "True", "yes", "1", "", "0s", "-5m", "4 h", "forever"]), GO_DURATIONS, st.text(max_size=8))


@given(st.sampled_from(DO_NOT_DISRUPT_ANNOTATIONS), VALUES)
def test_a_do_not_disrupt_value_is_never_silently_ignored(key: str, value: str) -> None:
    """Every value either holds as Karpenter's does ("true"), is "false", or is told to the pod:
    a duration holds (longer than Karpenter's grace period, said so), anything else does not
    hold (as in Karpenter, which ignores it too), said so."""
    annotations = {key: value}
    problem = do_not_disrupt_problem(annotations)
    if value in ("true", "false"):
        assert problem is None and do_not_disrupt(annotations) is (value == "true")
    else:
        assert problem is not None and key in problem
        assert do_not_disrupt(annotations) is holds(value)
    if re.fullmatch(r"[1-9][0-9]*(s|m|h|ms)", value):
        assert do_not_disrupt(annotations) and "for as long as the pod runs" in (problem or "")


class _Cluster:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    async def record_pod_event(self, pod: Any, *, type: str, reason: str, message: str, component: str = "tgp") -> None:
        self.events.append((f"{pod.namespace}/{pod.name}", reason, message))


def _pod(value: str, node: str = "gpu-a", uid: str = "u1") -> dict[str, Any]:
    meta = {"name": "train", "namespace": "ml", "uid": uid, "annotations": {"karpenter.sh/do-not-disrupt": value}}
    return {"metadata": meta, "spec": {"nodeName": node, "containers": []}, "status": {"phase": "Running"}}


async def test_the_bridge_tells_a_pod_on_a_tgp_node_once_per_value() -> None:
    cluster = _Cluster()
    bridge = Bridge(None, cluster)  # type: ignore[arg-type]
    bridge.facts.workflow_ids["gpu-a"] = "gpunode/ml/p/gpu-a"
    for value in ("4h", "4h", "true", "yes"):
        await bridge._warn_do_not_disrupt("ml/train", "MODIFIED", _pod(value))
    await bridge._warn_do_not_disrupt("other/x", "ADDED", _pod("4h", node="not-ours"))
    assert [(p, r) for p, r, _ in cluster.events] == [("ml/train", "DoNotDisruptValue")] * 2, cluster.events
    assert "holds its node for as long as the pod runs" in cluster.events[0][2] and "on node gpu-a" in cluster.events[0][2]
    assert "does not hold the node" in cluster.events[1][2]
    assert bridge.facts.holding.where == {}  # _warn only tells; on_pod counts the holders
    bridge.facts.on_pod("ADDED", _pod("4h"))
    assert bridge.facts.holding.where == {"ml/train": "gpu-a"}, "a duration holds the node"


