"""A node on Headscale 0.23/0.24 ends (issue 17, item 14): those versions refuse to expire the
key a node joined with (500 "AuthKey has already been used"), and on e9a7c55 the cleanup retried
that for ever, so the node never ended and its Node object and class slot leaked.
GPUNodeWorkflow on the real dev server with the simulated world's Headscale answering as 0.24."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.conftest import running_world
from tests.test_node_lifecycle import assert_nothing_left, node_exists, request, start, wait_phase
from tgp.types import BootConfig, NodePhase, NodeStatus
from workflows.node import GPUNodeWorkflow

# Seconds for the whole cleanup on a busy machine (it takes about one).
WAIT = 60.0


@pytest.mark.parametrize("version", [(0, 23), (0, 24)])
async def test_a_node_on_an_old_headscale_is_cleaned_up(temporal: WorkflowEnvironment, version: tuple[int, int]) -> None:
    async with running_world(temporal, headscale=True) as (world, _, queue):
        assert world.headscale is not None
        world.headscale.version = version  # before the worker's first call: it probes the key API then
        req = request(tailnet="headscale", boot=BootConfig(login_server=world.headscale.url))
        handle = await start(temporal, queue, req)
        await wait_phase(handle, NodePhase.READY)
        [node] = world.headscale.nodes.values()
        assert node.key.used

        await handle.signal(GPUNodeWorkflow.evict, {"reason": "done"})
        final: NodeStatus = await asyncio.wait_for(handle.result(), WAIT)
        assert final.phase is NodePhase.TERMINATED
        assert_nothing_left(world, req.node_name)
        assert not await node_exists(world, req.node_name)
