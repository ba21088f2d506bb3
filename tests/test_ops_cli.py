"""The operator verbs of the `tgp` CLI, run as a user would (subprocesses): `plan`, `status`,
`evict`, `temporal setup`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import yaml
from temporalio.testing import WorkflowEnvironment

from activities.visibility import running_node_workflows
from activities.http_wire import default_tls
from tests.conftest import binary, eventually, running_world
from tests.test_node_lifecycle import request, start, wait_phase
from workers.crdgen import manifests
from sim.demo import EXAMPLES, apply
from sim.world import sim_world
from tgp.types import NodePhase, NodeStatus

import httpx


async def tgp(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        binary("tgp"), *args, env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_plan_prints_the_chosen_offer_and_why_the_others_were_not() -> None:
    async with sim_world() as world, httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
        assert world.kube is not None
        for crd in manifests().values():
            world.kube.install_crd(crd)
        for name in ("gpunodeclass.yaml", "gpunodepool.yaml"):
            for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                await apply(kube, obj)
        env = {"TGP_KUBE_URL": world.kube_url, "TGP_SIMULATED_CLOUD_URL": world.cloud.url, "TGP_SIMULATED_CLOUD_API_KEY": world.cloud_api_key}
        code, out, err = await tgp("plan", "default/ml-workload-pool", env=env)
        assert code == 0, err
        lines = out.splitlines()
        chosen = next(line for line in lines if line.startswith("CHOSEN"))
        assert "simulated" in chosen and "RTX4090" in chosen and "us-east" in chosen and "$0.44/h" in chosen
        assert any("RTX4090" in line and "eu-west" in line and "more expensive" in line for line in lines)
        assert any("L40S" in line and "GPU L40S not in RTX4090" in line for line in lines)
        assert any("spot" in line and "does not allow spot" in line for line in lines)
        assert any("H100" in line and "above maxHourlyPrice $1.0/h" in line for line in lines)
        assert world.cloud.create_requests == 0, "a plan buys nothing"

        code, _, err = await tgp("plan", "default/nope", env=env)
        assert code == 2 and err.strip() == "tgp: GPUNodePool default/nope not found (kubectl get gnp -A lists them)"


async def test_status_and_evict_find_the_node_by_its_name(temporal: WorkflowEnvironment) -> None:
    env = {"TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host}
    async with running_world(temporal) as (_, _, queue):
        req = request()
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)

        async def listed() -> bool:
            return any(s.node_name == req.node_name and s.phase is NodePhase.READY for s in await running_node_workflows(temporal.client))

        # Visibility catches up first (read here: a `tgp status` per check cost a second of CPU).
        await eventually(listed, what="the node Ready in visibility, as `tgp status` lists it")
        code, out, err = await tgp("status", env=env)
        assert code == 0, err
        assert req.node_name in out and "Ready" in out, out
        assert f"pool {req.namespace}/{req.pool}:" in out and "simulated" in out and "$0.44/h now" in out

        # One node: the typed stage records its status query answers, when and why.
        code, out, err = await tgp("status", req.node_name, env=env)
        assert code == 0, err
        assert out.startswith(f"node {req.node_name} in pool {req.pool}: Ready, RTX4090 on simulated"), out
        stages = [line.split("Z  ", 1)[1] for line in out.splitlines() if "Z  " in line]
        assert stages[:1] == ["Pending"] and stages[-1] == "Ready" and "GpusRegistered" in stages, out

        code, out, err = await tgp("evict", req.node_name, "--reason", "from the CLI", env=env)
        assert code == 0, err
        final: NodeStatus = await handle.result()
        assert final.phase is NodePhase.TERMINATED and final.end_reason == "evicted: from the CLI"

        code, _, err = await tgp("evict", "no-such-node", env=env)
        assert code == 2 and "no running node workflow for node no-such-node" in err and len(err.strip().splitlines()) == 1


async def test_temporal_setup_registers_the_search_attributes(temporal: WorkflowEnvironment) -> None:
    code, out, err = await tgp("temporal", "setup", env={"TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host})
    assert code == 0, err
    assert "search attributes are registered" in out


def test_tgp_status_and_evict_start_without_loading_kubernetes_or_the_providers() -> None:
    """`tgp status` and `tgp evict` read Temporal only: their module (workers/ops.py) loads
    neither the Kubernetes client nor a cloud adapter (~0.5 s of CPU per call, `tgp plan`'s)."""
    probe = (
        "import sys, workers.cli, workers.ops; "
        "print(sorted(m for m in ('kubernetes', 'activities.kube.cluster', 'activities.clouds.registry') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
