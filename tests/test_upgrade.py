"""A rollout with Worker Versioning on the real dev server (issue 34): build v1's worker runs node,
pool and class workflows; build v2's worker (its node, pool and class workflows each issue a
command v1's never do) starts beside it on the same task queue and is made current. Every v1 run
keeps running on v1 until its next safe point and continues as new there onto v2; no workflow
task fails (a v1 run replayed by v2 code would); nothing is bought twice or left running; the
server reports v1 drained, after which its worker stops and v2 carries on.

Nodes: one Ready at rest (it moves at its watch's next wake, at the latest its backstop look),
one held in bring-up when v2 becomes current (it moves only when it reaches its watch), one
started after (it starts on v2). A pool and its class, started on v1, move at their next pass
(here the bridge's next message wakes them: their resyncs are set long, so nothing else does);
on v2 the pool still starts a node for a pending pod and the class still answers its reservation.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import kubernetes_validate
import pytest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.common import VersioningBehavior

from sim.world import SimWorld, sim_world
from tests import carried_state
from tests.conftest import eventually
from tests.test_deploy import KUBERNETES_VERSIONS, KUSTOMIZE, _kustomize
from tests.test_ops_cli import tgp
from tests.test_node_lifecycle import FAST, request, start, wait_phase
from tests.upgrade_builds import (
    V2_WORKFLOWS,
    build_of_run,
    runs_of,
    task_failures,
    v2_timers,
    versioned,
    versioned_dev_server,
    wait_registered,
)
from tgp.crds import GPUNodeClassSpec, GPUNodePoolSpec, GPUNodePoolStatus
from tgp.errors import ConfigError
from tgp.messages import ClassInput, ClassUpdate, Demand, Ledger, PoolUpdate, class_workflow_id, pool_workflow_id
from tgp.types import NodePhase, NodeStatus
from workers import ops, rollout, versioning
from workers.main import WORKFLOWS, WorkerConfig, build_activities, make_worker, worker_options
from workflows.node import GPUNodeWorkflow
from workflows.node_class import GPUNodeClassWorkflow
from workflows.pool import GPUNodePoolWorkflow, PoolInput

# A Ready node's backstop look here: its latest safe point once v2 is current.
BACKSTOP = timedelta(seconds=2)
# Generous on a loaded machine; each wait ends as soon as its condition holds.
WAIT = 30.0
# The pool's and the class's resync: longer than the test, so only a message wakes them.
NO_RESYNC = timedelta(hours=1)
# The held nodes': they stay in bring-up while the test checks the rollout (minutes on a loaded machine).
HELD = FAST.model_copy(update={"launch": timedelta(minutes=5), "tailnet_join": timedelta(minutes=5)})
CLASS = GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated"}], "tailscaleConfig": {"tags": ["tag:tgp-node"]}})


@dataclass
class Entities:
    """A pool and its class, as the bridge starts them."""

    pool: WorkflowHandle
    node_class: WorkflowHandle
    pool_v1: str = ""
    class_v1: str = ""


async def start_entities(client: Client, queue: str) -> Entities:
    name = f"upgrade-{uuid.uuid4().hex[:6]}"
    node_class = await client.start_workflow(
        GPUNodeClassWorkflow.run, ClassInput(name=name, resync_interval=NO_RESYNC), id=class_workflow_id(name), task_queue=queue,
        start_signal="update_class", start_signal_args=[ClassUpdate(spec=CLASS, generation=1)],
    )
    spec = GPUNodePoolSpec.model_validate({
        "nodeClassRef": {"name": name},
        "template": {"spec": {"requirements": [{"key": "tgp.io/gpu-type", "operator": "In", "values": ["RTX4090"]}]}},
    })
    pool = await client.start_workflow(
        GPUNodePoolWorkflow.run, PoolInput(namespace="ml", name=name, resync_interval=NO_RESYNC), id=pool_workflow_id("ml", name),
        task_queue=queue, start_signal="update", start_signal_args=[PoolUpdate(spec=spec, generation=1, node_class=CLASS)],
    )
    return Entities(pool=pool, node_class=node_class)


def pending(*pods: str) -> Demand:
    return Demand(pods=list(pods), observed_at=datetime.now(timezone.utc))


async def moved(handle: WorkflowHandle, old_run: str) -> bool:
    run, build = await build_of_run(handle)
    return run != old_run and build == "v2"


async def entities_move(entities: Entities) -> None:
    """The bridge's next messages wake the pool and the class: each continues as new onto v2."""
    await entities.pool.signal(GPUNodePoolWorkflow.demand, pending())
    await entities.node_class.signal(GPUNodeClassWorkflow.update_class, ClassUpdate(spec=CLASS, generation=1))
    await eventually(lambda: moved(entities.pool, entities.pool_v1), timeout=WAIT, what="the pool continued as new onto v2")
    await eventually(lambda: moved(entities.node_class, entities.class_v1), timeout=WAIT, what="the class continued as new onto v2")


async def entities_serve_on_v2(client: Client, entities: Entities) -> WorkflowHandle:
    """On v2 the pool starts a node for a pending pod, and the class holds its reservation."""
    await entities.pool.signal(GPUNodePoolWorkflow.demand, pending("ml/train"))

    async def ready() -> str | None:
        status: GPUNodePoolStatus = await entities.pool.query(GPUNodePoolWorkflow.status)
        return next((n.workflow_id for n in status.nodes if n.phase == "Ready"), None)

    node = client.get_workflow_handle_for(GPUNodeWorkflow.run, await eventually(ready, timeout=WAIT, what="the pool's node Ready on v2"))
    ledger: Ledger = await entities.node_class.query(GPUNodeClassWorkflow.budget)
    assert list(ledger.reservations) == [node.id], ledger
    assert (await build_of_run(node))[1] == "v2"
    return node


async def test_a_rollout_moves_every_node_to_the_new_build_at_a_safe_point_and_drains_the_old() -> None:
    async with versioned_dev_server() as env, sim_world(boot_delay=0.2) as world, AsyncExitStack() as stack:
        client = env.client
        activities = await build_activities(WorkerConfig.from_env(world.worker_env()), stack)
        activities.node.poll_interval = timedelta(seconds=0.1)
        queue = f"upgrade-{uuid.uuid4().hex[:8]}"
        v1 = make_worker(client, activities, task_queue=queue, deployment_config=versioned("v1"))
        v1_running = asyncio.create_task(v1.run())
        # The first build of a deployment becomes current by itself (the worker does this at start).
        await wait_registered(client, "v1")
        assert await rollout.become_current_if_first(client, "v1")
        assert not await rollout.become_current_if_first(client, "v1"), "only while no build is current"

        # v1: a pool and its class; a node Ready at rest, and one held in bring-up (its instance bought, not booting).
        entities = await start_entities(client, queue)
        rest = await start(env, queue, request(timeouts=FAST.model_copy(update={"watch_interval": BACKSTOP})))
        await wait_phase(rest, NodePhase.READY, timeout=WAIT)
        world.cloud.hold_boots()
        joining = await start(env, queue, request(timeouts=HELD))
        await eventually(lambda: _true(len(world.cloud.instances) == 2), timeout=WAIT, what="the second node's instance bought")
        rest_v1, rest_build = await build_of_run(rest)
        joining_v1, joining_build = await build_of_run(joining)
        (entities.pool_v1, pool_build), (entities.class_v1, class_build) = await build_of_run(entities.pool), await build_of_run(entities.node_class)
        assert (rest_build, joining_build, pool_build, class_build) == ("v1",) * 4

        # v2 starts beside v1 on the same task queue and is made current.
        v2 = make_worker(client, activities, task_queue=queue, deployment_config=versioned("v2"), workflows=V2_WORKFLOWS)
        stack.push_async_callback(v2.shutdown)
        asyncio.create_task(v2.run())
        await wait_registered(client, "v2")
        said = await rollout.promote(client, "v2")
        assert said.startswith("build v2 is current") and "tgp rollout status --build v1" in said, said
        fresh = await start(env, queue, request(timeouts=HELD))  # a node started now starts on v2 (and is held too)

        # The Ready node moves at its watch's next wake (the backstop look at the latest).
        await eventually(lambda: moved(rest, rest_v1), timeout=WAIT, what="the Ready node continued as new onto v2")
        if carried_state.recording():  # the state a Ready node carries to the next build
            await _record_carried_state(client, rest.id, rest_v1)
        # The node in bring-up stays on v1, in its first run, until it reaches its watch.
        assert await build_of_run(joining) == (joining_v1, "v1")
        status: NodeStatus = await joining.query(GPUNodeWorkflow.status)
        assert status.phase in (NodePhase.LAUNCHING, NodePhase.JOINING), status.phase
        assert (await build_of_run(fresh))[1] == "v2"
        # `tgp rollout status --build v1`: not yet (exit status 3), with the runs and their bounds.
        cli = {"TEMPORAL_ADDRESS": client.service_client.config.target_host}
        code, out, err = await tgp("rollout", "status", "--build", "v1", env=cli)
        assert code == 3, err
        assert out.startswith("build v1: draining: 3 run(s) still pinned to it (1 GPUNodeClassWorkflow; 1 GPUNodePoolWorkflow; 1 node(s) (1 "), out
        assert "next safe point within 2h15m" in out and "GPUNodePoolWorkflow at its next pass" in out, out

        await entities_move(entities)
        await _status_shows_the_builds(client)
        # Released, the node joins, reaches its watch and moves too; then v1 drains.
        world.cloud.release_boots()
        await eventually(lambda: moved(joining, joining_v1), timeout=WAIT, what="the joined node continued as new onto v2")
        pool_node = await entities_serve_on_v2(client, entities)
        await _v1_drains_and_stops(client, cli, v1, v1_running, fresh)

        await _v2_ends_everything(world, (rest, joining, fresh, pool_node), entities)
        runs = ((rest, rest_v1), (joining, joining_v1), (fresh, None), (pool_node, None), (entities.pool, entities.pool_v1), (entities.node_class, entities.class_v1))
        for handle, first in runs:
            await _ran_each_build(client, handle, first)


async def _v2_ends_everything(world: SimWorld, nodes: tuple[WorkflowHandle, ...], entities: Entities) -> None:
    """v2 alone ends every node: one instance each, none left running; then the pool and class go."""
    for handle in nodes:
        await handle.signal(GPUNodeWorkflow.evict, {"reason": "end of test"})  # type: ignore[arg-type]
    for handle in nodes:
        final: NodeStatus = await asyncio.wait_for(handle.result(), WAIT)
        assert final.phase is NodePhase.TERMINATED, final
    assert len(world.cloud.instances) == len(nodes), "a node bought twice"
    assert world.cloud.live_instances() == [], "an instance left running"
    for handle in (entities.pool, entities.node_class):
        await handle.terminate("end of test")


async def _record_carried_state(client: Client, workflow_id: str, run_id: str) -> None:
    history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
    (payload,) = history.events[-1].workflow_execution_continued_as_new_event_attributes.input.payloads
    carried_state.save("GPUNodeWorkflow", payload)


async def _status_shows_the_builds(client: Client) -> None:
    """`tgp status` shows each node's build and the one run still on the older build."""

    async def listed() -> str | None:
        out = await ops.status(client)
        builds = [line.rsplit(" ", 1)[-1] for line in out.splitlines() if line.startswith("  gpu-")]
        return out if sorted(builds) == ["v1", "v2", "v2"] and "1 run(s) still on an older build (v1)" in out else None

    await eventually(listed, timeout=WAIT, what="`tgp status` showing the builds")


async def _v1_drains_and_stops(client: Client, cli: dict[str, str], v1: Any, v1_running: asyncio.Task[None], fresh: WorkflowHandle) -> None:
    async def v1_drained() -> str | None:
        text, drained = await rollout.rollout_status(client, "v1")
        return text if drained else None

    text = await eventually(v1_drained, timeout=WAIT, what="the server reporting v1 drained")
    assert text == "build v1: drained: its workers may stop", text
    await wait_phase(fresh, NodePhase.READY, timeout=WAIT)
    code, out, err = await tgp("rollout", "status", env=cli)
    current = "build v2: current: 1 GPUNodeClassWorkflow; 1 GPUNodePoolWorkflow; 4 node(s) (4 Ready)"
    assert code == 0 and out.splitlines() == [current, "build v1: drained: its workers may stop"], out + err
    await v1.shutdown()
    await v1_running


async def _ran_each_build(client: Client, handle: WorkflowHandle, first: str | None) -> None:
    """Every run of `handle`'s workflow: no workflow task failed; its v1 run (`first`) ran v1's
    code and continued as new, the others v2's."""
    runs = await runs_of(client, handle.id)
    assert len(runs) >= (2 if first else 1), runs
    for run in runs:
        one = client.get_workflow_handle(handle.id, run_id=run)
        assert await task_failures(one) == [], f"{handle.id} run {run}"
        described = await one.describe()
        build = described.raw_description.workflow_execution_info.versioning_info.deployment_version.build_id
        assert build == ("v1" if run == first else "v2"), (handle.id, run, build)
        assert await v2_timers(one) == (0 if run == first else 1), (handle.id, run)
        if run == first:
            assert described.status is WorkflowExecutionStatus.CONTINUED_AS_NEW


def test_every_workflow_type_is_pinned_and_the_worker_says_so() -> None:
    """One behaviour for every type the worker hosts (VERSIONING_BEHAVIORS), given as the
    worker's deployment default when versioning is on; off, the worker has no deployment."""
    names = {w.__temporal_workflow_definition.name for w in WORKFLOWS}  # type: ignore[attr-defined]
    assert set(versioning.VERSIONING_BEHAVIORS) == names == set(versioning.SAFE_POINTS)
    assert versioning.deployment_behavior() is VersioningBehavior.PINNED
    config = versioned("0.2.0-abc")
    assert config.version.deployment_name == "tgp" and config.version.build_id == "0.2.0-abc"
    assert config.use_worker_versioning and config.default_versioning_behavior is VersioningBehavior.PINNED
    assert versioning.deployment_config({}) is None
    assert "deployment_config" not in worker_options()


def test_the_build_id_is_the_version_and_the_workflow_source() -> None:
    build = versioning.build_id({})
    assert build == f"{versioning.package_version()}-{versioning.source_hash()}" and len(build.rsplit("-", 1)[1]) == 10
    assert versioning.build_id({"TGP_BUILD_ID": "0.2.0-git1234"}) == "0.2.0-git1234"
    for bad in ({"TGP_BUILD_ID": "a b"}, {"TGP_WORKER_VERSIONING": "maybe"}):
        with pytest.raises(ConfigError):
            versioning.deployment_config({"TGP_WORKER_VERSIONING": "on", **bad})
    assert versioning.drain_bound() == timedelta(minutes=135)  # 3 x (10 + 10 + 5 + 10 + 10) minutes


async def _true(value: bool) -> bool:
    return value


# --- the rollout's manifests (deploy/kustomize/rollout) ------------------------------------

ROLLOUT = KUSTOMIZE / "rollout"


def _builds(name: str) -> dict[str, dict[str, Any]]:
    """The worker Deployments of a rendering, by their build label."""
    return {
        d["metadata"]["labels"]["tgp.io/build"]: d
        for d in _kustomize(ROLLOUT / name)
        if d["kind"] == "Deployment" and d["metadata"]["name"] != "tgp-bridge"
    }


@pytest.mark.parametrize("name", ["example", "build-template"])
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_rollout_manifests_are_valid_for_kubernetes(name: str, version: str) -> None:
    for obj in _kustomize(ROLLOUT / name):
        kubernetes_validate.validate(obj, version, strict=True)


def test_each_build_runs_beside_the_others_as_the_base_worker_does() -> None:
    """One Deployment per build folder, named and labelled by its build (selector included, so two
    builds never claim each other's pods), polling as that build, versioned, rolled within the
    build; otherwise the base's worker exactly (one source: deploy/kustomize/worker)."""
    rendered = _kustomize(ROLLOUT / "example")
    folders = sorted(p.name for p in (ROLLOUT / "example" / "builds").iterdir())
    builds = _builds("example")
    assert sorted(builds) == folders and len(folders) == 2
    assert {d["metadata"]["name"] for d in rendered if d["kind"] == "Deployment"} == {"tgp-bridge", *(f"tgp-worker-{b}" for b in folders)}
    assert sorted(d["metadata"]["name"] for d in rendered if d["kind"] == "PodDisruptionBudget") == [f"tgp-worker-{b}" for b in folders]
    (settings,) = [o for o in rendered if o["kind"] == "ConfigMap"]
    assert settings["data"]["TGP_WORKER_VERSIONING"] == "on" and versioning.versioning_on(settings["data"])
    (base,) = [d for d in _kustomize(KUSTOMIZE / "base") if d["metadata"]["name"] == "tgp-worker" and d["kind"] == "Deployment"]
    for build, deployment in builds.items():
        assert deployment["metadata"]["name"] == f"tgp-worker-{build}"
        spec = deployment["spec"]
        assert spec["selector"]["matchLabels"] == {"app": "tgp-worker", "tgp.io/build": build}
        assert spec["template"]["metadata"]["labels"]["tgp.io/build"] == build
        assert spec["strategy"]["type"] == "RollingUpdate"
        (container,) = spec["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert versioning.build_id(env) == build  # what its workers poll as, a valid build id
        # The rest is the base's worker: the same pod but for the image, the build and the names.
        same = json.loads(json.dumps(deployment))
        same["metadata"] = base["metadata"]
        same["spec"]["selector"], same["spec"]["strategy"] = base["spec"]["selector"], base["spec"]["strategy"]
        same["spec"]["template"]["metadata"] = base["spec"]["template"]["metadata"]
        (mine,) = same["spec"]["template"]["spec"]["containers"]
        mine["env"] = [e for e in mine["env"] if e["name"] != "TGP_BUILD_ID"]
        mine["image"] = "tgp"
        for ref in mine["envFrom"]:
            if "configMapRef" in ref:
                ref["configMapRef"]["name"] = base["spec"]["template"]["spec"]["containers"][0]["envFrom"][0]["configMapRef"]["name"]
        assert same == base, build
    selectors = [d["spec"]["selector"]["matchLabels"] for d in builds.values()]
    assert all(a.items() - b.items() for a in selectors for b in selectors if a is not b), "two builds' selectors overlap"
