"""What a tenant reads on their pool says what went wrong, and nothing of the admin's Secrets."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone

import httpx
from temporalio.testing import WorkflowEnvironment

from activities.http_wire import default_tls
from tests.conftest import eventually, running_world
from tests.test_entities_heal import CLASS, start_class, start_pool
from tests.test_pool_accounting import pool_spec
from tgp.crds import GPUNodeClassSpec, GPUNodePoolStatus
from tgp.messages import Demand
from workflows.pool import GPUNodePoolWorkflow


async def events(world_kube_url: str, reason: str) -> list[dict[str, object]]:
    async with httpx.AsyncClient(verify=default_tls(), base_url=world_kube_url) as kube:
        items = (await kube.get("/api/v1/namespaces/ml/events")).json()["items"]
    return [e for e in items if e.get("reason") == reason]


async def test_a_failed_launch_event_says_why(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        for offer in world.cloud.catalog:
            world.cloud.set_capacity(offer, False)
        klass = f"msg-{uuid.uuid4().hex[:6]}"
        await start_class(temporal, queue, klass)
        pool = await start_pool(temporal, queue, f"pool-{uuid.uuid4().hex[:6]}", pool_spec(klass, minNodes=1))

        async def failed() -> list[dict[str, object]] | None:
            return await events(world.kube_url, "LaunchFailed") or None

        [event] = (await eventually(failed, timeout=60, what="a LaunchFailed Event"))[:1]
        message = str(event["message"])
        assert "capacity" in message and not message.endswith(": failed"), message
        await pool.terminate("test finished")


async def test_a_broken_class_is_named_on_the_pool_without_its_secrets(temporal: WorkflowEnvironment) -> None:
    async with running_world(temporal) as (world, _, queue):
        secret = f"admins-cloud-keys-{uuid.uuid4().hex[:6]}"
        spec = CLASS.model_copy(
            update={"providers": [GPUNodeClassSpec.model_validate({"providers": [{"name": "simulated", "credentialsRef": {"name": secret, "key": "SIM_KEY"}}]}).providers[0]]}
        )
        klass = f"msg-{uuid.uuid4().hex[:6]}"
        await start_class(temporal, queue, klass, spec)
        pool = await start_pool(temporal, queue, f"pool-{uuid.uuid4().hex[:6]}", pool_spec(klass), klass=spec)
        await pool.signal(GPUNodePoolWorkflow.demand, Demand(pods=["ml/train"], observed_at=datetime.now(timezone.utc)))

        async def refused() -> GPUNodePoolStatus | None:
            status: GPUNodePoolStatus = await pool.query(GPUNodePoolWorkflow.status)
            ready = next((c for c in status.conditions if c.type == "Ready"), None)
            return status if ready is not None and ready.status == "False" else None

        status = await eventually(refused, timeout=60, what="the pool to report the class as not valid")
        async with httpx.AsyncClient(verify=default_tls(), base_url=world.kube_url) as kube:
            all_events = (await kube.get("/api/v1/namespaces/ml/events")).json()["items"]
        tenant_view = json.dumps(status.model_dump(mode="json")) + json.dumps(all_events)
        assert klass in tenant_view
        assert secret not in tenant_view and "SIM_KEY" not in tenant_view, "a tenant must not learn the admin's Secret names or keys"
        assert world.cloud.create_requests == 0
        await pool.terminate("test finished")
