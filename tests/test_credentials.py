"""Provider credentials per GPUNodeClass (activities/accounts.py): one adapter per
(provider, Secret key), read when an activity needs it, kept while the Secret's resourceVersion
stays the same, replaced (and the old one closed) when the key is rotated.

Against the Kubernetes API (emulator, or TGP_TEST_KUBECONFIG) and the simulated cloud, whose
keys belong to accounts: a key sees and bills only its own account."""

from __future__ import annotations

import base64
import secrets
from collections.abc import AsyncIterator
from datetime import timedelta

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from activities.accounts import ProviderRegistry
from activities.clouds.registry import CAPABILITIES
from activities.clouds.simulated import SimulatedProvider
from tests.conftest import eventually, running_world
from tests.kube_env import KubeApi
from tests.test_node_lifecycle import FAST, start, wait_phase
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec
from tgp.errors import AuthError, ConfigError
from tgp.pools import node_request
from sim.cloud import SimulatedCloud
from sim.world import NODE_TAG
from tgp.types import BootPayload, CredentialsRef, NodePhase
from workflows.node import GPUNodeWorkflow

NS = "tgp-system"


def new_key(team: str) -> str:
    return f"sim-{team}-{secrets.token_hex(12)}"


async def put_secret(http: httpx.AsyncClient, name: str, data: dict[str, str], namespace: str = NS) -> None:
    """Create or replace the Secret (a replace gets a new resourceVersion, as a rotation does)."""
    encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    path = f"/api/v1/namespaces/{namespace}/secrets"
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}, "data": encoded}
    created = await http.post(path, json=body)
    _PUT.add((namespace, name))
    if created.status_code == 409:
        merge = {"Content-Type": "application/merge-patch+json"}
        (await http.patch(f"{path}/{name}", json={"data": encoded}, headers=merge)).raise_for_status()
    else:
        created.raise_for_status()


# Secrets put by the running test: deleted after it on a real cluster, which keeps them.
_PUT: set[tuple[str, str]] = set()


@pytest.fixture
async def cloud(kube_api: KubeApi) -> AsyncIterator[SimulatedCloud]:
    _PUT.clear()
    async with SimulatedCloud(api_key=new_key("worker")) as c:
        yield c
    if kube_api.real:
        for namespace, name in sorted(_PUT):
            await kube_api.http.delete(f"/api/v1/namespaces/{namespace}/secrets/{name}")


async def test_each_secret_key_gets_its_own_adapter_billing_its_own_account(kube_api: KubeApi, cloud: SimulatedCloud) -> None:
    if kube_api.real:
        await kube_api.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    key_a, key_b = new_key("a"), new_key("b")
    cloud.add_key(key_a, "team-a")
    cloud.add_key(key_b, "team-b")
    await put_secret(kube_api.http, "team-a-cloud", {"apiKey": key_a})
    await put_secret(kube_api.http, "team-b-cloud", {"apiKey": key_b})
    registry = ProviderRegistry(cluster=kube_api.cluster, env={"TGP_SIMULATED_CLOUD_URL": cloud.url})
    try:
        ref_a = CredentialsRef(name="team-a-cloud", key="apiKey")
        ref_b = CredentialsRef(name="team-b-cloud", key="apiKey")
        a, b = await registry.get("simulated", ref_a), await registry.get("simulated", ref_b)
        assert a is not b
        assert await registry.get("simulated", ref_a) is a, "same resourceVersion, same adapter"
        assert registry.builds == 2

        offer = (await a.list_offers())[0]
        boot = BootPayload(kind="env", content="", hostname="n")
        bought_a = await a.launch(offer, name="tgp-a-1", boot=boot)
        bought_b = await b.launch(offer, name="tgp-b-1", boot=boot)
        assert cloud.instances[bought_a.instance_id].account == "team-a"
        assert cloud.instances[bought_b.instance_id].account == "team-b"
        # A key sees only its own account's instances, as on a real cloud.
        assert await b.describe(bought_a.instance_id) is None
        assert [i.name for i in await a.list_instances("tgp-")] == ["tgp-a-1"]
    finally:
        await registry.aclose()


async def test_a_rotated_key_gets_a_new_adapter_and_the_old_one_is_kept_for_its_nodes(kube_api: KubeApi, cloud: SimulatedCloud) -> None:
    if kube_api.real:
        await kube_api.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    old, new = new_key("a"), new_key("a")
    cloud.add_key(old, "team-a")
    await put_secret(kube_api.http, "rotating", {"apiKey": old})
    registry = ProviderRegistry(cluster=kube_api.cluster, env={"TGP_SIMULATED_CLOUD_URL": cloud.url}, retire_after=timedelta(0))
    ref = CredentialsRef(name="rotating", key="apiKey")
    try:
        before = await registry.get("simulated", ref)
        assert isinstance(before, SimulatedProvider)
        await before.list_offers()
        # Rotate: the account gets a new key, the Secret is updated, the old key is deleted.
        cloud.add_key(new, "team-a")
        await put_secret(kube_api.http, "rotating", {"apiKey": new})
        cloud.revoke_key(old)
        with pytest.raises(AuthError):
            await before.list_offers()

        after = await registry.get("simulated", ref)
        assert after is not before
        assert await after.list_offers()
        assert cloud.requests_by_key[new] == 1
        # The replaced adapter stays open (bounded, MAX_KEPT_ACCOUNTS): nodes bought with its key
        # are reached with it until they end (test_account_switch.py).
        assert not before._client.is_closed
        assert await registry.get("simulated", ref) is after
        # A Secret rewritten with the same key (a new resourceVersion) keeps the adapter.
        await put_secret(kube_api.http, "rotating", {"apiKey": new})
        merge = {"Content-Type": "application/merge-patch+json"}
        (await kube_api.http.patch(f"/api/v1/namespaces/{NS}/secrets/rotating", json={"metadata": {"labels": {"x": "y"}}}, headers=merge)).raise_for_status()
        assert await registry.get("simulated", ref) is after and registry.builds == 2
    finally:
        await registry.aclose()
    assert after._client.is_closed and before._client.is_closed  # type: ignore[attr-defined]


async def test_missing_secrets_keys_and_providers_are_config_errors_naming_them(kube_api: KubeApi, cloud: SimulatedCloud) -> None:
    if kube_api.real:
        await kube_api.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    await put_secret(kube_api.http, "wrong-key", {"other": "x" * 20})
    worker = SimulatedProvider(cloud.url)
    registry = ProviderRegistry(cluster=kube_api.cluster, env={}, fallback={"simulated": worker})
    try:
        with pytest.raises(ConfigError, match="Secret tgp-system/nowhere does not exist.*credentialsRef"):
            await registry.get("simulated", CredentialsRef(name="nowhere", key="apiKey"))
        with pytest.raises(ConfigError, match="has no key 'apiKey' \\(keys: other\\)"):
            await registry.get("simulated", CredentialsRef(name="wrong-key", key="apiKey"))
        await put_secret(kube_api.http, "no-url", {"apiKey": "sim-" + "k" * 20})
        with pytest.raises(ConfigError, match="TGP_SIMULATED_CLOUD_URL"):
            await registry.get("simulated", CredentialsRef(name="no-url", key="apiKey"))
        # Without a reference: the worker's own adapter, or a message saying how to give one.
        assert await registry.get("simulated") is worker
        with pytest.raises(ConfigError, match="'lambdalabs' is not configured on this worker.*credentialsRef"):
            await registry.get("lambdalabs")
    finally:
        await registry.aclose()
        await worker.aclose()


async def test_capabilities_are_the_configured_adapters() -> None:
    """A Vast.ai adapter with VAST_VM=true rents VMs: validation must see that, not the table's
    container entry."""
    registry = ProviderRegistry(cluster=None, env={"VAST_VM": "true"})  # type: ignore[arg-type]  # no Secret is read
    caps = await registry.capabilities("vastai")
    assert caps == CAPABILITIES["vastai-vm"] and caps.joins_as_node
    assert not (await ProviderRegistry(cluster=None, env={}).capabilities("vastai")).joins_as_node  # type: ignore[arg-type, union-attr]


def test_the_node_request_carries_references_never_keys() -> None:
    klass = GPUNodeClassSpec.model_validate(
        {
            "providers": [
                {"name": "runpod", "credentialsRef": {"name": "team-a", "key": "RUNPOD_API_KEY"}},
                {"name": "lambdalabs", "credentialsRef": {"name": "team-a", "key": "LAMBDA", "namespace": "other"}},
                {"name": "vastai"},
                {"name": "paperspace", "enabled": False, "credentialsRef": {"name": "off", "key": "k"}},
            ],
            "kubernetesVersion": "v1.34.1",
            "tailscaleConfig": {"ephemeral": False, "acceptRoutes": True},
        }
    )
    req = node_request(
        namespace="ml", pool_name="p", class_name="c", node_name="n", pool=GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}}), klass=klass
    )
    assert req.requirements.credentials == {
        "runpod": CredentialsRef(namespace=NS, name="team-a", key="RUNPOD_API_KEY"),
        "lambdalabs": CredentialsRef(namespace="other", name="team-a", key="LAMBDA"),
    }
    assert req.boot.kubernetes_version == "v1.34.1" and req.boot.accept_routes and not req.boot.ephemeral


async def test_a_class_with_its_own_tailscale_oauth_client_mints_with_it_and_picks_up_a_new_one(temporal: WorkflowEnvironment) -> None:
    """tailscaleConfig.oauthSecretRef: the node's key is minted by the class's OAuth client, not
    the worker's; the Secret changed to another client is used by the next node."""
    async with running_world(temporal) as (world, _, queue):
        clients = {name: (f"k{secrets.token_hex(6)}CNTRL", f"tskey-client-{secrets.token_hex(16)}") for name in ("first", "second")}
        for client_id, client_secret in clients.values():
            world.tailscale.clients[client_id] = (client_secret, [NODE_TAG])
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            client_id, client_secret = clients["first"]
            await put_secret(kube, "team-tailnet", {"client-id": client_id, "client-secret": client_secret})
            klass = GPUNodeClassSpec.model_validate(
                {"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": [NODE_TAG], "oauthSecretRef": "team-tailnet"}}
            )
            pool = GPUNodePoolSpec.model_validate({"nodeClassRef": {"name": "c"}})

            async def node_minted_by() -> str:
                req = node_request(namespace="ml", pool_name="p", class_name="c", node_name=f"gpu-{secrets.token_hex(3)}", pool=pool, klass=klass)
                req = req.model_copy(update={"timeouts": FAST, "class_workflow_id": None, "pool_workflow_id": None})
                assert req.tailnet_ref is not None and req.tailnet_ref.name == "team-tailnet"
                handle = await start(temporal, queue, req)
                await wait_phase(handle, NodePhase.READY)
                [key] = [k for k in world.tailscale.keys.values() if k.description.endswith(req.node_name)]
                await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
                await handle.result()
                assert world.tailnet_devices(req.node_name) == [], "cleanup used the class's tailnet too"
                return key.client_id

            assert await node_minted_by() == clients["first"][0]
            client_id, client_secret = clients["second"]
            await put_secret(kube, "team-tailnet", {"client-id": client_id, "client-secret": client_secret})
            assert await node_minted_by() == clients["second"][0]
        assert all(k.client_id != world.oauth_client_id for k in world.tailscale.keys.values()), "the worker's client minted nothing"
