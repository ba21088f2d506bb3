"""Boot paths that work out of the box: a class is validated against the template each of its
nodes would really boot with (the shipped default included, rendered with the class's own
settings) and against the capabilities of the adapter the worker has configured; the class's
tailscaleConfig.ephemeral and acceptRoutes reach the minted key and the boot payload."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import SecretStr
from temporalio.testing import WorkflowEnvironment

from activities.boot.render import (
    TALOS_WORKER_TEMPLATE,
    UBUNTU_CLOUD_INIT_TEMPLATE,
    BootSettings,
    join_secrets_from_secret,
    render_boot_payload,
    shipped_template,
)
from activities.node_class import NodeClassActivities, ValidateClassInput
from activities.clouds.lambdalabs import LambdaProvider
from activities.clouds.paperspace import PaperspaceProvider
from activities.clouds.vastai import VastProvider
from tests.conftest import running_world
from tests.test_bootstrap import JOIN_VALUES, secret_data
from tests.test_node_lifecycle import request, start, wait_phase
from tgp.crds import GPUNodeClassSpec
from tgp.types import BootConfig, NodePhase
from workflows.node import GPUNodeWorkflow

KEY = SecretStr("k" * 32)
ONSTART = "#!/bin/bash\nset -eu\necho {{ NodeName | shell_quote }} > /etc/hostname\ntailscale up --auth-key={{ TailscaleAuthKey | shell_quote }}\n"


def spec(*providers: str, **fields: Any) -> GPUNodeClassSpec:
    return GPUNodeClassSpec.model_validate({"providers": [{"name": p} for p in providers], **fields})


async def validate(fleet: NodeClassActivities, klass: GPUNodeClassSpec) -> list[str]:
    return await fleet.validate_class(ValidateClassInput(name="c", spec=klass))


@pytest.fixture
async def fleet() -> Any:
    """Fleet activities whose worker has Lambda, Paperspace and Vast.ai (VAST_VM=true) keys.
    No Secret is read: these classes reference none."""
    providers = {
        "lambdalabs": LambdaProvider(KEY, ssh_key_name="tgp"),
        "paperspace": PaperspaceProvider(KEY),
        "vastai": VastProvider(KEY, vm=True),
    }
    yield NodeClassActivities(cluster=None, providers=providers)  # type: ignore[arg-type]
    for p in providers.values():
        await p.aclose()


async def test_the_default_ubuntu_path_needs_a_kubernetes_version_and_join_material(fleet: NodeClassActivities) -> None:
    """Lambda boots cloud-init: without a template, the shipped Ubuntu one, which needs
    KubernetesVersion (and the join Secret). Such a class used to be Ready while every node
    failed at launch."""
    problems = await validate(fleet, spec("lambdalabs"))
    assert any(p.startswith("kubernetesVersion: the default Ubuntu boot template") and "lambdalabs" in p for p in problems), problems
    assert any(p.startswith("joinSecretRef: ") and "ClusterCA" in p for p in problems), problems

    assert await validate(fleet, spec("lambdalabs", kubernetesVersion="1.34.1", joinSecretRef="cluster-join")) == []


async def test_a_class_template_is_checked_with_the_class_settings(fleet: NodeClassActivities) -> None:
    template = "#cloud-config\nruncmd:\n  - [echo, {{ KubernetesVersion | quote }}, {{ NodeName | quote }}]\n"
    [problem] = await validate(fleet, spec("lambdalabs", bootstrapTemplate=template))
    assert problem.startswith("bootstrapTemplate: ") and "'KubernetesVersion' is not defined (set kubernetesVersion" in problem
    assert await validate(fleet, spec("lambdalabs", bootstrapTemplate=template, kubernetesVersion="v1.34.1")) == []


async def test_a_payload_kind_without_a_shipped_default_needs_a_template(fleet: NodeClassActivities) -> None:
    [problem] = await validate(fleet, spec("paperspace"))
    assert problem.startswith("bootstrapTemplate: provider paperspace boots with a startup-script payload"), problem
    assert await validate(fleet, spec("paperspace", bootstrapTemplate=ONSTART)) == []


async def test_a_vast_vm_class_is_validated_against_the_vm_adapter(fleet: NodeClassActivities) -> None:
    """VAST_VM=true: the worker's Vast.ai adapter rents VMs, which join as nodes. Validation
    used the table's container entry, so such a class could never be Ready."""
    assert await validate(fleet, spec("vastai", bootstrapTemplate=ONSTART)) == []
    containers = NodeClassActivities(cluster=None, providers={"vastai": VastProvider(KEY)})  # type: ignore[arg-type]
    problems = await validate(containers, spec("vastai", bootstrapTemplate=ONSTART))
    assert any("cannot become a Kubernetes node" in p for p in problems), problems


def test_accept_routes_reaches_every_shipped_payload() -> None:
    join = join_secrets_from_secret(secret_data(JOIN_VALUES), secret_ref="Secret tgp-system/cluster-join")
    for accept in (True, False):
        settings = BootSettings(kubernetes_version="1.34.1", tailscale_tags=["tag:tgp-node"], tailscale_accept_routes=accept)
        payloads = {
            "ubuntu": render_boot_payload("cloud-init", hostname="gpu-1", auth_key=KEY, settings=settings, join=join).content,
            "talos": render_boot_payload(
                "cloud-init", hostname="gpu-1", auth_key=KEY, template=shipped_template(TALOS_WORKER_TEMPLATE), settings=settings, join=join
            ).content,
            "env": render_boot_payload("env", hostname="gpu-1", auth_key=KEY, settings=settings).content,
        }
        for name, content in payloads.items():
            assert ("--accept-routes" in content) is accept, (name, accept)
    assert "tailscale up" in shipped_template(UBUNTU_CLOUD_INIT_TEMPLATE)


@pytest.mark.parametrize("backend", ["tailscale", "headscale"])
async def test_ephemeral_and_accept_routes_reach_the_key_and_the_payload(temporal: WorkflowEnvironment, backend: str) -> None:
    async with running_world(temporal, headscale=backend == "headscale") as (world, _, queue):
        login = world.headscale.url if world.headscale else None
        req = request(tailnet=backend, boot=BootConfig(login_server=login, ephemeral=False, accept_routes=True))
        handle = await start(temporal, queue, req)
        ready = await wait_phase(handle, NodePhase.READY)
        assert "--accept-routes" in world.cloud.instances[ready.instance_id or ""].user_data
        if world.headscale is not None:
            [key] = world.headscale.keys.values()
        else:
            [key] = world.tailscale.keys.values()
        assert key.ephemeral is False and not key.reusable
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()

        # The default stays ephemeral.
        req = request(tailnet=backend, boot=BootConfig(login_server=login))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        keys = world.headscale.keys if world.headscale is not None else world.tailscale.keys
        assert [k.ephemeral for k in keys.values()] == [False, True]
        assert "--accept-routes" not in world.cloud.live_instances()[0].user_data
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()
