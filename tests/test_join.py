"""Joining for real: each tailnet backend, class templates rendered with join material from a
Secret, and a bad join Secret that fails fast. GPUNodeWorkflow on the real dev server."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from activities.boot.render import UBUNTU_CLOUD_INIT_TEMPLATE, shipped_template
from tests.conftest import running_world
from tests.test_node_lifecycle import assert_nothing_left, readable, request, start, temporal_cli, wait_phase
from sim.world import NODE_TAG
from tgp.types import BootConfig, NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow

CLOUD_INIT = BootConfig(template=shipped_template(UBUNTU_CLOUD_INIT_TEMPLATE), join_secret="tgp-system/cluster-join", kubernetes_version="1.34.1")

PEM = "-----BEGIN CERTIFICATE-----\nMIIBkTCB+wIJAKHBfpegPjMCMA0GCSqGSIb3DQEBCwUAMBExDzANBgNVBAMMBnRl\n-----END CERTIFICATE-----\n"
TOKEN = "abcdef.0123456789abcdef"
JOIN = {"controlPlaneEndpoint": "https://100.64.0.1:6443", "clusterCA": PEM, "bootstrapToken": TOKEN}


async def put_secret(kube_url: str, name: str, data: dict[str, str]) -> None:
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": "tgp-system"},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }
    async with httpx.AsyncClient(verify=default_tls(), base_url=kube_url) as kube:
        (await kube.post("/api/v1/namespaces/tgp-system/secrets", json=secret)).raise_for_status()


@pytest.mark.parametrize("backend", ["tailscale", "headscale"])
async def test_each_tailnet_backend_leaves_no_key_and_no_device(temporal: WorkflowEnvironment, backend: str) -> None:
    async with running_world(temporal, headscale=backend == "headscale") as (world, _, queue):
        login = world.headscale.url if world.headscale else None
        req = request(tailnet=backend, boot=BootConfig(login_server=login))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        assert len(world.tailnet_devices(req.node_name)) == 1
        if world.headscale is not None:
            [node] = world.headscale.nodes.values()
            assert NODE_TAG in node.tags and node.key.ephemeral and not node.key.reusable
            assert world.tailscale.keys == {}, "the Headscale node never touched Tailscale"

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED
        assert_nothing_left(world, req.node_name)
        history = readable(temporal_cli(temporal, "workflow", "show", "--workflow-id", req.workflow_id, "--output", "json").stdout)
        assert [s for s in world.secrets() if s in history] == []


async def test_a_class_template_renders_with_the_join_secret_and_boots(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        await put_secret(world.kube_url, "cluster-join", JOIN)
        req = request(boot=CLOUD_INIT)
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)

        payload = world.cloud.instances[ready.instance_id or ""].user_data
        assert payload.startswith("#cloud-config") and "https://100.64.0.1:6443" in payload and TOKEN in payload
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()
        assert_nothing_left(world, req.node_name)
        history = readable(temporal_cli(temporal, "workflow", "show", "--workflow-id", req.workflow_id, "--output", "json").stdout)
        assert TOKEN not in history and PEM.splitlines()[1] not in history, "join material stays out of history"
        assert [s for s in world.secrets() if s in history] == []


async def test_a_join_secret_without_the_bootstrap_token_fails_fast_and_buys_nothing(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        await put_secret(world.kube_url, "cluster-join", {k: v for k, v in JOIN.items() if k != "bootstrapToken"})
        final: NodeStatus = await (await start(temporal, queue, request(boot=CLOUD_INIT))).result()

        assert final.phase is NodePhase.FAILED
        # The tenant learns that the class's join Secret is at fault; which Secret and key goes to
        # the class's admin (a JoinSecretInvalid Event on the class, tests/test_template_failures.py).
        assert "join Secret" in (final.last_error or "") and "JoinSecretInvalid" in (final.last_error or "")
        assert "cluster-join" not in (final.last_error or "")
        assert len(final.attempts) == 1, "a bad Secret is not a reason to try another offer"
        assert world.cloud.instances == {} and world.tailscale.keys == {}, "no instance bought, no key minted"
        assert json.dumps(final.model_dump(mode="json")).count(PEM.splitlines()[1]) == 0


async def test_a_template_that_cannot_render_ends_the_node_at_once_without_trying_other_offers(temporal: WorkflowEnvironment) -> None:
    """Every offer would fail the same way: fail over to none, buy nothing, name the problem."""
    async with running_world(temporal) as (world, _, queue):
        req = request(boot=BootConfig(template="#cloud-config\nruncmd: [echo {% for x in %}]\n"))
        status: NodeStatus = await (await start(temporal, queue, req)).result()
        assert status.phase is NodePhase.FAILED
        assert len(status.attempts) == 1, "a broken class template is not retried on the next offer"
        assert "TemplateError" in (status.last_error or "")
        assert world.cloud.create_requests == 0
        assert_nothing_left(world, req.node_name)
