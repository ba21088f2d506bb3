"""`tgp dev` against "your" cluster (here the emulator, reached through a kubeconfig as a real
one would be), and its honest startup errors."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import re
import socket
from pathlib import Path

import httpx
import kmock
import yaml

from activities.http_wire import default_tls
from tests.conftest import binary, eventually
from workers.crdgen import manifests
from sim.demo import EXAMPLES, apply
from sim.kube import KubeEmulator
from sim.kube import kubeconfig as kube_config
from sim.scheduler import SimScheduler


def free_port_pair() -> int:
    """A port p with p and p+1000 free (the dev server and its Web UI), both below the kernel's
    ephemeral range (32768 and up): a port the kernel hands out for `bind(port 0)` or an outgoing
    connection, as every other test's servers and clients get theirs, could be taken again
    between this check and the command's own bind (a suite run failed so: "port ... is in use")."""
    for _ in range(200):
        port = random.randrange(20000, 32768 - 1000)
        try:
            for p in (port, port + 1000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


async def tgp(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        binary("tgp"), *args, env={**os.environ, **env}, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )


async def test_tgp_dev_runs_the_product_against_the_current_kube_context(tmp_path: Path) -> None:
    """It waits quietly while the API server is starting, then tells the demo's story."""
    refused: list[str] = []

    def initializing(request: kmock.Request) -> bool:  # a fresh API server refuses tgp's (not this test's) lists a while
        if request.url.path.startswith("/apis/tgp.io/") and request.headers.get("User-Agent") != "test" and len(refused) < 3:
            refused.append(request.url.path)
            return True
        return False

    async with (
        KubeEmulator() as kube,
        httpx.AsyncClient(verify=default_tls(), base_url=kube.url, timeout=10, headers={"User-Agent": "test"}) as http,
        SimScheduler(kube.url, interval=0.2),
    ):
        for crd in manifests().values():
            kube.install_crd(crd)
        kube[initializing] << 429 << {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 429,
                                      "reason": "TooManyRequests", "message": "storage is (re)initializing"}
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        port = free_port_pair()
        proc = await tgp(
            "dev", "--port", str(port), "--simulated-cloud", "--boot-delay", "0.2", "--state-dir", str(tmp_path / "dev"),
            env={"KUBECONFIG": str(kubeconfig)},
        )
        try:
            assert proc.stdout is not None
            banner = b""
            while b"Web UI" not in banner:
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                assert line, f"tgp dev ended early: {(await proc.stderr.read()).decode()[-2000:] if proc.stderr else ''}"
                banner += line
            for name in ("gpunodeclass.yaml", "gpunodepool.yaml", "gpu-job.yaml"):
                for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                    await apply(http, obj)

            async def running() -> bool:
                pod = (await http.get("/api/v1/namespaces/default/pods/train-job")).json()
                return (pod.get("status") or {}).get("phase") in ("Running", "Succeeded")

            await eventually(running, timeout=90, what="the GPU pod to run on a node tgp dev bought")

            async def labelled() -> bool:
                nodes = (await http.get("/api/v1/nodes", params={"labelSelector": "tgp.io/pool=ml-workload-pool"})).json()["items"]
                return len(nodes) == 1

            await eventually(labelled, what="one Node labelled with the pool")
            story = b""
            while not re.search(rb"pod train-job +Running on", story) or not re.search(rb"node \S+ +Ready", story):
                line = await asyncio.wait_for(proc.stdout.readline(), 60)
                assert line, f"tgp dev ended before telling the story: {story.decode()[-2000:]}"
                story += line
        finally:
            proc.send_signal(signal.SIGINT)
            await asyncio.wait_for(proc.wait(), 60)
        assert proc.returncode == 0
        assert len(refused) == 3, refused
        err = (await proc.stderr.read()).decode() if proc.stderr else ""
        assert "429" not in err and "initializing" not in err, err[-2000:]


async def test_tgp_dev_says_what_is_missing_in_one_line(tmp_path: Path) -> None:
    missing = await tgp("dev", env={"KUBECONFIG": str(tmp_path / "nope")})
    _, err = await asyncio.wait_for(missing.communicate(), 60)
    assert missing.returncode == 2 and err.decode().strip().startswith("tgp: no kubeconfig at"), err.decode()
    assert "Traceback" not in err.decode()

    async with KubeEmulator() as kube:  # no CRDs installed
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        bare = await tgp("dev", "--port", str(free_port_pair()), "--state-dir", str(tmp_path / "dev"), env={"KUBECONFIG": str(kubeconfig)})
        _, err = await asyncio.wait_for(bare.communicate(), 60)
    assert bare.returncode == 2 and "kubectl apply -f deploy/crds/" in err.decode(), err.decode()
    assert len(err.decode().strip().splitlines()) == 1


async def test_tgp_dev_against_a_cluster_that_is_down_names_the_server_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on once the socket is closed
        closed.bind(("127.0.0.1", 0))
        server = f"http://127.0.0.1:{closed.getsockname()[1]}"
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(kube_config(server)))
    down = await tgp("dev", "--port", str(free_port_pair()), "--state-dir", str(tmp_path / "dev"), env={"KUBECONFIG": str(kubeconfig)})
    _, err = await asyncio.wait_for(down.communicate(), 60)
    lines = err.decode().strip().splitlines()
    assert down.returncode == 2 and len(lines) == 1, err.decode()[-3000:]
    assert lines[0].startswith(f"tgp: cannot reach the Kubernetes API at {server}") and "ConnectError" in lines[0], lines


async def test_a_taken_port_is_an_error_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await tgp("demo", "--port", str(port), env={})
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and f"port {port} is in use" in err.decode(), err.decode()
    assert "make demo PORT=N" in err.decode() and "TGP_DEMO_PORT" in err.decode()


async def test_the_bridge_without_a_kubeconfig_says_so_in_one_line_and_nothing_else(tmp_path: Path, temporal: object) -> None:
    from temporalio.testing import WorkflowEnvironment

    assert isinstance(temporal, WorkflowEnvironment)
    env = {"KUBECONFIG": str(tmp_path / "missing"), "TEMPORAL_ADDRESS": temporal.client.service_client.config.target_host, "TGP_KUBE_URL": ""}
    proc = await tgp("bridge", env=env)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    lines = err.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "cannot load Kubernetes credentials" in lines[0], err.decode()
    assert "watching" not in err.decode() + out.decode()
