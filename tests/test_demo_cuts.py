"""A new user's paper cuts (issue 36): the story tells every node's end, `tgp demo` stops with
status 0 on Ctrl-C and serves the SDK's metrics, `tgp dev` waits quietly for a starting API
server, and every `--help` opens with what the command does."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import io
import os
import pty
import re
import subprocess
import termios
import uuid
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import yaml
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from activities.http_wire import default_tls
from sim.demo import EXAMPLES, apply
from sim.dev import wait_for_api
from sim.kube import KubeEmulator
from sim.story import Story
from tests.conftest import binary, eventually
from tests.test_dev_command import free_port_pair
from tgp.errors import ConfigError
from tgp.types import NodePhase, NodeStatus, Stage, StageRecord
from workers import cli
from workers.crdgen import manifests

POOL = "/apis/tgp.io/v1/namespaces/default/gpunodepools/ml-workload-pool"
AT = datetime(2026, 1, 1, tzinfo=timezone.utc)


@workflow.defn(name="StoryNode")
class StoryNode:
    """What the story reads of a node workflow, its `status` query: Ready until told to end."""

    def __init__(self) -> None:
        self.phase = NodePhase.READY

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self.phase.is_final)

    @workflow.signal
    def end(self) -> None:
        self.phase = NodePhase.TERMINATED

    @workflow.query
    def status(self) -> NodeStatus:
        stages = [Stage.READY] + ([Stage.TERMINATING, Stage.TERMINATED] if self.phase.is_final else [])
        return NodeStatus(
            workflow_id=workflow.info().workflow_id, node_name="story-node", phase=self.phase, pool="default/ml-workload-pool",
            stages=[StageRecord(stage=s, at=AT) for s in stages],
        )


async def test_a_node_that_leaves_the_pool_between_two_looks_still_tells_its_end(temporal: WorkflowEnvironment) -> None:
    queue, workflow_id = f"story-{uuid.uuid4().hex[:8]}", f"gpunode/default/ml-workload-pool/story-{uuid.uuid4().hex[:8]}"
    async with KubeEmulator() as kube, httpx.AsyncClient(verify=default_tls(), base_url=kube.url, timeout=10) as http, Worker(
        temporal.client, task_queue=queue, workflows=[StoryNode], workflow_runner=UnsandboxedWorkflowRunner()
    ):
        for crd in manifests().values():
            kube.install_crd(crd)
        for name in ("gpunodeclass.yaml", "gpunodepool.yaml"):
            for obj in yaml.safe_load_all((EXAMPLES / name).read_text()):
                await apply(http, obj)
        node = await temporal.client.start_workflow(StoryNode.run, id=workflow_id, task_queue=queue)
        await _set_nodes(http, [{"name": "story-node", "phase": "Ready", "workflowId": workflow_id}])
        story = Story(temporal.client, http, "http://ui")
        first = await _told(story)
        assert "story-node" in first and "Ready" in first and "Terminated" not in first, first

        # Between two looks the node ends and the pool's status drops it.
        await node.signal(StoryNode.end)
        await node.result()
        await _set_nodes(http, [])
        second = await _told(story)
        assert re.search(r"node story-node +Terminating", second) and re.search(r"node story-node +Terminated", second), second
        assert second.index("Terminated") < second.index("back to zero"), "the pool's zero line comes after its node's end"
        assert not story.following


async def _set_nodes(http: httpx.AsyncClient, nodes: list[dict[str, str]]) -> None:
    response = await http.patch(f"{POOL}/status", json={"status": {"nodes": nodes}}, headers={"Content-Type": "application/merge-patch+json"})
    assert response.status_code == 200, response.text


async def _told(story: Story) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        await story.look()
    return out.getvalue()


@pytest.mark.timeout(300)  # a node's life and teardown on a loaded 2-core machine
async def test_ctrl_c_under_make_stops_the_demo_with_status_0_after_every_end_line_and_serves_sdk_metrics(tmp_path: Path) -> None:
    """As a user runs it: `make demo` in a terminal, then Ctrl-C typed into that terminal (SIGINT
    to its foreground process group). make says nothing of its own (no `*** [...] Interrupt`,
    no `Error 130`) and exits 0: the demo held the foreground alone (sim.terminal)."""
    port = free_port_pair()
    makefile = tmp_path / "Makefile"
    makefile.write_text(f"demo:\n\t{binary('tgp')} demo --port {port} --boot-delay 0.5 --state-dir {tmp_path / 'state'}\n")
    terminal, demo_side = pty.openpty()
    make = await asyncio.create_subprocess_exec(
        "make", "--no-print-directory", "-f", str(makefile), stdin=demo_side, stdout=demo_side, stderr=demo_side,
        env={**os.environ, "HOME": str(tmp_path)}, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # the pty becomes make's controlling terminal
    )
    os.close(demo_side)
    output: list[str] = []
    reader = asyncio.create_task(asyncio.to_thread(_read_terminal, terminal, output))
    try:
        ready = await eventually(lambda: _line(output, r"node (\S+) +Ready\b"), timeout=120, what="the demo's node to be Ready")
        url = (await _line(output, r"metrics: (http://\S+)")) or ""
        async with httpx.AsyncClient(verify=default_tls(), timeout=10) as http:
            body = (await http.get(url)).text
        assert re.search(r'^temporal_\w+\{[^}]*service="tgp-worker"', body, re.M), body[-2000:]
        assert "tgp_nodes" in body
    finally:
        os.write(terminal, b"\x03")  # Ctrl-C, typed
        try:
            await asyncio.wait_for(make.wait(), 200)
        finally:
            subprocess.run(["pkill", "-KILL", "-s", str(make.pid)], check=False)  # nothing outlives a failed test
            await asyncio.wait_for(reader, 10)
            os.close(terminal)
    text = "".join(output)
    assert make.returncode == 0, text[-3000:]
    assert "make:" not in text and "Interrupt" not in text, text[-3000:]
    assert re.search(rf"node {ready} +Terminated", text), text[-3000:]
    assert "Left behind: 0 instance(s), 0 tailnet device(s), 0 usable tailnet key(s)" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def _read_terminal(terminal: int, output: list[str]) -> None:
    """What the terminal shows, until every process that wrote to it has gone (EIO)."""
    while True:
        try:
            chunk = os.read(terminal, 65536)
        except OSError:
            return
        if not chunk:
            return
        output.append(chunk.decode(errors="replace"))


async def _line(output: list[str], pattern: str) -> str | None:
    found = re.search(pattern, "".join(output))
    return found.group(1) if found else None


async def test_tgp_dev_waits_quietly_while_the_api_server_is_starting_and_says_when_it_never_is() -> None:
    starting = {"refusals": 0}

    def initializing(request: object) -> bool:  # the first three requests, as a fresh API server answers them
        starting["refusals"] += 1
        return starting["refusals"] <= 3

    async with KubeEmulator() as kube:
        for crd in manifests().values():
            kube.install_crd(crd)
        body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "storage is (re)initializing", "reason": "TooManyRequests", "code": 429}
        kube[initializing] << 429 << body
        async with httpx.AsyncClient(verify=default_tls(), base_url=kube.url, timeout=10) as http:
            await wait_for_api(http, "kubeconfig")  # returns once ready, after the refusals
            assert starting["refusals"] > 3
            kube[lambda _: True] << 429 << body  # one that never becomes ready
            with pytest.raises(ConfigError) as refused:
                await wait_for_api(http, "kubeconfig", timeout=0)
    message = str(refused.value)
    assert "was not ready within 0s" in message and "429 storage is (re)initializing" in message and "/readyz" in message, message


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [((*path, name), sub), *_subcommands(sub, (*path, name))]
    return found


def test_every_subcommand_help_opens_with_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    parsers = _subcommands(cli.build_parser())
    assert {("plan",), ("dev",), ("demo",), ("temporal", "setup")} <= {path for path, _ in parsers}
    missing = []
    for path, _ in parsers:
        with pytest.raises(SystemExit):
            cli.main([*path, "--help"])
        text = capsys.readouterr().out
        opening = text.split("\n\n")[1] if "\n\n" in text else ""
        # The description: a sentence, not the options list or a bare usage line.
        if not re.match(r"[A-Z][^\n]*\w", opening) or opening.lstrip().startswith(("options:", "positional arguments:")):
            missing.append(" ".join(path))
    assert not missing, f"--help without a sentence saying what the command does: {missing}"


def test_the_first_make_says_what_its_silent_minutes_are() -> None:
    """`make demo` on a fresh clone installs for minutes before anything else: one line says
    so first, and pip's setuptools notice (which reads like a fault) is not shown."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # as typed, not under `make test`
    done = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=root, env=env, capture_output=True, text=True, timeout=60, check=True)
    lines = done.stdout.splitlines()
    assert "Installing tgp and its dependencies" in lines[0], done.stdout
    assert any("-W 'ignore:Editable installation:UserWarning'" in line and "pip install" in line for line in lines), done.stdout
