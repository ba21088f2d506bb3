"""A pool cannot write a Node's identity (issue 18 item 7).

A tenant's pool labels go onto its Nodes. With `kubernetes.io/hostname: victim-node` one Node
claimed another's hostname, which breaks every scheduling rule keyed on it; so did
`topology.kubernetes.io/zone`, `node.kubernetes.io/instance-type` and `nvidia.com/gpu.product`.
Label keys in the kubernetes.io and k8s.io namespaces (except node.kubernetes.io/ and
kubelet.kubernetes.io/, not node.kubernetes.io/instance-type), and in the GPU-discovery
namespaces nvidia.com/ and feature.node.kubernetes.io/, are refused three times over: by the
CRD's CEL rule at apply (a 422), by the bridge's admission, and by the pool's validation of its
labels. The property: for any key, the CRD's rule (as the emulator evaluates it, as a real API
server does) and admission give the same verdict.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from activities.http_wire import default_tls
from tests.kube_env import load_crd
from sim.kube import KubeEmulator
from tgp.crds import GPUNodePool
from tgp.labels import label_problems, qualified_name_problems

CRDS = Path(__file__).parent.parent / "deploy" / "crds"
IDENTITY = ["kubernetes.io/hostname", "topology.kubernetes.io/zone", "node.kubernetes.io/instance-type", "nvidia.com/gpu.product"]
REFUSED = [*IDENTITY, "feature.node.kubernetes.io/pci-10de.present", "gpu.nvidia.com/class", "x.k8s.io/y", "kubernetes.io/os",
           "node-role.kubernetes.io/worker", "tgp.io/managed", "beta.kubernetes.io/arch"]  # fmt: skip
ALLOWED = ["node.kubernetes.io/gpu-tier", "kubelet.kubernetes.io/tier", "example.com/team", "team", "nvidia.example.com/x", "k8s.iox/y"]
DOMAINS = ["kubernetes.io", "k8s.io", "node.kubernetes.io", "kubelet.kubernetes.io", "feature.node.kubernetes.io",
           "topology.kubernetes.io", "node-role.kubernetes.io", "nvidia.com", "tgp.io", "example.com", "io", "com"]  # fmt: skip


def pool(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "tgp.io/v1",
        "kind": "GPUNodePool",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"nodeClassRef": {"name": "c"}, "template": {"metadata": {"labels": labels}}},
    }


@functools.cache
def schema_rule() -> dict[str, Any]:
    crd = load_crd(CRDS / "gpunodepools.tgp.io.yaml")
    labels = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["template"]
    [rule] = labels["properties"]["metadata"]["properties"]["labels"]["x-kubernetes-validations"]
    return dict(rule)


def admitted(key: str) -> bool:
    return not label_problems({key: "v"}, tenant=True)


@pytest.mark.parametrize("key", REFUSED)
def test_admission_refuses_a_nodes_identity_and_discovery_labels(key: str) -> None:
    with pytest.raises(ValidationError, match="label key"):
        GPUNodePool.admit(pool({key: "victim-node"}))


@pytest.mark.parametrize("key", ALLOWED)
def test_admission_keeps_the_namespaces_a_pool_may_use(key: str) -> None:
    assert GPUNodePool.admit(pool({key: "v"}))


def test_the_generated_crd_carries_the_rule_tgp_checks() -> None:
    from tgp.labels import TENANT_LABEL_KEY_RULE

    assert schema_rule()["rule"] == TENANT_LABEL_KEY_RULE


@given(
    st.tuples(
        st.lists(st.sampled_from(["a", "x-1", "gpu", "feature", "node", "beta", "topology"]), max_size=2),
        st.sampled_from(DOMAINS),
        st.sampled_from(["hostname", "zone", "instance-type", "gpu.product", "team", "x"]),
    )
)
def test_the_crd_rule_and_admission_give_the_same_verdict_for_any_key(parts: tuple[list[str], str, str]) -> None:
    from sim.kube_cel import compile_rule

    prefix, domain, name = parts
    key = f"{'.'.join([*prefix, domain])}/{name}"
    assert not qualified_name_problems(key)
    assert compile_rule(schema_rule()["rule"])({key: "v"}) is admitted(key), key


async def test_the_api_server_refuses_each_at_apply_naming_the_rule() -> None:
    async with KubeEmulator() as kube:
        kube.install_crd(load_crd(CRDS / "gpunodepools.tgp.io.yaml"))
        async with httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
            path = "/apis/tgp.io/v1/namespaces/default/gpunodepools"
            for key in IDENTITY:
                answer = await http.post(path, json=pool({"example.com/team": "ml", key: "victim-node"}))
                assert answer.status_code == 422, (key, answer.text)
                [cause] = answer.json()["details"]["causes"]
                assert cause["field"] == "spec.template.metadata.labels" and "kubernetes.io" in cause["message"], cause
            answer = await http.post(path, json=pool({"node.kubernetes.io/gpu-tier": "a", "example.com/team": "ml"}))
            assert answer.status_code == 201, answer.text


async def test_a_pool_stored_before_the_rule_can_still_lose_its_finalizer() -> None:
    """As a real API server ratchets (1.30+): an update that leaves the refused label as it was
    (the worker removing the pool's finalizer) passes; adding one does not."""
    crd = load_crd(CRDS / "gpunodepools.tgp.io.yaml")
    labels = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["template"]
    labels = labels["properties"]["metadata"]["properties"]["labels"]
    rule = labels.pop("x-kubernetes-validations")
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        kube.install_crd(crd)
        path = "/apis/tgp.io/v1/namespaces/default/gpunodepools"
        body = pool({"kubernetes.io/hostname": "victim-node"})
        body["metadata"]["finalizers"] = ["tgp.io/nodes-terminated"]
        assert (await http.post(path, json=body)).status_code == 201
        labels["x-kubernetes-validations"] = rule
        kube.install_crd(crd)
        merge = {"Content-Type": "application/merge-patch+json"}
        answer = await http.patch(f"{path}/p", json={"metadata": {"finalizers": None}}, headers=merge)
        assert answer.status_code == 200, answer.text
        answer = await http.patch(f"{path}/p", json={"spec": {"template": {"metadata": {"labels": {"nvidia.com/gpu.product": "x"}}}}}, headers=merge)
        assert answer.status_code == 422, answer.text
