"""Operator verbs of the `tgp` CLI that read Temporal only: `status` and `evict` (`plan`, which
reads the cluster and the providers, is workers/plan.py: these start without loading either).

Each says what to fix when the input is wrong (a `ConfigError`, exit status 2) and never prints a
secret. They reach Temporal through the same connection settings as the worker.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from temporalio.client import Client

from activities.visibility import RUNNING_NODES, running_node_workflows
from tgp.errors import ConfigError
from tgp.types import BILLING_PHASES, NodeStatus
from workers import rollout, versioning

# A query is answered by a worker: none running (or all busy) must not hang the CLI.
QUERY_TIMEOUT = timedelta(seconds=15)


async def node_status(client: Client, node_name: str) -> str:
    """One node's life so far, from its workflow's `status` query: what it runs on and each
    stage it entered, when and why (the same typed records the pool's Events are made of)."""
    workflow_id = (await _node_workflows(client, node_name))[0]
    s = await client.get_workflow_handle(workflow_id).query("status", result_type=NodeStatus, rpc_timeout=QUERY_TIMEOUT)
    where = f"{s.gpu_type} on {s.provider} ({s.region}) at ${s.hourly_price}/h, instance {s.instance_id or '-'}" if s.provider else "no offer chosen yet"
    lines = [f"node {s.node_name} in pool {s.pool}: {s.phase.value}, {where}", f"  workflow {workflow_id}"]
    for record in s.stages:
        lines.append(f"  {record.at.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z  {record.describe()}")
    if s.last_error:
        lines.append(f"  last error: {s.last_error}")
    return "\n".join(lines)


async def _node_workflows(client: Client, node_name: str) -> list[str]:
    """The running workflows of Node `node_name` (one, unless something went wrong); a
    ConfigError when it is no Node name or none runs."""
    if not node_name.replace("-", "").replace(".", "").isalnum():
        raise ConfigError(f"{node_name!r} is not a Node name")
    found = [wf.id async for wf in client.list_workflows(f"{RUNNING_NODES} AND TgpNodeName = '{node_name}'")]
    if not found:
        raise ConfigError(f"no running node workflow for node {node_name} (tgp status lists them)")
    return found


async def status(client: Client) -> str:
    """Running nodes by pool: phase, provider, GPU, $/h, age and cost so far (since the node
    workflow started: an upper bound of what its instance billed), and the build each runs on
    (Worker Versioning; "-" unversioned), with how many runs are still on an older build."""
    now = datetime.now(UTC)
    builds = await versioning.node_builds(client)
    rows: dict[str, list[tuple[str, ...]]] = {}
    totals: dict[str, tuple[Decimal, Decimal]] = {}
    for s in await running_node_workflows(client):
        pool, phase = s.pool or "?", s.phase.value if s.phase else "?"
        price = (s.hourly_price or Decimal(0)).quantize(Decimal("0.01"))
        hours = Decimal((now - s.started_at).total_seconds()) / 3600 if s.started_at else Decimal(0)
        cost = (price * hours).quantize(Decimal("0.01")) if phase in BILLING_PHASES else Decimal(0)
        age = _age(now - s.started_at) if s.started_at else "?"
        build = builds.get(s.workflow_id, "-")
        rows.setdefault(pool, []).append((s.node_name or s.workflow_id, phase, s.provider or "-", s.gpu_type or "-", f"{price}", age, f"{cost}", build))
        rate, spent = totals.get(pool, (Decimal(0), Decimal(0)))
        totals[pool] = (rate + (price if phase in BILLING_PHASES else 0), spent + cost)
    if not rows:
        return "No running GPU nodes."
    out = []
    header = ("NODE", "PHASE", "PROVIDER", "GPU", "$/H", "AGE", "COST", "BUILD")
    for pool in sorted(rows):
        rate, spent = totals[pool]
        out.append(f"pool {pool}: {len(rows[pool])} node(s), ${rate}/h now, ${spent} so far")
        table = [header, *sorted(rows[pool])]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        out += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table]
    if builds:
        out.append(await rollout.builds_line(client))
    return "\n".join(out)


def _age(delta: object) -> str:
    seconds = int(delta.total_seconds())  # type: ignore[attr-defined]
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600}h"


async def evict(client: Client, node_name: str, reason: str) -> str:
    """Send `evict` to the running workflow of Node `node_name`."""
    found = await _node_workflows(client, node_name)
    for workflow_id in found:
        await client.get_workflow_handle(workflow_id).signal("evict", {"reason": reason})
    return f"evict sent to {', '.join(found)}: the node drains and terminates (watch it in the Web UI)"
