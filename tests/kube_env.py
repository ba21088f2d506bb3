"""Where the Kubernetes contract tests run: the in-process `KubeEmulator`, or a real cluster.

Set `TGP_TEST_KUBECONFIG=/path/to/kubeconfig` to run the same tests against a real API server
(a throwaway cluster: the tests create and delete Nodes named `tgp-test-*` and one namespace per
test). Without it every test gets a fresh emulator.

tests/conftest.py registers this module as a plugin, so any test can ask for `kube_api`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from activities.http_wire import default_tls
from activities.kept_accounts import LABEL_KEPT
from activities.kube.cluster import MERGE_PATCH, KubernetesCluster
from activities.kube.connection import authenticated_http
from sim.kube import KubeEmulator
from tgp.types import OPERATOR_NAMESPACE

KUBECONFIG_ENV = "TGP_TEST_KUBECONFIG"
# Set by `python -m sim.kube_control_plane run`: the cluster is the lane's own, thrown away after.
OWN_CONTROL_PLANE_ENV = "TGP_TEST_OWN_CONTROL_PLANE"
# How long a real cluster's controllers (node lifecycle, disruption, service accounts) may take
# to catch up. The emulator applies their effects within the write, so it never waits.
CONVERGENCE_TIMEOUT = 30.0


def load_crd(path: Path) -> dict[str, Any]:
    """A generated CRD file (deploy/crds/), parsed once per process and copied for each caller
    (callers set a resourceVersion on theirs). PyYAML's pure-Python parser took 0.2 s of CPU for
    each install of the two CRDs, in every test that installs them; libyaml's parser is used
    where PyYAML has it."""
    return copy.deepcopy(_parsed_crd(path.resolve()))


@functools.cache
def _parsed_crd(path: Path) -> dict[str, Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(path.read_text(), Loader=loader)  # noqa: S506 - a safe loader
_POLL_INTERVAL = 0.2

@dataclass
class KubeApi:
    """One test's view of the API: the adapter under test plus a raw HTTP client for setup."""

    url: str
    cluster: KubernetesCluster
    http: httpx.AsyncClient  # authenticated like the adapter; base_url is the API server
    namespace: str
    emulator: KubeEmulator | None = None  # None on a real cluster
    _nodes: list[str] = field(default_factory=list)

    @property
    def real(self) -> bool:
        return self.emulator is None

    def unique(self, prefix: str) -> str:
        """A name no other test (or earlier run on a real cluster) uses. Nodes that get this
        name are deleted after the test, however they were created."""
        name = f"tgp-test-{prefix}-{secrets.token_hex(3)}"
        self._nodes.append(name)
        return name

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.http.post(path, json=body)
        assert response.status_code == 201, response.text
        result: dict[str, Any] = response.json()
        return result

    async def get(self, path: str) -> dict[str, Any] | None:
        response = await self.http.get(path)
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    async def merge_patch(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return await self.http.patch(path, json=body, headers={"Content-Type": MERGE_PATCH})

    async def create_node(self, name: str, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """A bare Node, as a kubelet's first call creates it (no status yet)."""
        if name not in self._nodes:
            self._nodes.append(name)
        return await self.create(
            "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
        )

    async def create_pod(
        self,
        name: str,
        *,
        node: str,
        labels: dict[str, str] | None = None,
        phase: str = "Running",
        gpu: bool = False,
        owner_kind: str | None = None,
        owner_name: str | None = None,
        owner_api_version: str = "apps/v1",
        owner_uid: str = "00000000-0000-0000-0000-000000000001",
        mirror: bool = False,
        grace_period: int = 0,
        annotations: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """A pod bound to `node`; `phase="Running"` also reports it Ready, as a kubelet would.
        `grace_period` is its terminationGracePeriodSeconds (0: a deletion removes it at once).
        On a real cluster the garbage collector deletes a pod whose owner does not exist (by
        uid): give a real owner's `owner_api_version` and `owner_uid` there."""
        container: dict[str, Any] = {"name": "main", "image": "registry.k8s.io/pause:3.9"}
        if gpu:
            container["resources"] = {"limits": {"nvidia.com/gpu": "1"}, "requests": {"nvidia.com/gpu": "1"}}
        metadata: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": labels or {}}
        if owner_kind:
            metadata["ownerReferences"] = [{
                "apiVersion": owner_api_version, "kind": owner_kind, "name": owner_name or f"{name}-owner",
                "uid": owner_uid, "controller": True,
            }]
        metadata["annotations"] = dict(annotations or {})
        if mirror:
            metadata["annotations"]["kubernetes.io/config.mirror"] = "0123456789abcdef"
        pod = await self.create(
            f"/api/v1/namespaces/{self.namespace}/pods",
            {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
             "spec": {"nodeName": node, "containers": [container], "terminationGracePeriodSeconds": grace_period}},
        )
        if phase != "Pending":
            conditions = [{"type": "Ready", "status": "True"}] if phase == "Running" else []
            response = await self.merge_patch(
                f"/api/v1/namespaces/{self.namespace}/pods/{name}/status",
                {"status": {"phase": phase, "conditions": conditions}},
            )
            assert response.status_code == 200, response.text
            pod = response.json()
        return pod

    async def create_pdb(
        self, name: str, *, match_labels: dict[str, str], min_available: int | str | None = None,
        max_unavailable: int | str | None = None,
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {"selector": {"matchLabels": match_labels}}
        if min_available is not None:
            spec["minAvailable"] = min_available
        if max_unavailable is not None:
            spec["maxUnavailable"] = max_unavailable
        return await self.create(
            f"/apis/policy/v1/namespaces/{self.namespace}/poddisruptionbudgets",
            {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name}, "spec": spec},
        )

    async def eventually(self, check: Callable[[], Awaitable[bool]]) -> None:
        """Assert that `check()` comes to hold. The emulator applies what a real cluster's
        controllers do (node lifecycle, disruption budgets) within the write, so there it must
        hold at once; a real cluster gets CONVERGENCE_TIMEOUT seconds."""
        await eventually(check, timeout=CONVERGENCE_TIMEOUT if self.real else 0.0)

    async def pod_exists(self, name: str) -> bool:
        return await self.get(f"/api/v1/namespaces/{self.namespace}/pods/{name}") is not None


async def eventually(check: Callable[[], Awaitable[bool]], *, timeout: float) -> None:
    """Poll until `check()` holds, for at most `timeout` seconds (at least one check)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"condition not reached within {timeout}s")
        await asyncio.sleep(_POLL_INTERVAL)


# Namespaces that tests share (created when absent, kept between tests): test_bridge.py and
# test_credentials.py. On the lane's own control plane they are deleted when the session ends.
SHARED_NAMESPACES = ("ml", "tgp-system")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    kubeconfig = os.environ.get(KUBECONFIG_ENV)
    if kubeconfig and os.environ.get(OWN_CONTROL_PLANE_ENV):
        asyncio.run(_delete_shared_namespaces(kubeconfig))


async def _delete_shared_namespaces(kubeconfig: str) -> None:
    async with authenticated_http(kubeconfig) as http:
        for name in SHARED_NAMESPACES:
            await http.delete(f"/api/v1/namespaces/{name}")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that asks for `kube_api` is real-cluster capable: `make test-real-cluster`
    runs exactly these (`-m real_cluster`) against a real control plane."""
    for item in items:
        if "kube_api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_cluster)


@pytest.fixture
async def kube_api() -> AsyncIterator[KubeApi]:
    """A ready `KubeApi`: a fresh emulator, or the cluster named by $TGP_TEST_KUBECONFIG."""
    kubeconfig = os.environ.get(KUBECONFIG_ENV)
    namespace = f"tgp-test-{secrets.token_hex(4)}"
    if not kubeconfig:
        async with KubeEmulator() as emulator, httpx.AsyncClient(verify=default_tls(), base_url=emulator.url, timeout=10.0) as http:
            async with KubernetesCluster.from_url(emulator.url) as cluster:
                # No Namespace object: kmock 0.8 cannot parse /api/v1/namespaces and needs none.
                yield KubeApi(url=emulator.url, cluster=cluster, http=http, namespace=namespace, emulator=emulator)
        return

    async with _real_http(kubeconfig) as http, KubernetesCluster.from_kubeconfig(kubeconfig) as cluster:
        api = KubeApi(url=str(http.base_url).rstrip("/"), cluster=cluster, http=http, namespace=namespace)
        await api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})

        async def service_account_ready() -> bool:
            return await api.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/default") is not None

        await eventually(service_account_ready, timeout=CONVERGENCE_TIMEOUT)  # pods are refused until it exists
        try:
            yield api
        finally:
            await _clean_real_cluster(api)


def _real_http(kubeconfig: str) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    """An httpx client with the kubeconfig's server, CA, client certificate and token."""
    return authenticated_http(kubeconfig)


async def _clean_real_cluster(api: KubeApi) -> None:
    # Pods bound to nodes without a kubelet never finish a graceful delete: force them.
    pods = await api.get(f"/api/v1/namespaces/{api.namespace}/pods") or {"items": []}
    for pod in pods["items"]:
        await api.http.request(
            "DELETE", f"/api/v1/namespaces/{api.namespace}/pods/{pod['metadata']['name']}",
            json={"gracePeriodSeconds": 0},
        )
    await api.http.delete(f"/api/v1/namespaces/{api.namespace}")
    # The keys the test's workers kept for what they bought (activities/kept_accounts.py), in
    # tgp-system, which outlives a test.
    await api.http.delete(f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/secrets", params={"labelSelector": LABEL_KEPT})
    for node in api._nodes:
        # tgp's termination finalizer (put on by label_and_taint) would keep a deleted Node.
        await api.http.patch(f"/api/v1/nodes/{node}", json={"metadata": {"finalizers": None}}, headers={"Content-Type": "application/merge-patch+json"})
        await api.http.delete(f"/api/v1/nodes/{node}")
