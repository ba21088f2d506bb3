"""The class says at once what is wrong with its provider accounts (issue 35 items 4 and 11), and a
deleted pool shows the releases it waits for.

A class's credentials Secret deleted while its nodes run used to be noticed at the class's next
validation (up to 10 minutes; the class said Ready meanwhile); a provider account blocked for
rejected credentials was a Warning Event only. Now each resync's `account_problems` look makes
them conditions (CredentialsMissing, ProviderAccountBlocked) naming the Secret. On the dev
server, with the worker, Kubernetes emulator and simulated cloud of `running_world`.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import httpx
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from sim.world import SimWorld
from tests.conftest import eventually, running_world
from tests.test_credentials import NS, new_key, put_secret
from tests.test_entities_heal import FAST, start_class, start_pool
from tests.test_node_lifecycle import FAST as NODE_FAST
from tests.test_node_lifecycle import request, start, wait_phase
from tests.test_pool_accounting import CLASS, pool_spec
from tgp.crds import GROUP, VERSION, GPUNodeClassSpec, GPUNodePoolStatus
from tgp.messages import PoolUpdate
from tgp.types import BootConfig, CredentialsRef, NodePhase, OfferRequirements
from workers.crdgen import manifests
from workflows.node import GPUNodeWorkflow
from workflows.pool import GPUNodePoolWorkflow

REF = CredentialsRef(namespace=NS, name="team-cloud", key="apiKey")
SPEC = {"providers": [{"name": "simulated", "credentialsRef": {"namespace": NS, "name": REF.name, "key": REF.key}}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}}


async def team_class(env: WorkflowEnvironment, world: SimWorld, queue: str, kube: httpx.AsyncClient) -> tuple[str, WorkflowHandle]:
    """A GPUNodeClass whose provider bills the `team` account through Secret REF, its workflow
    resyncing every second."""
    assert world.kube is not None
    for crd in manifests().values():
        world.kube.install_crd(crd)
    key = new_key("team")
    world.cloud.add_key(key, "team")
    await kube.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await put_secret(kube, REF.name, {REF.key: key})
    name = f"team-{uuid.uuid4().hex[:6]}"
    made = await kube.post(f"/apis/{GROUP}/{VERSION}/gpunodeclasses", json={"apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUNodeClass", "metadata": {"name": name}, "spec": SPEC})
    assert made.status_code == 201, made.text
    return key, await start_class(env, queue, name, GPUNodeClassSpec.model_validate(SPEC))


def team_node(name: str, **overrides: Any) -> Any:
    requirements = OfferRequirements(gpu_types=["RTX4090"], allow_spot=False, credentials={"simulated": REF})
    return request(node_class=name, boot=BootConfig(node_class=name), requirements=requirements, **overrides)


async def condition(kube: httpx.AsyncClient, name: str, type: str, status: str) -> dict[str, Any] | None:
    """The class's condition `type` once the status written to the API server says `status`."""
    got = (await kube.get(f"/apis/{GROUP}/{VERSION}/gpunodeclasses/{name}")).json()
    found = {c["type"]: c for c in (got.get("status") or {}).get("conditions", [])}
    return found[type] if type in found and found[type]["status"] == status else None


async def class_events(kube: httpx.AsyncClient, reason: str) -> list[dict[str, Any]]:
    items = (await kube.get("/api/v1/events")).json()["items"]
    return [e for e in items if e["reason"] == reason and e["involvedObject"]["kind"] == "GPUNodeClass"]


async def account_looks(handle: WorkflowHandle) -> int:
    history = await handle.fetch_history()
    return sum(1 for e in history.events if e.activity_task_scheduled_event_attributes.activity_type.name == "account_problems")


async def test_a_deleted_credentials_secret_is_told_at_once_naming_it_and_clears_when_it_is_back(temporal: WorkflowEnvironment) -> None:
    """Issue 35 item 4: the Secret deleted while a node bought with it runs. Within the class's
    next resync (not its 10-minute validation) the class says CredentialsMissing naming
    namespace/name, Ready False, one Warning Event; the node still ends (the worker's kept key);
    re-created, the condition clears and the class is Ready again."""
    async with running_world(temporal) as (world, _, queue), httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        key, klass = await team_class(temporal, world, queue, kube)
        name = klass.id.split("/")[-1]
        node = await start(temporal, queue, team_node(name))
        await wait_phase(node, NodePhase.READY, timeout=60)
        await eventually(lambda: condition(kube, name, "Ready", "True"), what="the class Ready")

        assert (await kube.delete(f"/api/v1/namespaces/{NS}/secrets/{REF.name}")).status_code in (200, 202)
        missing = await eventually(lambda: condition(kube, name, "CredentialsAvailable", "False"), what="CredentialsMissing")
        assert missing["reason"] == "CredentialsMissing" and f"Secret {NS}/{REF.name} does not exist" in missing["message"], missing
        assert "re-create it" in missing["message"] and key not in missing["message"]
        ready = await condition(kube, name, "Ready", "False")
        assert ready is not None and ready["reason"] == "CredentialsMissing", ready
        # Two more looks at the accounts: still one Event.
        looked = await account_looks(klass)
        await eventually(lambda: _more(account_looks(klass), looked + 2), what="two more passes")
        [event] = await class_events(kube, "CredentialsMissing")
        assert event["type"] == "Warning" and f"{NS}/{REF.name}" in event["message"] and key not in event["message"]

        await node.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await node.result()).phase is NodePhase.TERMINATED
        assert world.cloud.live_instances() == [], "the node ended with the key the worker kept"

        await put_secret(kube, REF.name, {REF.key: key})
        back = await eventually(lambda: condition(kube, name, "CredentialsAvailable", "True"), what="the condition to clear")
        assert back["reason"] == "Found"
        assert await eventually(lambda: condition(kube, name, "Ready", "True"), what="the class Ready again")
        await klass.terminate("test finished")


async def _more(count: Any, than: int) -> bool:
    return await count >= than


async def test_a_blocked_provider_account_is_a_condition_naming_provider_secret_and_code_until_it_lifts(temporal: WorkflowEnvironment) -> None:
    """Issue 35 item 11: the account answers 403 to a create; the launch blocks the account for
    the class (the worker's account-wide block). The class's condition says so, naming the
    provider, the Secret and the error type, until the block lifts; the one Warning Event is the
    launch's."""
    async with running_world(temporal) as (world, _, queue), httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        key, klass = await team_class(temporal, world, queue, kube)
        name = klass.id.split("/")[-1]
        await eventually(lambda: condition(kube, name, "ProviderAccountsAvailable", "True"), what="the accounts usable")
        world.cloud.fail("/v1/instances", 403, times=10, method="POST", message=f"forbidden for {key}")
        node = await start(temporal, queue, team_node(name, max_launch_attempts=1, unavailable_offer_ttl=timedelta(seconds=8)))
        await wait_phase(node, NodePhase.FAILED, timeout=60)

        blocked = await eventually(lambda: condition(kube, name, "ProviderAccountsAvailable", "False"), what="ProviderAccountBlocked")
        message = blocked["message"]
        assert blocked["reason"] == "ProviderAccountBlocked" and "provider simulated" in message and f"Secret {NS}/{REF.name}" in message, message
        assert "PermissionDenied" in message and key not in message and "forbidden" not in message, message
        ready = await condition(kube, name, "Ready", "True")
        assert ready is not None and "account blocked: simulated" in ready["message"], ready
        assert len(await class_events(kube, "ProviderAccountBlocked")) == 1

        lifted = await eventually(lambda: condition(kube, name, "ProviderAccountsAvailable", "True"), what="the block to lift")
        assert lifted["reason"] == "Usable"
        await klass.terminate("test finished")


async def test_a_deleted_pool_shows_the_releases_it_waits_for(temporal: WorkflowEnvironment) -> None:
    """Issue 35 item 4: while a deleted pool waits for its nodes, a release the provider holds up
    (or a missing Secret) shows as InstancesReleased=False naming the node; the tear-down used to
    publish Ready alone."""
    async with running_world(temporal) as (world, _, queue):
        spec = pool_spec(f"cls-{uuid.uuid4().hex[:6]}")
        klass = await start_class(temporal, queue, spec.node_class_ref.name)
        pool = await start_pool(temporal, queue, f"p-{uuid.uuid4().hex[:6]}", spec)
        namespace, pool_name = pool.id.split("/")[1:]
        timeouts = NODE_FAST.model_copy(update={"termination_stuck": timedelta(seconds=1)})
        node = await start(temporal, queue, request(namespace=namespace, pool=pool_name, pool_workflow_id=pool.id, timeouts=timeouts))
        await wait_phase(node, NodePhase.READY, timeout=60)
        world.cloud.fail_deletes(10_000)
        await pool.signal(GPUNodePoolWorkflow.update, PoolUpdate(spec=spec, generation=1, node_class=CLASS, deleting=True))

        async def stuck() -> dict[str, Any] | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            found = {c.type: c for c in status.conditions}
            c = found.get("InstancesReleased")
            return c.model_dump() if c is not None and c.status == "False" and found["Ready"].reason == "Deleting" else None

        released = await eventually(stuck, what="InstancesReleased=False while the pool is deleted")
        node_name = (await node.query(GPUNodeWorkflow.status)).node_name
        assert released["reason"] == "TerminationStuck" and node_name in released["message"], released
        world.cloud.fail_deletes(0)
        assert (await node.result()).phase is NodePhase.TERMINATED
        await eventually(lambda: _completed(pool), what="the pool to end")
        assert world.cloud.live_instances() == []
        await klass.terminate("test finished")


async def _completed(handle: WorkflowHandle) -> bool:
    return (await handle.describe()).status.name == "COMPLETED"
