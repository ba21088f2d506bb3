"""A pool's name leaves room for its nodes' names (issue 18 item 8).

Nodes are named `<pool>-<5 characters>`, and a Node's name is its `kubernetes.io/hostname`
label, a label value of at most 63 characters: a pool named longer than 57 passed the API
server's name rule, but none of its nodes could register on a real cluster, where the emulator
let them. Now the CRD (a CEL rule on the name) and the bridge's admission refuse such a pool,
and the emulator checks every object's labels as the real API server does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from tests.kube_env import load_crd
from activities.http_wire import default_tls
from sim.kube import KubeEmulator
from tgp.crds import GPUNodePool

CRDS = Path(__file__).parent.parent / "deploy" / "crds"


def pool(name: str) -> dict[str, Any]:
    return {"apiVersion": "tgp.io/v1", "kind": "GPUNodePool", "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeClassRef": {"name": "c"}}}  # fmt: skip


def test_admission_refuses_a_pool_name_its_nodes_could_not_carry() -> None:
    assert GPUNodePool.admit(pool("p" * 57))
    with pytest.raises(ValidationError, match="at most 57 characters"):
        GPUNodePool.admit(pool("p" * 58))
    assert GPUNodePool.model_validate(pool("p" * 58)), "a pool admitted before still decodes"


async def test_the_api_server_refuses_it_at_apply_and_a_node_named_past_63() -> None:
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        kube.install_crd(load_crd(CRDS / "gpunodepools.tgp.io.yaml"))
        path = "/apis/tgp.io/v1/namespaces/default/gpunodepools"
        answer = await http.post(path, json=pool("p" * 58))
        assert answer.status_code == 422 and "at most 57" in answer.text, answer.text
        assert (await http.post(path, json=pool("p" * 57))).status_code == 201

        for name, status in (("n" * 63, 201), ("m" * 64, 422)):
            node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}}
            answer = await http.post("/api/v1/nodes", json=node)
            assert answer.status_code == status, answer.text
        assert "must be no more than 63 characters" in answer.text
