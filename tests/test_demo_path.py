"""The user's real path, headless: `tgp demo` runs the whole system, and the real kubectl and
temporal binaries drive it as the README says: apply the examples, watch the node join and the
pod run and complete, burst, evict by annotation and by signal, and scale back to zero."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest

from tests.conftest import binary, eventually
from tests.test_dev_command import free_port_pair

TIMEOUT = 60.0


async def run(*argv: str, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    assert proc.returncode == 0, f"{' '.join(argv)}: {err.decode()[-1000:]}"
    return out.decode()


@pytest.mark.timeout(600)  # the whole product's path, minutes of it, on a loaded 2-core machine
async def test_the_demo_path_with_kubectl_and_temporal(tmp_path: Path) -> None:
    port = free_port_pair()
    env = {**os.environ, "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "state" / str(port) / "kubeconfig")}
    demo = await asyncio.create_subprocess_exec(
        binary("tgp"), "demo", "--port", str(port), "--boot-delay", "0.5", "--state-dir", str(tmp_path / "state"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )
    output: list[str] = []

    async def read() -> None:
        assert demo.stdout is not None
        async for line in demo.stdout:
            output.append(line.decode())

    reader = asyncio.create_task(read())
    kubectl = binary("kubectl")
    try:
        await eventually(lambda: _said(output, "applied examples/gpu-job.yaml"), timeout=TIMEOUT, what="the demo to apply the examples")

        async def node_with_gpu_label() -> str | None:
            out = await run(kubectl, "get", "nodes", "-L", "tgp.io/gpu-type", "--no-headers", env=env)
            return out if "RTX4090" in out else None

        await eventually(node_with_gpu_label, timeout=TIMEOUT, what="a GPU node in `kubectl get nodes`")

        async def pod_phase(want: str) -> bool:
            pod = json.loads(await run(kubectl, "get", "pod", "train-job", "-o", "json", env=env))
            return pod["status"].get("phase") == want and bool(pod["spec"].get("nodeName"))

        await eventually(lambda: pod_phase("Running"), timeout=TIMEOUT, what="the pod bound and running")
        pools = await run(kubectl, "get", "gnp", "-A", env=env)
        assert "$/H" in pools and "0.44" in pools and "ml-workload-pool" in pools, pools
        # The burst while the first pod still runs: its nodes boot while that pod finishes.
        await run(kubectl, "apply", "-f", str(Path(__file__).resolve().parent.parent / "examples" / "burst.yaml"), env=env)
        await eventually(lambda: pod_phase("Succeeded"), timeout=TIMEOUT, what="the pod to complete")
        # The nodes of the two longest burst pods are evicted (by annotation, by signal): the
        # pool is back to zero once the shortest has run and its node idled out.
        by_annotation, by_signal = await eventually(lambda: burst_nodes(env), timeout=TIMEOUT, what="the burst's pods running on Ready nodes")
        await run(kubectl, "annotate", "node", by_annotation.rsplit("/", 1)[1], "tgp.io/evict=manual", env=env)
        await run(
            binary("temporal"), "workflow", "signal", "--address", f"127.0.0.1:{port}", "--workflow-id", by_signal,
            "--name", "evict", "--input", '{"reason":"manual"}', env=env,
        )

        async def ended(workflow_id: str) -> bool:
            out = await run(binary("temporal"), "workflow", "describe", "--address", f"127.0.0.1:{port}", "--workflow-id", workflow_id, "-o", "json", env=env)
            return '"WORKFLOW_EXECUTION_STATUS_COMPLETED"' in out

        for workflow_id in (by_annotation, by_signal):
            await eventually(lambda: ended(workflow_id), timeout=TIMEOUT, what=f"{workflow_id} to be drained and terminated")

        await eventually(lambda: _said(output, "back to zero"), timeout=3 * TIMEOUT, what="the pool to scale back to zero")
        nodes_left = await run(kubectl, "get", "nodes", "--no-headers", env=env)
        assert "ml-workload-pool" not in nodes_left
    finally:
        demo.send_signal(signal.SIGINT)
        await asyncio.wait_for(demo.wait(), 2 * TIMEOUT)
        reader.cancel()
    text = "".join(output)
    assert "Left behind: 0 instance(s), 0 tailnet device(s), 0 usable tailnet key(s)" in text, text[-3000:]


async def burst_nodes(env: dict[str, str]) -> tuple[str, str] | None:
    """Once the three burst pods are bound, each to a node of its own, and burst-3 and burst-2
    (the longest runs) run on Ready nodes: those nodes' workflow ids."""
    kubectl = binary("kubectl")
    pods = json.loads(await run(kubectl, "get", "pods", "-o", "json", env=env))["items"]
    bound = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in pods if p["metadata"]["name"].startswith("burst-")}
    running = {p["metadata"]["name"] for p in pods if p["status"].get("phase") == "Running"}
    pool = json.loads(await run(kubectl, "get", "gnp", "ml-workload-pool", "-o", "json", env=env))
    ready = {n["name"]: n["workflowId"] for n in (pool.get("status") or {}).get("nodes") or [] if n["phase"] == "Ready"}
    if len(set(bound.values()) - {None}) < 3 or not {"burst-3", "burst-2"} <= running:
        return None
    longest = (ready.get(bound["burst-3"] or ""), ready.get(bound["burst-2"] or ""))
    return (longest[0], longest[1]) if longest[0] and longest[1] else None


async def _said(output: list[str], words: str) -> bool:
    return any(words in line for line in output)
