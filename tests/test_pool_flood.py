"""A flood of pending pods (issue 35): the pool's carried state and the demand signal stay far
below Temporal's 2 MiB payload limit whatever a tenant creates. A pool plans for at most
MAX_PODS_TRACKED pending pods at a time (oldest first, `tgp.demand.tracked`); the rest wait, and
its PodsTracked condition says how many. Before, 10,000 pending pods made a ~2.6 MB state and
continue-as-new was refused."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from tgp.capacity import CapacityNode, plan_capacity
from tgp.demand import MAX_PODS_TRACKED, PendingPod, tracked, unsold_counts, unsold_gpu_resources
from tgp.messages import Demand
from tgp.pool_plan import pods_tracked
from workflows.pool import GPUNodePoolWorkflow, PoolInput

AT = datetime(2026, 1, 1, tzinfo=timezone.utc)
LIMIT = 512 * 1024


def flood(count: int, name: str = "train-job-{i:05d}-worker") -> list[PendingPod]:
    return [PendingPod(namespace="ml-team", name=name.format(i=i), gpus=1 + i % 3, created=AT + timedelta(seconds=i)) for i in range(count)]


def bridge_demand(pods: list[PendingPod]) -> Demand:
    """The demand the bridge sends for `pods` (crd_bridge.bridge.Bridge.send_demand)."""
    chosen, untracked = tracked(p for p in pods if not p.unsold)
    return Demand(
        pods=sorted(p.key for p in chosen),
        observed_at=AT,
        pod_gpus={p.key: p.gpus for p in chosen if p.gpus != 1},
        unsold=unsold_counts(pods),
        untracked=untracked,
    )


@pytest.mark.parametrize("count", [10_000, 50_000])
@pytest.mark.parametrize("name", ["train-job-{i:05d}-worker", "j{i:05d}-" + "x" * 240])
def test_a_flood_of_pending_pods_keeps_the_carried_state_small(count: int, name: str) -> None:
    d = bridge_demand(flood(count, name))
    assert len(d.pods) <= MAX_PODS_TRACKED and d.untracked == count - len(d.pods)
    assert len(d.model_dump_json()) < LIMIT, "one demand signal"
    pool = GPUNodePoolWorkflow(PoolInput(namespace="ml", name="p"))
    pool.demand(d)  # the pool's own signal handler
    state = pool.state
    # Every tracked pod nominated to a launching node (the most the state holds per pod).
    nodes = [CapacityNode(workflow_id=f"gpunode/ml/p/p-{i:05d}", node_name=f"p-{i:05d}", launching=True, gpus=8) for i in range(len(d.pods))]
    pending = {pod: state.pod_gpus.get(pod, 1) for pod in state.demand}
    plan = plan_capacity(pending, nodes, {}, set(), AT)
    state.nominations = dict(plan.nominations)
    assert len(state.nominations) == len(d.pods), "every tracked pod is served"
    carried = PoolInput(namespace="ml", name="p", state=state).model_dump_json()
    assert len(carried) < LIMIT, f"{len(carried)} bytes carried across continue-as-new"
    assert state.untracked == d.untracked
    assert pods_tracked(state.untracked, MAX_PODS_TRACKED)[:2] == ("False", "TooManyPending")


def test_the_oldest_pods_are_tracked_first_and_the_choice_is_stable() -> None:
    pods = flood(3 * MAX_PODS_TRACKED)
    chosen, untracked = tracked(reversed(pods))
    assert [p.key for p in chosen] == [p.key for p in pods[:MAX_PODS_TRACKED]] and untracked == 2 * MAX_PODS_TRACKED
    newer = PendingPod(namespace="ml-team", name="late", created=AT + timedelta(days=1))
    assert tracked([*pods, newer])[0] == chosen, "a newer pod waits its turn"
    assert tracked(pods[:10]) == (pods[:10], 0)
    assert pods_tracked(0, MAX_PODS_TRACKED)[0] == "True"


def test_gpu_resources_tgp_does_not_sell_are_named_and_cut() -> None:
    def pod(**limits: str) -> dict[str, object]:
        return {"spec": {"containers": [{"resources": {"limits": {"cpu": "1", "memory": "1Gi", **limits}}}]}}

    assert unsold_gpu_resources(pod(**{"nvidia.com/gpu": "1"})) == []
    assert unsold_gpu_resources(pod(**{"nvidia.com/mig-1g.10gb": "1", "amd.com/gpu": "2"})) == ["amd.com/gpu", "nvidia.com/mig-1g.10gb"]
    [cut] = unsold_gpu_resources(pod(**{"nvidia.com/" + "x" * 300: "1"}))
    assert len(cut) <= 80
    init = {"spec": {"initContainers": [{"resources": {"requests": {"gpu.intel.com/i915": "1"}}}]}}
    assert unsold_gpu_resources(init) == ["gpu.intel.com/i915"]
