"""activities.drain over the real `KubernetesCluster` adapter and HTTP, against the emulator or
(with TGP_TEST_KUBECONFIG) a real cluster: a drain is over when the evicted pods are gone, not
when their evictions were accepted (docs/reference/kubernetes-testing.md).

On a real cluster the test Nodes have no kubelet, so `kubelet_of` plays its part of a graceful
deletion (the final delete once the grace period has passed); the emulator does that itself.
Pods owned by a made-up controller run on the emulator only: a real garbage collector deletes
pods whose owner does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from tests.kube_env import KubeApi, eventually

from activities.drain import EVENT_DRAIN_TIMED_OUT, EVENT_UNMANAGED, drain
from tgp.types import DrainInput, DrainResult

POLL = timedelta(seconds=0.1)
# Long enough for every drain here to finish; the tests that hit a deadline set a short one.
TIMEOUT = timedelta(seconds=30)
LONG_GRACE = 120  # seconds: a pod that is still shutting down when the test ends


@contextlib.asynccontextmanager
async def kubelet_of(kube_api: KubeApi, node: str) -> AsyncIterator[None]:
    """On a real cluster, finish the graceful deletions of pods on `node` once due, as its
    kubelet would when the containers have stopped."""
    if not kube_api.real:
        yield
        return

    # A kubelet gives the containers the whole grace period from when it sees the deletion;
    # the deletionTimestamp is written in whole seconds, so it may read up to a second early.
    seen: dict[str, datetime] = {}

    async def confirm_deletions() -> None:
        while True:
            listing = await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/pods?fieldSelector=spec.nodeName={node}")
            for pod in (listing or {}).get("items") or []:
                meta = pod["metadata"]
                if not meta.get("deletionTimestamp"):
                    continue
                grace = timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))
                if seen.setdefault(meta["uid"], datetime.now(UTC)) + grace <= datetime.now(UTC):
                    await kube_api.http.request(
                        "DELETE", f"/api/v1/namespaces/{kube_api.namespace}/pods/{meta['name']}",
                        json={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}},
                    )
            await asyncio.sleep(0.2)

    task = asyncio.create_task(confirm_deletions())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def run_drain(kube_api: KubeApi, node: str, timeout: timedelta = TIMEOUT, heartbeats: list[int] | None = None) -> DrainResult:
    beats = heartbeats if heartbeats is not None else []
    return await drain(kube_api.cluster, DrainInput(node_name=node, timeout=timeout), poll_interval=POLL, heartbeat=beats.append)


async def pod(kube_api: KubeApi, name: str) -> dict[str, Any] | None:
    return await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/pods/{name}")


async def events_about(kube_api: KubeApi, name: str) -> list[dict[str, Any]]:
    listing = await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/events")
    return [e for e in (listing or {}).get("items") or [] if e["involvedObject"].get("name") == name]


async def test_drain_waits_until_evicted_pods_are_gone(kube_api: KubeApi) -> None:
    node = kube_api.unique("drain")
    await kube_api.create_node(node)
    await kube_api.create_pod("trainer", node=node, grace_period=2)
    await kube_api.create_pod("static", node=node, mirror=True)
    heartbeats: list[int] = []

    async with kubelet_of(kube_api, node):
        started = asyncio.get_running_loop().time()
        result = await run_drain(kube_api, node, heartbeats=heartbeats)
        took = asyncio.get_running_loop().time() - started

    assert result == DrainResult(evicted=1)
    assert await pod(kube_api, "trainer") is None, "the drain returned while the pod was still shutting down"
    assert took >= 2, "the pod had a 2 s grace period"
    assert await pod(kube_api, "static") is not None, "mirror pods belong to the kubelet"
    assert heartbeats and heartbeats[-1] == 1, "a heartbeat on every poll"
    drained = await kube_api.cluster.get_node(node)
    assert drained is not None and drained.unschedulable


async def test_drain_retries_a_pod_its_budget_blocks_until_the_budget_allows(kube_api: KubeApi) -> None:
    node, elsewhere = kube_api.unique("pdb"), kube_api.unique("elsewhere")
    await kube_api.create_node(node)
    await kube_api.create_node(elsewhere)
    for name in ("a", "b"):
        await kube_api.create_pod(name, node=node, labels={"app": "web"}, grace_period=1)
    await kube_api.create_pdb("web", match_labels={"app": "web"}, min_available=1)

    async with kubelet_of(kube_api, node):
        draining = asyncio.create_task(run_drain(kube_api, node))

        async def one_gone_one_blocked() -> bool:
            left = await kube_api.cluster.list_pods_on_node(node)
            return len(left) == 1 and not left[0].deleting

        await eventually(one_gone_one_blocked, timeout=20)
        [blocked] = await kube_api.cluster.list_pods_on_node(node)
        assert not draining.done(), "the drain waits for the blocked pod"
        if kube_api.emulator is not None:
            path = f"post /api/v1/namespaces/{kube_api.namespace}/pods/{blocked.name}/eviction"
            assert len(kube_api.emulator[path]) >= 2, "the blocked eviction was retried"

        # The replacement starts elsewhere (a controller would create it): the budget has room again.
        await kube_api.create_pod("c", node=elsewhere, labels={"app": "web"})
        result = await asyncio.wait_for(draining, TIMEOUT.total_seconds())

    assert result == DrainResult(evicted=2)
    assert await kube_api.cluster.list_pods_on_node(node) == []


async def test_drain_reports_pods_not_evicted_and_pods_still_shutting_down_at_the_deadline(kube_api: KubeApi) -> None:
    node = kube_api.unique("deadline")
    await kube_api.create_node(node)
    await kube_api.create_pod("slow", node=node, grace_period=LONG_GRACE)
    await kube_api.create_pod("guarded", node=node, labels={"app": "db"})
    await kube_api.create_pdb("db", match_labels={"app": "db"}, min_available=1)

    async with kubelet_of(kube_api, node):
        result = await run_drain(kube_api, node, timeout=timedelta(seconds=1))

    ns = kube_api.namespace
    assert result == DrainResult(evicted=1, remaining=[f"{ns}/guarded"], terminating=[f"{ns}/slow"])
    slow = await pod(kube_api, "slow")
    assert slow is not None and slow["metadata"]["deletionGracePeriodSeconds"] == LONG_GRACE


async def test_a_drain_bounded_by_termination_grace_deletes_a_blocked_pod_its_own_grace_before_the_deadline(kube_api: KubeApi) -> None:
    """With delete_at_deadline (the pool's terminationGracePeriod is the bound) a pod whose PDB
    refuses its eviction is deleted over the PDB at the deadline minus its own grace, with that
    grace (or what is left), and told so by a Warning Event; without it, the pod stays."""
    from activities.drain import EVENT_DELETED_AT_GRACE

    grace = 3  # the pod's terminationGracePeriodSeconds; the deadline 2 s after it is due for deletion
    node = kube_api.unique("grace")
    await kube_api.create_node(node)
    await kube_api.create_pod("guarded", node=node, labels={"app": "db"}, grace_period=grace)
    await kube_api.create_pdb("db", match_labels={"app": "db"}, min_available=1)
    inp = DrainInput(node_name=node, timeout=timedelta(seconds=grace + 2), bound="terminationGracePeriod", delete_at_deadline=True)

    async with kubelet_of(kube_api, node):
        started = asyncio.get_running_loop().time()
        result = await drain(kube_api.cluster, inp, poll_interval=POLL, heartbeat=lambda _: None)
        took = asyncio.get_running_loop().time() - started

    ns = kube_api.namespace
    assert result.deleted == [f"{ns}/guarded"] and result.evicted == 0, result
    assert took >= 2, "deleted before the deadline minus its grace"
    guarded = await pod(kube_api, "guarded")
    assert guarded is None or 0 < guarded["metadata"]["deletionGracePeriodSeconds"] <= grace, guarded
    [said] = [e for e in await events_about(kube_api, "guarded") if e["reason"] == EVENT_DELETED_AT_GRACE]
    assert "overrides PodDisruptionBudgets" in said["message"], said["message"]


async def test_drain_waits_for_pods_someone_else_deleted(kube_api: KubeApi) -> None:
    # A pod deleted before the drain started is shutting down on this machine all the same.
    node = kube_api.unique("predeleted")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=LONG_GRACE)
    response = await kube_api.http.delete(f"/api/v1/namespaces/{kube_api.namespace}/pods/job")
    assert response.status_code == 200, response.text

    async with kubelet_of(kube_api, node):
        result = await run_drain(kube_api, node, timeout=timedelta(seconds=1))

    assert result == DrainResult(evicted=0, terminating=[f"{kube_api.namespace}/job"])


async def test_evicting_an_unmanaged_pod_records_a_warning_event_on_it(kube_api: KubeApi) -> None:
    node = kube_api.unique("bare")
    await kube_api.create_node(node)
    created = await kube_api.create_pod("scratch", node=node)

    async with kubelet_of(kube_api, node):
        assert await run_drain(kube_api, node) == DrainResult(evicted=1)

    [event] = await events_about(kube_api, "scratch")
    assert (event["type"], event["reason"]) == ("Warning", EVENT_UNMANAGED)
    involved = event["involvedObject"]
    assert (involved["kind"], involved["namespace"], involved["uid"]) == ("Pod", kube_api.namespace, created["metadata"]["uid"])
    assert node in event["message"] and "will not be recreated" in event["message"]


async def _real_owner(kube_api: KubeApi, kind: str, name: str, node_selector: dict[str, str]) -> dict[str, str]:
    """A real ReplicaSet (1 replica) or DaemonSet (OnDelete: it never replaces a pod by itself)
    whose selector matches the pod made for it, so the garbage collector keeps that pod and the
    controller adopts it; `node_selector` keeps any pod it makes off other nodes."""
    labels = {"app": name}
    template = {"metadata": {"labels": labels}, "spec": {"nodeSelector": node_selector, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9"}]}}
    spec: dict[str, object] = {"selector": {"matchLabels": labels}, "template": template}
    if kind == "DaemonSet":
        spec["updateStrategy"] = {"type": "OnDelete"}
    else:
        spec["replicas"] = 1
    plural = "daemonsets" if kind == "DaemonSet" else "replicasets"
    made = await kube_api.create(f"/apis/apps/v1/namespaces/{kube_api.namespace}/{plural}", {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name}, "spec": spec})
    return {"owner_kind": kind, "owner_name": name, "owner_uid": made["metadata"]["uid"], "labels": labels}


async def test_drain_leaves_daemonset_pods_and_records_no_event_for_managed_pods(kube_api: KubeApi) -> None:
    node = kube_api.unique("managed")
    if kube_api.real:  # real owners: a real garbage collector deletes a pod whose owner does not exist
        await kube_api.create_node(node, labels={"tgp.io/test-daemons": node})
        web = await _real_owner(kube_api, "ReplicaSet", "web-rs", {"tgp.io/test-nowhere": "x"})
        agent = await _real_owner(kube_api, "DaemonSet", "agent-ds", {"tgp.io/test-daemons": node})
        labels = {"web": web.pop("labels"), "agent": agent.pop("labels")}
        await kube_api.create_pod("web", node=node, labels=labels["web"], **web)
        await kube_api.create_pod("agent", node=node, labels=labels["agent"], **agent)
    else:
        await kube_api.create_node(node)
        await kube_api.create_pod("web", node=node, owner_kind="ReplicaSet")
        await kube_api.create_pod("agent", node=node, owner_kind="DaemonSet")

    assert await run_drain(kube_api, node) == DrainResult(evicted=1)
    assert [p.name for p in await kube_api.cluster.list_pods_on_node(node)] == ["agent"]
    assert await events_about(kube_api, "web") == []


async def test_drain_of_a_node_that_is_gone_does_nothing(kube_api: KubeApi) -> None:
    heartbeats: list[int] = []
    assert await run_drain(kube_api, kube_api.unique("gone"), heartbeats=heartbeats) == DrainResult(evicted=0)
    assert heartbeats == []


async def test_drain_leaves_completed_pods_alone_and_warns_about_none_of_them(kube_api: KubeApi) -> None:
    # Issue 17 item 20: every scale-down warned `EvictedUnmanagedPod` about Jobs' finished pods.
    node = kube_api.unique("completed")
    await kube_api.create_node(node)
    await kube_api.create_pod("done", node=node, phase="Succeeded")
    await kube_api.create_pod("crashed", node=node, phase="Failed")
    await kube_api.create_pod("scratch", node=node)

    async with kubelet_of(kube_api, node):
        assert await run_drain(kube_api, node) == DrainResult(evicted=1)

    assert await events_about(kube_api, "done") == [] and await events_about(kube_api, "crashed") == []
    assert [e["reason"] for e in await events_about(kube_api, "scratch")] == [EVENT_UNMANAGED]
    assert await kube_api.pod_exists("done") and await kube_api.pod_exists("crashed"), "a completed pod is not evicted"


async def run_idle_drain(kube_api: KubeApi, node: str) -> DrainResult:
    return await drain(kube_api.cluster, DrainInput(node_name=node, timeout=TIMEOUT, revalidate=True), poll_interval=POLL, heartbeat=[].append)


async def node_spec(kube_api: KubeApi, node: str) -> dict[str, Any]:
    found = await kube_api.get(f"/api/v1/nodes/{node}")
    assert found is not None
    return found.get("spec") or {}


async def test_the_drain_of_an_idle_node_is_called_off_when_a_pod_arrived_before_the_cordon(kube_api: KubeApi) -> None:
    # Issue 17 item 10: a pod bound between the idle verdict and the cordon was evicted seconds
    # after it started. After the cordon nothing more can arrive: look again, call it off.
    node = kube_api.unique("arrived")
    await kube_api.create_node(node)
    if not kube_api.real:  # a real garbage collector deletes pods whose made-up owner does not exist
        await kube_api.create_pod("agent", node=node, owner_kind="DaemonSet")
    await kube_api.create_pod("done", node=node, phase="Succeeded")
    await kube_api.create_pod("fresh", node=node, gpu=True)

    result = await run_idle_drain(kube_api, node)

    assert result == DrainResult(evicted=0, called_off=[f"{kube_api.namespace}/fresh"])
    assert await kube_api.pod_exists("fresh") and await events_about(kube_api, "fresh") == []
    assert not (await node_spec(kube_api, node)).get("unschedulable"), "the node takes pods again"


async def test_an_idle_node_still_idle_after_the_cordon_is_drained(kube_api: KubeApi) -> None:
    node = kube_api.unique("still-idle")
    await kube_api.create_node(node)
    await kube_api.create_pod("done", node=node, phase="Succeeded")

    assert await run_idle_drain(kube_api, node) == DrainResult(evicted=0)
    assert (await node_spec(kube_api, node)).get("unschedulable") is True


@pytest.mark.parametrize("inp", [{"revalidate": True}, {"holds": True}], ids=["idle", "voluntary"])
async def test_an_empty_nodes_drain_lists_its_pods_once(kube_api: KubeApi, inp: dict[str, bool]) -> None:
    """The look after the cordon is the first poll: an empty node's drain is three requests
    (read the Node, cordon it, list its pods), not four. 100 idle nodes drain at once in the
    bench's idle reaction."""
    if kube_api.emulator is None:
        pytest.skip("counts the requests the emulator served")
    node = kube_api.unique("empty")
    await kube_api.create_node(node)
    await kube_api.create_pod("done", node=node, phase="Succeeded")
    before = len(kube_api.emulator._requests)
    result = await drain(kube_api.cluster, DrainInput(node_name=node, timeout=TIMEOUT, **inp), poll_interval=POLL, heartbeat=[].append)
    assert result == DrainResult(evicted=0)
    served = [(r.method, str(r.url.path)) for r in kube_api.emulator._requests[before:]]
    listings = [path for method, path in served if method == "GET" and path == "/api/v1/pods"]
    assert len(listings) == 1 and len(served) == 3, served


async def test_a_called_off_drain_leaves_a_cordon_someone_else_set(kube_api: KubeApi) -> None:
    node = kube_api.unique("admin-cordon")
    await kube_api.create_node(node)
    await kube_api.cluster.cordon(node)  # an operator's `kubectl cordon`
    await kube_api.create_pod("fresh", node=node)

    assert (await run_idle_drain(kube_api, node)).called_off == [f"{kube_api.namespace}/fresh"]
    assert (await node_spec(kube_api, node)).get("unschedulable") is True


@pytest.mark.parametrize("on", ["pod", "node"])
async def test_the_drain_of_a_voluntary_end_is_called_off_by_do_not_disrupt_after_the_cordon(kube_api: KubeApi, on: str) -> None:
    # A v5 life asks the pool's budgets inside the drain: a do-not-disrupt pod that started
    # meanwhile (or the Node annotated meanwhile) was not in the view the verdict came from.
    # After the cordon nothing more can arrive: look again, call it off, say what holds it.
    node = kube_api.unique("held")
    await kube_api.create_node(node)
    dnd = {"karpenter.sh/do-not-disrupt": "true"}
    await kube_api.create_pod("guarded", node=node, annotations=dnd if on == "pod" else None)
    if on == "node":
        assert (await kube_api.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": dnd}})).status_code == 200

    inp = DrainInput(node_name=node, timeout=TIMEOUT, holds=True)
    result = await drain(kube_api.cluster, inp, poll_interval=POLL, heartbeat=[].append)

    assert result == DrainResult(evicted=0, held=[f"{kube_api.namespace}/guarded" if on == "pod" else f"Node {node}"])
    assert await kube_api.pod_exists("guarded") and await events_about(kube_api, "guarded") == []
    assert not (await node_spec(kube_api, node)).get("unschedulable"), "the node takes pods again"


async def test_at_the_deadline_each_pod_left_on_the_node_gets_a_warning_saying_why(kube_api: KubeApi) -> None:
    # Issue 17 item 11: the pods killed with the machine must hear why, where `kubectl describe pod` shows it.
    node = kube_api.unique("why")
    await kube_api.create_node(node)
    await kube_api.create_pod("slow", node=node, grace_period=LONG_GRACE)
    await kube_api.create_pod("guarded", node=node, labels={"app": "db"})
    await kube_api.create_pdb("db", match_labels={"app": "db"}, min_available=1)

    async with kubelet_of(kube_api, node):
        await run_drain(kube_api, node, timeout=timedelta(seconds=1))

    [guarded] = [e for e in await events_about(kube_api, "guarded") if e["reason"] == EVENT_DRAIN_TIMED_OUT]
    [slow] = [e for e in await events_about(kube_api, "slow") if e["reason"] == EVENT_DRAIN_TIMED_OUT]
    assert guarded["type"] == slow["type"] == "Warning"
    assert node in guarded["message"] and "eviction was refused" in guarded["message"] and "disruption budget" in guarded["message"]
    assert node in slow["message"] and "still shutting down" in slow["message"]


async def test_a_retried_drain_lifts_the_cordon_its_first_attempt_set(kube_api: KubeApi) -> None:
    # The first attempt's worker died after the cordon: the cordon found is ours, not an operator's.
    node = kube_api.unique("retried")
    await kube_api.create_node(node)
    await kube_api.cluster.cordon(node)
    await kube_api.create_pod("fresh", node=node)

    inp = DrainInput(node_name=node, timeout=TIMEOUT, revalidate=True)
    result = await drain(kube_api.cluster, inp, poll_interval=POLL, heartbeat=[].append, retry=True)

    assert result.called_off == [f"{kube_api.namespace}/fresh"]
    assert not (await node_spec(kube_api, node)).get("unschedulable")
