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

from activities.node import temporal_errors
from activities.ports import CloudProvider, Tailnet

log = structlog.get_logger("tgp.sweeper")

# Instance names are tgp-<node-name>-<attempt> (tgp.types.instance_name).
_INSTANCE_NAME = re.compile(r"^tgp-(?P<node>.+)-\d+$")


class SweepInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix: str = "tgp-"
    tags: list[str] = ["tag:tgp-node"]


class Orphan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str  # "instance" or "device"
    system: str  # provider or tailnet backend name
    id: str
    name: str
    node_name: str


def node_of_instance(name: str) -> str | None:
    """The node name inside an instance name, or None when it is not one of ours."""
    match = _INSTANCE_NAME.match(name)
    return match.group("node") if match else None


class SweeperActivities:
    def __init__(self, *, providers: Mapping[str, CloudProvider], tailnets: Mapping[str, Tailnet]) -> None:
        self.providers = dict(providers)
        self.tailnets = dict(tailnets)

    async def _running_nodes(self) -> set[str]:
        """Node names of every running node workflow (from the TgpNodeName search attribute)."""
        names: set[str] = set()
        async for wf in activity.client().list_workflows("WorkflowType = 'GPUNodeWorkflow' AND ExecutionStatus = 'Running'"):
            value = (wf.search_attributes or {}).get("TgpNodeName")
            names.update(str(v) for v in (value or []))
        return names

    async def _orphans(self, inp: SweepInput) -> list[Orphan]:
        running = await self._running_nodes()
        found: list[Orphan] = []
        with temporal_errors():
            for name, provider in self.providers.items():
                for inst in await provider.list_instances(inp.prefix):
                    node = node_of_instance(inst.name)
                    if node is not None and node not in running:
                        found.append(Orphan(kind="instance", system=name, id=inst.instance_id, name=inst.name, node_name=node))
            for name, tailnet in self.tailnets.items():
                for device in await tailnet.list_devices(inp.tags):
                    if device.hostname and device.hostname not in running:
                        found.append(Orphan(kind="device", system=name, id=device.device_id, name=device.hostname, node_name=device.hostname))
        return found

    @activity.defn
    async def find_orphans(self, inp: SweepInput) -> list[Orphan]:
        """Instances and devices marked as tgp's whose node has no running workflow."""
        return await self._orphans(inp)

    @activity.defn
    async def remove_orphans(self, inp: SweepInput, suspects: list[Orphan]) -> list[Orphan]:
        """Remove the suspects that are still orphans now (a node that started meanwhile keeps
        what it has). Returns what was removed."""
        still = set(await self._orphans(inp)) & set(suspects)
        with temporal_errors(always_retry=True):
            for orphan in sorted(still, key=lambda o: (o.kind, o.id)):
                if orphan.kind == "instance":
                    await self.providers[orphan.system].terminate(orphan.id)
                else:
                    await self.tailnets[orphan.system].delete_device(orphan.id)
                log.warning("orphan_removed", kind=orphan.kind, system=orphan.system, id=orphan.id, node=orphan.node_name)
        return sorted(still, key=lambda o: (o.kind, o.id))

    def all(self) -> list[object]:
        return [self.find_orphans, self.remove_orphans]
