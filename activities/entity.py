"""Activities every entity workflow (pool, class) uses: the status and Events of its custom
resource, and what Temporal knows of the node workflows it counts."""

from __future__ import annotations

import asyncio

import structlog
from pydantic import BaseModel, ConfigDict
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from activities.kube.cluster import CustomResource, KubernetesCluster
from activities.errors import temporal_errors
from activities.visibility import running_node_workflows
from tgp.crds import GROUP, VERSION, GPUNodePoolStatus
from tgp.events import EventSpec
from tgp.messages import NodeSighting, ObjectRef, RunningNodesChanges, RunningNodesQuery
from tgp.types import PodSummary

log = structlog.get_logger("tgp.entity")

_PLURALS = {"GPUNodePool": "gpunodepools", "GPUNodeClass": "gpunodeclasses"}
# Events of one emit_events call written at once.
EVENT_WRITES_AT_ONCE = 20
class StatusWrite(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: ObjectRef
    status: dict[str, object]


class PoolStatusWrite(BaseModel):
    """Write a pool's status as its workflow's `status` query answers it now: the history records
    this small reference, not the status (~110 KB for a 500-node pool) on each change."""

    model_config = ConfigDict(extra="forbid")
    ref: ObjectRef
    workflow_id: str


def resource(ref: ObjectRef) -> CustomResource:
    return CustomResource(GROUP, VERSION, _PLURALS[ref.kind], ref.kind, ref.name, ref.namespace, ref.uid)


class EntityActivities:
    def __init__(self, *, cluster: KubernetesCluster) -> None:
        self.cluster = cluster

    @activity.defn
    async def running_nodes(self, query: str) -> list[NodeSighting] | None:
        """Running node workflows matching `query` (a visibility filter on tgp's search
        attributes, e.g. `TgpPool = 'ml/rtx'`): what a pool or class rebuilds its state from.
        None when this Temporal server has no visibility API at all (the time-skipping test
        server): there is nothing to rebuild from, and waiting for it would stall for ever."""
        try:
            return await running_node_workflows(activity.client(), query)
        except RPCError as exc:
            if exc.status is RPCStatusCode.UNIMPLEMENTED:
                return None
            raise

    @activity.defn
    async def running_nodes_changed(self, q: RunningNodesQuery) -> RunningNodesChanges:
        """`running_nodes` as differences from what the caller knows: its history records the
        nodes that appeared or went, not the whole fleet each time it looks."""
        running = await self.running_nodes(q.query)
        if running is None:
            return RunningNodesChanges(listed=False)
        known = set(q.known)
        names = {s.workflow_id.removeprefix(q.prefix): s for s in running}
        return RunningNodesChanges(
            unknown=[s for name, s in sorted(names.items()) if name not in known],
            missing=sorted(known - set(names)),
        )

    @activity.defn
    async def closed_workflows(self, workflow_ids: list[str]) -> list[str]:
        """Those of `workflow_ids` whose latest run is closed or that never existed (read from
        the workflows themselves, not from eventually consistent visibility)."""
        client = activity.client()

        async def closed(wid: str) -> str | None:
            try:
                desc = await client.get_workflow_handle(wid).describe()
            except RPCError as exc:
                if exc.status is not RPCStatusCode.NOT_FOUND:
                    raise
                return wid
            return None if desc.status is WorkflowExecutionStatus.RUNNING else wid

        return [w for w in await asyncio.gather(*(closed(w) for w in workflow_ids)) if w is not None]

    @activity.defn
    async def write_status(self, write: StatusWrite) -> bool:
        """Patch the status subresource; False when the object is gone."""
        with temporal_errors():
            return await self.cluster.patch_custom_status(resource(write.ref), write.status)

    @activity.defn
    async def write_pool_status(self, write: PoolStatusWrite) -> bool:
        """Patch a pool's status subresource with what its workflow's `status` query answers (the
        state of the pass that scheduled this, or a later one); False when the object is gone."""
        status = await activity.client().get_workflow_handle(write.workflow_id).query("status", result_type=GPUNodePoolStatus)
        with temporal_errors():
            return await self.cluster.patch_custom_status(resource(write.ref), status.model_dump(mode="json", by_alias=True))

    @activity.defn
    async def emit_events(self, events: list[EventSpec]) -> None:
        """Write a pass's Events, EVENT_WRITES_AT_ONCE at a time (a burst's pass has hundreds:
        one at a time they outlasted the activity's timeout, and the pass retried them all)."""
        gate = asyncio.Semaphore(EVENT_WRITES_AT_ONCE)

        async def emit(e: EventSpec) -> None:
            async with gate:
                if e.ref.kind == "Pod":
                    await self._pod_event(e)
                else:
                    await self.cluster.create_event(resource(e.ref), type=e.type, reason=e.reason, message=e.message, count=e.count)

        with temporal_errors():
            await asyncio.gather(*(emit(e) for e in events))

    async def _pod_event(self, e: EventSpec) -> None:
        """An Event on a pending pod, found by its uid (`kubectl describe pod` looks by uid): a
        ref without one is read first; a pod gone meanwhile needs no Event."""
        uid = e.ref.uid
        if not uid:
            selector = f"metadata.namespace={e.ref.namespace},metadata.name={e.ref.name}"
            found = await self.cluster.list_objects("pods", field_selector=selector)
            uid = ((found[0].get("metadata") or {}).get("uid") if found else None) or ""
            if not uid:
                return
        pod = PodSummary(namespace=e.ref.namespace or "default", name=e.ref.name, uid=uid)
        await self.cluster.record_pod_event(pod, type=e.type, reason=e.reason, message=e.message, count=e.count)

    def all(self) -> list[object]:
        return [self.running_nodes, self.running_nodes_changed, self.closed_workflows, self.write_status, self.write_pool_status, self.emit_events]
