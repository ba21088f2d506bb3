"""Graceful deletion of Pods, as a real API server does it (docs/reference/kubernetes-testing.md:
"evicted pods get a deletionTimestamp and disappear after the grace period").

Runs against `kube_api`: the emulator, or a real cluster when TGP_TEST_KUBECONFIG is set.
Expected values come from the API server's pod strategy and generic registry (CheckGracefulDelete,
BeforeDelete), not from the emulator. The final removal of a pod is the kubelet's part: it deletes
the pod for good once its containers stopped. The emulator plays it when the grace period ends; on
a real cluster the simulated kubelet (sim.kube_kubelet.SimKubelet) of the test Node does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from sim.kube_kubelet import SimKubelet
from tests.kube_env import KubeApi, eventually
from tests.test_kube_emulator import STREAM_READ_TIMEOUT, WatchReader, no_server_errors  # noqa: F401 - an autouse fixture

MERGE = {"Content-Type": "application/merge-patch+json"}
GRACE = 30  # seconds: longer than any test, so a pod in graceful deletion stays for the test
# How long the emulator may take past a grace period to remove the pod (it polls nothing: a timer).
REMOVAL_SLACK = 5.0

Obj = dict[str, Any]


def _path(kube_api: KubeApi, name: str) -> str:
    return f"/api/v1/namespaces/{kube_api.namespace}/pods/{name}"


async def _delete(kube_api: KubeApi, name: str, options: Obj | None = None, params: Obj | None = None) -> Obj:
    response = await kube_api.http.request("DELETE", _path(kube_api, name), json=options, params=params)
    assert response.status_code == 200, response.text
    result: Obj = response.json()
    return result


def _time(value: str) -> datetime:
    return datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)


@contextlib.asynccontextmanager
async def _kubelet(kube_api: KubeApi, node: str) -> AsyncIterator[None]:
    """The kubelet's part: the emulator's own timer, or on a real cluster the Node's simulated
    kubelet, which deletes a pod for good once its grace period (from when it saw the deletion)
    has passed."""
    if not kube_api.real:
        yield
        return
    kubelet = SimKubelet(kube_api.url, node, client=kube_api.http, pod_sync_interval=0.1)
    task = asyncio.create_task(kubelet.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _gone(kube_api: KubeApi, name: str) -> bool:
    return not await kube_api.pod_exists(name)


# --- what the API server does ---------------------------------------------------------------


async def test_a_deleted_pod_on_a_node_stays_terminating(kube_api: KubeApi) -> None:
    node = kube_api.unique("graceful")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=GRACE)

    deleted = await _delete(kube_api, "job")

    meta = deleted["metadata"]
    assert meta["deletionGracePeriodSeconds"] == GRACE
    # The deletionTimestamp is when the deletion is due: the request's time plus the grace period.
    due_in = (_time(meta["deletionTimestamp"]) - _time(meta["creationTimestamp"])).total_seconds()
    assert GRACE - 1 <= due_in <= GRACE + 10
    fetched = await kube_api.get(_path(kube_api, "job"))
    assert fetched is not None and fetched["metadata"]["deletionTimestamp"] == meta["deletionTimestamp"]
    [summary] = await kube_api.cluster.list_pods_on_node(node)
    assert summary.name == "job" and summary.deleting


async def test_default_grace_period_is_30_seconds(kube_api: KubeApi) -> None:
    node = kube_api.unique("default")
    await kube_api.create_node(node)
    created = await kube_api.create(
        f"/api/v1/namespaces/{kube_api.namespace}/pods",
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain"},
         "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9"}]}},
    )
    assert created["spec"]["terminationGracePeriodSeconds"] == 30
    assert (await _delete(kube_api, "plain"))["metadata"]["deletionGracePeriodSeconds"] == 30


@pytest.mark.parametrize("where", ["body", "query"])
async def test_the_requests_grace_period_overrides_the_pods(kube_api: KubeApi, where: str) -> None:
    node = kube_api.unique("override")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=GRACE)
    if where == "body":
        deleted = await _delete(kube_api, "job", options={"gracePeriodSeconds": 7})
    else:
        deleted = await _delete(kube_api, "job", params={"gracePeriodSeconds": "7"})
    assert deleted["metadata"]["deletionGracePeriodSeconds"] == 7


async def test_a_second_delete_may_shorten_the_grace_period_but_not_lengthen_it(kube_api: KubeApi) -> None:
    node = kube_api.unique("shorten")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=GRACE)
    first = (await _delete(kube_api, "job"))["metadata"]

    longer = (await _delete(kube_api, "job", options={"gracePeriodSeconds": GRACE * 2}))["metadata"]
    assert longer["deletionGracePeriodSeconds"] == GRACE
    assert longer["deletionTimestamp"] == first["deletionTimestamp"]

    shorter = (await _delete(kube_api, "job", options={"gracePeriodSeconds": GRACE - 20}))["metadata"]
    assert shorter["deletionGracePeriodSeconds"] == GRACE - 20
    moved = (_time(first["deletionTimestamp"]) - _time(shorter["deletionTimestamp"])).total_seconds()
    assert moved == 20, "the deletion is due 20 s earlier"
    assert await kube_api.pod_exists("job")


@pytest.mark.parametrize("case", ["unbound", "finished", "zero"])
async def test_pods_no_kubelet_has_to_stop_go_at_once(kube_api: KubeApi, case: str) -> None:
    node = kube_api.unique("at-once")
    await kube_api.create_node(node)
    options = None
    if case == "unbound":
        await kube_api.create(
            f"/api/v1/namespaces/{kube_api.namespace}/pods",
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job"},
             "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.9"}],
                      "terminationGracePeriodSeconds": GRACE,
                      "nodeSelector": {"tgp-test/nowhere": "true"}}},  # the scheduler must not bind it
        )
    elif case == "finished":
        await kube_api.create_pod("job", node=node, grace_period=GRACE, phase="Succeeded")
    else:
        await kube_api.create_pod("job", node=node, grace_period=GRACE)
        options = {"gracePeriodSeconds": 0}
    await _delete(kube_api, "job", options=options)
    assert not await kube_api.pod_exists("job")


@pytest.mark.parametrize("version", ["policy/v1", "policy/v1beta1"])
async def test_an_accepted_eviction_marks_the_pod_terminating(kube_api: KubeApi, version: str) -> None:
    node = kube_api.unique("evicted")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=GRACE)
    await kube_api.create_pod("other", node=node, grace_period=GRACE)

    async def evict(name: str, options: Obj | None = None) -> int:
        body: Obj = {"apiVersion": version, "kind": "Eviction", "metadata": {"name": name, "namespace": kube_api.namespace}}
        if options is not None:
            body["deleteOptions"] = options
        response = await kube_api.http.post(f"{_path(kube_api, name)}/eviction", json=body)
        if kube_api.real and response.status_code in (400, 404):
            pytest.skip(f"this server does not serve {version} Evictions")
        return response.status_code

    assert await evict("job") == 201
    assert await evict("other", {"gracePeriodSeconds": 7}) == 201
    job, other = await kube_api.get(_path(kube_api, "job")), await kube_api.get(_path(kube_api, "other"))
    assert job is not None and job["metadata"]["deletionGracePeriodSeconds"] == GRACE
    assert other is not None and other["metadata"]["deletionGracePeriodSeconds"] == 7
    assert await evict("other") == 201, "evicting a terminating pod is allowed and changes nothing"
    again = await kube_api.get(_path(kube_api, "other"))
    assert again is not None and again["metadata"]["deletionTimestamp"] == other["metadata"]["deletionTimestamp"]


async def test_a_status_update_keeps_a_terminating_pod(kube_api: KubeApi) -> None:
    # The kubelet reports its containers stopping while the pod is Terminating.
    node = kube_api.unique("status")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=GRACE)
    await _delete(kube_api, "job")
    response = await kube_api.merge_patch(
        f"{_path(kube_api, 'job')}/status", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    assert response.status_code == 200, response.text
    fetched = await kube_api.get(_path(kube_api, "job"))
    assert fetched is not None and fetched["metadata"]["deletionGracePeriodSeconds"] == GRACE


# --- the kubelet's part, played by the emulator -------------------------------------------


async def test_watch_sees_terminating_then_deleted_after_the_grace_period(kube_api: KubeApi) -> None:
    node = kube_api.unique("watched")
    await kube_api.create_node(node)
    created = await kube_api.create_pod("job", node=node, grace_period=2)
    params = {"watch": "true", "resourceVersion": created["metadata"]["resourceVersion"],
              "fieldSelector": "metadata.name=job"}
    loop = asyncio.get_running_loop()
    async with _kubelet(kube_api, node), kube_api.http.stream(
        "GET", f"/api/v1/namespaces/{kube_api.namespace}/pods", params=params, timeout=STREAM_READ_TIMEOUT
    ) as stream:
        asked = loop.time()
        await _delete(kube_api, "job")
        reader = WatchReader(stream)
        events = await reader.read(2)
        while events[-1]["type"] != "DELETED":  # a real server may report the kubelet's final write
            events += await reader.read(1)
        terminating, deleted = events[0], events[-1]
        ended = loop.time()
    assert terminating["type"] == "MODIFIED" and terminating["object"]["metadata"]["deletionGracePeriodSeconds"] == 2
    assert deleted["type"] == "DELETED"
    assert ended - asked >= 2, "the pod stayed for its whole grace period"


async def test_a_shortened_grace_period_ends_sooner(kube_api: KubeApi) -> None:
    node = kube_api.unique("sooner")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=GRACE * 10)
    async with _kubelet(kube_api, node):
        await _delete(kube_api, "job")
        await _delete(kube_api, "job", options={"gracePeriodSeconds": 1})
        await eventually(lambda: _gone(kube_api, "job"), timeout=1 + REMOVAL_SLACK)


async def test_finalizers_keep_a_pod_past_its_grace_period(kube_api: KubeApi) -> None:
    node = kube_api.unique("held")
    await kube_api.create_node(node)
    await kube_api.create_pod("job", node=node, grace_period=1)
    assert (await kube_api.merge_patch(_path(kube_api, "job"), {"metadata": {"finalizers": ["tgp.io/test"]}})).status_code == 200
    async with _kubelet(kube_api, node):
        await _delete(kube_api, "job")

        async def due() -> bool:  # the kubelet's final delete only sets the grace period to 0
            pod = await kube_api.get(_path(kube_api, "job"))
            return pod is not None and pod["metadata"]["deletionGracePeriodSeconds"] == 0

        await eventually(due, timeout=1 + REMOVAL_SLACK)
    assert (await kube_api.merge_patch(_path(kube_api, "job"), {"metadata": {"finalizers": None}})).status_code == 200
    assert not await kube_api.pod_exists("job")
