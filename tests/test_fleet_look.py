"""The fleet look against the simulated cloud and a real Temporal dev server: at rest one list
per account per look and no request per node; an instance the provider ended is told to its
node; a listing that fails or lags tells nothing wrong (issue 20, provider state in bulk)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import httpx
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from activities.http_wire import default_tls
from activities.accounts import ProviderRegistry
from activities.clouds.registry import providers_from_env
from activities.fleet import FleetActivities, FleetLookInput, FleetLookResult
from sim.world import SimWorld
from tests.conftest import eventually, running_world
from temporalio.worker import Replayer

from tests.histories_io import save_history
from tests.test_node_lifecycle import FAST, request, start, wait_phase
from tgp.types import InstanceSighting, NodePhase, NodeStatus
from workers.temporal import DATA_CONVERTER
from workflows.fleet import FleetLookWorkflow
from workflows.node import GPUNodeWorkflow

# Nodes that do not look at their instance themselves during the test (the watch poll this
# look replaces; on a tree where it is gone, the interval changes nothing).
AT_REST = FAST.model_copy(update={"watch_interval": timedelta(hours=1)})


async def look(
    env: WorkflowEnvironment, fleet: FleetActivities, skip: list[str] | None = None, *, queue: str, client: Client | None = None
) -> FleetLookResult:
    """One look at the node workflows of `queue` (the test's own: the session's dev server holds
    other tests' nodes too), through `client` (else the environment's)."""
    return await ActivityEnvironment(client=client or env.client).run(fleet.look_at_fleet, FleetLookInput(skip=skip or [], task_queue=queue))


async def sightings_told(handle: WorkflowHandle) -> list[InstanceSighting]:
    """The instance_seen signals in the node's history."""
    from tests.test_watch_events import signals_received

    return await signals_received(handle, "instance_seen", InstanceSighting)


async def ready_nodes(env: WorkflowEnvironment, queue: str, count: int) -> list[tuple[WorkflowHandle, NodeStatus]]:
    handles = [await start(env, queue, request(timeouts=AT_REST)) for _ in range(count)]
    return [(h, await wait_phase(h, NodePhase.READY)) for h in handles]


async def until_listed_ready(
    env: WorkflowEnvironment, fleet: FleetActivities, count: int, *, queue: str, client: Client | None = None
) -> FleetLookResult:
    """Looks until visibility shows `count` Ready nodes (it lags a second or so): the first look
    that knows them all."""

    async def listed() -> FleetLookResult | None:
        result = await look(env, fleet, queue=queue, client=client)
        return result if result.nodes >= count and result.unresolved == 0 else None

    return await eventually(listed, timeout=60, what=f"visibility showing {count} Ready nodes")


async def looks_completed(handle: WorkflowHandle) -> int:
    """Looks the fleet look's workflow has completed (its activity results in history)."""
    events = [e async for e in handle.fetch_history_events()]
    return sum(1 for e in events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED)


async def test_at_rest_over_several_intervals_the_running_look_lists_once_per_look_and_nothing_per_node(temporal: WorkflowEnvironment) -> None:
    """(a) As the worker runs it: the fleet look's workflow (every half second here) over
    several looks of four Ready nodes at rest: the provider sees one instance listing per look
    (the worker's one account), no describe, and no node is signalled."""
    from workers.main import ensure_fleet_look

    async with running_world(temporal) as (world, _, queue):
        nodes = await ready_nodes(temporal, queue, 4)
        async with fleet_look(world) as fleet:
            await until_listed_ready(temporal, fleet, len(nodes), queue=queue)
        lists, describes = world.cloud.instance_lists, world.cloud.describe_requests
        look_id = f"fleet-look-{uuid.uuid4().hex[:6]}"
        await ensure_fleet_look(temporal.client, queue, timedelta(seconds=0.5), workflow_id=look_id)
        look_handle = temporal.client.get_workflow_handle(look_id)

        async def several() -> int | None:
            done = await looks_completed(look_handle)
            return done if done >= 4 else None

        try:
            await eventually(several, timeout=60, what="four fleet looks")
        finally:
            await look_handle.terminate("test finished")
        looks = await looks_completed(look_handle)

        listed = world.cloud.instance_lists - lists
        assert looks <= listed <= looks + 1, "one listing per look (one more if a look was cut short by the end)"
        assert world.cloud.describe_requests == describes, "no request per node"
        for handle, _ in nodes:
            assert await sightings_told(handle) == []
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            await handle.result()


async def test_an_instance_the_provider_ended_is_told_to_its_node_only(temporal: WorkflowEnvironment) -> None:
    """(b), the look's part: the provider takes one instance away behind tgp's back; the next
    look tells that node (missing from the listing), and no other."""
    async with running_world(temporal) as (world, _, queue):
        (victim, victim_status), (bystander, _) = await ready_nodes(temporal, queue, 2)
        async with fleet_look(world) as fleet:
            await until_listed_ready(temporal, fleet, 2, queue=queue)
            await world.cloud.preempt(victim_status.instance_id or "")
            result = await look(temporal, fleet, queue=queue)

        assert [(a.account, a.sent) for a in result.accounts] == [("simulated", 1)]
        [told] = await sightings_told(victim)
        assert (told.instance_id, told.state) == (None, None), "the simulated cloud lists no ended instance: missing"
        assert await sightings_told(bystander) == []
        assert (await asyncio.wait_for(victim.result(), 60)).phase is NodePhase.INTERRUPTED
        await bystander.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await bystander.result()


async def test_a_look_sees_only_the_nodes_of_its_own_task_queue(temporal: WorkflowEnvironment) -> None:
    """Two installations sharing a Temporal namespace (or two tests sharing a dev server): a look
    running on one task queue neither lists, queries nor tells the other's nodes. Before the
    look was scoped, another queue's nodes (their worker gone) stayed unresolved at every look."""
    async with running_world(temporal) as (world, _, queue):
        [(handle, _)] = await ready_nodes(temporal, queue, 1)
        async with fleet_look(world) as fleet:
            await until_listed_ready(temporal, fleet, 1, queue=queue)
            elsewhere = await look(temporal, fleet, queue=f"{queue}-other")
        assert (elsewhere.nodes, elsewhere.unresolved) == (0, 0)
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()


async def test_a_listing_that_lags_behind_a_new_node_tells_it_nothing(temporal: WorkflowEnvironment) -> None:
    """(c) The provider's list lags behind creates (a window of 10 minutes here): a node that
    just became Ready is missing from the listing, and is told nothing within the window."""
    async with running_world(temporal) as (world, _, queue):
        [(handle, _)] = await ready_nodes(temporal, queue, 1)
        world.cloud.model.list_lag = 3600.0  # every listing from now on omits the instance
        async with fleet_look(world, consistency_window=timedelta(minutes=10)) as fleet:
            result = await until_listed_ready(temporal, fleet, 1, queue=queue)

        assert [(a.account, a.listed, a.sent) for a in result.accounts] == [("simulated", 0, 0)]
        assert await sightings_told(handle) == []
        assert (await handle.query(GPUNodeWorkflow.status)).phase is NodePhase.READY
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()


async def test_a_throttled_listing_tells_nothing_and_is_skipped_while_it_backs_off(temporal: WorkflowEnvironment) -> None:
    """(d) Every list answers 429 (after the adapter's own bounded retries): the look reports
    the account failed with its error type only and tells no node; while the account backs off
    the next look does not list it at all."""
    async with running_world(temporal) as (world, _, queue):
        [(handle, _)] = await ready_nodes(temporal, queue, 1)
        async with fleet_look(world) as fleet:
            await until_listed_ready(temporal, fleet, 1, queue=queue)
            world.cloud.fail("/v1/instances", 429, times=1000, method="GET", message="slow down, key sk-live-123")
            requests = sum(world.cloud.requests_by_key.values())

            failed = await look(temporal, fleet, queue=queue)
            [account] = failed.accounts
            assert (account.failure, account.sent) == ("TransientError", 0)
            assert await sightings_told(handle) == [], "a failed listing is not an empty one"
            tried = sum(world.cloud.requests_by_key.values())
            assert tried > requests

            skipped = await look(temporal, fleet, skip=[account.account], queue=queue)
            assert [(a.skipped, a.sent) for a in skipped.accounts] == [(True, 0)]
            assert sum(world.cloud.requests_by_key.values()) == tried, "an account backing off is not listed"
        world.cloud.clear_faults()
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await handle.result()


@asynccontextmanager
async def fleet_look(world: SimWorld, *, consistency_window: timedelta | None = None) -> AsyncIterator[FleetActivities]:
    """The fleet look's activities with the worker's own adapters (the simulated cloud)."""
    providers = providers_from_env(world.worker_env())
    if consistency_window is not None:
        providers["simulated"].consistency_window = consistency_window  # type: ignore[misc]
    try:
        yield FleetActivities(registry=ProviderRegistry(cluster=None, fallback=providers))  # type: ignore[arg-type]
    finally:
        for provider in providers.values():
            await provider.aclose()  # type: ignore[attr-defined]


async def test_each_account_is_listed_once_per_look_whatever_its_nodes(temporal: WorkflowEnvironment) -> None:
    """Two accounts (the worker's own key, and a class whose credentialsRef names another
    account's key), nodes on each: one listing per account per look; the class's account is
    learnt from the GPUNodeClass once per node, not read each look; and a preempted instance
    on the class's account is told to its node."""
    from activities.kube.cluster import KubernetesCluster
    from tests.test_credentials import NS, new_key, put_secret
    from tgp.crds import GROUP, VERSION
    from tgp.types import CredentialsRef, OfferRequirements
    from workers.crdgen import manifests

    async with running_world(temporal) as (world, _, queue):
        assert world.kube is not None
        for crd in manifests().values():
            world.kube.install_crd(crd)
        team_key, ref = new_key("team"), CredentialsRef(namespace=NS, name="team-cloud", key="apiKey")
        world.cloud.add_key(team_key, "team")
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            await kube.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
            await put_secret(kube, ref.name, {ref.key: team_key})
            klass = {"providers": [{"name": "simulated", "credentialsRef": {"namespace": NS, "name": ref.name, "key": ref.key}}]}
            made = await kube.post(f"/apis/{GROUP}/{VERSION}/gpunodeclasses", json={"apiVersion": f"{GROUP}/{VERSION}", "kind": "GPUNodeClass", "metadata": {"name": "team"}, "spec": klass})
            assert made.status_code == 201, made.text
        team_requirements = OfferRequirements(gpu_types=["RTX4090"], allow_spot=False, credentials={"simulated": ref})
        own = [await start(temporal, queue, request(timeouts=AT_REST)) for _ in range(2)]
        team = [await start(temporal, queue, request(timeouts=AT_REST, node_class="team", requirements=team_requirements)) for _ in range(2)]
        statuses = {h.id: await wait_phase(h, NodePhase.READY) for h in own + team}
        assert {world.cloud.instances[s.instance_id or ""].account for s in statuses.values()} == {"default", "team"}

        providers = providers_from_env(world.worker_env())
        cluster = KubernetesCluster.from_url(world.kube_url)
        registry = ProviderRegistry(cluster=cluster, env=world.worker_env(), fallback=providers)
        try:
            fleet = FleetActivities(registry=registry, cluster=cluster)
            await until_listed_ready(temporal, fleet, 4, queue=queue)
            lists_by_key = dict(world.cloud.requests_by_key)
            describes = world.cloud.describe_requests
            results = [await look(temporal, fleet, queue=queue) for _ in range(2)]
            team_account = f"simulated:{NS}/{ref.name}/{ref.key}"
            assert all([(a.account, a.nodes, a.sent) for a in r.accounts] == [("simulated", 2, 0), (team_account, 2, 0)] for r in results)
            assert world.cloud.describe_requests == describes
            # Per key: its listings (2), and the team key nothing else.
            assert world.cloud.requests_by_key[team_key] - lists_by_key.get(team_key, 0) == 2
            assert world.cloud.requests_by_key[world.cloud_api_key] - lists_by_key.get(world.cloud_api_key, 0) == 2

            await world.cloud.preempt(statuses[team[0].id].instance_id or "")
            told = await look(temporal, fleet, queue=queue)
            assert [(a.account, a.sent) for a in told.accounts] == [("simulated", 0), (team_account, 1)]
            assert len(await sightings_told(team[0])) == 1
            for handle in own + team[1:]:
                assert await sightings_told(handle) == []

            # Every listing throttled: nobody is told anything, and the class's admin hears why
            # (by error type, never the provider's words).
            world.cloud.fail("/v1/instances", 429, times=1000, method="GET", message="slow down, key sk-live-xyz")
            try:
                failed = await look(temporal, fleet, queue=queue)
            finally:
                world.cloud.clear_faults()
            assert {(a.account, a.failure, a.sent) for a in failed.accounts} >= {(team_account, "TransientError", 0)}
            async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
                events = (await kube.get("/api/v1/events")).json()["items"]
            [event] = [e for e in events if e["reason"] == "InstanceListFailed"]
            assert (event["type"], event["involvedObject"]["kind"], event["involvedObject"]["name"]) == ("Warning", "GPUNodeClass", "team")
            assert "TransientError" in event["message"] and "sk-live" not in event["message"] and "slow down" not in event["message"]
        finally:
            await registry.aclose()
            for provider in providers.values():
                await provider.aclose()  # type: ignore[attr-defined]
            await cluster.close()
        assert (await asyncio.wait_for(team[0].result(), 60)).phase is NodePhase.INTERRUPTED, "its own describe (with the class's key) confirmed it"
        for handle in own + team[1:]:
            await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
            await handle.result()
        assert world.cloud.live_instances() == []


async def test_an_instance_preempted_behind_tgps_back_ends_its_node_interrupted_within_a_look(temporal: WorkflowEnvironment) -> None:
    """(b) End to end: the fleet look runs as the worker runs it (its workflow, every second
    here); the provider takes a Ready node's instance away; the next look tells the node, the
    node describes its instance once and ends Interrupted with everything released. Its
    neighbour, at rest, is told nothing and stays Ready. The nodes' own backstop look is an
    hour away: only the fleet look can have noticed."""
    from workers.main import ensure_fleet_look

    async with running_world(temporal) as (world, _, queue):
        (victim, victim_status), (bystander, _) = await ready_nodes(temporal, queue, 2)
        look_id = f"fleet-look-{uuid.uuid4().hex[:6]}"
        await ensure_fleet_look(temporal.client, queue, timedelta(seconds=1), workflow_id=look_id)
        try:
            await world.cloud.preempt(victim_status.instance_id or "")
            ended: NodeStatus = await asyncio.wait_for(victim.result(), 60)
        finally:
            look_handle = temporal.client.get_workflow_handle(look_id)
            await look_handle.terminate("test finished")
        history = await look_handle.fetch_history()
        await Replayer(workflows=[FleetLookWorkflow], data_converter=DATA_CONVERTER).replay_workflow(history)
        save_history("fleet_look", history)

        assert ended.phase is NodePhase.INTERRUPTED, ended.end_reason
        assert len(await sightings_told(victim)) >= 1
        assert await sightings_told(bystander) == []
        assert (await bystander.query(GPUNodeWorkflow.status)).phase is NodePhase.READY
        await bystander.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        await bystander.result()
        assert world.cloud.live_instances() == []
