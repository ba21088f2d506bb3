"""Demand from pending pods: matching, weights, taints, batching and node counts. Pure."""

from datetime import datetime, timedelta, timezone

import pytest

from tgp.crds import GPUNodePoolSpec
from tgp.demand import Batch, PendingPod, PoolCandidate, Toleration, UnreadablePod, assign_pods, gpu_request, pending_gpu_pod, pod_fits_pool
from tgp.crds import NodeSelectorRequirement as Req

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
GPU_TOLERATION = Toleration(key="nvidia.com/gpu", operator="Exists")


def pool(name: str, weight: int = 0, gpus: list[str] | None = None, regions: list[str] | None = None, taint: bool = True, labels: dict[str, str] | None = None) -> PoolCandidate:
    reqs = []
    if gpus:
        reqs.append({"key": "tgp.io/gpu-type", "operator": "In", "values": gpus})
    if regions:
        reqs.append({"key": "tgp.io/region", "operator": "In", "values": regions})
    spec = GPUNodePoolSpec.model_validate(
        {
            "nodeClassRef": {"name": "c"},
            "weight": weight,
            "template": {
                "metadata": {"labels": labels or {}},
                "spec": {"requirements": reqs, "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}] if taint else []},
            },
        }
    )
    return PoolCandidate(namespace="ml", name=name, spec=spec)


def pod(name: str = "p", **kw: object) -> PendingPod:
    kw.setdefault("tolerations", [GPU_TOLERATION])
    return PendingPod(namespace="ml", name=name, **kw)  # type: ignore[arg-type]


def test_node_selector_on_gpu_type() -> None:
    rtx = pool("rtx", gpus=["RTX4090"])
    assert pod_fits_pool(pod(node_selector={"tgp.io/gpu-type": "RTX4090"}), rtx)
    assert not pod_fits_pool(pod(node_selector={"tgp.io/gpu-type": "A100-80GB"}), rtx)
    assert pod_fits_pool(pod(node_selector={"tgp.io/gpu-type": "A100-80GB"}), pool("any")), "an unconstrained pool can pick any GPU"


def test_unknown_label_must_be_a_pool_label() -> None:
    assert not pod_fits_pool(pod(node_selector={"disktype": "ssd"}), pool("a"))
    assert pod_fits_pool(pod(node_selector={"disktype": "ssd"}), pool("a", labels={"disktype": "ssd"}))
    assert pod_fits_pool(pod(node_selector={"tgp.io/pool": "a"}), pool("a"))


def test_required_affinity_is_an_or_of_ands() -> None:
    p = pool("eu", gpus=["RTX4090"], regions=["eu-west"])
    us_only = [[Req(key="tgp.io/region", operator="In", values=["us-east"])]]
    either = us_only + [[Req(key="tgp.io/region", operator="In", values=["eu-west"]), Req(key="tgp.io/gpu-type", operator="NotIn", values=["A100-80GB"])]]
    assert not pod_fits_pool(pod(affinity_terms=us_only), p)
    assert pod_fits_pool(pod(affinity_terms=either), p)
    assert not pod_fits_pool(pod(affinity_terms=[[Req(key="tgp.io/gpu-type", operator="DoesNotExist")]]), p)


def test_taints_need_tolerations() -> None:
    assert not pod_fits_pool(pod(tolerations=[]), pool("a"))
    assert pod_fits_pool(pod(tolerations=[]), pool("a", taint=False))
    assert pod_fits_pool(pod(tolerations=[Toleration(key="nvidia.com/gpu", value="true")]), pool("a"))
    assert not pod_fits_pool(pod(tolerations=[Toleration(key="nvidia.com/gpu", value="false")]), pool("a"))


def test_highest_weight_wins_and_each_pod_counts_once() -> None:
    low, high = pool("low", weight=1), pool("high", weight=50, gpus=["RTX4090"])
    pods = [pod("a", node_selector={"tgp.io/gpu-type": "RTX4090"}), pod("b", node_selector={"tgp.io/gpu-type": "A100-80GB"})]
    assigned = assign_pods(pods, [low, high])
    assert [p.name for p in assigned["ml/high"]] == ["a"]
    assert [p.name for p in assigned["ml/low"]] == ["b"]


def test_pending_gpu_pod_reads_the_pod_object() -> None:
    obj = {
        "metadata": {"name": "train", "namespace": "ml"},
        "spec": {
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}],
            "nodeSelector": {"tgp.io/gpu-type": "RTX4090"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }
    p = pending_gpu_pod(obj)
    assert p is not None and p.gpus == 2 and p.node_selector == {"tgp.io/gpu-type": "RTX4090"}
    assert pending_gpu_pod({**obj, "spec": {**obj["spec"], "nodeName": "n1"}}) is None, "already bound"
    assert pending_gpu_pod({**obj, "status": {"phase": "Pending"}}) is None, "not (yet) unschedulable"
    cpu_only = {**obj, "spec": {**obj["spec"], "containers": [{"name": "c"}]}}
    assert pending_gpu_pod(cpu_only) is None


def test_batch_closes_after_idle_or_max_window() -> None:
    b = Batch().add(T0)
    assert not b.due(T0 + timedelta(milliseconds=900))
    assert b.due(T0 + timedelta(seconds=1))
    for i in range(1, 12):
        b = b.add(T0 + timedelta(milliseconds=900 * i))  # a steady trickle keeps it open ...
    assert b.due(T0 + timedelta(seconds=10)), "... but not beyond the maximum window"
    assert Batch().add(T0).wait(T0) == timedelta(seconds=1)


def test_a_multi_gpu_pod_asks_the_pool_for_nodes_with_that_many_gpus() -> None:
    from tgp.crds import GPUNodeClassSpec
    from tgp.pools import node_request

    klass = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "instanceRequirements": {"minGpuCount": 1}})
    p = pool("rtx", gpus=["RTX4090"]).spec
    req = node_request(namespace="ml", pool_name="rtx", class_name="c", node_name="n", pool=p, klass=klass, min_gpus=4)
    assert req.requirements.min_gpu_count == 4
    assert node_request(namespace="ml", pool_name="rtx", class_name="c", node_name="n", pool=p, klass=klass).requirements.min_gpu_count == 1


def unschedulable_pod(**spec: object) -> dict:
    """A pending, unschedulable pod object asking for one GPU, with `spec` fields on top."""
    container = {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
    return {
        "metadata": {"name": "odd", "namespace": "ml"},
        "spec": {"containers": [container], "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}], **spec},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]},
    }


def required_terms(*terms: dict) -> dict:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}


def test_gt_and_lt_compare_label_values_as_integers() -> None:
    def with_cuda(op: str, value: str) -> dict:
        return unschedulable_pod(affinity=required_terms({"matchExpressions": [{"key": "cuda-major", "operator": op, "values": [value]}]}))

    cuda12 = pool("a", labels={"cuda-major": "12"})
    assert pod_fits_pool(pending_gpu_pod(with_cuda("Gt", "11")), cuda12)  # type: ignore[arg-type]
    assert not pod_fits_pool(pending_gpu_pod(with_cuda("Gt", "12")), cuda12)  # type: ignore[arg-type]
    assert pod_fits_pool(pending_gpu_pod(with_cuda("Lt", "100")), cuda12)  # type: ignore[arg-type]
    assert not pod_fits_pool(pending_gpu_pod(with_cuda("Lt", "9")), cuda12)  # type: ignore[arg-type]
    assert not pod_fits_pool(pending_gpu_pod(with_cuda("Gt", "1")), pool("b")), "no such label on the pool's nodes"  # type: ignore[arg-type]
    assert not pod_fits_pool(pending_gpu_pod(with_cuda("Gt", "1")), pool("c", labels={"cuda-major": "twelve"}))  # type: ignore[arg-type]
    gpu_type_gt = unschedulable_pod(affinity=required_terms({"matchExpressions": [{"key": "tgp.io/gpu-type", "operator": "Gt", "values": ["3"]}]}))
    assert not pod_fits_pool(pending_gpu_pod(gpu_type_gt), pool("d")), "GPU types are names, never integers"  # type: ignore[arg-type]


def test_a_pod_pinned_to_a_node_name_fits_no_new_node() -> None:
    pinned = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-7"]}]}
    with pytest.raises(UnreadablePod) as skipped:
        pending_gpu_pod(unschedulable_pod(affinity=required_terms(pinned)))
    assert skipped.value.reason == "match_fields"
    either = unschedulable_pod(affinity=required_terms(pinned, {"matchExpressions": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}]}))
    p = pending_gpu_pod(either)
    assert p is not None and pod_fits_pool(p, pool("rtx", gpus=["RTX4090"])), "the other term can still be met"
    assert not pod_fits_pool(p, pool("a100", gpus=["A100-80GB"]))


def test_gpu_quantities_are_kubernetes_quantities() -> None:
    def gpus(value: object, kind: str = "limits") -> int:
        obj = unschedulable_pod()
        obj["spec"]["containers"] = [{"name": "c", "resources": {kind: {"nvidia.com/gpu": value}}}]
        return gpu_request(obj)

    assert gpus("1") == 1 and gpus(2) == 2 and gpus("+3", "requests") == 3
    assert gpus("1k") == 1000 and gpus("2e1") == 20 and gpus("1Ki") == 1024 and gpus("2000m") == 2
    for bad in ("500m", "1.5", "-1", "one", "", "1kk", "0x10", True):
        with pytest.raises(UnreadablePod) as skipped:
            gpus(bad)
        assert skipped.value.reason == "gpu_quantity", bad


@pytest.mark.parametrize(
    "spec",
    [
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Sometimes"}]},
        {"tolerations": [{"key": "nvidia.com/gpu", "operator": None}]},
        {"tolerations": "all"},
        {"tolerations": [7]},
        {"nodeSelector": ["tgp.io/gpu-type"]},
        {"affinity": required_terms({"matchExpressions": [{"key": "k", "operator": "Near", "values": ["x"]}]})},
        {"affinity": required_terms({"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["1", "2"]}]})},
        {"affinity": required_terms({"matchExpressions": [{"key": "k", "operator": "Lt", "values": ["high"]}]})},
        {"affinity": required_terms({})},
        {"affinity": {"nodeAffinity": "yes"}},
        {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "500m"}}}]},
        {"containers": {"c": {}}},
    ],
)
def test_odd_pod_shapes_are_skipped_or_read_never_raise_anything_else(spec: dict) -> None:
    try:
        result = pending_gpu_pod(unschedulable_pod(**spec))
    except UnreadablePod as skipped:
        assert skipped.reason and isinstance(skipped.reason, str)
        return
    assert result is not None
    assert not pod_fits_pool(result, pool("a")), "a toleration it cannot read does not tolerate the pool's taint"
    assert pod_fits_pool(result, pool("b", taint=False))


def test_capacity_a_launching_floor_node_takes_a_pod_and_borrowing_is_tried_once() -> None:
    from datetime import datetime, timedelta, timezone

    from tgp.capacity import CapacityNode, Nomination, plan_capacity

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
    floor = CapacityNode(workflow_id="floor", node_name="n-floor", launching=True)
    plan = plan_capacity({"ns/p": 1}, [floor], {}, set(), t0)
    assert plan.uncovered == [] and plan.nominations["ns/p"].workflow_id == "floor", "a launching node nobody waits for takes the pod"

    busy = CapacityNode(workflow_id="busy", node_name="n-busy", ready_at=t0, free_gpus=1)
    plan = plan_capacity({"ns/q": 1}, [busy], {}, set(), t0)
    assert plan.nominations["ns/q"] == Nomination(workflow_id="busy", since=t0, bought=False)
    later = plan_capacity({"ns/q": 1}, [busy], plan.nominations, set(), t0 + timedelta(minutes=5))
    assert later.newly_unfit == [] and later.borrow_failed == ["ns/q"] and later.uncovered == ["ns/q"], (
        "a pod that did not bind where it borrowed GPUs is not unfit: it gets a node of its own"
    )
    again = plan_capacity({"ns/q": 1}, [busy], {}, set(), t0 + timedelta(minutes=6), no_borrow={"ns/q"})
    assert again.uncovered == ["ns/q"], "and it does not borrow from the same kind of node again"

    bought = plan_capacity({"ns/r": 1}, [busy], {"ns/r": Nomination(workflow_id="busy", since=t0)}, set(), t0 + timedelta(minutes=5))
    assert bought.newly_unfit == ["ns/r"] and bought.uncovered == [], "a pod that did not bind on its own node does not fit"

    draining = CapacityNode(workflow_id="old", node_name="n-old")
    assert plan_capacity({"ns/s": 1}, [draining], {}, set(), t0).uncovered == ["ns/s"], "a node on its way out takes nothing"
