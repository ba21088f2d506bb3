"""The sweeper's activities: find instances and tailnet devices that carry tgp's marks but
belong to no running node workflow, and remove them.

Every exit path of a node workflow releases what it bought; this is the backstop for what no
workflow can clean up any more (a workflow terminated by hand, a bug). It assumes one tgp
installation per cloud account and node tag.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio import activity

from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import temporal_errors
from activities.ports import Cluster, CloudProvider, Tailnet
from activities import metrics
from tgp.messages import class_workflow_id
from tgp.types import LABEL_MANAGED

log = structlog.get_logger("tgp.sweeper")

# Instance names are tgp-<node-name>-<attempt> (tgp.types.instance_name).
_INSTANCE_NAME = re.compile(r"^tgp-(?P<node>.+)-\d+$")
# Node names tgp gives: a pool name (DNS label) and a random suffix.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class SweepInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix: str = "tgp-"
    tags: list[str] = ["tag:tgp-node"]


class Orphan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # "instance" or "device" (removed after the grace), or "stray": an instance named after a
    # running node that is not the one the node recorded (reported, never removed by the sweeper:
    # the node's own cleanup terminates every instance of its name).
    kind: str
    system: str  # provider or tailnet backend name
    id: str
    name: str
    node_name: str


def node_of_instance(name: str) -> str | None:
    """The node name inside an instance name, or None when it is not one of ours."""
    match = _INSTANCE_NAME.match(name)
    return match.group("node") if match else None


class SweeperActivities:
    def __init__(self, *, providers: Mapping[str, CloudProvider], tailnets: Mapping[str, Tailnet], cluster: Cluster | None = None) -> None:
        self.providers = dict(providers)
        self.tailnets = dict(tailnets)
        self.cluster = cluster

    async def _running_nodes(self) -> dict[str, str]:
        """Node name -> workflow id of every running node workflow (TgpNodeName)."""
        names: dict[str, str] = {}
        async for wf in activity.client().list_workflows("WorkflowType = 'GPUNodeWorkflow' AND ExecutionStatus = 'Running'"):
            for value in (wf.search_attributes or {}).get("TgpNodeName") or []:
                names[str(value)] = wf.id
        return names

    async def _recorded_instances(self, workflow_id: str) -> set[str] | None:
        """Instance ids a running node recorded (its attempts), or None when it cannot say."""
        try:
            status = await activity.client().get_workflow_handle(workflow_id).query("status")
        except Exception:  # noqa: BLE001 - a node busy or just closed: no verdict this round
            return None
        ids = {a.get("instance_id") for a in status.get("attempts") or []} | {status.get("instance_id")}
        return {i for i in ids if i}

    async def _orphans(self, inp: SweepInput) -> list[Orphan]:
        running = await self._running_nodes()
        found: list[Orphan] = []
        with temporal_errors():
            for name, provider in self.providers.items():
                for inst in await provider.list_instances(inp.prefix):
                    node = node_of_instance(inst.name)
                    if node is None:
                        continue
                    if node not in running:
                        found.append(Orphan(kind="instance", system=name, id=inst.instance_id, name=inst.name, node_name=node))
                        continue
                    recorded = await self._recorded_instances(running[node])
                    if recorded and inst.instance_id not in recorded:
                        log.warning("stray_instance", provider=name, instance_id=inst.instance_id, instance_name=inst.name, node=node)
                        found.append(Orphan(kind="stray", system=name, id=inst.instance_id, name=inst.name, node_name=node))
            for name, tailnet in self.tailnets.items():
                for device in await tailnet.list_devices(inp.tags):
                    if device.hostname and device.hostname not in running:
                        found.append(Orphan(kind="device", system=name, id=device.device_id, name=device.hostname, node_name=device.hostname))
        return found

    @activity.defn
    async def find_orphans(self, inp: SweepInput) -> list[Orphan]:
        """Instances and devices marked as tgp's whose node has no running workflow."""
        found = await self._orphans(inp)
        for orphan in found:
            metrics.ORPHANS_FOUND.labels(orphan.kind, orphan.system).inc()
        return found

    @activity.defn
    async def remove_orphans(self, inp: SweepInput, suspects: list[Orphan]) -> list[Orphan]:
        """Remove the suspects that are still orphans now (a node that started meanwhile keeps
        what it has). Returns what was removed."""
        still = {o for o in set(await self._orphans(inp)) & set(suspects) if o.kind != "stray"}
        with temporal_errors(always_retry=True):
            for orphan in sorted(still, key=lambda o: (o.kind, o.id)):
                if orphan.kind == "instance":
                    await self.providers[orphan.system].terminate(orphan.id)
                    await self._forget_node(orphan.node_name)
                else:
                    await self.tailnets[orphan.system].delete_device(orphan.id)
                metrics.ORPHANS_REMOVED.labels(orphan.kind, orphan.system).inc()
                log.warning("orphan_removed", kind=orphan.kind, system=orphan.system, id=orphan.id, node=orphan.node_name)
        return sorted(still, key=lambda o: (o.kind, o.id))

    async def _forget_node(self, node_name: str) -> None:
        """What a node workflow closed without cleanup also left: its Node object (only if
        tgp manages it) and its reservation in the class ledger."""
        if self.cluster is not None:
            node = await self.cluster.get_node(node_name)
            if node is not None and node.labels.get(LABEL_MANAGED) == "true":
                await self.cluster.delete_node(node_name)
                log.warning("orphan_node_deleted", node=node_name)
        if not _NODE_NAME.match(node_name):
            return  # not a name tgp gives (and never spliced into a query)
        client = activity.client()
        async for wf in client.list_workflows(f"WorkflowType = 'GPUNodeWorkflow' AND TgpNodeName = '{node_name}'"):
            for klass in (wf.search_attributes or {}).get("TgpClass") or []:
                try:
                    await client.get_workflow_handle(class_workflow_id(str(klass))).execute_update("release", wf.id)
                except (RPCError, WorkflowUpdateFailedError) as exc:
                    if isinstance(exc, RPCError) and exc.status is not RPCStatusCode.NOT_FOUND:
                        raise
                    # The class is gone: nothing holds the budget.

    def all(self) -> list[object]:
        return [self.find_orphans, self.remove_orphans]
