"""A class whose nodes could join no tailnet is not Ready, and cleaning up after it finishes
(issue 18 item 6).

A class with `loginServer` (Headscale) on a worker without Headscale credentials reported Ready,
bought nothing (every launch failed on the missing backend), and deleting its pool hung for
ever: the tailnet cleanup of each failed node retried `remove_from_tailnet` against a backend
that does not exist, holding the budget. Now the class's validation names the missing backend,
a cleanup through a backend the worker lacks and through which no key was minted is done at
once, and `loginServer` must be a URL (in the schema and in the class's validation).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from activities.http_wire import default_tls
from activities.node import NodeActivities
from activities.node_class import NodeClassActivities, ValidateClassInput
from tests.kube_env import load_crd
from sim.kube import KubeEmulator
from sim.kube_schema import go_regexp
from tgp.crds import GPUNodeClassSpec
from tgp.types import TailnetCleanupInput

CRDS = Path(__file__).parent.parent / "deploy" / "crds"
GOOD_URLS = ["https://hs.example.com", "http://127.0.0.1:8080", "https://hs.example.com/base/", "https://[::1]:443"]
BAD_URLS = ["headscale.example.com", "ftp://hs.example.com", "https://user:pw@hs.example.com", "https://hs.example.com/?x=1",
            "https://hs.example.com#f", "https://hs example.com", "https://hs.example.com/\nExecStart=/bin/sh", "javascript:alert(1)"]  # fmt: skip


def spec(**tailscale: Any) -> GPUNodeClassSpec:
    return GPUNodeClassSpec.model_validate({"providers": [{"name": "runpod"}], "tailscaleConfig": tailscale})


async def problems(worker_tailnets: list[str], klass: GPUNodeClassSpec) -> list[str]:
    fleet = NodeClassActivities(cluster=None, providers={}, tailnets=worker_tailnets)  # type: ignore[arg-type]  # no Secret is read
    return await fleet.validate_class(ValidateClassInput(name="c", spec=klass))


async def test_a_class_naming_headscale_on_a_worker_without_it_is_not_ready() -> None:
    found = await problems(["tailscale"], spec(loginServer="https://hs.example.com"))
    assert any(p.startswith("tailscaleConfig:") and "headscale" in p and "HEADSCALE_URL" in p for p in found), found
    found = await problems(["headscale"], spec())
    assert any(p.startswith("tailscaleConfig:") and "TS_OAUTH_CLIENT_ID" in p for p in found), found
    assert not any("tailscaleConfig" in p for p in await problems(["headscale"], spec(loginServer="https://hs.example.com")))


@pytest.mark.parametrize("url", BAD_URLS)
async def test_a_login_server_that_is_not_a_url_is_a_problem_of_the_class(url: str) -> None:
    found = await problems(["headscale"], spec(loginServer=url))
    assert any(p.startswith("tailscaleConfig.loginServer:") for p in found), found


def test_the_schema_and_the_class_check_agree_on_login_servers() -> None:
    crd = load_crd(CRDS / "gpunodeclasses.tgp.io.yaml")
    field = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["tailscaleConfig"]
    schema = field["properties"]["loginServer"]
    for url in GOOD_URLS + BAD_URLS:
        accepted = len(url) <= schema["maxLength"] and go_regexp(schema["pattern"]).search(url) is not None
        assert accepted is (url in GOOD_URLS), url


async def test_the_api_server_refuses_a_login_server_that_is_not_a_url() -> None:
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url) as http:
        kube.install_crd(load_crd(CRDS / "gpunodeclasses.tgp.io.yaml"))
        body = {"apiVersion": "tgp.io/v1", "kind": "GPUNodeClass", "metadata": {"name": "c"},
                "spec": {"providers": [{"name": "runpod"}], "tailscaleConfig": {"loginServer": "hs.example.com\nx"}}}  # fmt: skip
        answer = await http.post("/apis/tgp.io/v1/gpunodeclasses", json=body)
        assert answer.status_code == 422 and "loginServer" in answer.text, answer.text


async def test_cleaning_a_tailnet_the_worker_has_no_backend_for_finishes() -> None:
    """No key of the node was minted through it (the launch failed on the missing backend):
    nothing to clean, and a deleted pool's nodes end."""
    acts = NodeActivities(providers={}, tailnets={}, cluster=None, poll_interval=timedelta(seconds=0.01))  # type: ignore[arg-type]
    cleanup = TailnetCleanupInput(hostname="gpu-1", tags=["tag:tgp-node"], tailnet="headscale")
    result = await ActivityEnvironment().run(acts.remove_from_tailnet, cleanup)
    assert result.keys_revoked == 0 and result.devices_deleted == 0
