"""A node stays terminable by the account that bought it on any worker (issue 35 item 4, as
audited): the key a class's Secret held when a node was bought is kept in a Secret of tgp's own
(activities/kept_accounts.py), so with the class's Secret deleted (or its key removed) a
restarted worker, or the chart's other replica, still ends the instance. Before, only the
process that had built the adapter could: after a restart or on another replica the terminate
failed until the Secret came back, and the instance billed.

The kept key is in that Secret only: never in workflow history, logs, Events or status. Buying
with the class's Secret gone is still refused, naming it. A kept key goes once nothing can need
it: unused for UNUSED_FOR and its account showing no live tgp instance.

Against the Kubernetes API (emulator, or a real one) and the simulated cloud, whose keys belong
to accounts.
"""

from __future__ import annotations

import base64
import json
import uuid
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import Any, Callable

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.http_wire import default_tls
from activities.accounts import ProviderRegistry
from activities.kept_accounts import LABEL_KEPT, UNUSED_FOR, KeptAccounts, account_of, kept_name
from activities.node import NodeActivities
from activities.sweeper import SweeperActivities
from sim.cloud import SimulatedCloud
from sim.world import SimWorld, sim_world
from tests.kube_env import KubeApi
from tests.test_account_switch import REF, launch, setup
from tests.test_class_accounts import class_events, team_class, team_node
from tests.conftest import eventually
from tests.test_credentials import NS, new_key, put_secret
from tests.test_node_lifecycle import readable, start, wait_phase
from tests.test_secret_echo import logs  # noqa: F401 - the fixture: logging as the worker configures it
from tests.test_template_failures import StubTailnet
from tgp.errors import ConfigError
from tgp.secrets import class_reference_problem
from tgp.types import CredentialsRef, LaunchInput, NodePhase
from workers.main import WorkerConfig, build_activities, make_worker
from workflows.node import GPUNodeWorkflow

SECRETS = f"/api/v1/namespaces/{NS}/secrets"


async def another_worker(kube_api: KubeApi, cloud: SimulatedCloud) -> tuple[NodeActivities, ProviderRegistry]:
    """A worker that never saw the class's Secret: a restarted one, or another replica."""
    registry = ProviderRegistry(cluster=kube_api.cluster, env={"TGP_SIMULATED_CLOUD_URL": cloud.url})
    acts = NodeActivities(
        providers={}, tailnets={"stub": StubTailnet()}, cluster=kube_api.cluster,  # type: ignore[dict-item]
        registry=registry, poll_interval=timedelta(seconds=0.01), create_settle=timedelta(0),
    )  # fmt: skip
    return acts, registry


async def remove(kube_api: KubeApi, gone: str, key: str) -> None:
    """The class's Secret deleted, or its key removed (renamed: a merge patch with null drops it)."""
    if gone == "secret":
        assert (await kube_api.http.delete(f"{SECRETS}/{REF.name}")).status_code in (200, 202)
        return
    await put_secret(kube_api.http, REF.name, {"renamed": key})
    merge = {"Content-Type": "application/merge-patch+json"}
    (await kube_api.http.patch(f"{SECRETS}/{REF.name}", json={"data": {REF.key: None}}, headers=merge)).raise_for_status()


async def kept_secrets(http: httpx.AsyncClient) -> list[dict[str, Any]]:
    return list((await http.get(SECRETS, params={"labelSelector": LABEL_KEPT})).json().get("items") or [])


def decoded(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


@pytest.mark.parametrize("gone", ["secret", "key"])
async def test_a_node_is_ended_by_another_worker_after_its_class_secret_goes(kube_api: KubeApi, gone: str) -> None:
    key = new_key("a")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key, "team-a")
        acts, registry = await setup(kube_api, cloud, key)
        ref = await launch(acts, registry)
        await registry.aclose()  # the worker that bought it goes, and its memory with it
        [kept] = await kept_secrets(kube_api.http)
        assert kept["metadata"]["name"] == kept_name("simulated", ref.account or "") and ref.account == account_of(key)
        assert decoded(kept) == {"provider": "simulated", "key": key}, "provider and key only"
        await remove(kube_api, gone, key)

        acts, registry = await another_worker(kube_api, cloud)
        try:
            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
            assert cloud.instances[ref.instance_id or ""].status == "terminated"
            assert cloud.live_instances() == [], "nothing left billing"
        finally:
            await registry.aclose()


async def test_after_a_restart_and_a_switch_of_account_the_kept_key_ends_the_old_accounts_node(kube_api: KubeApi) -> None:
    """The class's Secret switched to another account's key, then a restart: the new worker never
    saw the old key and the Secret no longer holds it, but it was kept; no operator step."""
    key_a, key_b = new_key("a"), new_key("b")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key_a, "team-a")
        cloud.add_key(key_b, "team-b")
        acts, registry = await setup(kube_api, cloud, key_a)
        ref = await launch(acts, registry)
        await registry.aclose()
        await put_secret(kube_api.http, REF.name, {REF.key: key_b})
        acts, registry = await another_worker(kube_api, cloud)
        try:
            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
            assert cloud.instances[ref.instance_id or ""].status == "terminated" and cloud.instances[ref.instance_id or ""].account == "team-a"
        finally:
            await registry.aclose()


async def test_buying_with_the_class_secret_gone_is_refused_naming_it(kube_api: KubeApi) -> None:
    """A kept key ends what was bought; it never buys: a purchase needs the class's Secret."""
    key = new_key("a")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key, "team-a")
        acts, registry = await setup(kube_api, cloud, key)
        ref = await launch(acts, registry)
        offer = (await (await registry.get("simulated", REF)).list_offers())[0]
        await registry.aclose()
        await remove(kube_api, "secret", key)
        acts, registry = await another_worker(kube_api, cloud)
        try:
            with pytest.raises(ConfigError, match=f"Secret {NS}/{REF.name} does not exist"):
                await registry.for_purchase("simulated", REF)
            with pytest.raises(ConfigError, match=f"Secret {NS}/{REF.name} does not exist"):
                await registry.get("simulated", REF)  # no account: nothing bought to reach
            inp = LaunchInput(node_name="gpu-2", attempt=1, offer=offer, credentials=REF, tailnet_tags=["tag:tgp-node"], tailnet="stub")
            with pytest.raises(ApplicationError, match=f"Secret {NS}/{REF.name} does not exist"):
                await ActivityEnvironment().run(acts.launch_instance, inp)
            assert [i.id for i in cloud.live_instances()] == [ref.instance_id], "nothing more was bought"
        finally:
            await registry.aclose()


async def test_a_kept_key_goes_once_its_account_holds_no_tgp_instance(kube_api: KubeApi) -> None:
    """The sweeper's rule (KeptAccounts.forget_unused): not while it was used within
    UNUSED_FOR, not while its account still has a live tgp instance, not while its provider
    refuses it (what it still holds cannot be told); then it goes."""
    key, revoked = new_key("a"), new_key("b")
    async with SimulatedCloud(boot_delay=0.05) as cloud:
        cloud.add_key(key, "team-a")
        cloud.add_key(revoked, "team-b")
        acts, registry = await setup(kube_api, cloud, key)
        ref = await launch(acts, registry)
        await put_secret(kube_api.http, "other-cloud", {REF.key: revoked})
        await registry.for_purchase("simulated", CredentialsRef(name="other-cloud", key=REF.key))
        await registry.aclose()
        cloud.revoke_key(revoked)
        names = {kept_name("simulated", account_of(k)) for k in (key, revoked)}
        assert {s["metadata"]["name"] for s in await kept_secrets(kube_api.http)} == names

        def sweeper(now: Callable[[], datetime]) -> SweeperActivities:
            kept = KeptAccounts(kube_api.cluster, namespace=NS, env={"TGP_SIMULATED_CLOUD_URL": cloud.url}, now=now)
            return SweeperActivities(providers={}, tailnets={}, kept=kept)

        later = lambda: datetime.now(UTC) + UNUSED_FOR + timedelta(minutes=1)  # noqa: E731
        assert await ActivityEnvironment().run(sweeper(later).forget_kept_accounts) == [], "its instance still runs"

        acts, registry = await another_worker(kube_api, cloud)
        try:
            assert await ActivityEnvironment().run(acts.terminate_instance, ref) is True
        finally:
            await registry.aclose()
        # No instance left, but the key was used lately: a purchase with it may not show yet.
        assert await ActivityEnvironment().run(sweeper(lambda: datetime.now(UTC)).forget_kept_accounts) == [], "used lately"
        gone = await ActivityEnvironment().run(sweeper(later).forget_kept_accounts)
        assert gone == [kept_name("simulated", ref.account or "")]
        assert [s["metadata"]["name"] for s in await kept_secrets(kube_api.http)] == [kept_name("simulated", account_of(revoked))]


async def test_no_class_may_name_a_kept_secret(kube_api: KubeApi) -> None:
    name = kept_name("simulated", account_of(new_key("a")))
    assert class_reference_problem(name, "credentialsRef") is not None
    registry = ProviderRegistry(cluster=kube_api.cluster, env={})
    with pytest.raises(ConfigError, match="one of tgp's own"):
        await registry.get("simulated", CredentialsRef(name=name, key="key"))


async def test_the_kube_adapter_writes_lists_and_deletes_its_own_secrets(kube_api: KubeApi) -> None:
    """The Cluster port's Secret writes (activities/kube/cluster.py) over HTTP: a create of a
    name that exists is False and leaves it; a delete at a stale resourceVersion is False."""
    if kube_api.real:
        await kube_api.http.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    cluster, name = kube_api.cluster, f"tgp-kept-test-{uuid.uuid4().hex[:8]}"
    labels = {LABEL_KEPT: "key-test"}
    assert await cluster.create_secret(NS, name, {"key": b"first"}, labels=labels, annotations={"a": "1"})
    assert not await cluster.create_secret(NS, name, {"key": b"second"}, labels=labels, annotations={})
    assert await cluster.annotate_secret(NS, name, {"b": "2"})
    [listed] = [s for s in await cluster.list_secrets(NS, f"{LABEL_KEPT}=key-test") if s.name == name]
    assert listed.data == {"key": b"first"} and listed.annotations == {"a": "1", "b": "2"}
    assert await cluster.annotate_secret(NS, name, {"b": "3"})
    assert not await cluster.delete_secret(NS, name, resource_version=listed.resource_version), "changed since it was read"
    current = await cluster.read_secret_versioned(NS, name)
    assert current is not None and await cluster.delete_secret(NS, name, resource_version=current.resource_version)
    assert await cluster.read_secret(NS, name) is None
    assert not await cluster.annotate_secret(NS, name, {"c": "4"}) and not await cluster.delete_secret(NS, name, resource_version="1")


async def _worker(stack: AsyncExitStack, temporal: WorkflowEnvironment, world: SimWorld, queue: str) -> None:
    activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
    activities.node.poll_interval = timedelta(seconds=0.1)
    await stack.enter_async_context(make_worker(temporal.client, activities, task_queue=queue))


async def test_a_restarted_worker_ends_a_node_whose_class_secret_went_and_the_key_shows_nowhere(
    temporal: WorkflowEnvironment, logs: Callable[[], str]  # noqa: F811
) -> None:
    """The whole path on the dev server: a class's node bought by one worker; the class's Secret
    deleted; that worker stopped and another started (a restart, a rollout, the other replica);
    the node evicted ends on the new worker and nothing bills. The key is in the kept Secret and
    nowhere else: not in either workflow's history, the logs, the Events or the class status."""
    async with AsyncExitStack() as stack:
        world = await stack.enter_async_context(sim_world(boot_delay=0.2))
        kube = await stack.enter_async_context(httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url))
        queue = f"test-{uuid.uuid4().hex[:8]}"
        async with AsyncExitStack() as first:
            await _worker(first, temporal, world, queue)
            key, klass = await team_class(temporal, world, queue, kube)
            name = klass.id.split("/")[-1]
            node = await start(temporal, queue, team_node(name))
            await wait_phase(node, NodePhase.READY, timeout=60)
            assert (await kube.delete(f"{SECRETS}/team-cloud")).status_code in (200, 202)
        await _worker(stack, temporal, world, queue)
        [told] = await eventually(lambda: class_events(kube, "CredentialsMissing"), what="the Warning Event naming the Secret")
        assert f"{NS}/team-cloud" in told["message"], told

        await node.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        assert (await node.result()).phase is NodePhase.TERMINATED
        assert world.cloud.live_instances() == [], "the new worker ended it with the kept key"

        [kept] = await kept_secrets(kube)
        assert decoded(kept) == {"provider": "simulated", "key": key}
        forms = {key, base64.b64encode(key.encode()).decode()}
        seen = {
            "history": readable((await node.fetch_history()).to_json()) + readable((await klass.fetch_history()).to_json()),
            "logs": logs(),
            "events": (await kube.get("/api/v1/events")).text,
            "status": (await kube.get(f"/apis/tgp.io/v1/gpunodeclasses/{name}")).text + json.dumps((await node.query(GPUNodeWorkflow.status)).model_dump(mode="json")),
        }
        assert "key-" in seen["history"], "the account (a fingerprint) is in history, as it was"
        assert "credentials_secret_missing_using_kept_key" in seen["logs"], "the new worker ended it with the kept key"
        assert {where for where, text in seen.items() if any(f in text for f in forms)} == set(), "the kept key reached them"
        await klass.terminate("test finished")
