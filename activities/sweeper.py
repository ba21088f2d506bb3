"""The sweeper's activities: find instances and tailnet devices that carry tgp's marks but
belong to no running node workflow, and remove them.

Every exit path of a node workflow releases what it bought; this is the backstop for what no
workflow can clean up any more (a workflow terminated by hand, a bug, a create that landed
after everyone stopped looking). It ends every tgp-named instance whose id is not the recorded
one of a running node workflow, once it has been seen for longer than its provider's
consistency window (a node still launching has recorded nothing yet, and is left alone), and
verifies each termination by reading the instance (activities.termination). It assumes one tgp
installation per cloud account and node tag.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime, timedelta, timezone

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio import activity

from temporalio.client import WorkflowUpdateFailedError
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import temporal_errors
from activities.fleet import INSTANCE_KEYS, recorded_instance
from activities.kept_accounts import KeptAccounts
from activities.listing import list_account
from activities.ports import Cluster, CloudProvider, Tailnet
from activities.termination import consistency_window, end_for_good
from activities.visibility import RUNNING_NODES, list_workflows
from activities import metrics
from tgp.errors import TgpError, TransientError
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
    # "instance" or "device": no running node workflow owns it; or "stray": an instance named
    # after a running node that is not the one the node recorded (a twin its launch bought).
    # All are removed once seen for the grace and the provider's consistency window.
    kind: str
    system: str  # provider or tailnet backend name
    id: str
    name: str
    node_name: str
    seen_at: datetime | None = None  # when the sweep first saw it

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.system, self.id)


def node_of_instance(name: str) -> str | None:
    """The node name inside an instance name, or None when it is not one of ours."""
    match = _INSTANCE_NAME.match(name)
    return match.group("node") if match else None


class SweeperActivities:
    def __init__(
        self,
        *,
        providers: Mapping[str, CloudProvider],
        tailnets: Mapping[str, Tailnet],
        cluster: Cluster | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
        kept: KeptAccounts | None = None,
    ) -> None:
        """`kept`: the keys that bought nodes, kept for every worker (the registry's,
        activities.kept_accounts); the sweep forgets those nothing needs any more."""
        self.providers = dict(providers)
        self.tailnets = dict(tailnets)
        self.cluster = cluster
        self.kept = kept
        self.now = now
        self.sleep = sleep

    async def _running_nodes(self) -> tuple[dict[str, str], dict[str, str]]:
        """Node name -> workflow id of every running node workflow (TgpNodeName), and workflow
        id -> the instance a Ready node recorded (TgpInstanceId, upserted with its Ready phase
        in a life-v2 run; a node past Ready never launches again, so the pair holds)."""
        names: dict[str, str] = {}
        instances: dict[str, str] = {}
        async for wf in list_workflows(activity.client(), RUNNING_NODES):
            attributes = wf.attributes((*INSTANCE_KEYS, "TgpPhase"))
            for value in attributes.get("TgpNodeName") or []:
                names[str(value)] = wf.id
            if attributes.get("TgpPhase") == ["Ready"] and (recorded := recorded_instance(attributes)):
                instances[wf.id] = recorded[2]
        return names, instances

    async def _recorded_instance(self, workflow_id: str, listed: Mapping[str, str]) -> str | None:
        """The instance id a running node recorded, or None when it has none yet (launching) or
        cannot say (busy, just closed): no verdict this round. A Ready node's is in the listing;
        any other is asked (a query replays a node workflow the worker's cache no longer holds:
        a thousand every sweep at rest, before)."""
        if workflow_id in listed:
            return listed[workflow_id]
        try:
            status = await activity.client().get_workflow_handle(workflow_id).query("status")
        except Exception:  # noqa: BLE001 - a node busy or just closed: no verdict this round
            return None
        return status.get("instance_id") or None

    async def _orphans(self, inp: SweepInput) -> list[Orphan]:
        running, recorded_instances = await self._running_nodes()
        found: list[Orphan] = []
        now = self.now()
        with temporal_errors():
            for name, provider in self.providers.items():
                for inst in await list_account(provider, inp.prefix, account=name):  # the worker's own key (activities.fleet.account_key)
                    node = node_of_instance(inst.name)
                    if node is None:
                        continue
                    if node not in running:
                        found.append(Orphan(kind="instance", system=name, id=inst.instance_id, name=inst.name, node_name=node, seen_at=now))
                        continue
                    recorded = await self._recorded_instance(running[node], recorded_instances)
                    if recorded and inst.instance_id != recorded:
                        log.warning("stray_instance", provider=name, instance_id=inst.instance_id, instance_name=inst.name, node=node)
                        found.append(Orphan(kind="stray", system=name, id=inst.instance_id, name=inst.name, node_name=node, seen_at=now))
            for name, tailnet in self.tailnets.items():
                for device in await tailnet.list_devices(inp.tags):
                    if device.hostname and device.hostname not in running:
                        found.append(
                            Orphan(kind="device", system=name, id=device.device_id, name=device.hostname, node_name=device.hostname, seen_at=now)
                        )
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
        what it has) and have been seen for longer than their provider's consistency window
        (younger ones wait for the next sweep: a node may not have recorded them yet). An
        instance counts as removed only once a read shows it terminated or gone; one that will
        not go is logged and left to the next sweep. Returns what was removed."""
        now = self.now()
        earlier = {o.key: o for o in suspects}
        still = [o for o in await self._orphans(inp) if o.key in earlier and self._old_enough(earlier[o.key], now)]
        removed: list[Orphan] = []
        with temporal_errors(always_retry=True):
            for orphan in sorted(still, key=lambda o: (o.kind, o.id)):
                if orphan.kind in ("instance", "stray"):
                    if not await self._end_instance(orphan):
                        continue
                    if orphan.kind == "instance":
                        await self._forget_node(orphan.node_name)
                else:
                    await self.tailnets[orphan.system].delete_device(orphan.id)
                removed.append(orphan)
                metrics.ORPHANS_REMOVED.labels(orphan.kind, orphan.system).inc()
                log.warning("orphan_removed", kind=orphan.kind, system=orphan.system, id=orphan.id, node=orphan.node_name)
        return removed

    def _old_enough(self, suspect: Orphan, now: datetime) -> bool:
        """Seen for at least the provider's consistency window (devices: any age)."""
        if suspect.kind == "device" or suspect.seen_at is None:
            return True
        provider = self.providers.get(suspect.system)
        window = consistency_window(provider) if provider is not None else timedelta(0)
        return now - suspect.seen_at >= window

    async def _end_instance(self, orphan: Orphan) -> bool:
        """Terminate and read until the instance shows terminated or gone (it is older than the
        window, so a 404 is the truth). False when it will not go this sweep."""
        try:
            await end_for_good(self.providers[orphan.system], [orphan.id], settle=None, now=self.now, sleep=self.sleep, heartbeat=activity.heartbeat)
        except TransientError as exc:
            metrics.TERMINATION_FAILURES.labels(orphan.system, "TerminationStuck").inc()
            log.error("orphan_termination_stuck", system=orphan.system, id=orphan.id, node=orphan.node_name, error=str(exc))
            return False
        return True

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

    @activity.defn
    async def forget_kept_accounts(self) -> list[str]:
        """Delete the kept account keys no node can need any more (KeptAccounts.forget_unused):
        the names of the Secrets deleted. A failure is logged, never raised: it must not hold
        up the sweep, and a kept key left for the next one costs nothing."""
        if self.kept is None:
            return []
        try:
            return await self.kept.forget_unused()
        except TgpError as exc:
            log.error("kept_accounts_not_swept", error=str(exc), error_type=type(exc).__name__)
            return []

    def all(self) -> list[object]:
        return [self.find_orphans, self.remove_orphans, self.forget_kept_accounts]
