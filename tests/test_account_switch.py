"""A node keeps the account it was bought with until it ends (issue 18 item 5).

Switching a class's credentials Secret to another account's key used to abandon every running
instance: read with the new key, the old account's instances looked gone, were marked
Interrupted and replaced, and kept billing after the pool was deleted. Now a node's InstanceRef
carries the fingerprint of the key that bought it, the registry reaches its instance with that
key (kept open, or found under any key of the Secret), a revoked key (a rotation) falls back to
the Secret's current one, a node no key reaches is an error that says what to do (never
"gone"), and the class says that its Secret holds another key than running nodes were bought
with.

Against the Kubernetes API (emulator) and the simulated cloud, whose keys belong to accounts.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.accounts import ProviderRegistry
from activities.kept_accounts import kept_name
from activities.node import NodeActivities
from activities.node_class import NodeClassActivities, ValidateClassInput
from sim.cloud import SimulatedCloud
from tests.conftest import eventually
from tests.kube_env import KubeApi
from tests.test_credentials import NS, new_key, put_secret
from tests.test_template_failures import StubTailnet
from tgp.crds import GPUNodeClassSpec
from tgp.errors import ConfigError
from tgp.types import CredentialsRef, InstanceRef, LaunchInput, ObserveInput, StageCheck, StageLook

REF = CredentialsRef(name="class-cloud", key="apiKey")


async def setup(kube_api: KubeApi, cloud: SimulatedCloud, key: str) -> tuple[NodeActivities, ProviderRegistry]:
    if kube_api.real:
        await kube_api.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await put_secret(kube_api.http, REF.name, {REF.key: key})
    registry = ProviderRegistry(cluster=kube_api.cluster, env={"TGP_SIMULATED_CLOUD_URL": cloud.url})
    acts = NodeActivities(
        providers={}, tailnets={"stub": StubTailnet()}, cluster=kube_api.cluster,  # type: ignore[dict-item]
        registry=registry, poll_interval=timedelta(seconds=0.01), create_settle=timedelta(0),
    )  # fmt: skip
    return acts, registry


async def launch(acts: NodeActivities, registry: ProviderRegistry) -> InstanceRef:
    offer = (await (await registry.get("simulated", REF)).list_offers())[0]
    inp = LaunchInput(node_name="gpu-1", attempt=1, offer=offer, credentials=REF, tailnet_tags=["tag:tgp-node"], tailnet="stub")
    result = await ActivityEnvironment().run(acts.launch_instance, inp)
    # What the node workflow records (workflows/node/launch.py, `_launched`).
    return InstanceRef(provider="simulated", instance_name="tgp-gpu-1-1", instance_id=result.instance.instance_id, credentials=REF, account=result.account)


async def running(acts: NodeActivities, ref: InstanceRef) -> StageLook:
    """The join's look at the instance (`check_stage`) until it runs; it must never read as
    gone (what a look with the wrong account's key would see)."""

    async def look() -> StageLook | None:
        seen = await ActivityEnvironment().run(acts.check_stage, StageCheck(instance=ref))
        assert "gone" not in seen.seen, f"read as vanished: {seen.seen}"
        return seen if seen.up else None

    return await eventually(look, what=f"instance {ref.instance_id} running")


async def test_a_node_keeps_the_account_it_was_bought_with_when_the_secret_switches(kube_api: KubeApi) -> None:
    key_a, key_b = new_key("a"), new_key("b")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key_a, "team-a")
        cloud.add_key(key_b, "team-b")
        acts, registry = await setup(kube_api, cloud, key_a)
        try:
            ref = await launch(acts, registry)
            assert ref.account is not None and key_a not in ref.account, "the node carries which key bought it, not the key"
            await put_secret(kube_api.http, REF.name, {REF.key: key_b})  # the class now bills team-b

            await running(acts, ref)
            spec = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated", "credentialsRef": {"name": REF.name, "key": REF.key}}]})
            fleet = NodeClassActivities(cluster=kube_api.cluster, providers={}, registry=registry)
            problems = await fleet.validate_class(ValidateClassInput(name="c", spec=spec, operator_namespace=NS))
            assert any("now names another account than running nodes were bought with" in p for p in problems), problems

            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
            assert cloud.instances[ref.instance_id].status == "terminated" and cloud.instances[ref.instance_id].account == "team-a"
        finally:
            await registry.aclose()


async def test_after_a_restart_the_old_key_is_found_under_any_key_of_the_secret(kube_api: KubeApi) -> None:
    """A node whose key was not kept (bought by a release before activities/kept_accounts.py,
    or its kept Secret deleted by hand): only the class's Secret can give the old key back."""
    key_a, key_b = new_key("a"), new_key("b")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key_a, "team-a")
        cloud.add_key(key_b, "team-b")
        acts, registry = await setup(kube_api, cloud, key_a)
        ref = await launch(acts, registry)
        await registry.aclose()
        await put_secret(kube_api.http, REF.name, {REF.key: key_b})
        kept = await kube_api.http.delete(f"/api/v1/namespaces/{NS}/secrets/{kept_name('simulated', ref.account or '')}")
        assert kept.status_code in (200, 202)
        acts, registry = await setup(kube_api, cloud, key_b)  # a new worker: it never saw key_a
        try:
            with pytest.raises(ApplicationError, match="put it back in the Secret"):
                await ActivityEnvironment().run(acts.terminate_instance, ref)
            await put_secret(kube_api.http, REF.name, {REF.key: key_b, "old": key_a})
            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
            assert cloud.instances[ref.instance_id].status == "terminated"
        finally:
            await registry.aclose()


async def test_a_rotated_and_revoked_key_falls_back_to_the_current_one(kube_api: KubeApi) -> None:
    old, new = new_key("a"), new_key("a")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(old, "team-a")
        acts, registry = await setup(kube_api, cloud, old)
        try:
            ref = await launch(acts, registry)
            cloud.add_key(new, "team-a")
            await put_secret(kube_api.http, REF.name, {REF.key: new})
            cloud.revoke_key(old)
            await running(acts, ref)
            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
        finally:
            await registry.aclose()


async def test_a_switch_to_another_account_with_the_old_key_revoked_is_unreachable_not_gone(kube_api: KubeApi) -> None:
    """The old account's key answers 401 and the new account's key sees nothing: the instance
    still bills in the old account, so it must read as unreachable (an error saying what to
    do, then TerminationStuck), never as gone (Interrupted, replaced, and left billing)."""
    key_a, key_b = new_key("a"), new_key("b")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key_a, "team-a")
        cloud.add_key(key_b, "team-b")
        acts, registry = await setup(kube_api, cloud, key_a)
        try:
            ref = await launch(acts, registry)
            await put_secret(kube_api.http, REF.name, {REF.key: key_b})
            cloud.revoke_key(key_a)
            # The watch's look: an error (an outage to the watch, which keeps the node), not gone.
            with pytest.raises(ApplicationError, match="put it back in the Secret"):
                await ActivityEnvironment().run(acts.observe_node, ObserveInput(instance=ref, node_name="gpu-1"))
            with pytest.raises(ApplicationError, match="put it back in the Secret"):
                await ActivityEnvironment().run(acts.terminate_instance, ref)
            assert cloud.instances[ref.instance_id].status != "terminated", "still billing in team-a: nothing may call it gone"
        finally:
            await registry.aclose()


@pytest.mark.parametrize("gone", ["secret", "key"])
async def test_a_node_stays_terminable_when_its_class_secret_goes(kube_api: KubeApi, gone: str) -> None:
    """Issue 35 item 4: the class's credentials Secret deleted (or its key renamed) while a node
    bought with it runs. The node's end still reaches its instance with the adapter of that
    account this worker has open: it is terminated and verified, not left billing until the
    Secret comes back (on another worker: the kept key, tests/test_kept_accounts.py)."""
    key = new_key("a")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key, "team-a")
        acts, registry = await setup(kube_api, cloud, key)
        try:
            ref = await launch(acts, registry)
            if gone == "secret":
                assert (await kube_api.http.delete(f"/api/v1/namespaces/{NS}/secrets/{REF.name}")).status_code in (200, 202)
            else:  # renamed: the old key removed (a merge patch with null drops it)
                await put_secret(kube_api.http, REF.name, {"renamed": key})
                merge = {"Content-Type": "application/merge-patch+json"}
                patch = await kube_api.http.patch(f"/api/v1/namespaces/{NS}/secrets/{REF.name}", json={"data": {REF.key: None}}, headers=merge)
                patch.raise_for_status()
            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
            assert cloud.instances[ref.instance_id or ""].status == "terminated"
            with pytest.raises(ConfigError, match="does not exist|has no key"):  # a new purchase still says what to fix
                await registry.get("simulated", REF)
        finally:
            await registry.aclose()
